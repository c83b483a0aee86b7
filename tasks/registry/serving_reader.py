"""Serving-side read of the champion config: one domain's settings, cached, surviving MLflow outages.

    reader = ChampionReader("http://mlflow:5000", "smollm2-135m-instruct", cache_path="/var/cache/specdec.json")
    reader.domain("json")   # {"enabled": True, "drafter": {...}, "k": 7, "max_batch_size": 4, ...}

The champion is re-read at most every `ttl_s` seconds. When the registry cannot be reached, the
last good config is kept (in memory, and in `cache_path` across restarts) and the failure logged;
a domain the config does not name gets the config's default (speculation off).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from .config_schema import SpecdecConfig, config_model_name, parse_config
from .tracking import CHAMPION, alias_version, client, fail_fast, load_version_config

log = logging.getLogger(__name__)

OFF = {"enabled": False}


class ChampionReader:
    def __init__(self, registry_uri: str, target_id: str, ttl_s: float = 60.0,
                 cache_path: str | Path | None = None, clock=time.monotonic):
        self.registry_uri = registry_uri
        self.name = config_model_name(target_id)
        self.ttl_s = ttl_s
        self.cache_path = Path(cache_path) if cache_path else None
        self.clock = clock
        self._config: SpecdecConfig | None = None
        self._version: str | None = None
        self._checked_at: float | None = None
        self.last_error: str | None = None
        if self.cache_path is not None and self.cache_path.exists():
            try:
                self._config = parse_config(self.cache_path.read_text("utf-8"))
            except Exception as exc:       # a corrupt cache must not stop serving
                log.warning("ignoring unreadable champion cache %s: %s", self.cache_path, exc)

    def _refresh(self) -> None:
        with fail_fast():
            mlflow_client = client(self.registry_uri)
            version = alias_version(mlflow_client, self.name, CHAMPION)
            if version is None:
                raise LookupError(f"{self.name} has no champion")
            if version != self._version or self._config is None:
                self._config = load_version_config(mlflow_client, self.name, version)
                self._version = version
                if self.cache_path is not None:
                    self.cache_path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = self.cache_path.with_suffix(".tmp")
                    tmp.write_text(self._config.to_json(), encoding="utf-8")
                    tmp.replace(self.cache_path)

    def config(self) -> SpecdecConfig | None:
        """The champion config (refreshed when older than ttl_s), or the last good one."""
        now = self.clock()
        if self._checked_at is None or now - self._checked_at >= self.ttl_s:
            self._checked_at = now
            try:
                self._refresh()
                self.last_error = None
            except Exception as exc:       # registry down or misconfigured: keep serving
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("champion config of %s not refreshed (%s); keeping %s", self.name,
                            self.last_error, "the last good config" if self._config else "speculation off")
        return self._config

    @property
    def version(self) -> str | None:
        return self._version

    def domain(self, domain: str) -> dict:
        config = self.config()
        if config is None:
            return dict(OFF)
        setting = config.domains.get(domain)
        if setting is None:
            return config.default.model_dump()
        return setting.model_dump(mode="json")
