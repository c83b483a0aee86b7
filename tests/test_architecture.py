"""The engine's layer table is written three times for three readers -- the import-linter contract
that `make test` enforces (pyproject.toml), docs/design.md and the package docstring: they must
say the same thing, and name every module of the package."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import specdec_core

REPO = Path(__file__).resolve().parent.parent
CONTRACT = "specdec_core layers"


def contract_layers() -> list[list[str]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contracts = {c["name"]: c for c in config["tool"]["importlinter"]["contracts"]}
    return [[name.strip() for name in re.split(r"[:|]", layer)] for layer in contracts[CONTRACT]["layers"]]


def design_layers() -> list[list[str]]:
    text = (REPO / "docs" / "design.md").read_text()
    table = text[text.index("| layer | modules | holds |"):].split("\n\n")[0].splitlines()[2:]
    return [re.findall(r"`(\w+)`", row.split("|")[2]) for row in table]


def docstring_layers() -> list[list[str]]:
    doc = specdec_core.__doc__
    block = doc[doc.index("Layers, from the top"):].split("\n\n")[0].splitlines()[2:]
    # "  <layer name>  <modules, comma-separated>": the name and the modules two spaces apart
    return [[name.strip() for name in re.split(r"\s{2,}", line.strip())[1].split(",")]
            for line in block]


def test_the_layer_table_is_the_same_in_the_contract_the_design_and_the_docstring():
    layers = contract_layers()
    assert len(layers) >= 5
    assert design_layers() == layers
    assert docstring_layers() == layers


def test_every_engine_module_has_a_layer_and_imports_only_from_its_own_and_lower_ones():
    layers = contract_layers()
    rank = {module: i for i, layer in enumerate(layers) for module in layer}
    modules = {p.stem for p in (REPO / "specdec_core").glob("*.py") if p.stem != "__init__"}
    assert set(rank) == modules
    for module in modules:
        tree = ast.parse((REPO / "specdec_core" / f"{module}.py").read_text())
        imported = {node.module.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}
        upward = sorted(name for name in imported if rank[name] < rank[module])
        assert not upward, f"{module} imports {upward} from a layer above its own"




def test_the_steps_are_split_by_phase_into_small_modules_each_with_a_layer():
    # issue 84: tasks/steps/ is the run's glue and one subpackage per phase of the run, each a layer of
    # the "Layers inside tasks.steps" contract; no module over 500 lines, no subpackage over 12 files
    steps = REPO / "tasks" / "steps"
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"]
                    if c.get("containers") == ["tasks.steps"])
    layered = {name.strip() for layer in contract["layers"] for name in re.split(r"[:|]", layer)}
    children = {p.stem for p in steps.glob("*.py") if p.stem != "__init__"}
    packages = {p.parent.name for p in steps.glob("*/__init__.py")}
    assert layered == children | packages
    for package in packages:
        assert len(list((steps / package).glob("*.py"))) <= 12, package
        init = ast.parse((steps / package / "__init__.py").read_text())
        assert ast.get_docstring(init) and len(init.body) == 1, package     # a docstring, no import
    long = {str(p.relative_to(steps)) for p in steps.rglob("*.py") if len(p.read_text().splitlines()) > 500}
    assert not long, long


def test_both_cache_kinds_keep_the_kv_cache_protocol():
    # the decode loop and the drafters use only KVCache's members; a static cache never shrinks
    # its batch, so select_rows is the dynamic kind's alone
    from specdec_core.cache import KVCache, SequenceCache
    from specdec_core.static_cache import StaticSequenceCache

    members = {name for name, value in vars(KVCache).items()
               if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    members |= set(KVCache.__annotations__)
    assert {"forward", "mark", "reserve", "rollback", "follow", "rollback_to", "width"} <= members
    for kind, lacking in ((SequenceCache, set()), (StaticSequenceCache, {"select_rows"})):
        has = {name for name in members if hasattr(kind, name)}
        has |= {name for name in members if name in kind.__init__.__code__.co_names}
        assert members - has == lacking, kind.__name__


def test_the_drafter_protocol_declares_what_the_loop_reads():
    # flags are class attributes on the base: the loop reads them without getattr
    from specdec_core.drafters import Drafter

    for flag in ("device_side", "reads_host_state", "needs_target_hidden"):
        assert getattr(Drafter, flag) is False
    loop = (REPO / "specdec_core" / "loop.py").read_text()
    assert "getattr(" not in loop and "type(drafter)" not in loop


def test_callers_ask_drafters_through_the_protocol_not_by_probing():
    # "is this a suffix drafter with an index?" is the protocol's (takes_index, index,
    # indexed_requests, identity, walks_text), never a probe of a drafter's class or attributes
    probes = re.compile(r"hasattr\(\s*drafter|getattr\(\s*drafter|isinstance\([^)]*SuffixDrafter|"
                        r"propose_tokens\"")
    found = [f"{path.relative_to(REPO)}:{number}"
             for folder in ("tasks", "specdec_core") for path in sorted((REPO / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if probes.search(line)]
    assert not found, found
    from specdec_core.drafters import Drafter

    for member in ("kind", "index", "takes_index", "walks_text", "indexed_requests", "index_digest",
                   "identity", "with_index", "propose_tokens"):
        assert hasattr(Drafter, member), member
