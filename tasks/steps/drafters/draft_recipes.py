"""What a draft training trains: one typed recipe per kind, each with its own `train()`, the data
every kind shares (TrainingData), and every training default in one place.

    recipe = Eagle3Recipe(vocab_size=4096, config=training_config(steps=300))
    train_draft_from_traffic("eagle3-1", recipe, TrainingData(domains=("json",)), target=...)

Kinds (a version's registry tag `kind` says which):
- DraftModelRecipe  `draft_model`: a small causal LM of the target's first `num_layers` layers
  (hidden size `hidden_size`, default the target's), specdec_core.train.train_draft;
- HeadRecipe        `head`: a draft head on the target's hidden states, its vocabulary cut to the
  training traffic's `vocab_size` most frequent tokens (None: the target's full head), `unroll`
  draft steps trained as a chain on its own features (default 1);
- Eagle3Recipe      `eagle3`: an EAGLE-3 head on the target layers `layer_ids` (default vLLM's),
  its vocabulary the training responses' `vocab_size` most frequent tokens (None: all), `unroll`
  steps of training-time test (default 3); its kept checkpoint is rewritten in the speculators
  format vLLM and SGLang load, with the planned K and the target as verifier.
recipe_for(kind, config, **options) builds the recipe of a kind from the flat options a command
line or a DAG run carries (options of another kind are not the recipe's and are left out;
layer_ids given to another kind than eagle3 is refused); recipe_and_data(kind, **options) splits
flat options into the recipe (with its TrainConfig) and the TrainingData.

Defaults, one source each: TrainConfig's fields (specdec_core.train_config), TrainingData's and
the recipes' fields here. TRAINING_DEFAULTS gathers them for `specdec draft train`'s flags;
SCHEDULED_RETRAINING is the weekly retraining's deliberate choice (dags/specdec_retrain_draft.py's
Params): longer training on a bounded window.

Importing this module loads no torch (a DAG file's parse reads the defaults); each train() loads
the engine's training code (tasks.steps.drafters.draft_engine) when it runs.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from specdec_core.train_config import TrainConfig

from ...errors import SpecdecTaskError


class DraftTrainingError(SpecdecTaskError, ValueError):
    """Draft training cannot run on this input (no traffic, another vocabulary, bad sizes)."""


def _engine():
    """tasks.steps.drafters.draft_engine: the recipes' builds and training on the target, imported
    by the first recipe that trains or checks one (it loads torch; this module's defaults are read
    at a DAG file's parse)."""
    from . import draft_engine

    return draft_engine


def training_config(**values) -> TrainConfig:
    """A TrainConfig of `values` (a value None: TrainConfig's default) whose learning rate warms up
    over a tenth of the steps (at least one) unless warmup_steps is given: the rule of
    `specdec draft train` and of the retraining DAG."""
    given = {name: value for name, value in values.items() if value is not None}
    unknown = sorted(set(given) - {f.name for f in fields(TrainConfig)})
    if unknown:
        raise DraftTrainingError(f"training options {unknown}: TrainConfig has "
                                 f"{[f.name for f in fields(TrainConfig)]}")
    given.setdefault("warmup_steps", max(1, int(given.get("steps", TrainConfig.steps)) // 10))
    return TrainConfig(**given)


@dataclass(frozen=True)
class TrainingData:
    """Which stored requests a draft is trained and held out on (every kind alike): this target's
    production traffic of `domains` (None: pooled, every domain) in the `window_days` ending at
    the newest request (None: all), at most `max_requests`; `heldout_fraction` of them held out by
    a hash of (training id, request id) -- of `split_from`'s id when given, so that drafts compare
    on the same held-out rows; `validation_fraction` of the other rows (at least one) kept out of
    training by another hash: they score the training curve and choose the checkpoint kept, and
    the held-out rows score that checkpoint once (scored on the rows that chose it, a draft would
    report the best of several looks); `max_eval_requests` rows of each scored, round robin over
    domains; include_generated: also train on the rows the target generated (`specdec draft
    generate`), never one generated from a held-out or validation prompt."""

    domains: tuple[str, ...] | None = None
    window_days: float | None = None
    max_requests: int | None = None
    heldout_fraction: float = 0.2
    validation_fraction: float = 0.1
    max_eval_requests: int | None = 60
    split_from: str | None = None
    include_generated: bool = False

    def __post_init__(self):
        object.__setattr__(self, "domains", tuple(self.domains) if self.domains else None)


@dataclass
class TrainingRun:
    """What a recipe's train() trains on: the target, its rows and where checkpoints go."""

    train_id: str
    target: str
    fingerprint: str
    model: object                     # the target, loaded
    train: list                       # [LoggedRequest] of the training split
    evaluation: list                  # [LoggedRequest] of the validation split, scored at each evaluation
    directory: Path                   # checkpoints ($SPECDEC_HOME/drafts/<train id>/)
    progress: bool = True
    report: list | None = None        # [LoggedRequest] held out, the kept checkpoint scored once


@dataclass(frozen=True)
class DraftRecipe:
    """One kind's recipe: its options, how it is recorded, and its train()."""

    kind: ClassVar[str] = ""
    config: TrainConfig = field(default_factory=TrainConfig)

    def prepare(self, model, target: str) -> "DraftRecipe":
        """This recipe with what depends on the loaded target resolved and checked."""
        return self

    def params(self) -> dict:
        """The kind's own options, as the training's record keeps them."""
        return {}

    def base_model(self, target: str) -> str:
        raise NotImplementedError

    def train(self, run: TrainingRun):
        """Train on run's rows (resuming run.directory's checkpoints); the TrainResult."""
        raise NotImplementedError


@dataclass(frozen=True)
class DraftModelRecipe(DraftRecipe):
    kind: ClassVar[str] = "draft_model"
    num_layers: int = 2
    hidden_size: int | None = None

    def params(self) -> dict:
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size}

    def base_model(self, target: str) -> str:
        return f"{target} (first {self.num_layers} layers)"

    def train(self, run: TrainingRun):
        return _engine().train_draft_model(self, run)


def _check_unroll(unroll: int) -> None:
    if int(unroll) < 1:
        raise DraftTrainingError(f"unroll {unroll}: train at least one draft step (>= 1)")


def _vocabulary(vocab_size: int | None) -> str:
    return "full vocabulary" if vocab_size is None else f"{vocab_size} tokens"


@dataclass(frozen=True)
class HeadRecipe(DraftRecipe):
    kind: ClassVar[str] = "head"
    vocab_size: int | None = None
    unroll: int = 1

    def __post_init__(self):
        _check_unroll(self.unroll)

    def params(self) -> dict:
        return {"vocab_size": self.vocab_size, "unroll": self.unroll}

    def base_model(self, target: str) -> str:
        return f"{target} (draft head, {_vocabulary(self.vocab_size)})"

    def train(self, run: TrainingRun):
        return _engine().train_draft_head(self, run)


@dataclass(frozen=True)
class Eagle3Recipe(DraftRecipe):
    kind: ClassVar[str] = "eagle3"
    vocab_size: int | None = None
    unroll: int = 3
    layer_ids: tuple[int, ...] | None = None      # None: vLLM's default for the target

    def __post_init__(self):
        _check_unroll(self.unroll)
        if self.layer_ids is not None:
            object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))

    def prepare(self, model, target: str) -> "Eagle3Recipe":
        """layer_ids resolved (recorded as used, not as "default") and checked against the target."""
        return _engine().prepare_eagle3(self, model, target)

    def params(self) -> dict:
        return {"vocab_size": self.vocab_size, "unroll": self.unroll,
                "layer_ids": None if self.layer_ids is None else list(self.layer_ids),
                "vocab_from": "responses"}

    def base_model(self, target: str) -> str:
        return f"{target} (EAGLE-3 head, {_vocabulary(self.vocab_size)})"

    def train(self, run: TrainingRun):
        return _engine().train_eagle3(self, run)


RECIPES: dict[str, type[DraftRecipe]] = {recipe.kind: recipe for recipe in
                                         (DraftModelRecipe, HeadRecipe, Eagle3Recipe)}
KINDS = tuple(RECIPES)


def _own_defaults(kind: type) -> dict:
    return {f.name: f.default for f in fields(kind) if f.default is not MISSING}


def recipe_for(kind: str, config: TrainConfig | None = None, **options) -> DraftRecipe:
    """The recipe of `kind` from flat options (a value None: the recipe's default). Options that
    belong to another kind are left out, except layer_ids (eagle3's only), which is refused."""
    if kind not in RECIPES:
        raise DraftTrainingError(f"draft kind {kind!r}: train one of {list(KINDS)}")
    recipe = RECIPES[kind]
    known = {name for other in RECIPES.values() for name in _own_defaults(other)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise DraftTrainingError(f"draft options {unknown}: the recipes take {sorted(known)}")
    if options.get("layer_ids") is not None and kind != Eagle3Recipe.kind:
        raise DraftTrainingError(f"layer_ids {list(options['layer_ids'])} are for kind eagle3, "
                                 f"not {kind}")
    if options.get("unroll") is not None:
        _check_unroll(options["unroll"])
    own = _own_defaults(recipe)
    given = {name: value for name, value in options.items() if name in own and value is not None}
    return recipe(config=config or TrainConfig(), **given)


def recipe_and_data(kind: str, **options) -> tuple[DraftRecipe, TrainingData]:
    """The recipe of `kind` and its data from flat options, as a command line or a DAG run gives
    them: TrainConfig's fields (training_config), TrainingData's, and the recipes' options
    (recipe_for). A value None: its default."""
    config_names = {f.name for f in fields(TrainConfig)}
    data_names = {f.name for f in fields(TrainingData)}
    config = training_config(**{k: v for k, v in options.items() if k in config_names})
    data = TrainingData(**{k: v for k, v in options.items() if k in data_names and v is not None})
    recipe = recipe_for(kind, config, **{k: v for k, v in options.items()
                                         if k not in config_names | data_names})
    return recipe, data


# every training default, by the name of its option: `specdec draft train` takes these
TRAINING_DEFAULTS = {**_own_defaults(TrainConfig), **_own_defaults(TrainingData),
                     **_own_defaults(DraftModelRecipe)}
# The weekly retraining (dags/specdec_retrain_draft.py) trains longer than a run by hand, with
# fewer validation evaluations, on the last four weeks of at most 2000 requests: a deliberate
# choice, the DAG's Params' defaults
SCHEDULED_RETRAINING = {**TRAINING_DEFAULTS, "steps": 300, "eval_every": 100, "window_days": 28,
                        "max_requests": 2000}
