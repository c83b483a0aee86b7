"""`specdec draft train|generate|list|index build`: drafts trained on the traffic they serve
(tasks.steps.drafters.draft_training), more training data answered by the target itself
(tasks.steps.traffic.traffic_generate) and suffix indexes over the traffic
(tasks.steps.drafters.suffix_index)."""

from __future__ import annotations

import argparse

from rich.markup import escape
from rich.table import Table

from specdec_core.home import DEFAULT_MODEL

from ..paths import check_identifier
from ..steps.drafters.draft_recipes import KINDS, TRAINING_DEFAULTS, recipe_and_data
from ..timeutil import default_run_id
from .common import days, open_registry, open_store, print_json, tracking_uri_arg, url_arg
from .console import make_console

console = make_console()


def heldout_table(best: dict, title: str) -> Table:
    table = Table(title=escape(title), title_justify="left")
    for column in ("domain", "held-out requests", "E[tokens/round]", "acceptance", "K", "predicted speedup"):
        table.add_column(column, justify="left" if column == "domain" else "right")
    rows = [("all", best)] + sorted(best.get("domains", {}).items())
    for name, scores in rows:
        table.add_row(name, str(scores.get("requests", "-")), f"{scores['expected_tokens_per_round']:.3f}",
                      f"{scores['acceptance_rate']:.3f}", str(scores["k"]), f"{scores['predicted_speedup']:.2f}x")
    return table


def _layer_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        ids = []
    if not ids:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated layer ids, e.g. 2,16,29")
    return ids


def train_recipe(args):
    """(recipe, data) of `specdec draft train`'s flags (tasks.steps.drafters.draft_recipes)."""
    return recipe_and_data(
        args.kind, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        eval_every=args.eval_every, teacher_topk=args.teacher_topk, k_max=args.k_max,
        max_length=args.max_length, num_layers=args.layers, hidden_size=args.hidden,
        vocab_size=args.vocab_size, unroll=args.unroll, layer_ids=args.layer_ids,
        domains=args.domains.split(",") if args.domains else None, window_days=args.days,
        max_requests=args.max_requests, heldout_fraction=args.heldout_fraction,
        validation_fraction=args.validation_fraction,
        max_eval_requests=args.max_eval_requests, split_from=args.split_from,
        include_generated=args.include_generated)


def cmd_train(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.drafters.draft_training import train_draft_from_traffic

    if args.id is not None:
        check_identifier(args.id, "draft id")      # before the target is loaded
    recipe, data = train_recipe(args)               # a bad option fails before the target loads
    store = open_store(args)
    result = train_draft_from_traffic(
        args.id or "draft__" + default_run_id().split("__")[1].replace(":", "-"), recipe, data,
        target=args.model, store=store, registry=open_registry(args, store), device=args.device,
        register=not args.no_register)
    if args.json:
        print_json({k: v for k, v in result.items() if k != "result"})
        return 0
    best, heldout = result["best"], result["heldout"] or result["best"]
    console.print(heldout_table(heldout, f"draft {result['train_id']}: the checkpoint kept, on "
                                         "held-out requests"))
    console.print(f"step {best['step']} of {result['steps']} kept, chosen on "
                  f"{result['validation_requests']} validation requests (predicted "
                  f"{best['predicted_speedup']:.2f}x there); {result['train_requests']} train / "
                  f"{result['validation_requests']} validation / {result['heldout_requests']} "
                  "held-out requests")
    console.print(f"held-out KL {heldout['heldout_kl']:.4f}; checkpoint {escape(result['best_dir'])}; "
                  + (f"registered {result['model_uri']} (alias candidate)" if result["model_uri"] else "not registered"))
    return 0


def cmd_generate(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.traffic.traffic_generate import generate_traffic

    run_id = args.id or "generate__" + default_run_id().split("__")[1].replace(":", "-")
    result = generate_traffic(run_id, [d.strip() for d in args.domain.split(",") if d.strip()],
                              args.count, target=args.model, store=open_store(args), window_days=args.days,
                              batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                              device=args.device,
                              heldout=((args.for_training, args.heldout_fraction,
                                        args.validation_fraction) if args.for_training else None))
    if args.json:
        print_json(result)
        return 0
    table = Table(title=f"generated traffic {escape(run_id)} (re-run this id to resume)",
                  title_justify="left")
    for column in ("domain", "logged prompts", "planned", "already there", "generated now", "rows"):
        table.add_column(column, justify="left" if column == "domain" else "right")
    for domain, counts in result["domains"].items():
        table.add_row(escape(domain), *(str(counts[key]) for key in
                                        ("available", "planned", "before", "generated", "rows")))
    console.print(table)
    console.print("train on them with `specdec draft train --include-generated`; they are never "
                  "sampled, indexed or reported as production traffic")
    return 0


def cmd_list(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.drafters.draft_training import draft_model_name

    name = draft_model_name(args.model)
    versions = open_registry(args).client.search_model_versions(f"name='{name}'")
    table = Table(title=f"{name}: registered drafts", title_justify="left")
    for column in ("version", "kind", "aliases", "train id", "domains", "window", "held-out speedup",
                   "fingerprint"):
        table.add_column(column)
    for v in sorted(versions, key=lambda v: int(v.version)):
        tags = v.tags or {}
        table.add_row(str(v.version), tags.get("kind", "draft_model"), ",".join(v.aliases or []),
                      escape(tags.get("train_id", "")),
                      tags.get("domains", ""), tags.get("window", ""),
                      tags.get("heldout_predicted_speedup", ""), tags.get("target_fingerprint", ""))
    console.print(table)
    return 0


def cmd_index_build(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.drafters.suffix_index import build_and_register

    results = {}
    store = open_store(args)
    registry = open_registry(args, store)
    for domain in [d.strip() for d in args.domain.split(",") if d.strip()]:
        results[domain] = build_and_register(args.model, domain, store,
                                             registry=registry, window_days=args.days)
    if args.json:
        print_json(results)
        return 0
    table = Table(title=f"suffix indexes of {escape(args.model)}", title_justify="left")
    for column in ("domain", "model URI", "requests", "tokens", "window"):
        table.add_column(column)
    for domain, out in results.items():
        table.add_row(escape(domain), escape(out["model_uri"]), str(out["requests"]),
                      str(out["tokens"]), escape(out["window"]))
    console.print(table)
    console.print("use one in an evaluation as candidate suffix:index=<model URI>")
    return 0


def register(sub) -> None:
    draft = sub.add_parser("draft", help="train drafts on logged traffic; list registered drafts")
    d_sub = draft.add_subparsers(dest="draft_command", required=True)
    _add_train(d_sub)
    _add_generate(d_sub)
    listing = d_sub.add_parser("list", help="registered drafts of a target")
    listing.add_argument("--model", default=DEFAULT_MODEL)
    tracking_uri_arg(listing)
    listing.set_defaults(func=cmd_list)
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
    build.set_defaults(func=cmd_index_build)


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
    train.set_defaults(func=cmd_train)


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
    generate.set_defaults(func=cmd_generate)


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
