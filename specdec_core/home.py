"""Where specdec keeps its files, and the default target: plain Python, no torch, so pipeline code
that only needs these (data commands, DAG files) stays light."""

from __future__ import annotations

import os
from pathlib import Path

# The embedded default target (models.EMBEDDED_MODELS)
DEFAULT_MODEL = "smollm2-135m-instruct"


def specdec_home() -> Path:
    """$SPECDEC_HOME, default ./.specdec: models, databases and reports live below it."""
    return Path(os.environ.get("SPECDEC_HOME", ".specdec"))
