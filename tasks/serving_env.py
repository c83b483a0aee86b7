"""The serving environment: vLLM in a virtual environment of its own (`make serving-env`), driven
as a separate process. vLLM pins a transformers older than the pipeline's, and production runs the
serving engine apart from the pipeline anyway, so this environment never imports vLLM: it runs
`serving_scripts/vllm_probe.py` with the serving environment's python and reads one JSON answer.

Where it is: the setting `serving_python` (SPECDEC_SERVING_PYTHON), else
`.venv-serving/bin/python` beside the repository. A vLLM you already run elsewhere: point
`serving_python` at the python of its environment.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .errors import ServingEnvUnavailable, ServingProbeError
from .settings import Settings, load_settings

REPOSITORY = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / "serving_scripts" / "vllm_probe.py"
MAKE_ONE = ("make one with `make serving-env` (vLLM's CPU build in .venv-serving), or set "
            "SPECDEC_SERVING_PYTHON to the python of an environment that has vLLM")


def serving_python(settings: Settings | None = None) -> Path:
    """The serving environment's python; ServingEnvUnavailable (saying how to make one) if none."""
    settings = settings or load_settings()
    configured = settings.serving_python
    path = Path(configured).expanduser() if configured else REPOSITORY / ".venv-serving" / "bin" / "python"
    if not path.exists():
        where = f"serving_python {configured!r} does not exist" if configured else (
            f"no serving environment at {path.parent.parent}")
        raise ServingEnvUnavailable(f"{where}; {MAKE_ONE}")
    return path


def available(settings: Settings | None = None) -> bool:
    try:
        serving_python(settings)
    except ServingEnvUnavailable:
        return False
    return True


def probe(command: str, request: dict, settings: Settings | None = None,
          timeout_s: float = 600.0) -> dict:
    """Run one vllm_probe.py command in the serving environment; its JSON answer."""
    python = serving_python(settings)
    try:
        done = subprocess.run([str(python), str(PROBE), command], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise ServingProbeError(f"serving environment {python}: `{command}` did not answer within "
                                f"{timeout_s:.0f} s; its last output:\n{tail}") from None
    answer = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    if done.returncode != 0 or not answer:
        raise ServingProbeError(f"serving environment {python}: `{command}` failed (exit "
                                f"{done.returncode}); its last output:\n{done.stderr[-2000:]}")
    return json.loads(answer[0])


def served_model_dir(target: str) -> Path:
    """The transformers directory a serving engine loads for `target`: the embedded default's
    dequantized copy under $SPECDEC_HOME/models (made on its first load), or the target's own
    directory."""
    from specdec_core.models import EMBEDDED_MODELS, load_model, models_dir

    if target.lower() in EMBEDDED_MODELS:
        directory = models_dir() / target.lower() / "transformers"
        if not (directory / "config.json").exists():
            load_model(target, device="cpu")
        return directory
    path = Path(target).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise ServingEnvUnavailable(f"target {target!r} is not the embedded default nor a transformers "
                                "directory: give the serving engine the target's directory")
