"""What the tasks of `specdec_evaluate` and `specdec_monitor` import before they work, timed for
two checkouts.

    python benchmarks/task_start.py --before /tmp/before-checkout [--repeats 5]

An Airflow task (LocalExecutor, CeleryExecutor, KubernetesExecutor alike) runs in a process of
its own, so the modules its function imports are paid for at every task start (the monitor's
tasks every 5 minutes). This reads each checkout's DAG files (their AST: no Airflow is imported),
takes the `from tasks... import ...` lines inside each named task's function (and, for the
sample task, the glue call that builds its spec: GLUE), and times a new Python process that runs
just those lines in that checkout. Before and after processes alternate, so load on the machine
falls on both. Prints the median seconds per task, the ratio, and which heavy packages the
imports loaded (asked once more after the timed runs).
"""

from __future__ import annotations

import ast
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_start import timed, two_checkouts  # noqa: E402 - the same two-checkout harness

# (DAG file, task function): the evaluation's database and registry tasks (CPU queue), the
# monitor's, then one task that runs the model, as a control
TASKS = tuple(("dags/specdec_evaluate.py", name) for name in (
    "sample", "check", "register", "promote", "acceptance_alert", "report")) + tuple(
    ("dags/specdec_monitor.py", name) for name in ("targets", "scrape", "check")) + (
    ("dags/specdec_evaluate.py", "estimate"),)
HEAVY = ("torch", "transformers", "mlflow", "great_expectations")
# what a task runs besides its own imports that imports more: the sample task builds the run's
# spec from its Params first (the glue imports RunSpec when called)
GLUE = {("dags/specdec_evaluate.py", "sample"): (
    "from tasks.orchestration.airflow_glue import evaluate_spec; evaluate_spec('r', {'target': 't', "
    "'domains': [], 'window_days': 1, 'max_per_domain': 30, 'min_per_domain': 20, 'candidates': "
    "['prompt_lookup'], 'hardware_profile': None, 'k_max': 3, 'min_speedup': 1.1, 'promote': False})")}


def task_imports(checkout: Path) -> dict[tuple[str, str], str]:
    """{(DAG file, task): its import lines joined by '; '} from the checkout's DAG files."""
    found = {}
    for dag_file in sorted({path for path, _ in TASKS}):
        for node in ast.walk(ast.parse((checkout / dag_file).read_text())):
            if isinstance(node, ast.FunctionDef) and (dag_file, node.name) in TASKS:
                found[dag_file, node.name] = "; ".join([
                    *(f"from {inner.module} import {', '.join(a.name for a in inner.names)}"
                      for inner in ast.walk(node)
                      if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("tasks.")),
                    *([GLUE[dag_file, node.name]] if (dag_file, node.name) in GLUE else [])])
    missing = set(TASKS) - set(found)
    if missing:
        raise SystemExit(f"{checkout}: no task function {sorted(missing)}")
    return found


def start(checkout: Path, code: str) -> tuple[float, str]:
    seconds, stdout, _ = timed(checkout, [sys.executable, "-c", code])
    return seconds, stdout


def main() -> int:
    checkouts, repeats = two_checkouts(__doc__)
    imports = {name: task_imports(checkout) for name, checkout in checkouts.items()}
    times: dict[tuple[str, str], list[float]] = {}
    for repeat in range(repeats):
        for task in TASKS:
            for name, checkout in checkouts.items():
                seconds, _ = start(checkout, imports[name][task] or "pass")
                times.setdefault((task, name), []).append(seconds)
        print(f"repeat {repeat + 1}/{repeats} done", file=sys.stderr, flush=True)
    loaded = {}
    for task in TASKS:
        for name, checkout in checkouts.items():
            probe = f"{imports[name][task] or 'pass'}; import sys; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
            loaded[task, name] = start(checkout, probe)[1].strip() or "none"
    print(f"A task's imports in a new process, median of {repeats} (interleaved), seconds\n")
    print("| DAG | task | before | after | before / after | loaded before | loaded after |")
    print("|---|---|---|---|---|---|---|")
    for task in TASKS:
        before, after = (statistics.median(times[task, n]) for n in checkouts)
        print(f"| {Path(task[0]).stem} | {task[1]} | {before:.2f} | {after:.2f} | {before / after:.2f}x | "
              f"{loaded[task, 'before']} | {loaded[task, 'after']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
