"""Runs inside the serving environment, never in the pipeline's: `SERVING_PYTHON eagle3_logits.py
logits` reads a JSON request on stdin and writes one JSON answer on stdout (logs go to stderr).
It imports the speculators library (installed by `make serving-env`), torch, safetensors and
the standard library only: the reference reading of an EAGLE-3 checkpoint in the speculators
format, to hold specdec's own Eagle3Head to.

Commands:
  versions  {} -> {speculators, torch, transformers}
  logits    {model: checkpoint directory (its verifier.name_or_path a transformers directory),
             hidden_states: [1, T, 3H] the target's auxiliary hidden states, input_ids: [1, T] the
             token at each position's next slot (EAGLE's alignment: hidden state j with token
             j + 1), position_ids: [1, T] (default 0..T-1)}
            -> {logits: [T, draft vocabulary], draft_vocab_size, d2t, layer_ids, attention,
            embedding_from_verifier}:
            the draft logits of one training-time-test step (the teacher-forced pass), read from
            the model's own LM head; eager attention (no flex attention on the CPU)
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path


def versions(_request: dict) -> dict:
    import speculators.models.eagle3  # noqa: F401 - it imports
    import torch
    import transformers

    return {"speculators": version("speculators"), "torch": torch.__version__,
            "transformers": transformers.__version__}


def logits(request: dict) -> dict:
    import torch
    from safetensors import safe_open
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(request["model"])
    config.transformer_layer_config._attn_implementation = "eager"   # noqa: SLF001 - its own switch
    model = Eagle3DraftModel.from_pretrained(request["model"], config=config)
    # speculators 0.9.0 on transformers 5.19 leaves the embedding of a checkpoint that has none
    # (it is the verifier's: ours, as vLLM's) as uninitialised memory -- its NaN marker for "take
    # the verifier's" does not survive from_pretrained -- so it is taken from the verifier here
    with safe_open(str(Path(request["model"]) / "model.safetensors"), framework="pt") as weights:
        own_embedding = "embed_tokens.weight" in weights.keys()
    if not own_embedding:
        model._load_verifier_weights(overwrite_embed_tokens=True)   # noqa: SLF001 - see above
    model = model.float().eval()
    hidden = torch.tensor(request["hidden_states"], dtype=torch.float32)
    input_ids = torch.tensor(request["input_ids"], dtype=torch.long)
    length = input_ids.shape[1]
    positions = request.get("position_ids")
    positions = (torch.arange(length)[None] if positions is None
                 else torch.tensor(positions, dtype=torch.long))
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _module, _args, out: seen.append(out))
    try:
        with torch.no_grad():
            model(hidden_states=hidden, input_ids=input_ids,
                  document_ids=torch.zeros_like(input_ids), position_ids=positions, ttt_steps=1)
    finally:
        hook.remove()
    [out] = seen
    return {"logits": out[0].tolist(), "draft_vocab_size": int(out.shape[-1]),
            "d2t": None if model.d2t is None else [int(v) for v in model.d2t],
            "layer_ids": list(model.target_layer_ids or []),
            "attention": model.config.transformer_layer_config._attn_implementation,  # noqa: SLF001
            "embedding_from_verifier": not own_embedding}


COMMANDS = {"versions": versions, "logits": logits}


if __name__ == "__main__":
    from json_command import run   # the sibling file: a script's directory is on sys.path

    sys.exit(run("eagle3_logits.py", COMMANDS))
