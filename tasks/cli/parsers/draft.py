"""`specdec draft train|generate|list|index build`'s parsers (run by tasks.cli.draft)."""

from __future__ import annotations

import argparse

from specdec_core.home import DEFAULT_MODEL

from ...steps.drafters.draft_recipes import KINDS, TRAINING_DEFAULTS
from ..common import days, tracking_uri_arg, url_arg
from . import Command


def register(sub) -> None:
    draft = sub.add_parser("draft", help="train drafts on logged traffic; list registered drafts")
    d_sub = draft.add_subparsers(dest="draft_command", required=True)
    _add_train(d_sub)
    _add_generate(d_sub)
    listing = d_sub.add_parser("list", help="registered drafts of a target")
    listing.add_argument("--model", default=DEFAULT_MODEL)
    tracking_uri_arg(listing)
    listing.set_defaults(func=Command("tasks.cli.draft:cmd_list"))
    index = d_sub.add_parser("index", help="suffix indexes over a domain's logged responses")
    i_sub = index.add_subparsers(dest="index_command", required=True)
    build = i_sub.add_parser("build", help="build a domain's index and register it in MLflow "
                                           "(specdec-suffix-<target>) with its lineage")
    build.add_argument("--domain", required=True, help="a domain, or several comma-separated")
    build.add_argument("--model", default=DEFAULT_MODEL, help="target (its fingerprint selects rows)")
    build.add_argument("--days", type=days("--days"), default=None,
                       help="window ending at the domain's newest request (default: all)")
    build.add_argument("--json", action="store_true")
    tracking_uri_arg(build)
    url_arg(build)
    build.set_defaults(func=Command("tasks.cli.draft:cmd_index_build"))


def _add_train(d_sub) -> None:
    train = d_sub.add_parser("train", help="distil a draft from the target's logged responses")
    train.add_argument("--id", default=None, help="training id (re-running it resumes); default: a timestamp")
    train.add_argument("--model", default=DEFAULT_MODEL, help="target")
    train.add_argument("--device", default=None)
    train.add_argument("--domains", default=None, help="comma-separated (default: pooled, all domains)")
    train.add_argument("--days", type=days("--days"), default=None, help="window ending at the newest request")
    train.add_argument("--max-requests", type=int, default=None)
    train.add_argument("--heldout-fraction", type=float, default=TRAINING_DEFAULTS["heldout_fraction"],
                       help="share of requests held out (by request id): never trained on")
    train.add_argument("--validation-fraction", type=float,
                       default=TRAINING_DEFAULTS["validation_fraction"],
                       help="share of the other requests (at least one) kept out of training to "
                            "score the curve and choose the checkpoint kept; the held-out requests "
                            "then score that checkpoint once")
    train.add_argument("--max-eval-requests", type=int, default=TRAINING_DEFAULTS["max_eval_requests"],
                       help="validation requests scored at each evaluation during training, and "
                            "held-out requests scored on the checkpoint kept")
    train.add_argument("--kind", choices=KINDS, default="draft_model",
                       help="draft_model: a small LM (--layers, --hidden); head: a draft head on the "
                            "target's hidden states (--vocab-size); eagle3: an EAGLE-3 head in the "
                            "speculators format vLLM serves (--vocab-size, --unroll, --layer-ids)")
    train.add_argument("--vocab-size", type=int, default=None,
                       help="head: score only the N most frequent tokens of the training traffic; "
                            "eagle3: of the training responses (default: the target's full vocabulary)")
    train.add_argument("--unroll", type=int, default=None,
                       help="head, eagle3: draft steps trained as a chain on the head's own features "
                            "(training-time test; 1: teacher-forced only; each step more costs one "
                            "more pass). Default: 1 for head, 3 for eagle3")
    train.add_argument("--layer-ids", type=_layer_ids, default=None, metavar="I,J,K",
                       help="eagle3: the target layers whose inputs it reads (default: vLLM's, the "
                            "inputs of layers 2, N/2 and N-3)")
    train.add_argument("--split-from", default=None, metavar="TRAIN_ID",
                       help="use this training id's train / held-out split (compare drafts on the "
                            "same held-out rows)")
    train_options(train)
    train.add_argument("--include-generated", action="store_true",
                       help="also train on the rows the target generated (`specdec draft generate`; "
                            "training split only)")
    train.add_argument("--no-register", action="store_true")
    tracking_uri_arg(train)
    train.add_argument("--json", action="store_true")
    url_arg(train)
    train.set_defaults(func=Command("tasks.cli.draft:cmd_train"))


def _add_generate(d_sub) -> None:
    generate = d_sub.add_parser("generate", help="more training data: the target answers logged "
                                                 "prompts under their logged sampling params")
    generate.add_argument("--domain", required=True, help="a domain, or several comma-separated")
    generate.add_argument("--count", type=int, required=True,
                          help="rows to generate per domain (one per logged prompt)")
    generate.add_argument("--id", default=None,
                          help="generation run id (re-running it resumes and skips what it "
                               "generated); default: a timestamp")
    generate.add_argument("--model", default=DEFAULT_MODEL, help="target (its fingerprint selects prompts)")
    generate.add_argument("--device", default=None)
    generate.add_argument("--days", type=days("--days"), default=None,
                          help="prompts of this window ending at the newest request (default: all)")
    generate.add_argument("--batch-size", type=int, default=8)
    generate.add_argument("--max-new-tokens", type=int, default=256,
                          help="at most this many tokens a response (else the row's max_tokens, "
                               "or its logged response's length)")
    generate.add_argument("--for-training", default=None, metavar="TRAIN_ID",
                          help="skip the prompts this training id (or the one it --split-from) holds "
                               "out or keeps for validation: it would leave their rows out anyway")
    generate.add_argument("--heldout-fraction", type=float,
                          default=TRAINING_DEFAULTS["heldout_fraction"],
                          help="with --for-training: that training's held-out share")
    generate.add_argument("--validation-fraction", type=float,
                          default=TRAINING_DEFAULTS["validation_fraction"],
                          help="with --for-training: that training's validation share (its "
                               "validation prompts are skipped too)")
    generate.add_argument("--json", action="store_true")
    url_arg(generate)
    generate.set_defaults(func=Command("tasks.cli.draft:cmd_generate"))


def train_options(train) -> None:
    """The draft's and the optimiser's flags; defaults: tasks.steps.drafters.draft_recipes.TRAINING_DEFAULTS
    (the draft_model recipe's and TrainConfig's fields)."""
    default = TRAINING_DEFAULTS
    train.add_argument("--layers", type=int, default=default["num_layers"],
                       help="draft_model: the target's first layers it starts from")
    train.add_argument("--hidden", type=int, default=default["hidden_size"],
                       help="draft_model: hidden size (default: the target's)")
    train.add_argument("--steps", type=int, default=default["steps"])
    train.add_argument("--batch-size", type=int, default=default["batch_size"])
    train.add_argument("--lr", type=float, default=default["lr"])
    train.add_argument("--eval-every", type=int, default=default["eval_every"])
    train.add_argument("--k-max", type=int, default=default["k_max"])
    train.add_argument("--max-length", type=int, default=default["max_length"],
                       help="tokens of a request trained on: its last ones (prompt end + response)")
    train.add_argument("--teacher-topk", type=int, default=default["teacher_topk"],
                       help="KL from the target's top-k (0: cross-entropy on the logged tokens)")


def _layer_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        ids = []
    if not ids:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated layer ids, e.g. 2,16,29")
    return ids
