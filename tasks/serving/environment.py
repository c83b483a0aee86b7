"""The serving environment: vLLM in a virtual environment of its own (`make serving-env`), driven
as a separate process. vLLM pins a transformers older than the pipeline's, and production runs the
serving engine apart from the pipeline anyway, so this environment never imports vLLM: it runs
`scripts/vllm_probe.py` with the serving environment's python and reads one JSON answer.

Where it is: the setting `engine_serving_python` (SPECDEC_ENGINE_SERVING_PYTHON), else
`.venv-serving/bin/python` beside the repository. A vLLM you already run elsewhere: point
`engine_serving_python` at the python of its environment.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from specdec_core.home import EMBEDDED_MODELS, models_dir

from ..errors import EngineTimeout, ServingEnvUnavailable, ServingProbeError
from ..settings import Settings, load_settings
from . import forks
from .scripts.fork_server import cpu_list, pin_cpus

REPOSITORY = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "scripts" / "vllm_probe.py"
# the speculators library's reading of an EAGLE-3 checkpoint (what specdec's Eagle3Head is held to)
EAGLE3_LOGITS = Path(__file__).resolve().parent / "scripts" / "eagle3_logits.py"
MAKE_ONE = ("make one with `make serving-env` (vLLM's CPU build in .venv-serving), or set "
            "SPECDEC_ENGINE_SERVING_PYTHON to the python of an environment that has vLLM")


def serving_python(settings: Settings | None = None) -> Path:
    """The serving environment's python; ServingEnvUnavailable (saying how to make one) if none."""
    settings = settings or load_settings()
    configured = settings.engine.serving_python
    path = Path(configured).expanduser() if configured else REPOSITORY / ".venv-serving" / "bin" / "python"
    if not path.exists():
        where = f"serving_python {configured!r} does not exist" if configured else (
            f"no serving environment at {path.parent.parent}")
        if path.is_symlink():       # a serving environment whose interpreter has gone
            where = (f"the serving python {path} is a link to {os.readlink(path)}, which does not "
                     "exist")
        raise ServingEnvUnavailable(f"{where}; {MAKE_ONE}")
    return path


# the interpreter runs and finds vLLM (without importing it: seconds saved), exit 3 where it is not
_FINDS_VLLM = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
_RUNS: set[str] = set()


def working_python(settings: Settings | None = None, timeout_s: float = 60.0) -> Path:
    """serving_python, once checked to run and to find vLLM (once per process and path);
    ServingEnvUnavailable, one line naming the interpreter and the fix, where it cannot be run,
    fails, or has no vLLM. For work that starts engines: a broken interpreter is said once, before
    anything is started or stored, not as every engine's failure."""
    python = serving_python(settings)
    if str(python) in _RUNS:
        return python
    try:
        done = subprocess.run([str(python), "-c", _FINDS_VLLM], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ServingEnvUnavailable(f"the serving python {python} did not answer within "
                                    f"{timeout_s:.0f} s; {MAKE_ONE}") from None
    except OSError as exc:
        raise ServingEnvUnavailable(f"the serving python {python} cannot be run "
                                    f"({exc.strerror or exc}); {MAKE_ONE}") from None
    if done.returncode == 3:
        raise ServingEnvUnavailable(f"the serving python {python} has no vLLM; {MAKE_ONE}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ServingEnvUnavailable(f"the serving python {python} fails (exit {done.returncode}: "
                                    f"{last[:300]}); {MAKE_ONE}")
    _RUNS.add(str(python))
    return python


def available(settings: Settings | None = None) -> bool:
    try:
        serving_python(settings)
    except ServingEnvUnavailable:
        return False
    return True


def probe(command: str, request: dict, settings: Settings | None = None,
          timeout_s: float = 600.0, script: Path = PROBE) -> dict:
    """Run one command of a serving-environment script (default vllm_probe.py) in the serving
    environment; its JSON answer."""
    settings = settings or load_settings()
    python = serving_python(settings)
    try:
        done = _run(settings, python, [str(script), command], dict(os.environ), json.dumps(request),
                    timeout_s)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise ServingProbeError(f"serving environment {python}: `{command}` did not answer within "
                                f"{timeout_s:.0f} s; its last output:\n{tail}") from None
    return _answer(done, lambda: f"serving environment {python}: `{command}` failed (exit "
                                 f"{done.returncode}); its last output:\n{done.stderr[-2000:]}")


def _cpu_times() -> dict[int, tuple[int, int]]:
    """{cpu: (busy jiffies, all jiffies)} from /proc/stat ({} where there is none)."""
    out = {}
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            numbers = [int(v) for v in values[:8]]
            out[int(name[3:])] = (sum(numbers) - numbers[3] - numbers[4], sum(numbers))
    return out


def free_cpus(sample_s: float = 6.0, margin: float = 0.25, slices: int = 12,
              count: int | None = None) -> dict:
    """The CPUs an engine started now should run its threads on: over `sample_s` (this process
    idle meanwhile) in `slices`, other processes kept `others` cores busy (read from /proc/stat:
    the mean, or the second busiest slice where that is more, so that a neighbour working in
    bursts of a second or more counts as the cores it takes when it works, whatever phase the
    sampling caught it in); the engine gets the allowed CPUs less ceil(others - margin) of them
    (at least one), the least busy ones. vLLM's CPU build runs an OpenMP thread per CPU it is
    given, each step waiting for the slowest: one CPU taken by a neighbour stalls them all, so
    the CPUs a neighbour uses are left to it. Output: {"cpus": [...], "others": cores, "spare":
    CPUs left to the others, "bind": "0,2" for VLLM_CPU_OMP_THREADS_BIND, or None where every
    allowed CPU is used (vLLM's own binding)}. count: that many CPUs (the least busy) whatever
    the others use, where an engine must be the same size as one started before it."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    readings = [_cpu_times()]
    for _ in range(max(1, slices)):
        time.sleep(sample_s / max(1, slices))
        readings.append(_cpu_times())
    first, last = readings[0], readings[-1]

    def share(before, after, cpu):
        return (after[cpu][0] - before[cpu][0]) / max(after[cpu][1] - before[cpu][1], 1)

    cpus = [cpu for cpu in allowed if all(cpu in r for r in readings)]
    if not cpus:
        return {"cpus": allowed, "others": 0.0, "spare": 0, "bind": None}
    used = {cpu: share(first, last, cpu) for cpu in cpus}
    busiest = sorted(sum(share(a, b, cpu) for cpu in cpus) for a, b in zip(readings, readings[1:]))
    burst = busiest[-2] if len(busiest) > 1 else busiest[-1]
    return choose_cpus(used, margin, others=max(sum(used.values()), burst), count=count)


PIN_VARIABLE = "SPECDEC_PIN_CPUS"      # the CPUs a whole engine process is kept on (fork_server.py)


def thread_env(threads: str | None) -> dict:
    """The environment that puts an engine on the CPUs `threads` names ("0,2"; None: every CPU,
    vLLM's own choice): as many OpenMP threads as CPUs (OMP_NUM_THREADS, read when torch loads:
    the fork server keys its forks on it, tasks/serving/forks.py), and the whole process kept
    there (PIN_VARIABLE). vLLM's in-process engine, and its server's engine core, never bind
    their OpenMP threads themselves (VLLM_CPU_OMP_THREADS_BIND is read only where vLLM starts
    worker processes of its own, and is set for those): left at the machine's count, an engine
    given one CPU ran two OpenMP threads on it, each parallel region waiting for the one the
    scheduler had not run, and a suffix engine beside a spun core served about 1 token/s (spun 1,
    last series: the replay timed out at 900 s; 320-980 ms a step against 40-70 ms quiet).
    With one thread per CPU it ran 55-95 ms a step."""
    if not threads:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": threads, "OMP_NUM_THREADS": str(len(cpu_list(threads))),
            PIN_VARIABLE: threads}


def pinned(bind: str | None):
    """A subprocess preexec_fn keeping the child, and every thread it starts, on the CPUs of a
    PIN_VARIABLE list (None where there is nothing to pin; a fork of the fork server pins itself
    with the same function, scripts/fork_server.py pin_cpus)."""
    if not bind:
        return None
    return lambda: pin_cpus(bind)


def fewer_cpus(threads: dict | None) -> str | None:
    """What an engine given free_cpus's `threads` ran on, where that is fewer CPUs than this
    process may use (other processes kept the rest busy): one OpenMP thread per CPU
    (thread_env), so what it timed is a smaller engine's steps than the hardware class names,
    and the ratios the planner reads can differ from a quiet machine's. None: every CPU."""
    if not (threads or {}).get("bind"):
        return None
    cpus = len(threads.get("cpus") or [])
    return (f"timed on {cpus} of {cpus + threads.get('spare', 0)} CPUs (other processes kept "
            f"{threads.get('others', 0):.2f} cores busy): a {cpus}-thread engine's costs")


def choose_cpus(used: dict[int, float], margin: float = 0.25, others: float | None = None,
                count: int | None = None) -> dict:
    """free_cpus's choice from each allowed CPU's busy share: the CPUs less ceil(others - margin)
    of them (or `count` of them), at least one, the least busy first (others: the cores other
    processes take, by default the shares' sum)."""
    others = sum(used.values()) if others is None else others
    if count is None:
        count = len(used) - max(0, math.ceil(others - margin))
    count = min(max(1, count), len(used))
    cpus = sorted(sorted(used, key=lambda cpu: used[cpu])[:count])
    return {"cpus": cpus, "others": round(others, 2), "spare": len(used) - count,
            "bind": ",".join(map(str, cpus)) if count < len(used) else None}


def run_engine(request: dict, log_path: Path, timeout_s: float, what: str,
               settings: Settings | None = None, command: str = "replay",
               threads: str | None = None) -> dict:
    """One engine in the serving environment (vllm_probe.py replay, or `command`): started with the request's
    speculative config, in-process (no engine-core child to leave behind), its log written to
    `log_path`, on the CPUs `threads` names, one OpenMP thread each (thread_env; None:
    vLLM's choice). Past `timeout_s` it is killed: EngineTimeout names `what` and the log."""
    python = serving_python(settings)
    settings = settings or load_settings()
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE=str(settings.engine.kv_cache_gib))
    env.update(thread_env(threads))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = _run(settings, python, [str(PROBE), command], env, json.dumps(request), timeout_s,
                    log_path=log_path)
    except subprocess.TimeoutExpired:
        raise EngineTimeout(f"{what}: the engine did not finish within {timeout_s:.0f} s "
                            f"(engine_check_timeout_s); its log: {log_path}") from None
    def failure() -> str:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty log)"]
        return f"{what}: the engine exited with {done.returncode}: {tail[0][:500]}; its log: {log_path}"
    return _answer(done, failure)


def _run(settings: Settings, python: Path, argv: list[str], env: dict, input_text: str,
         timeout_s: float, log_path: Path | None = None) -> subprocess.CompletedProcess:
    """`python ARGV...` with `input_text` on stdin, its stdout captured and its stderr captured
    (or written to log_path): a fork of the serving environment's fork server where the setting
    engine.fork_server allows one (tasks/serving/forks.py), else a process of its own.
    subprocess.TimeoutExpired past `timeout_s` (the process is killed)."""
    if settings.engine.fork_server:
        done = forks.run(python, argv, env, input_text, timeout_s, stderr_path=log_path)
        if done is not None:
            return done
    pin = pinned(env.get(PIN_VARIABLE))
    if log_path is None:
        return subprocess.run([str(python), *argv], input=input_text, capture_output=True,
                              text=True, timeout=timeout_s, env=env, preexec_fn=pin)
    with open(log_path, "w") as log_file:
        return subprocess.run([str(python), *argv], input=input_text, stdout=subprocess.PIPE,
                              stderr=log_file, text=True, timeout=timeout_s, env=env, preexec_fn=pin)


SERVED_MARK = "specdec_served.json"     # written beside a target directory made for serving


def _answer(done: subprocess.CompletedProcess, failure) -> dict:
    """The probe's one JSON answer (its last stdout line); ServingProbeError(failure()) without."""
    answer = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    if done.returncode != 0 or not answer:
        raise ServingProbeError(failure())
    return json.loads(answer[0])


def served_model_dir(target: str) -> Path:
    """The transformers directory a serving engine loads for `target`, with its fingerprint.

    The embedded default: its dequantized copy under $SPECDEC_HOME/models, (re)written once in the
    form serving engines load (the architecture named, tied embeddings under the input
    embedding's name) with the weights' fingerprint in `specdec_served.json` beside them. Any
    other target: its own transformers directory, as it is."""
    if target.lower() in EMBEDDED_MODELS:
        directory = models_dir() / target.lower() / "transformers"
        if not (directory / SERVED_MARK).exists():
            _write_served(target, directory)
        return directory
    path = Path(target).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise ServingEnvUnavailable(f"target {target!r} is not the embedded default nor a transformers "
                                "directory: give the serving engine the target's directory")


def servable(target: str) -> bool:
    """Whether served_model_dir can give a serving engine `target` (the embedded default, or a
    transformers directory), without writing anything."""
    path = Path(target).expanduser()
    return target.lower() in EMBEDDED_MODELS or (path.is_dir() and (path / "config.json").exists())


def served_fingerprint(directory: Path) -> str | None:
    """The fingerprint recorded beside a directory made for serving (None: not one of ours)."""
    mark = Path(directory) / SERVED_MARK
    return json.loads(mark.read_text())["fingerprint"] if mark.exists() else None


def _write_served(target: str, directory: Path) -> None:
    # imported here: torch: the CLI's config commands import it
    from specdec_core.models import load_model, save_transformers_dir
    from specdec_core.validation import fingerprint_id, target_fingerprint

    model, tokenizer = load_model(target, device="cpu")       # writes the directory on first use
    staging = Path(tempfile.mkdtemp(dir=directory.parent))
    try:
        save_transformers_dir(model, tokenizer, staging)
        (staging / SERVED_MARK).write_text(json.dumps(
            {"target": target, "fingerprint": fingerprint_id(target_fingerprint(model))}))
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
        os.replace(staging, directory)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
