"""`specdec evaluate|profile`: the evaluation commands of the CLI."""

from __future__ import annotations

import json
import signal
import sys

from rich.markup import escape
from rich.table import Table

from specdec_core.home import DEFAULT_MODEL

from ..paths import check_identifier
from ..registry.run_config import validation_text
from ..registry.run_view import (HEADERS, alert_markdown, below_bar_markdown, build_run_view, engine_state,
                                 reason_line, table_rows)
from ..settings import load_settings
from ..steps.drafters.candidates import build_drafters
from ..timeutil import default_run_id
from .common import days, k_value, open_registry, open_store, per_domain_args, print_json, tracking_uri_arg, url_arg
from .config import print_gates
from .console import make_console

console = make_console()


def evaluation_rich_table(view, seconds: float | None = None, hardware: str | None = None) -> Table:
    """The run's per-domain table in the terminal: the same rows as the version page and
    `reports/domains.md` (tasks.registry.run_view.table_rows of the run's RunView)."""
    config = view.config
    took = "" if seconds is None else f" ({seconds:.0f} s)"
    table = Table(title=escape(f"run {view.run_id}: {config.target.id} on "
                               f"{hardware or config.hardware_profile}{took}"), title_justify="left")
    right = {"K", "max batch", "E [tokens/round]", "proposal rate", "samples"}
    for column in HEADERS:
        table.add_column(column, justify="right" if column in right else "left")
    for row in table_rows(view):
        table.add_row(*[escape(cell) for cell in row])
    return table


def print_run(view, seconds: float | None = None, hardware: str | None = None) -> None:
    """The table, then why each domain is on or off and the engine check's state, as on the page."""
    console.print(evaluation_rich_table(view, seconds, hardware))
    notes = below_bar_markdown(view) + alert_markdown(view)
    if notes:
        console.print(escape(notes.replace("**", "").rstrip()), soft_wrap=True)
    if not view.config.domains_on:      # the one rule: a check that did not run says so
        console.print(f"no domain is on: this config is plain decoding everywhere; validation "
                      f"{escape(validation_text(view.config))}", soft_wrap=True)
    console.print(escape(f"engine check: {engine_state(view)}"), soft_wrap=True)
    for d in view.domains:
        console.print(escape(reason_line(d).replace("**", "")), soft_wrap=True)


def cmd_evaluate(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.evaluate import RunInterrupted, evaluate

    run_id = default_run_id() if args.run_id is None else check_identifier(args.run_id, "run id")
    settings = load_settings(plan_hardware_profile=args.hardware_profile)
    try:
        store = open_store(args, settings)
        result = evaluate(run_id=run_id, target=args.model, store=store, settings=settings,
                          domains=args.domains.split(",") if args.domains else None,
                          window=args.days, candidates=args.candidate or None, k_max=args.k_max,
                          max_per_domain=args.max_per_domain, min_per_domain=args.min_per_domain,
                          device=args.device,
                          progress=not args.no_progress, register=not args.no_register,
                          promote=args.promote, registry=open_registry(args, store),
                          new_profile=args.new_profile)
    except (RunInterrupted, KeyboardInterrupt) as exc:
        name = getattr(exc, "signal_name", "SIGINT")
        make_console(stderr=True).print(
            f"[red]run {escape(run_id)} interrupted by {name}[/red]: marked interrupted (reports "
            "leave it out); run it again with the same --run-id to replace it")
        return 128 + int(getattr(signal, name))
    if args.json:
        print_json(result)
        return _failed_domains_status(result)
    print_run(build_run_view(result["run_id"], open_store(args, settings), settings), result["seconds"])
    from ..steps.costs.reuse import profile_check_text

    console.print(escape(profile_check_text(result.get("profile_check"))))
    console.print(escape(f"cost profile {result['hardware_profile']}: {result['profile']['text']}"))
    fp = result["fingerprint"]
    console.print(f"target fingerprint {fp['id']}: {'ok' if fp['passed'] else 'FAILED: ' + '; '.join(fp['reasons'])}"
                  f"; steps (s): " + ", ".join(f"{k} {v:.0f}" for k, v in result["steps"].items()))
    if result["registered"]:
        reg = result["registered"]
        console.print(f"MLflow: {reg['name']} version {reg['version']} (alias challenger"
                      f"{', reused' if reg['reused'] else ''}); validation {reg['validation']}")
        audit = reg.get("champion_audit") or {}
        if audit.get("gated") is False:
            make_console(stderr=True).print(f"[red]WARNING:[/red] {escape(audit['detail'])}")
    if result["promoted"]:
        print_gates(result["promoted"])
    return _failed_domains_status(result)


FAILED_DOMAINS_STATUS = 3     # the run finished, but a domain's step failed (that domain is off)


def _failed_domains_status(result: dict) -> int:
    """0, or FAILED_DOMAINS_STATUS with one line on stderr naming each failed domain and why."""
    failed = [row for row in result["table"] if row["status"] == "failed"]
    if not failed:
        return 0
    make_console(stderr=True).print(
        f"[red]run {escape(result['run_id'])}: {len(failed)} domain(s) failed[/red] (off in this "
        "run's config; the champion's setting is kept): " + escape("; ".join(
            f"{row['domain']}: {str(row.get('reason') or '')[:300]}" for row in failed))
        + f" (exit status {FAILED_DOMAINS_STATUS})")
    return FAILED_DOMAINS_STATUS


def _profile_model(args):
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from specdec_core import load_model

    settings = load_settings()
    model, tokenizer = load_model(args.model, device=args.device)
    drafters = build_drafters(args.candidate or settings.plan.candidates, model, tokenizer)
    return settings, model, tokenizer, {label: d for label, (_, d) in drafters.items()}


def cmd_profile_measure(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.costs.costs import profile_costs

    if args.run_id is not None:
        check_identifier(args.run_id, "run id")
    if args.name is not None:
        check_identifier(args.name, "profile name")
    sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else None
    if args.engine == "vllm":
        from ..steps.costs.engine_costs import profile_vllm

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
    from specdec_core.static_cache import COMPILES

    if COMPILES["bodies"]:
        print(f"compiled forwards: {COMPILES['bodies']} bodies in {COMPILES['seconds']:.1f} s "
              "(part of the measurement's time, not of the costs)", file=sys.stderr)
    args.name, args.run = result["hardware_profile"]["name"], result["run_id"]
    return cmd_profile_show(args)


def cmd_profile_show(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.costs.costs import hardware_of, load_costs

    store = open_store(args)
    costs = load_costs(args.name, store, getattr(args, "run", None))
    table = Table(title=escape(f"cost profile {costs.hardware_profile} (run {costs.run_id}): "
                               "ratios to one target step, each with its spread (interquartile "
                               "range / median; draft and overhead: over the step)"),
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
    hardware = hardware_of(costs.hardware_profile, store)
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
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.costs.transfer import export_costs

    document = export_costs(args.name, args.file, open_store(args), args.run)
    console.print(f"wrote {len(document['costs'])} cost rows of {escape(args.name)} (run "
                  f"{escape(document['run_id'])}) to {escape(args.file)}")
    return 0


def cmd_profile_import(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..steps.costs.transfer import import_costs

    if args.name is not None:
        check_identifier(args.name, "profile name")
    result = import_costs(args.file, open_store(args), name=args.name)
    console.print(f"imported {result['rows']} cost rows as profile "
                  f"{escape(result['hardware_profile']['name'])} (run {escape(result['run_id'])})")
    return 0


def register(sub) -> None:
    ev = sub.add_parser("evaluate", help="sample -> check -> profile -> estimate -> plan -> confirm "
                                         "-> validate, then a per-domain table")
    ev.add_argument("--run-id", default=None, help="default: manual__<UTC time>; re-running replaces it")
    ev.add_argument("--model", default=DEFAULT_MODEL, help="target (default: the embedded default)")
    ev.add_argument("--device", default=None)
    ev.add_argument("--domains", default=None, help="comma-separated (default: all with traffic)")
    ev.add_argument("--days", type=days("--days"), default=None, help="window ending at the newest request")
    ev.add_argument("--candidate", action="append", default=None,
                    help="repeatable drafter KIND[:NAME=VALUE...] (default: settings.plan.candidates)")
    ev.add_argument("--hardware-profile", default=None,
                    help="plan with this stored (imported) cost profile instead of measuring here")
    ev.add_argument("--new-profile", action="store_true",
                    help="measure a new cost profile here even where a stored one of this hardware, "
                         "engine and target, younger than profile_max_age_days, could be reused")
    ev.add_argument("--k-max", type=k_value("--k-max"), default=None)
    per_domain_args(ev, min_help="minimum requests per domain", max_help="requests sampled per domain")
    ev.add_argument("--no-progress", action="store_true")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--no-register", action="store_true",
                    help="do not track the run in MLflow nor register its config")
    ev.add_argument("--promote", action="store_true",
                    help="after registering, gate the config and move the champion alias")
    tracking_uri_arg(ev)
    url_arg(ev)
    ev.set_defaults(func=cmd_evaluate)

    prof = sub.add_parser("profile", help="cost profiles: measure, show, export, import")
    p_sub = prof.add_subparsers(dest="profile_command", required=True)
    measure = p_sub.add_parser("measure", help="time target step, verify(K), draft steps here "
                                               "(always afresh; stored for later runs to reuse)")
    measure.add_argument("--name", default=None, help="profile name (default: from device and dtype)")
    measure.add_argument("--run-id", default=None)
    measure.add_argument("--model", default=DEFAULT_MODEL)
    measure.add_argument("--device", default=None)
    measure.add_argument("--candidate", action="append", default=None)
    measure.add_argument("--k-max", type=k_value("--k-max"), default=None)
    measure.add_argument("--batch-sizes", default=None, help="comma-separated (default: settings)")
    measure.add_argument("--engine", choices=["specdec", "vllm"], default="specdec",
                         help="whose decode steps to time: our engine here (default), or vLLM's in "
                              "the serving environment (`make serving-env`): a profile the planner "
                              "uses to predict speedups on vLLM")
    measure.add_argument("--ks", default=None,
                         help="--engine vllm: comma-separated K values given an engine of their own "
                              "(default 1, 2, 4, 8, ... and --k-max; the rest interpolated)")
    measure.add_argument("--draft-k", type=int, default=3,
                         help="--engine vllm: the K at which each --candidate's draft step is timed")
    url_arg(measure)
    measure.set_defaults(func=cmd_profile_measure)
    show = p_sub.add_parser("show", help="a stored profile as ratios to one target step")
    show.add_argument("name")
    show.add_argument("--run", default=None, help="default: the newest run of that profile")
    url_arg(show)
    show.set_defaults(func=cmd_profile_show)
    export = p_sub.add_parser("export", help="write a stored profile to a JSON file")
    export.add_argument("name")
    export.add_argument("file")
    export.add_argument("--run", default=None)
    url_arg(export)
    export.set_defaults(func=cmd_profile_export)
    imp = p_sub.add_parser("import", help="store a profile from a JSON file (from `profile export`)")
    imp.add_argument("file")
    imp.add_argument("--name", default=None, help="store it under another name")
    url_arg(imp)
    imp.set_defaults(func=cmd_profile_import)
