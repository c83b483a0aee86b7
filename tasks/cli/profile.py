"""`specdec profile measure|show|export|import`: cost profiles (tasks.steps.costs): measured here
with our engine or with vLLM's in the serving environment, shown as ratios to one target step,
moved between machines as JSON files; the parsers: tasks.cli.parsers.evaluation."""

from __future__ import annotations

import json
import sys

from rich.markup import escape
from rich.table import Table

from specdec_core import load_model
from specdec_core.static_cache import COMPILES

from ..paths import check_identifier
from ..settings import load_settings
from ..steps.costs.costs import hardware_of, load_costs, profile_costs
from ..steps.costs.engine_costs import profile_vllm
from ..steps.costs.transfer import export_costs, import_costs
from ..steps.drafters.candidates import build_drafters
from ..timeutil import default_run_id
from .common import open_store
from .console import make_console

console = make_console()


def _profile_model(args):
    settings = load_settings()
    model, tokenizer = load_model(args.model, device=args.device)
    drafters = build_drafters(args.candidate or settings.plan.candidates, model, tokenizer)
    return settings, model, tokenizer, {label: d for label, (_, d) in drafters.items()}


def cmd_profile_measure(args) -> int:
    if args.run_id is not None:
        check_identifier(args.run_id, "run id")
    if args.name is not None:
        check_identifier(args.name, "profile name")
    sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else None
    if args.engine == "vllm":
        result = profile_vllm(args.run_id or "vllm-profile__" + default_run_id().split("__")[1],
                              args.model, args.candidate, open_store(args), name=args.name,
                              k_max=args.k_max, batch_sizes=sizes, draft_k=args.draft_k,
                              ks=[int(k) for k in args.ks.split(",")] if args.ks else None)
        args.name, args.run = result["hardware_profile"]["name"], result["run_id"]
        return cmd_profile_show(args)
    settings, model, tokenizer, drafters = _profile_model(args)
    result = profile_costs(args.run_id or "profile__" + default_run_id().split("__")[1], model,
                           drafters, open_store(args, settings), hardware_profile=args.name, settings=settings,
                           k_max=args.k_max, batch_sizes=sizes, tokenizer=tokenizer)
    if COMPILES["bodies"]:
        print(f"compiled forwards: {COMPILES['bodies']} bodies in {COMPILES['seconds']:.1f} s "
              "(part of the measurement's time, not of the costs)", file=sys.stderr)
    args.name, args.run = result["hardware_profile"]["name"], result["run_id"]
    return cmd_profile_show(args)


def _rounds_table(costs, label: str, k_max: int, cell) -> Table:
    """A host drafter's whole rounds, timed in its own engine: r(K) by batch size."""
    rounds = Table(title=escape(f"{label}'s whole rounds, timed in its own engine (the planner "
                                "prices its rounds with them): r(K) = its round at K / its K 0 step"),
                   title_justify="left")
    rounds.add_column("batch", justify="right")
    for k in range(1, k_max + 1):
        rounds.add_column(f"r({k})", justify="right")
    for b in costs.batch_sizes:
        ratios = costs.round_ratios(label, b) or []
        rounds.add_row(str(b), *[cell(f"{r:.2f}", ("draft_round", label, k, b))
                                 for k, r in enumerate(ratios, 1)])
    return rounds


def cmd_profile_show(args) -> int:
    store = open_store(args)
    costs = load_costs(args.name, store, getattr(args, "run", None))
    hardware = hardware_of(costs.hardware_profile, store)
    paired = costs.paired or bool(((hardware or {}).get("details") or {}).get("engine", {}).get("paired"))
    spread = ("its 95% half-width over the ratio: paired timings" if paired else
              "interquartile range / median; draft and overhead: over the step")
    table = Table(title=escape(f"cost profile {costs.hardware_profile} (run {costs.run_id}): "
                               f"ratios to one target step, each with its spread ({spread})"),
                  title_justify="left")
    table.add_column("batch", justify="right")
    table.add_column("target step ms", justify="right")
    k_max = max(costs.k_max(b) for b in costs.batch_sizes)
    for k in range(1, k_max + 1):
        table.add_column(f"v({k})", justify="right")
    drafters = sorted(costs.draft_step)
    for label in drafters:
        table.add_column(escape(f"draft {label}"), justify="right")
    overheads = sorted(costs.round_overhead)      # per round outside forwards and proposals
    for label in overheads:
        table.add_column(escape(f"overhead {label}"), justify="right")

    def cell(value: str, key: tuple) -> str:
        spread = costs.spread.get(key)
        return value if spread is None else f"{value} ±{100 * spread:.0f}%"

    for b in costs.batch_sizes:
        ratios = costs.verify_ratios(b)
        step = costs.target_step[b]
        table.add_row(str(b), cell(f"{1000 * step:.1f}", ("target_step", None, None, b)),
                      *[cell(f"{r:.2f}", ("verify", None, k, b)) for k, r in enumerate(ratios, 1)],
                      *[cell(f"{costs.draft_ratio(label, b):.3f}", ("draft_step", label, None, b))
                        for label in drafters],
                      *[cell(f"{costs.round_overhead[label].get(b, 0.0) / step:.3f}",
                             ("round_overhead", label, None, b)) for label in overheads])
    console.print(table)
    if costs.sampled_timed:
        sampled = Table(title="sampled requests (timed apart: the serving engine's rejection sampler "
                              "does more for them): step and v(K) = verify(K) / the sampled step",
                        title_justify="left")
        sampled.add_column("batch", justify="right")
        sampled.add_column("sampled step ms", justify="right")
        timed_ks = sorted({k for per_k in costs.sampled_verify.values() for k in per_k})
        for k in timed_ks:
            sampled.add_column(f"v({k})", justify="right")
        for b in sorted(costs.sampled_step):
            step = costs.sampled_step[b]
            sampled.add_row(str(b), cell(f"{1000 * step:.1f}", ("sampled_step", None, None, b)),
                            *[cell(f"{costs.sampled_verify.get(b, {})[k] / step:.2f}",
                                   ("sampled_verify", None, k, b))
                              if k in costs.sampled_verify.get(b, {}) else "-" for k in timed_ks])
        console.print(sampled)
    for label in sorted(costs.draft_round):
        console.print(_rounds_table(costs, label, k_max, cell))
    if hardware is not None:
        engine = hardware["details"].get("engine")
        console.print(escape(f"hardware: {hardware['device']} {hardware['dtype']}; engine: "
                             + (json.dumps(engine) if isinstance(engine, dict) else str(engine))))
    check = costs.check
    if check is None:
        console.print("check: none recorded (measured or imported without one)")
    elif check["status"] == "noisy":
        console.print(f"[red]NOISY[/red] after {check['attempts']} check(s): "
                      + escape("; ".join(check.get("reasons") or []))
                      + ". The planner turns no domain on from it that the champion has off; "
                        "measure again on a quiet machine or plan with a stored profile "
                        "(--hardware-profile NAME).")
    else:
        console.print(f"check: {check['status']} ({check['attempts']} check(s), largest spread "
                      f"{100 * (check.get('max_spread') or 0):.0f}%)")
    return 0


def cmd_profile_export(args) -> int:
    document = export_costs(args.name, args.file, open_store(args), args.run)
    console.print(f"wrote {len(document['costs'])} cost rows of {escape(args.name)} (run "
                  f"{escape(document['run_id'])}) to {escape(args.file)}")
    return 0


def cmd_profile_import(args) -> int:
    if args.name is not None:
        check_identifier(args.name, "profile name")
    result = import_costs(args.file, open_store(args), name=args.name)
    console.print(f"imported {result['rows']} cost rows as profile "
                  f"{escape(result['hardware_profile']['name'])} (run {escape(result['run_id'])})")
    return 0
