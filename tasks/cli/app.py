"""The `specdec` command line: the root parser, `generate` and `compare`; the other command groups
register themselves from their own modules."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback

from rich.markup import escape
from rich.table import Table

from specdec_core.errors import SpecDecError
from specdec_core.home import DEFAULT_MODEL

from ..db.engine import database_error, is_disk_full, resolve_database_url
from ..errors import InvalidValue, SpecdecTaskError
from ..masking import mask_text, printable
from ..paths import check_identifier
from ..registry.mlflow_scope import SUPPRESS_RUN_URL_ENV, mlflow_settings
from ..steps.drafters.candidates import CandidateError, candidate_label, parse_candidate
from . import config, data, draft, engine, evaluation, main_job, monitor
from .console import MaskingStream, emit, flush_stdout, make_console
from .prompts import PromptFileError, encode, load_prompts

console = make_console()
errors = make_console(stderr=True)     # errors and warnings: stdout carries only results


def parse_drafter(text: str) -> tuple[str, dict]:
    """'prompt_lookup', 'layer_skip:num_layers=8', 'draft_model:model=PATH' -> (kind, params)."""
    try:
        spec = parse_candidate(text)
    except CandidateError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec["kind"], spec["params"]


def drafter_label(kind: str, params: dict) -> str:
    return candidate_label({"kind": kind, "params": params})


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


def _sampling(args):
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from specdec_core import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def cmd_generate(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from specdec_core import SpecDecoder, load_model
    from specdec_core.factory import make_drafter

    model, tokenizer = load_model(args.model, device=args.device)
    drafter = None
    if args.drafter:
        kind, params = args.drafter
        drafter = make_drafter(kind, params, model, tokenizer)
    decoder = SpecDecoder(model, drafter, k=args.k, tokenizer=tokenizer)
    ids, mask = encode(tokenizer, [args.prompt], chat=not args.no_chat, device=model.device)
    run = decoder.generate if drafter is not None else decoder.generate_plain
    result = run(ids, max_new_tokens=args.max_new_tokens, sampling=_sampling(args), seed=args.seed,
                 attention_mask=mask, eos_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(result.tokens[0, : result.num_tokens[0]], skip_special_tokens=True)
    emit(text)
    stats = ("plain " if drafter is None else drafter_label(*args.drafter) + f" k={args.k} ") \
        + result.stats.summary()
    if args.stats_to_stderr:
        print(stats, file=sys.stderr)
    else:
        emit(stats)
    return 0


def cmd_compare(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from specdec_core import load_model
    from specdec_core.factory import make_drafter

    from .compare import compare

    prompts = load_prompts(args.prompts)
    if args.domains:
        wanted = set(args.domains.split(","))
        prompts = [p for p in prompts if p.domain in wanted]
        if not prompts:
            raise PromptFileError(f"no prompt has a domain in {sorted(wanted)}")
    model, tokenizer = load_model(args.model, device=args.device)
    specs = args.drafter or [("prompt_lookup", {"k": 8}), ("layer_skip", {"num_layers": 8, "k": 2})]
    drafters = {}
    for kind, params in specs:
        params = dict(params)
        drafter_k = int(params.pop("k", args.k))
        drafters[drafter_label(kind, params) + f" k={drafter_k}"] = (
            make_drafter(kind, params, model, tokenizer), drafter_k)
    widths = None
    if not args.no_calibrate:
        from specdec_core.profile import calibrate_verify_widths

        widths = calibrate_verify_widths(model, max(k for _, k in drafters.values()) + 1)
    rows = compare(model, tokenizer, drafters, prompts, k=args.k,
                   max_new_tokens=args.max_new_tokens, sampling=_sampling(args), seed=args.seed,
                   verify_widths=widths)
    if args.format == "json":
        emit(json.dumps([row.to_dict() for row in rows], indent=2))
        return 0
    table = Table(title=f"{args.model}: plain vs drafters, {len(prompts)} prompts, batch 1, "
                        "decode phase")
    for column in ("domain", "contender", "decode tok/s", "acceptance rate",
                   "mean accepted length", "speedup"):
        table.add_column(column, justify="left" if column in ("domain", "contender") else "right",
                         no_wrap=column == "contender")
    for row in rows:
        plain = row.contender == "plain"
        table.add_row(row.domain, row.contender, f"{row.stats.decode_tokens_per_s:.1f}",
                      "-" if plain else f"{row.stats.acceptance_rate:.3f}",
                      "-" if plain else f"{row.stats.mean_accepted_length:.2f}",
                      f"{row.speedup:.2f}x")
    console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="The `specdec` command line.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate for one prompt: text, then a stats line")
    _add_model_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--drafter", type=parse_drafter, default=None,
                     help="prompt_lookup | layer_skip[:num_layers=N] | draft_model:model=SPEC "
                          "(default: plain decoding)")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--stats-to-stderr", action="store_true")
    gen.set_defaults(func=cmd_generate)

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
    cmp_.set_defaults(func=cmd_compare)
    data.register(sub)
    evaluation.register(sub)
    config.register(sub)
    main_job.register(sub)
    draft.register(sub)
    engine.register(sub)
    monitor.register(sub)
    return parser


class _MaskingFilter(logging.Filter):
    """Hides URL credentials in every log record (tasks.masking)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_text(message)
        if masked != message:
            record.msg, record.args = masked, ()
        return True


def main(argv: list[str] | None = None) -> int:
    # stdout carries results only, and no command prints a password: MLflow's own run links (the
    # tracking URI as given, credentials included) are switched off with MLflow's documented
    # setting, whatever the environment says, for this command only (the process's environment is
    # not written), and anything else written to stdout or stderr while the command runs has its
    # URL credentials masked.
    # An uncaught error (a bug to report) has its traceback printed here, while stderr still
    # masks: printed by the interpreter after main() returns, it would show the URLs in its
    # message (SQL parameters included) as they are.
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = MaskingStream(sys.stdout), MaskingStream(sys.stderr)
    try:
        with mlflow_settings(forced={SUPPRESS_RUN_URL_ENV: True}):
            return _main(argv)
    except Exception:
        traceback.print_exc()
        flush_stdout()
        return 1
    except KeyboardInterrupt:       # Ctrl-C: one line, not the traceback of wherever it landed
        errors.print("[red]error:[/red] Interrupted: stopped by Ctrl-C (SIGINT); what was committed "
                     "is kept: run the command again to go on (an import skips the rows it stored)")
        return 130
    finally:
        sys.stdout, sys.stderr = streams


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except InvalidValue as exc:     # a value the option's type refused: one line, before any work
        errors.print(f"[red]error:[/red] InvalidValue: {escape(printable(mask_text(str(exc)), keep_newlines=True))}")
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_MaskingFilter())
    if not args.verbose:    # urllib3's per-retry warnings: the error line says it once
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        # MLflow logs its store's database errors with their traceback before raising them
        # (a full disk: 70 lines); the error line says it once, -v shows them
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    try:
        if getattr(args, "run_id", None) is not None:     # every command's run id, one rule
            check_identifier(args.run_id, "run id")
        status = args.func(args)
    except (SpecDecError, PromptFileError, SpecdecTaskError) as exc:
        errors.print(f"[red]error:[/red] {type(exc).__name__}: {escape(printable(mask_text(str(exc)), keep_newlines=True))}")
        status = 2
    except Exception as exc:    # MLflow's own refusals, a full disk: one line, credentials hidden
        status = _known_failure(exc, args)
    flush_stdout()      # a reader that stopped early (`| head`) changes no exit status
    return status


def _known_failure(exc: Exception, args) -> int:
    """2 with one line on stderr for MLflow's refusals and a full disk (database or files);
    anything else is re-raised (a traceback: a bug to report)."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException) and not is_disk_full(exc):
        errors.print(f"[red]error:[/red] MLflow: {escape(printable(mask_text(' '.join(str(exc.message).split()))[:500]))}")
        return 2
    if not is_disk_full(exc):
        raise exc
    if isinstance(exc, OSError):
        where = f" writing {exc.filename}" if exc.filename else ""
        errors.print(f"[red]error:[/red] DiskFull: disk full{escape(printable(mask_text(where)))} ({escape(printable(exc.strerror or str(exc)))}); "
                     "free space there, then run the command again: a run or import repeats by its id")
        return 2
    try:
        url = resolve_database_url(getattr(args, "url", None))
    except SpecdecTaskError:
        url = "(the configured database)"
    failure = database_error(url, exc)
    errors.print(f"[red]error:[/red] {type(failure).__name__}: {escape(printable(mask_text(str(failure)), keep_newlines=True))}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
