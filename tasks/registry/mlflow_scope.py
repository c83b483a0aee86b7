"""MLflow's settings as specdec uses them, without writing the process's environment.

MLflow reads its settings from environment variables (mlflow.environment_variables) on every
call. specdec sets none of them; instead, once the first registry client is made
(tasks.registry.tracking.client), MLflow's setting objects named below read, in this order:
  1. a value forced by `mlflow_settings(forced=...)`, in the calling thread only, while it lasts
     (fail_fast: serving's reads; the CLI: no run links on stdout);
  2. the environment, as before (a variable you set wins over specdec's defaults);
  3. MLFLOW_CLIENT_DEFAULTS: specdec's bounded retries, no progress bars, no run links;
  4. MLflow's own default.
Child processes inherit nothing from this, and code that reads os.environ sees what you set.
MLflow's own worker threads (artifact transfers in its thread pool) see layers 2-4, not a forced
value of the thread that started them.

Importing this module imports no MLflow: the CLI enters a scope before it knows whether its
command will load MLflow at all.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar

# MLflow's documented switch for the "🏃 View run NAME at: URL" / "🧪 View experiment at: URL" lines
# it writes to stdout when a run ends on an http(s) store: the URL there is the tracking URI as
# given, password included, and stdout carries results (JSON) only.
SUPPRESS_RUN_URL_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
# Bounded retries (MLflow's own default retries an unreachable server for minutes), no progress
# bars in logs and tables, no run links on stdout (the README names them: unreachable MLflow).
MLFLOW_CLIENT_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": 2,
                          "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 1,
                          "MLFLOW_HTTP_REQUEST_TIMEOUT": 20,
                          "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": False,
                          SUPPRESS_RUN_URL_ENV: True}
# fail_fast (tasks.registry.tracking): no retry and a short wait, whatever the environment says
FAIL_FAST_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": 0, "MLFLOW_HTTP_REQUEST_TIMEOUT": 5}
SCOPED_NAMES = tuple(dict.fromkeys([*MLFLOW_CLIENT_DEFAULTS, *FAIL_FAST_SETTINGS]))

_FORCED: ContextVar[dict] = ContextVar("specdec_mlflow_forced", default={})


@contextmanager
def mlflow_settings(forced: dict):
    """Within it, in this thread only, MLflow reads `forced` (variable name -> value, one of
    SCOPED_NAMES) whatever the environment says; os.environ is not written. Scopes nest: an inner
    one adds to the outer's."""
    unknown = sorted(set(forced) - set(SCOPED_NAMES))
    if unknown:
        raise ValueError(f"mlflow_settings: {unknown} are not among the settings specdec scopes "
                         f"({list(SCOPED_NAMES)})")
    token = _FORCED.set({**_FORCED.get(), **forced})
    try:
        yield
    finally:
        _FORCED.reset(token)


def setting(name: str, read_environment):
    """The value MLflow gets for setting `name` (the order in the module docstring);
    read_environment: MLflow's own reading (the environment, else MLflow's default)."""
    forced = _FORCED.get()
    if name in forced:
        return forced[name]
    if os.environ.get(name) is None and name in MLFLOW_CLIENT_DEFAULTS:
        return MLFLOW_CLIENT_DEFAULTS[name]
    return read_environment()


def attach() -> None:
    """Make MLflow's setting objects of SCOPED_NAMES read through `setting` (once per object)."""
    # imported here: this module stays MLflow-free until a registry client is made
    from mlflow import environment_variables

    for name in SCOPED_NAMES:
        variable = getattr(environment_variables, name)
        if "get" not in vars(variable):
            variable.get = lambda name=name, read=variable.get: setting(name, read)
