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
