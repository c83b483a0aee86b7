"""`specdec config show|register|promote|rollback|export`: the config registry (MLflow); the
parsers: tasks.cli.parsers.config."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import yaml
from rich.markup import escape
from rich.table import Table

from specdec_core.home import EMBEDDED_MODELS, models_dir

from ..errors import DatabaseNotMigrated, DatabaseUnavailable, DiskFull, InvalidValue
from ..registry.compose_export import compose_export
from ..registry.config_schema import config_model_name
from ..registry.gate import gates_of
from ..registry.promotion import promote, rollback
from ..registry.registration import register_config
from ..registry.sglang_export import sglang_export
from ..registry.trtllm_export import trtllm_export
from ..registry.version_page import GATE_RESULTS, champion_audit, description_text
from ..registry.vllm_export import vllm_export
from ..serving.environment import SERVED_MARK
from ..settings import load_settings
from .common import open_registry, open_store, print_json
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
    store = open_store(args)
    result = register_config(args.run_id, store, registry=open_registry(args, store))
    console.print(f"{result['name']} version {result['version']} "
                  f"({'reused' if result['reused'] else 'registered'}), alias challenger; validation "
                  f"{result['validation']}; champion {result['champion_version'] or 'none'}")
    return 0


def cmd_promote(args) -> int:
    expected = "current" if args.expected_champion is None else (
        None if args.expected_champion == "none" else args.expected_champion)
    store = open_store(args)
    result = promote(_name(args), args.version, store, registry=open_registry(args, store),
                     force=args.force, expected_champion=expected)
    print_gates(result)
    return 0 if result["promoted"] else 1


def cmd_rollback(args) -> int:
    store = open_store(args)
    result = rollback(_name(args), store, registry=open_registry(args, store),
                      expected_champion=args.expected_champion or "current")
    console.print(f"{_name(args)}: champion {result['champion_before']} -> {result['champion']}")
    return 0


def cmd_export(args) -> int:
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
