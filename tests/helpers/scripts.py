"""Scripts of the repository (benchmarks/, scripts/) imported as modules, for their tests."""

from __future__ import annotations

import importlib.util

from . import REPO


def load_script(relative_path: str, name: str):
    """A script of the repository (benchmarks/, scripts/) imported as a module, for its tests."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
