"""`specdec generate|compare`'s parsers (run by tasks.cli.compare)."""

from __future__ import annotations

import argparse

from specdec_core.home import DEFAULT_MODEL

from ...steps.drafters.candidates import CandidateError, parse_candidate
from . import Command


def parse_drafter(text: str) -> tuple[str, dict]:
    """'prompt_lookup', 'layer_skip:num_layers=8', 'draft_model:model=PATH' -> (kind, params)."""
    try:
        spec = parse_candidate(text)
    except CandidateError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec["kind"], spec["params"]


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"target: HF id, local dir, GGUF file or {DEFAULT_MODEL} (default)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)


def register(sub) -> None:
    """Add the generate and compare commands to the `specdec` subparsers."""
    gen = sub.add_parser("generate", help="generate for one prompt: text, then a stats line")
    _add_model_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--drafter", type=parse_drafter, default=None,
                     help="prompt_lookup | layer_skip[:num_layers=N] | draft_model:model=SPEC "
                          "(default: plain decoding)")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--stats-to-stderr", action="store_true")
    gen.set_defaults(func=Command("tasks.cli.compare:cmd_generate"))

    cmp_ = sub.add_parser("compare", help="plain vs each drafter on a prompt set: a table")
    _add_model_args(cmp_)
    cmp_.add_argument("--prompts", default=None,
                      help="a .jsonl ({prompt, domain?, id?}) or .txt file (default: built-in set)")
    cmp_.add_argument("--domains", default=None, help="comma-separated domains to keep")
    cmp_.add_argument("--drafter", type=parse_drafter, action="append",
                      help="repeatable; k=N in the params gives that drafter its own K (default: "
                           "prompt_lookup:k=8 and layer_skip:num_layers=8,k=2)")
    cmp_.add_argument("--no-calibrate", action="store_true",
                      help="do not measure verify-pass widths (by default a verify pass runs at the "
                           "cheapest measured width >= the one needed; outputs are unchanged)")
    cmp_.add_argument("--format", choices=["table", "json"], default="table")
    cmp_.set_defaults(func=Command("tasks.cli.compare:cmd_compare"))
