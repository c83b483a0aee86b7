"""Save a random-weight Llama of a given shape, with a tokenizer, as a transformers directory.

For machines that can download nothing: `specdec_core.models.load_model(OUT_DIR)` (and so every
`specdec ... --model OUT_DIR` command) loads what this writes, without a network. The default shape
is the embedded default's architecture (SmolLM2-135M), so costs measured on it are those of the
default model; the weights are random, so its text is noise.

Written: config.json, generation_config.json, model.safetensors (save_pretrained) and a tokenizer
built here with the `tokenizers` library: byte-level, no merges (one token per byte), special
tokens <|pad|> <|bos|> <|eos|> (ids 0, 1, 2), then the 256 byte symbols, then filler tokens up to
the model's vocab_size, so that len(tokenizer) == vocab_size and any text round-trips.

    python benchmarks/random_model.py OUT_DIR [--shape smollm2-135m] [--dtype bfloat16] [--seed 0]
    python benchmarks/random_model.py OUT_DIR --smoke      # a tiny model, for tests
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_decode  # noqa: E402  -- the benchmark's model shapes and builder

SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")
DEFAULT_SHAPE = "smollm2-135m"


def build_tokenizer(vocab_size: int):
    """A byte-level PreTrainedTokenizerFast with exactly vocab_size tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    needed = len(SPECIALS) + len(alphabet)
    if vocab_size < needed:
        raise ValueError(f"vocab_size {vocab_size} < {needed}: no room for the byte-level alphabet")
    vocab = {token: i for i, token in enumerate((*SPECIALS, *alphabet))}
    for i in range(vocab_size - len(vocab)):
        vocab[f"<|filler_{i}|>"] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    pad, bos, eos = SPECIALS
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=pad, bos_token=bos,
                                        eos_token=eos, unk_token=None)
    if len(tokenizer) != vocab_size:
        raise AssertionError(f"tokenizer has {len(tokenizer)} tokens, expected {vocab_size}")
    return tokenizer


def save_random_model(out_dir: Path, shape: dict, dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0) -> Path:
    """Write the model and tokenizer to out_dir (created); returns out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(shape["vocab_size"])
    model = gpu_decode.build_model(shape, torch.device("cpu"), dtype, seed=seed)
    pad_id, bos_id, eos_id = (tokenizer.convert_tokens_to_ids(t) for t in SPECIALS)
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.bos_token_id, config.eos_token_id = pad_id, bos_id, eos_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # name the class both transformers 4 and 5 know (5 writes its own backend's name)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", default=DEFAULT_SHAPE, choices=sorted(gpu_decode.TARGET_SHAPES),
                        help=f"the architecture (default {DEFAULT_SHAPE}, the embedded default's)")
    parser.add_argument("--smoke", action="store_true", help="the benchmarks' tiny test shape instead")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = gpu_decode.TARGET_SMOKE if args.smoke else gpu_decode.TARGET_SHAPES[args.shape]
    out = save_random_model(args.out_dir, shape, getattr(torch, args.dtype), args.seed)
    label = "smoke" if args.smoke else args.shape
    print(f"wrote a random-weight {label} model ({args.dtype}, vocab {shape['vocab_size']}, "
          f"{shape['num_hidden_layers']} layers) and its tokenizer to {out}")
    return out


if __name__ == "__main__":
    main()
