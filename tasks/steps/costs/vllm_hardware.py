"""What a vLLM cost profile was timed on: the engine it names, the CPU and the OpenMP threads
its engines ran, the dtype vLLM serves the target in (tasks.steps.costs.engine_costs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .costs import _slug, describe_device


def profile_engine(hardware: dict | None) -> str:
    """Which engine a cost profile's hardware description times: "vllm" or "specdec"."""
    engine = ((hardware or {}).get("details") or {}).get("engine") or {}
    return "vllm" if isinstance(engine, dict) and engine.get("name") == "vllm" else "specdec"


def engine_threads(engines: list[dict]) -> int | None:
    """The OpenMP threads the profile's engines ran (free_cpus gave each as many CPUs) where a
    neighbour left them fewer CPUs than this machine's; None: every CPU."""
    first = (engines[0].get("threads") or {}) if engines else {}
    return len(first["cpus"]) if first.get("bind") else None


def vllm_hardware(version: str, dtype: str, name: str | None = None, threads: int | None = None) -> dict:
    """The hardware description of a vLLM profile on this CPU: {name (vllm-<version>-<cpu>),
    device ("vLLM <version>, <cpu device>"), dtype, details}. threads: the engines ran that many
    OpenMP threads, fewer than this machine's (a busy machine): the CPU device, and so the name
    and the key a later run reuses it by, says so, so that a run on the whole machine never plans
    on a smaller engine's costs (nor a busy run on a quiet one's by this key)."""
    hardware = describe_device("cpu", dtype)
    if threads:
        label = re.sub(r"\(\d+ threads\)", f"({threads} threads)", hardware["device"])
        slug = re.sub(r"cpu-\d+t", f"cpu-{threads}t", hardware["name"])
        hardware = {**hardware, "device": label, "name": slug}
    return {"name": name or _slug(f"vllm-{version}-{hardware['name']}"),
            "device": f"vLLM {version}, {hardware['device']}", "dtype": dtype,
            "details": dict(hardware["details"])}


def served_dtype(model_dir) -> str:
    """The dtype a vLLM engine serves the directory's model in (its config's; float32 otherwise)."""
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    return {"bfloat16": "bfloat16", "float16": "float16"}.get(
        str(model_config.get("torch_dtype") or model_config.get("dtype")), "float32")
