"""The main job with and without a busy neighbour (issue: decisions that hold on a busy machine).
Runs `specdec main-job` N times quiet and N times busy, alternating, each in its own SPECDEC_HOME
(a fresh store: no champion, so every "on" is a domain turning on); in the busy runs other
processes keep this machine's CPU busy for the whole run (default: one process in 3-second bursts,
about what a large pip install does; --neighbours 2 adds one spinning all the time; --during
profile keeps them to the profile step, as earlier rounds did); in the spun runs one process spins
on one core for the whole run. Prints one table per run (per
domain: on/off, drafter and K, predicted, the engine check's measured speedup at one request at
a time, the load check's levels predicted against measured), the profile's check, then one table
over every run, and writes benchmarks/results/busy_neighbour.md.

    python benchmarks/busy_neighbour.py --runs 3 --models .specdec/models --write
    python benchmarks/busy_neighbour.py --plan quiet-2,busy-1 --models .specdec/models
    python benchmarks/busy_neighbour.py --plan quiet-1,spun-1 --models .specdec/models
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

SPIN = "import time\nwhile True:\n    pass\n"
BURSTS = ("import time\nwhile True:\n    end = time.time() + 3\n    while time.time() < end:\n"
          "        pass\n    time.sleep(3)\n")
ROOT = Path(__file__).resolve().parents[1]


def run_main_job(home: Path, models: Path, codes: tuple[str, ...], log: Path,
                 during: str = "run") -> float:
    """One main job in a fresh home, the neighbours (`codes`: Python programs) running beside it;
    its wall time."""
    if home.exists():       # a fresh store each run: an earlier run's champion or profile is not reused
        shutil.rmtree(home)
    home.mkdir(parents=True)
    if not (home / "models").exists():
        (home / "models").symlink_to(models.resolve())
    env = dict(os.environ, SPECDEC_HOME=str(home), COLUMNS="250")
    env.pop("MLFLOW_TRACKING_URI", None)
    start = time.perf_counter()
    neighbours: list[subprocess.Popen] = []
    with log.open("w") as out:
        job = subprocess.Popen([str(Path(sys.executable).parent / "specdec"), "main-job"], cwd=ROOT,
                               env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            _follow(job, log, codes, neighbours, during)
        finally:       # never leave a neighbour spinning (an interrupt included)
            for process in neighbours:
                process.kill()
            if job.poll() is None:
                job.kill()
    return time.perf_counter() - start


def _follow(job: subprocess.Popen, log: Path, codes: tuple[str, ...], neighbours: list,
            during: str = "run") -> None:
    """Wait for the job; in busy runs keep the neighbours busy for the whole run, or (during
    "profile") while its profile task runs."""
    while job.poll() is None:
        time.sleep(1)
        text = log.read_text(errors="replace")
        # the profile task runs from its start line until the first estimate starts (estimates
        # wait for it; other tasks, such as domains_of, may start beside it)
        profiling = during == "run" or (" s  profile" in text and not re.search(r" s  (per_domain\.)?estimate", text))
        if codes and profiling and not neighbours:
            neighbours.extend(subprocess.Popen([sys.executable, "-c", code]) for code in codes)
        if neighbours and not profiling:
            for process in neighbours:
                process.kill()
                process.wait()
            neighbours.clear()


def results(home: Path) -> dict:
    db = sqlite3.connect(home / "specdec.db")
    db.row_factory = sqlite3.Row
    [run] = db.execute("SELECT run_id, hardware_profile FROM eval_runs ORDER BY created_at DESC LIMIT 1")
    rows = [dict(r) for r in db.execute(
        "SELECT d.domain, d.enabled, d.drafter, d.k, d.predicted_speedup, d.measured_speedup, "
        "l.predicted_same_requests, l.cost_model_error, l.measured_speedup_lo, l.measured_speedup_hi, "
        "d.reason FROM domain_configs d LEFT JOIN live_measurements l ON l.run_id = d.run_id AND "
        "l.domain = d.domain WHERE d.run_id = ? ORDER BY d.domain", (run["run_id"],))]
    check = db.execute("SELECT status, reasons, attempts, max_spread, details FROM cost_profile_checks "
                       "WHERE run_id = ?", (run["run_id"],)).fetchone()
    engine = {r["domain"]: dict(r) for r in db.execute(
        "SELECT domain, measured_speedup, predicted_speedup FROM engine_checks WHERE run_id = ?",
        (run["run_id"],))}
    levels = [dict(r) for r in db.execute(
        "SELECT domain, concurrency, k, measured_speedup, measured_speedup_lo, measured_speedup_hi, "
        "predicted_speedup, pays, predicted_served_speedup FROM load_check_levels WHERE run_id = ? "
        "ORDER BY domain, concurrency", (run["run_id"],))]
    for row in rows:
        row["engine_measured"] = (engine.get(row["domain"]) or {}).get("measured_speedup")
    contended = {"engine check": [0, 0], "load check": [0, 0]}
    for which, table in (("engine check", "live_measurements"), ("load check", "load_check_levels")):
        for (per_request,) in db.execute(f"SELECT per_request FROM {table} WHERE run_id = ?", (run["run_id"],)):
            pairs = json.loads(per_request) if isinstance(per_request, str) else (per_request or [])
            contended[which][0] += sum(1 for pair in pairs if pair.get("contended"))
            contended[which][1] += len(pairs)
    seconds = db.execute("SELECT MAX(created_at), MIN(created_at) FROM cost_profiles WHERE run_id = ?",
                         (run["run_id"],)).fetchone()
    return {"run_id": run["run_id"], "rows": rows, "check": dict(check) if check else None,
            "profile_written": seconds[0], "levels": levels, "contended": contended}


def task_seconds(log: Path) -> dict:
    """Seconds the profile and the engine check (with the sampling test and the load check) took,
    from the main job's table of task start offsets ("  305 s  estimate[4]")."""
    starts: dict[str, float] = {}
    for seconds, task in re.findall(r"^\s+(\d+) s  (\S+)$", log.read_text(errors="replace"), re.M):
        starts.setdefault(re.sub(r"^per_domain\.|\[\d+\]$", "", task), float(seconds))
    out = {}
    if "profile" in starts and "estimate" in starts:
        out["profile_s"] = starts["estimate"] - starts["profile"]
    if "engine_check" in starts and "register" in starts:
        out["engine_check_s"] = starts["register"] - starts["engine_check"]
    return out


def held_back(reason: str | None) -> str:
    reason = reason or ""
    if reason.startswith("off: cost profile too noisy"):
        return "noisy profile"
    if reason.startswith("live check:"):
        return "live veto: " + reason.split(": ", 2)[-1].split(";")[0]
    return ""


def table(label: str, result: dict, seconds: float) -> str:
    check = result["check"] or {}
    reasons = json.loads(check["reasons"]) if isinstance(check.get("reasons"), str) else check.get("reasons")
    lines = [f"### {label}: run {result['run_id']} ({seconds:.0f} s, load average {result.get('load', '-')})", "",
             f"cost profile: {check.get('status')}, {check.get('attempts')} check(s), largest "
             f"spread {100 * (check.get('max_spread') or 0):.0f}%"
             + (f"; reasons: {'; '.join(reasons)}" if reasons else ""), "",
             *engines_text(check),
             "- pairs a neighbour reached: " + ", ".join(
                 f"{which} {n} of {total}" for which, (n, total) in (result.get("contended") or {}).items()), "",
             "| domain | on | drafter, K | predicted | same requests | measured [95% CI] | cost-model err | on vLLM, 1 at a time | held back by |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        ci = "" if r["measured_speedup_lo"] is None else f" [{r['measured_speedup_lo']:.2f}, {r['measured_speedup_hi']:.2f}]"
        err = "-" if r["cost_model_error"] is None else f"{100 * r['cost_model_error']:+.0f}%"
        lines.append(f"| {r['domain']} | {'on' if r['enabled'] else 'off'} | {r['drafter']} K={r['k']} | "
                     f"{x(r['predicted_speedup'])} | {x(r['predicted_same_requests'])} | "
                     f"{x(r['measured_speedup'])}{ci} | {err} | {x(r.get('engine_measured'))} | "
                     f"{held_back(r['reason'])} |")
    if result.get("levels"):
        lines += ["", "| load check: domain | concurrent | K | predicted | measured [95% CI] | within 15% "
                      "| inside the interval | predicted on what vLLM served | within 15% |",
                  "|---|---|---|---|---|---|---|---|---|"]
        yes_no = lambda v: "-" if v is None else ("yes" if v else "no")    # noqa: E731
        for level in result["levels"]:
            lines.append(f"| {level['domain']} | {level['concurrency']} | {level['k']} | "
                         f"{_x(level['predicted_speedup'])} | {_x(level['measured_speedup'])} "
                         f"[{_x(level['measured_speedup_lo'])}, {_x(level['measured_speedup_hi'])}] | "
                         f"{yes_no(within_15(level))} | {yes_no(inside_interval(level))} | "
                         f"{_x(level.get('predicted_served_speedup'))} | "
                         f"{yes_no(within_15(level, 'predicted_served_speedup'))} |")
    return "\n".join(lines)


def engines_text(check: dict) -> list[str]:
    """Per engine of the profile: its timing seconds, rounds, contended pairs and why it stopped."""
    details = check.get("details")
    details = json.loads(details) if isinstance(details, str) else (details or {})
    return [f"- {e['config']}: {e['seconds']:.0f} s, {e['repeats']} rounds, {e.get('contended', 0)} "
            f"contended pair(s), stopped: {e['stopped']}" for e in details.get("engines") or []]


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def within_15(level: dict, predicted: str = "predicted_speedup") -> bool | None:
    """Whether the level's prediction (on the logged responses; predicted_served_speedup: on
    what vLLM served) is within 15% of the measured speedup."""
    if level.get(predicted) is None or not level["measured_speedup"]:
        return None
    return abs(level[predicted] / level["measured_speedup"] - 1) <= 0.15


def inside_interval(level: dict) -> bool | None:
    """Whether the prediction lies inside the level's measured 95% interval (eight requests a
    level: the interval is often wider than 15% either side)."""
    if level["predicted_speedup"] is None or level["measured_speedup_lo"] is None:
        return None
    return level["measured_speedup_lo"] <= level["predicted_speedup"] <= level["measured_speedup_hi"]


def summary(runs: list[tuple[str, dict, float]]) -> str:
    """One table over the runs: per domain, on/off and drafter/K in each run, and the spread of
    the measured speedups at one request at a time over the runs where it is on: the engine
    check's replay, and the load check's level 1."""
    domains = sorted({r["domain"] for _, result, _ in runs for r in result["rows"]})
    lines = ["| domain | " + " | ".join(label for label, _, _ in runs)
             + " | same decision | K within one step | measured spread | load check c1 spread |",
             "|---|" + "---|" * len(runs) + "---|---|---|---|"]
    for domain in domains:
        cells, decisions, measured, ks, first = [], set(), [], [], []
        for _, result, _ in runs:
            row = next((r for r in result["rows"] if r["domain"] == domain), None)
            if row is None:
                cells.append("-")
                continue
            on = bool(row["enabled"])
            decisions.add((on, row["drafter"] if on else None))
            ks += [row["k"]] if on else []
            value = row.get("engine_measured") if on else None
            measured += [value] if value else []
            first += [level["measured_speedup"] for level in result.get("levels") or []
                      if on and level["domain"] == domain and level["concurrency"] == 1
                      and level["measured_speedup"]]
            cells.append((f"on {row['drafter']} K={row['k']} {_x(value)}" if on else "off"))
        spread, c1 = (f"{100 * (max(v) - min(v)) / min(v):.0f}%" if len(v) > 1 else "-"
                      for v in (measured, first))
        within = "-" if not ks else ("yes" if max(ks) - min(ks) <= 1 else "no")
        lines.append(f"| {domain} | " + " | ".join(cells)
                     + f" | {'yes' if len(decisions) == 1 else 'no'} | {within} | {spread} | {c1} |")
    levels = [level for _, result, _ in runs for level in result.get("levels") or []]
    known = [v for v in map(within_15, levels) if v is not None]
    inside = [v for v in map(inside_interval, levels) if v is not None]
    served = [v for v in (within_15(level, "predicted_served_speedup") for level in levels) if v is not None]
    lines += ["", f"load check: predicted within 15% of measured at {sum(known)} of {len(known)} "
                  f"measured domain-levels, inside the measured 95% interval at {sum(inside)} of "
                  f"{len(inside)}; predicted on what vLLM served, within 15% at {sum(served)} of "
                  f"{len(served)}", "",
              "| run | seconds | profile s | engine check s | load average |", "|---|---|---|---|---|"]
    lines += [f"| {label} | {seconds:.0f} | {result.get('profile_s', '-'):.0f} | "
              f"{result.get('engine_check_s', '-'):.0f} | {result.get('load', '-')} |"
              if "profile_s" in result and "engine_check_s" in result else
              f"| {label} | {seconds:.0f} | - | - | {result.get('load', '-')} |" for label, result, seconds in runs]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", type=Path, default=ROOT / ".specdec" / "models")
    parser.add_argument("--work", type=Path, default=Path("/tmp/busy_neighbour"))
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--neighbours", type=int, default=1, choices=(1, 2))
    parser.add_argument("--during", default="run", choices=("run", "profile"),
                        help="keep the neighbours for the whole run (default) or the profile step only")
    parser.add_argument("--plan", default=None, help="runs to make, e.g. quiet-2,busy-1,spun-1 "
                                                    "(default: quiet-1,busy-1,... alternating, --runs "
                                                    "each; spun: one core spun the whole run)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # run the cleanup on a kill
    sections, runs = [], []
    plan = (args.plan.split(",") if args.plan else
            [f"{kind}-{index + 1}" for index in range(args.runs) for kind in ("quiet", "busy")])
    for name in plan:
        codes = {"busy": (BURSTS, SPIN)[:args.neighbours], "spun": (SPIN,)}.get(name.split("-")[0], ())
        label = name.replace("-", " ")
        home = args.work / name
        seconds = run_main_job(home, args.models, codes, args.work / f"{name}.log", args.during)
        result = results(home)
        result.update(task_seconds(args.work / f"{name}.log"))
        result["load"] = " / ".join(f"{v:.2f}" for v in os.getloadavg())      # 1, 5, 15 minutes
        runs.append((label, result, seconds))
        sections.append(table(label, result, seconds))
        print(sections[-1] + "\n", flush=True)
        if args.write:       # after every run: an interrupted series keeps what it measured
            write(args, runs, sections)
    print(summary(runs))


def write(args, runs: list, sections: list[str]) -> None:
    """benchmarks/results/busy_neighbour.md: the table over the runs so far, then each run's."""
    out = ROOT / "benchmarks" / "results" / "busy_neighbour.md"
    out.write_text("# The main job, quiet and with a busy neighbour\n\n"
                   "Command: `python benchmarks/busy_neighbour.py "
                   + (f"--plan {args.plan}" if args.plan else f"--runs {args.runs}")
                   + f" --neighbours {args.neighbours} --during {args.during} --write` (fresh store per "
                   "run: no champion; the load average is read when each run ends).\n\n"
                   "## Over the runs\n\n" + summary(runs) + "\n\n## Each run\n\n"
                   + "\n\n".join(sections) + "\n")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
