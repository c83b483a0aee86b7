"""`specdec config show|register|promote|rollback|export`: the config registry (MLflow)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import yaml
from rich.markup import escape
from rich.table import Table

from specdec_core.home import DEFAULT_MODEL, EMBEDDED_MODELS, models_dir

from ..errors import DatabaseNotMigrated, DatabaseUnavailable, DiskFull, InvalidValue
from ..registry.compose_export import compose_export
from ..registry.config_schema import config_model_name
from ..registry.gate import gates_of
from ..registry.sglang_export import sglang_export
from ..registry.trtllm_export import trtllm_export
from ..registry.version_page import GATE_RESULTS, champion_audit, description_text
from ..registry.vllm_export import vllm_export
from ..serving.environment import SERVED_MARK
from ..settings import load_settings
from .common import open_registry, open_store, output_file, print_json, tracking_uri_arg, url_arg
from .console import emit, make_console

console = make_console()
errors = make_console(stderr=True)


def _name(args) -> str:
    return config_model_name(args.target)


def print_gates(result: dict) -> None:
    table = Table(title=escape(f"gates for version {result['version']}"), title_justify="left")
    for column in ("gate", "result", "figure"):
        table.add_column(column)
    for gate in gates_of(result["gates"]):
        word = GATE_RESULTS[gate.outcome]
        table.add_row(gate.name, word if word != "FAIL" else "[red]FAIL[/red]", escape(gate.figure))
    console.print(table)
    verdict = "promoted to champion" + (" (FORCED)" if result["forced"] else "") if result["promoted"] \
        else "NOT promoted"
    console.print(f"version {result['version']}: {verdict}: {escape(result['reason'])}")


def _champion_audit(args, shown: dict) -> dict | None:
    """The audit of the champion when the shown version is it (tasks.registry.version_page)."""
    if "champion" not in shown["aliases"]:
        return None
    try:
        return champion_audit(open_store(args), shown["name"], shown["version"])
    except (DatabaseUnavailable, DatabaseNotMigrated) as exc:   # the registry alone still answers
        return {"champion": shown["version"], "gated": None,
                "detail": f"gate record not checked: {exc}"}


def _warn_ungated(audit: dict | None) -> None:
    """A champion moved past the gates: a warning (a note when unchecked), on stderr."""
    if audit and audit["gated"] is False:
        errors.print(f"[red]WARNING:[/red] {escape(audit['detail'])}")
    elif audit and audit["gated"] is None:
        errors.print(f"[yellow]note:[/yellow] {escape(audit['detail'])}")


def cmd_show(args) -> int:
    shown = open_registry(args).show_version(_name(args), args.which)
    audit = _champion_audit(args, shown)
    if args.json:
        print_json({**shown, "champion_audit": audit})
        return 0
    _warn_ungated(audit)
    console.print(f"[bold]{shown['name']}[/bold] version {shown['version']} aliases {shown['aliases']}")
    console.print("tags: " + ", ".join(f"{k}={escape(str(v))}" for k, v in sorted(shown["tags"].items())))
    console.print(escape(description_text(shown["description"] or "")))
    return 0


def cmd_register(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..registry.registration import register_config

    store = open_store(args)
    result = register_config(args.run_id, store, registry=open_registry(args, store))
    console.print(f"{result['name']} version {result['version']} "
                  f"({'reused' if result['reused'] else 'registered'}), alias challenger; validation "
                  f"{result['validation']}; champion {result['champion_version'] or 'none'}")
    return 0


def cmd_promote(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..registry.promotion import promote

    expected = "current" if args.expected_champion is None else (
        None if args.expected_champion == "none" else args.expected_champion)
    store = open_store(args)
    result = promote(_name(args), args.version, store, registry=open_registry(args, store),
                     force=args.force, expected_champion=expected)
    print_gates(result)
    return 0 if result["promoted"] else 1


def cmd_rollback(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    from ..registry.promotion import rollback

    store = open_store(args)
    result = rollback(_name(args), store, registry=open_registry(args, store),
                      expected_champion=args.expected_champion or "current")
    console.print(f"{_name(args)}: champion {result['champion_before']} -> {result['champion']}")
    return 0


def cmd_export(args) -> int:
    # imported here: the CLI imports every command module at start-up; this loads for its command only
    registry = open_registry(args)
    shown = registry.show_version(_name(args), args.which)
    _warn_ungated(_champion_audit(args, shown))      # stdout stays the JSON
    version = shown["version"]
    config = registry.version_config(_name(args), version)
    if args.format == "compose":
        return _export_compose(args, config, version)
    if args.format in ("vllm", "sglang"):
        export = vllm_export if args.format == "vllm" else sglang_export
        return _deliver(args, json.dumps(export(config, target_path=args.model_dir
                                                or _served_dir(config.target.id)), indent=2), version)
    return _deliver(args, json.dumps(trtllm_export(config) if args.format == "trtllm"
                                     else json.loads(config.to_json()), indent=2), version)


def _deliver(args, text: str, version: str) -> int:
    """The export to --output (written whole or not at all: a temporary file beside it, then
    renamed over it), else to stdout."""
    if not args.output:
        emit(text)
        return 0
    path = Path(args.output)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text + "\n", encoding="utf-8")
        os.replace(temporary, path)
    except OSError as exc:
        try:
            temporary.unlink(missing_ok=True)
        except OSError:         # a read-only folder: nothing was made there
            pass
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"disk full writing --output {args.output} ({exc.strerror}); nothing was "
                           "written there (a file already there is unchanged). Free space on its "
                           "disk or give a path on another, then run the command again") from None
        raise InvalidValue(f"--output {args.output}: cannot be written ({exc.strerror or exc}); "
                           "nothing was written there. Give a file in a folder you can write") from None
    errors.print(f"wrote {escape(args.output)}: {_name(args)} version {version} ({args.format})")
    return 0


def _export_compose(args, config, version: str) -> int:
    """The Compose override of the version's vLLM deployments (tasks.registry.compose_export):
    to --output, else stdout."""
    text = yaml.safe_dump(compose_export(config, _name(args), version,
                                         load_settings().engine.serving_image,
                                         target_path=args.model_dir), sort_keys=False)
    header = (f"# specdec: the vLLM deployments of {_name(args)} version {version} (profile serving)\n"
              "#   docker compose -f docker-compose.yml -f THIS_FILE --profile serving up -d\n")
    return _deliver(args, (header + text).rstrip("\n"), version)


def _served_dir(target: str) -> str | None:
    """The directory a serving engine loads for the embedded default, once it has been written
    (by the engine check); None: the export names the target id."""
    directory = models_dir() / target.lower() / "transformers"
    return str(directory.resolve()) if target.lower() in EMBEDDED_MODELS and (
        directory / SERVED_MARK).exists() else None


def register(sub) -> None:
    config = sub.add_parser("config", help="the promoted config in the MLflow registry")
    c_sub = config.add_subparsers(dest="config_command", required=True)

    def common(parser, url: bool = False):
        parser.add_argument("--target", default=DEFAULT_MODEL, help="target id (names the registered model)")
        tracking_uri_arg(parser)
        if url:
            url_arg(parser)

    show = c_sub.add_parser("show", help="a version: aliases, tags, description (per-domain table)")
    show.add_argument("which", nargs="?", default="champion", help="champion | challenger | VERSION")
    show.add_argument("--json", action="store_true")
    common(show, url=True)
    show.set_defaults(func=cmd_show)
    reg = c_sub.add_parser("register", help="track a run in MLflow and register its config (challenger)")
    reg.add_argument("run_id")
    common(reg, url=True)
    reg.set_defaults(func=cmd_register)
    prom = c_sub.add_parser("promote", help="gate, then move the champion alias (compare-and-set)")
    prom.add_argument("version")
    prom.add_argument("--force", action="store_true", help="promote past failed gates (recorded)")
    prom.add_argument("--expected-champion", default=None,
                      help="the champion version the gates were reviewed against ('none' if none); "
                           "refused if it has changed")
    common(prom, url=True)
    prom.set_defaults(func=cmd_promote)
    back = c_sub.add_parser("rollback", help="champion back to the version it replaced")
    back.add_argument("--expected-champion", default=None, metavar="N",
                      help="roll back only if version N is still the champion (default: whatever is)")
    common(back, url=True)
    back.set_defaults(func=cmd_rollback)
    export = c_sub.add_parser("export", help="a version as JSON, or as each serving engine's "
                                             "speculative settings per domain")
    export.add_argument("which", nargs="?", default="champion")
    export.add_argument("--format", choices=["json", "vllm", "trtllm", "sglang", "compose"],
                        default="json",
                        help="json: the config; vllm / trtllm: each engine's speculative_config "
                             "per domain (K by batch size in the engine's own key); sglang: the "
                             "launch_server flags per domain (one K per server); compose: a Docker "
                             "Compose override with one vLLM service per deployment (profile serving)")
    export.add_argument("--output", type=output_file("--output"), default=None, help="the file to write, in a folder that exists (any format; default: stdout)")
    export.add_argument("--model-dir", default=None,
                        help="vllm / sglang / compose: the target directory the server loads (default: the embedded "
                             "default's served copy under $SPECDEC_HOME/models once the engine check "
                             "wrote it, else the target id)")
    common(export, url=True)
    export.set_defaults(func=cmd_export)
