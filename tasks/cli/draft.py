"""`specdec draft train|generate|list|index build`: drafts trained on the traffic they serve
(tasks.steps.drafters.draft_training), more training data answered by the target itself
(tasks.steps.traffic.traffic_generate) and suffix indexes over the traffic
(tasks.steps.drafters.suffix_index). The parsers: tasks.cli.parsers.draft."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..paths import check_identifier
from ..steps.drafters.draft_recipes import recipe_and_data
from ..steps.drafters.draft_training import draft_model_name, train_draft_from_traffic
from ..steps.drafters.suffix_index import build_and_register
from ..steps.traffic.traffic_generate import generate_traffic
from ..timeutil import default_run_id
from .common import open_registry, open_store, print_json
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
