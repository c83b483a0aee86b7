"""Runs inside the serving environment (vLLM's own virtual environment), never in the pipeline's:
`SERVING_PYTHON vllm_probe.py COMMAND` reads a JSON request on stdin and writes one JSON answer on
stdout (vLLM's logs go to stderr). It imports vLLM and the standard library only.

Commands:
  versions        {} -> {vllm, torch, transformers}
  check-configs   {model, configs: {name: speculative_config}} -> {name: {ok, error}}: each config
                  through vLLM's own engine-argument validation (what `vllm serve
                  --speculative-config` does before it starts an engine)
  ngram           {min_n, max_n, k, sequences: [[token, ...], ...]} -> {proposals: [[...], ...]}:
                  what vLLM's `ngram` proposer proposes after each whole sequence
"""

from __future__ import annotations

import json
import sys


def versions(_request: dict) -> dict:
    import torch
    import transformers
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def check_configs(request: dict) -> dict:
    from vllm.engine.arg_utils import EngineArgs

    out = {}
    for name, spec in request["configs"].items():
        try:
            EngineArgs(model=request["model"], speculative_config=spec,
                       max_model_len=request.get("max_model_len"),   # None: the model's own
                       enforce_eager=True).create_engine_config()
            out[name] = {"ok": True, "error": None}
        except Exception as exc:  # noqa: BLE001 - vLLM's own refusal, reported as it is
            lines = [line.strip() for line in str(exc).splitlines()
                     if line.strip() and "errors.pydantic.dev" not in line]
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {' | '.join(lines[-3:])}"[:1000]}
    return out


def ngram(request: dict) -> dict:
    import numpy as np
    from vllm.v1.spec_decode import ngram_proposer

    find = ngram_proposer._find_longest_matched_ngram_and_propose_tokens
    proposals = []
    for sequence in request["sequences"]:
        tokens = np.asarray(sequence, dtype=np.int32)
        found = find(tokens, int(request["min_n"]), int(request["max_n"]),
                     int(request.get("max_model_len", 1 << 20)), int(request["k"]))
        proposals.append([] if found is None else [int(t) for t in found])
    return {"proposals": proposals}


COMMANDS = {"versions": versions, "check-configs": check_configs, "ngram": ngram}


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: vllm_probe.py {{{'|'.join(COMMANDS)}}} < request.json", file=sys.stderr)
        return 2
    request = json.load(sys.stdin)
    stdout = sys.stdout
    sys.stdout = sys.stderr          # vLLM prints: only the answer goes to stdout
    try:
        answer = COMMANDS[sys.argv[1]](request)
    finally:
        sys.stdout = stdout
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
