"""The Registry: MLflow's tracking store (and model registry), resolved once where a process
starts working on it, beside tasks.db.store.Store.

A boundary (a CLI command, a DAG task, a test) opens the Registry: the URI is resolved (the
argument, else $MLFLOW_TRACKING_URI, else sqlite:///$SPECDEC_HOME/mlflow.db; never specdec's own
database). Steps and the registry's functions take the Registry (or the context holding it) and
never a URI; they reach MLflow through its `client` (tasks.registry.tracking.RegistryClient),
made on first use and kept.

Importing this module imports no MLflow: the steps that hold a Registry without calling MLflow
(the database steps, a RunSpec) start without it.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..db.engine import display_url
from ..db.store import Store
from ..errors import RegistryError
from ..masking import mask_url
from ..settings import specdec_home
from .config_schema import SpecdecConfig, config_model_name
from .run_config import run_row

if TYPE_CHECKING:
    from .tracking import RegistryClient


def _tracking():
    """tasks.registry.tracking, imported by the first call that needs it (it loads MLflow)."""
    from . import tracking

    return tracking


def tracking_uri(uri: str | None = None, store: Store | str | None = None) -> str:
    """The MLflow tracking URI to use; refuses specdec's own database (`store`'s, when given).
    store: the Store; a database URL string is still taken from the steps that hold no Store yet
    (draft training, the suffix index), compared as it is."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{(specdec_home() / 'mlflow.db').resolve()}"
    own = store.url if isinstance(store, Store) else store
    if own and uri == own:
        raise RegistryError(f"MLflow's tracking store {display_url(uri)} is specdec's own database; "
                            "give MLflow its own (default sqlite:///$SPECDEC_HOME/mlflow.db)")
    return uri


def registry_of(registry: "Registry | str | None" = None, uri: str | None = None,
                store: Store | str | None = None) -> "Registry":
    """The Registry a public function works with: `registry` (opened by the caller), else one
    opened from `uri` -- the deprecated keyword of register_config, promote and rollback, kept for
    callers outside this repository, as is a URI string passed where the Registry now goes (the
    place `uri` had). Refuses specdec's own database (`store`'s) either way."""
    if isinstance(registry, str):         # a caller that passed the URI by position
        if uri is not None:
            raise TypeError("pass registry= (tasks.registry.registry.Registry) or uri=, not both")
        warnings.warn("a tracking URI in registry's place is deprecated: pass "
                      "registry=Registry.open(uri) (tasks.registry.registry)",
                      DeprecationWarning, stacklevel=3)
        return Registry.open(registry, store)
    if registry is not None:
        if uri is not None:
            raise TypeError("pass registry= (tasks.registry.registry.Registry) or uri=, not both")
        tracking_uri(registry.uri, store)          # refuses specdec's own database
        return registry
    if uri is not None:
        warnings.warn("uri= is deprecated: pass registry=Registry.open(uri) (tasks.registry.registry)",
                      DeprecationWarning, stacklevel=3)
    return Registry.open(uri, store)


@dataclass(frozen=True)
class Registry:
    """The MLflow tracking store (and model registry) one process works with, resolved once where
    a process starts working on it -- a CLI command, a DAG task, a test -- as tasks.db.store.Store
    is. Steps and the registry take the Registry (or the context holding it), never a URI.

    Opening resolves the URI (`tracking_uri`: the argument, else $MLFLOW_TRACKING_URI, else
    sqlite:///$SPECDEC_HOME/mlflow.db; specdec's own database refused) and touches nothing: the
    client is made, and the store checked (`client`), by the first call that needs it, then kept.
    A command that never reaches MLflow never creates or probes its store."""

    uri: str = field(repr=False)      # repr: masked
    _opened: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def open(cls, uri: str | None = None, store: Store | str | None = None) -> "Registry":
        """The Registry of `uri` (else $MLFLOW_TRACKING_URI, else the default under
        $SPECDEC_HOME). store: specdec's database (its Store, or its URL where a caller holds no
        Store), which MLflow must not share; RegistryError if it does."""
        return cls(uri=tracking_uri(uri, store))

    def __repr__(self) -> str:
        return f"Registry({mask_url(self.uri)!r})"

    @property
    def client(self) -> "RegistryClient":
        """The store's RegistryClient, made (and the store checked) on first use; a failure is not
        kept, so that a later call tries again."""
        if "client" not in self._opened:
            self._opened["client"] = _tracking().client(self.uri)
        return self._opened["client"]

    def local_store_missing(self) -> bool:
        """Whether this is a sqlite:/// store whose file does not exist yet: nothing registered
        there, and reading would create it."""
        return self.uri.startswith("sqlite:///") and not Path(self.uri[len("sqlite:///"):]).exists()

    def check_reachable(self) -> str:
        """Raise RegistryError (one line) unless the tracking store answers now; the URI
        otherwise. Run before expensive work that ends by registering."""
        with _tracking().fail_fast():
            self.client.search_registered_models(max_results=1)
        return self.uri

    def current_champion(self, target_id: str | None = None, run_id: str | None = None,
                         store: Store | None = None) -> tuple[str | None, "SpecdecConfig | None"]:
        """(version, config) of the champion of the target (of `run_id`'s target, read from
        `store`, when target_id is None)."""
        tracking = _tracking()
        if target_id is None:
            target_id = run_row(store, run_id)["target_id"]
        name = config_model_name(target_id)
        version = tracking.alias_version(self.client, name, tracking.CHAMPION)
        if version is None:
            return None, None
        return version, tracking.load_version_config(self.client, name, version)

    def show_version(self, name: str, which: str = "champion") -> dict:
        """{name, version, aliases, tags, description, config} of an alias or a version number."""
        tracking = _tracking()
        mlflow_client = self.client
        version = which if which.isdigit() else tracking.alias_version(mlflow_client, name, which)
        if version is None:
            raise RegistryError(f"{name} has no version with alias {which!r}")
        detail = mlflow_client.get_model_version(name, version)
        return {"name": name, "version": version, "aliases": list(detail.aliases or []),
                "tags": dict(detail.tags or {}), "description": detail.description,
                "config": json.loads(tracking.load_version_config(mlflow_client, name, version).to_json())}

    def version_config(self, name: str, version: str) -> "SpecdecConfig":
        """The config.json version `version` of `name` was registered from."""
        return _tracking().load_version_config(self.client, name, version)
