"""The one settings object of the data steps: defaults here, overridable from the environment.

Every setting has one name: `<group>_<field>` for a grouped one (`settings.plan.k_max` is
`plan_k_max`), its own name for a top-level one (`database_url`). It is the `SPECDEC_<NAME>`
environment variable (upper case), the key of the settings file, the keyword of
`load_settings(**overrides)`, the key of RunSpec.overrides and the argument of Settings.value().
The names from before this rule (DEPRECATED_ALIASES: `eval_k_max`, `gpu_queue`, ...) are still
accepted there, each with a DeprecationWarning naming the new one; where both are set in the same
place, the new name wins.

Precedence (highest first): keyword overrides in code, `SPECDEC_<NAME>` environment variables,
the JSON file named by `SPECDEC_SETTINGS_FILE`, the defaults below. List-valued fields take JSON in
the environment (`SPECDEC_KNOWN_DOMAINS='["json","code"]'`); `known_domains` also takes a comma list.

    from tasks.settings import load_settings
    settings = load_settings()                              # env + file + defaults
    settings = load_settings(traffic_import_batch_size=50)  # and an override
"""

from __future__ import annotations

import json
import os
import re
import socket
import warnings
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specdec_core.home import DEFAULT_MODEL, specdec_home  # noqa: F401 - re-exported (torch-free)

from .errors import SettingsError

ENV_PREFIX = "SPECDEC_"
DATABASE_URL_ENV = "SPECDEC_DATABASE_URL"
SETTINGS_FILE_ENV = "SPECDEC_SETTINGS_FILE"


class _PatternRule(BaseModel):
    """A named rule whose `pattern` must be a valid regular expression."""

    model_config = ConfigDict(frozen=True)
    name: str
    pattern: str

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from exc
        return pattern


class DomainRule(_PatternRule):
    """Assigns `domain` to a request without one when `pattern` (a regular expression, searched
    case-insensitively in the prompt text) matches. Rules are tried in order; the first match wins."""

    model_config = ConfigDict(frozen=True)
    name: str
    domain: str
    pattern: str


class RedactionRule(_PatternRule):
    """Replaces every match of `pattern` in prompts and responses with `replacement` at import."""

    model_config = ConfigDict(frozen=True)
    name: str
    pattern: str
    replacement: str


DEFAULT_DOMAIN_RULES = (
    DomainRule(name="json-keyword", domain="json", pattern=r"\bjson\b"),
    DomainRule(name="code-markers", domain="code",
               pattern=r"```|\bdef \w+\(|\bclass \w+[:(]|\b(python|javascript|typescript|rust|golang|"
                       r"sql query|regex|function|stack ?trace|compile|refactor|unit tests?)\b"),
    DomainRule(name="summarize-keyword", domain="summarize",
               pattern=r"\b(summari[sz]e|summary|tl;?dr|gist|abstract|key points)\b"),
    DomainRule(name="creative-keyword", domain="creative",
               pattern=r"\b(poem|haiku|limerick|story|lyrics|slogan|toast|fairy tale)\b"),
    DomainRule(name="question-form", domain="qa",
               pattern=r"^\s*(what|who|when|where|why|which|how many|how much|is|are|does|do)\b[^\n]*\?\s*$"),
)

# E-mail addresses, and strings shaped like well-known API keys and bearer tokens.
DEFAULT_REDACTION_RULES = (
    RedactionRule(name="email", pattern=r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}",
                  replacement="[EMAIL]"),
    RedactionRule(name="api-key",
                  pattern=r"\b(?:sk|pk|rk)-(?:[A-Za-z0-9_-]{2,}-)?[A-Za-z0-9_-]{16,}"
                          r"|\bAKIA[0-9A-Z]{16}\b|\bgh[pousr]_[A-Za-z0-9]{20,}\b"
                          r"|\bxox[abprs]-[A-Za-z0-9-]{10,}\b|\bAIza[0-9A-Za-z_-]{30,}\b",
                  replacement="[API_KEY]"),
    RedactionRule(name="bearer-token", pattern=r"(?i)\bbearer\s+[A-Za-z0-9._~+/-]{20,}=*",
                  replacement="Bearer [TOKEN]"),
)


class _Group(BaseModel):
    """One concern's settings (a field of Settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class TrafficSettings(_Group):
    """Importing logged traffic (`specdec traffic import`)."""

    import_batch_size: int = Field(default=500, ge=1, le=100_000)
    max_row_bytes: int = Field(default=1_000_000, ge=1024,
                               description="a line (JSONL) or record (CSV) longer than this is quarantined")
    default_temperature: float | None = Field(
        default=None, description="used when a row has no temperature; None: such rows are quarantined")


class SampleSettings(_Group):
    """Drawing a run's sample per domain."""

    window_days: float = Field(default=14.0, gt=0,
                               description="the default window ends at the newest stored request")
    future_tolerance_hours: float = Field(default=1.0, ge=0, description=(
        "the default window ends at the newest request stamped at most this long after now; "
        "rows stamped later (a skewed clock) are left out of it, and counted"))
    min_per_domain: int = Field(default=20, ge=1)
    max_per_domain: int = Field(default=30, ge=1, description=(
        "sized for the 2-core CPU (an evaluation scores tens of requests per domain per minute); "
        "raise it on a GPU"))
    draw: Literal["stable", "per_run"] = Field(default="stable", description=(
        "which requests a run draws: stable (each request keyed by its id alone: runs over the "
        "same window draw the same requests, and a later window keeps the requests still in it, "
        "so a decision changes with the traffic and the costs, not with the draw) or per_run "
        "(keyed by the run id as well: every run a new draw of the window)"))

    @model_validator(mode="after")
    def _ordered(self) -> "SampleSettings":
        if self.min_per_domain > self.max_per_domain:
            raise ValueError(f"min_per_domain {self.min_per_domain} > max_per_domain {self.max_per_domain}")
        return self


class QualitySettings(_Group):
    """The quality gates of a traffic sample and of the result tables."""

    min_prompt_chars: int = 1
    max_prompt_chars: int = 200_000
    max_response_chars: int = 200_000
    min_response_tokens: int = 1
    max_prompt_tokens: int = 32_768
    max_response_tokens: int = 8_192
    k_max: int = Field(default=16, ge=1, description=(
        "the largest K a stored estimate or plan may carry (a gate of the result tables). Not "
        "the K a run plans up to: that is plan.k_max"))


class PlanSettings(_Group):
    """What a run evaluates and how it decides: candidates, K, policy (CPU-sized defaults)."""

    candidates: tuple[str, ...] = Field(
        default=("prompt_lookup:max_ngram=3", "suffix", "layer_skip:num_layers=8"),
        description="drafters to evaluate, KIND[:PARAM=VALUE,...] (see tasks.steps.drafters.candidates)")
    auto_draft_candidates: bool = Field(default=True, description=(
        "add the drafts registered for this target (alias candidate, else the newest) to the candidates"))
    k_max: int = Field(default=8, ge=1, le=32, description=(
        "largest K a run profiles, estimates and plans (RunSpec.k_max, the DAG Param `k_max` and "
        "`specdec evaluate --k-max` set it); at most quality.k_max, the result tables' gate"))
    hardware_profile: str | None = Field(
        default=None, description="cost profile to plan with; None: measure this machine")
    engine: Literal["auto", "specdec", "vllm"] = Field(default="auto", description=(
        "whose costs plan the run: vllm (a cost profile of vLLM's own steps, reused or measured; "
        "the live check then measures vLLM on the same requests in the engine check), specdec (our "
        "engine's profile and its confirm step), auto: vllm where the engine check is on and a "
        "serving environment exists, else specdec"))
    hysteresis: bool = Field(default=True, description=(
        "a domain on in the champion config stays on while its predicted interval's upper end "
        "clears min_speedup and its lower end clears 1.0; a domain that is off turns on only when "
        "its lower end clears min_speedup (configs do not flap at the edge)"))
    min_speedup: float = Field(default=1.1, gt=0, description=(
        "policy: a domain is on only when the lower end of its predicted speedup's 95% interval "
        "clears this"))
    k_tolerance: float = Field(default=0.05, ge=0, lt=1, description=(
        "the planner takes the smallest K of the chosen drafter whose predicted speedup is within "
        "this share of the best one's (at every profiled batch size alike): past a few tokens a "
        "suffix or prompt-lookup drafter's curve is flat to within 1%, so its argmax K is the "
        "cost profile's noise (measured: json K 4 in one run, K 7 in the next, 0.7% apart). 5%, "
        "the half-width a paired cost ratio is timed to (profile_ratio_halfwidth): at 2%, six "
        "runs of one traffic planned json at K 4 to 6, at 5% K 3 to 4; 0: the best, whatever it "
        "buys"))
    estimate_batch_size: int = Field(default=4, ge=1)
    bootstrap_samples: int = Field(default=1000, ge=100)
    acceptance_alert: float = Field(default=1.2, ge=1.0, description=(
        "the low-acceptance alert: a domain whose planned drafter's expected tokens per round "
        "falls below this is published on `specdec://alerts/low-acceptance` and named on the "
        "version page"))

    @field_validator("candidates", mode="before")
    @classmethod
    def _spaced_list(cls, value):
        """Candidates as text: separated by spaces or `;` (commas may separate their params)."""
        if isinstance(value, str):
            return tuple(item for item in re.split(r"[;\s]+", value) if item)
        return value


class ProfileSettings(_Group):
    """Measuring a cost profile, and judging whether it can be trusted or reused."""

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    context_len: int = Field(default=256, ge=8)
    repeats: int = Field(default=3, ge=1, description=(
        "timings of every cost figure per measurement (interleaved; the median is stored)"))
    attempts: int = Field(default=3, ge=1, description=(
        "a profile that fails its checks gets one more pass at a time, checked after each over "
        "its last 2 x repeats passes, up to repeats x attempts passes in all; then it is stored "
        "marked noisy"))
    max_spread: float = Field(default=0.25, gt=0, description=(
        "largest spread of a cost figure (interquartile range of its timings over the median; "
        "draft steps and overheads over the target step) in a trustworthy profile; a quiet 2-core "
        "machine running the main job gave up to 19%, from one of three timings off"))
    checks: bool = Field(default=True, description=(
        "check each measured cost profile for consistency and spread, re-measure a failing one "
        "and mark it noisy (off: every measurement is trusted; tests of orchestration on tiny "
        "models, whose timings are noise)"))
    verify_dip: float = Field(default=0.25, ge=0, lt=1, description=(
        "how far verify(K) may fall as K grows in a trustworthy profile: CPU matrix kernels "
        "change path with the width (a quiet 2-core machine: -12% to -16%, repeatably)"))
    step_dip: float = Field(default=0.1, ge=0, lt=1, description=(
        "how far below one target step verify(K) may cost in a trustworthy profile: on a CPU one "
        "token takes the padded 4-row kernel path plus the padding (a quiet 2-core machine: v(4) "
        "= 0.91-0.98 of a step, repeatably; a busy one gave 0.80)"))
    overhead_floor: float = Field(default=0.2, ge=0, description=(
        "how negative (in target steps) a round's measured overhead may be in a trustworthy "
        "profile: it is the difference of a short decode and its priced forwards (a quiet 2-core "
        "machine: down to -0.12)"))
    max_age_days: float = Field(default=7.0, ge=0, description=(
        "a run reuses the newest stored cost profile that passed its checks, was measured on "
        "this hardware (device, CPU model and threads), engine and engine version, dtype and "
        "target fingerprint, covers the run's batch sizes, K and candidates, and is younger "
        "than this many days; else it measures one (0: always measure; `specdec evaluate "
        "--new-profile` and the DAG Param `new_profile` force a measurement)"))
    engine_budget_s: float = Field(default=180.0, gt=0, description=(
        "seconds a serving engine's cost profile may spend timing (engine starts apart): each "
        "drafter method's engine times pairs of a plain (K 0) batch and a batch at K, one more "
        "pair a round for every ratio whose 95% interval is not yet within ratio_halfwidth, "
        "until none is left or this budget is spent (the ngram engine three shares, a host "
        "drafter's ladder two, another method's one); no round is begun that its pairs' last "
        "timings say would end past it"))
    ratio_halfwidth: float = Field(default=0.05, gt=0, lt=1, description=(
        "a serving engine's cost ratio (a step at K over the K 0 step of the same engine) is "
        "settled when its 95% interval's half-width is at most this share of it"))
    contention_cores: float = Field(default=0.25, ge=0, description=(
        "a timed batch during which other processes took more than this many cores of CPU "
        "(read from /proc/stat) is marked contended and its repeat taken again"))
    slowed: float = Field(default=1.0, gt=0, description=(
        "a timed batch whose step is more than this share over the fastest batch of its batch "
        "size and K (the same prompts, the same work) was slowed by something else: its pair is "
        "left out like a contended one. A neighbour in bursts stalls one batch of a pair 4 to 11 "
        "times over, often without /proc showing it; a quiet machine's batches stay within 1.5 "
        "times the fastest"))
    noise_floor: float = Field(default=0.05, ge=0, lt=1, description=(
        "a cost that falls where it must not (the step as the batch grows, verify as K grows, "
        "verify below one step) is inconsistent only when it falls by more than this and than "
        "the figures' spreads"))


class LiveSettings(_Group):
    """The live check on our own engine (the confirm step)."""

    requests: int = Field(default=3, ge=1, description="live requests per domain")
    max_new_tokens: int = Field(default=48, ge=2)
    tolerance: float = Field(default=0.25, gt=0, description=(
        "flag a domain when |measured / predicted speedup - 1| exceeds this"))
    veto: bool = Field(default=True, description=(
        "a domain that would turn on stays at the champion's setting when confirm measures it "
        "slower than plain decoding, confidently below min_speedup, or confidently slower than "
        "predicted beyond live.tolerance (tasks.steps.checks.confirm.live_verdict); a domain on in the "
        "config that measured so fails the live_check gate (off: live timings are noise, the gate "
        "reports and is not enforced)"))


class ValidationSettings(_Group):
    """The sampling test and the greedy check (output distribution unchanged)."""

    rows: int = Field(default=300, ge=50, description=(
        "continuations per (K, sampling) in the sampling test; 2000 on a GPU"))
    alpha: float = Field(default=0.01, gt=0, lt=1, description="false-alarm rate of one check")
    confirm_factor: int = Field(default=4, ge=0, description=(
        "a sampling test (ours, or on the serving engine) that fails is drawn again, afresh, at "
        "this many times its rows, and the config fails only where that confirmation fails too (a lossless "
        "config then fails about alpha squared of the time, not alpha; a gross fault fails both); "
        "0: the first draw decides"))
    seed: int | None = Field(default=None, ge=0, description=(
        "seed of the sampling test's random streams (mixed with the domain); None: derived from "
        "the run id, so a re-run of a run id repeats its test. A fixed seed fixes the random "
        "streams for every run id; the validated context still comes from the run's own sample. "
        "At alpha 0.01 about one correct run in a hundred fails by chance"))
    per_domain: bool = Field(default=False, description=(
        "run the sampling test for every domain; False: once per distinct (drafter, planned K, "
        "sampling settings), shared by the domains whose three are all equal"))
    samplings: int = Field(default=2, ge=1, description=(
        "sampling settings per sampling test: the most frequent non-greedy settings of the "
        "domain's sampled traffic (each costs validation rows continuations at K = 1 and at the "
        "planned K)"))
    greedy_check_requests: int = Field(default=2, ge=1, description="requests per domain")
    greedy_check_tokens: int = Field(default=24, ge=2)


class EngineSettings(_Group):
    """The serving engine: vLLM in its own virtual environment (`make serving-env`)."""

    serving_python: str | None = Field(default=None, description=(
        "python of the serving environment that has vLLM; None: .venv-serving/bin/python beside "
        "the repository when it exists (`make serving-env`)"))
    check: bool = Field(default=True, description=(
        "before register: serve each domain the plan turns on with its exported config on vLLM "
        "in the serving environment, replay its requests and compare vLLM's own acceptance "
        "counters with the estimate (skipped, with one line, when there is no serving environment)"))
    check_required: bool = Field(default=False, description=(
        "a missing serving environment fails the engine check instead of skipping it"))
    check_requests: int = Field(default=8, ge=1, description=(
        "requests per domain the engine check replays: the domain's confirm requests first, then "
        "the sample's next ones in draw order"))
    check_tolerance: float = Field(default=0.05, ge=0, description=(
        "gate: a domain is not promotable as on when vLLM's mean accepted length falls below the "
        "lower end of the estimate's 95% interval by more than this fraction"))
    check_history: int = Field(default=8, ge=0, description=(
        "suffix decoding: requests of the domain's sample served first (not measured), so vLLM's "
        "suffix tree holds the domain's history before the replay"))
    check_retries: int = Field(default=2, ge=0, description=(
        "a replayed K 0 twin during which other processes took CPU (profile_contention_cores, "
        "read from /proc), or whose step is more than profile_slowed over the fastest of its K "
        "on the engine, is served again up to this many times after the replay, its better "
        "timing kept; the live check's interval is over the pairs neither of whose twins was "
        "contended or slowed where at least 5 are left"))
    check_budget_s: float | None = Field(default=480.0, gt=0, description=(
        "seconds one engine's replay may spend serving (after its start and history), shared "
        "out over its domains in turn (one that ends early leaves its time to the next): a "
        "domain's pairs not started within its share are left out and named, its check decided "
        "on those served (a machine whose other processes leave the engine one slow CPU); None: "
        "no budget, engine_check_timeout_s only"))
    check_timeout_s: float = Field(default=900.0, gt=0, description=(
        "one engine's start and replay; past it the engine is killed and its domains fail the "
        "check, naming the engine log"))
    profile: str | None = Field(default=None, description=(
        "the serving engine's cost profile (`specdec profile measure --engine vllm`) the engine "
        "check predicts its speedups from; None: the newest stored profile of the served vLLM's "
        "version"))
    kv_cache_gib: int = Field(default=2, ge=1, description=(
        "VLLM_CPU_KVCACHE_SPACE of a CPU engine (GiB)"))
    server_start_timeout_s: float = Field(default=300.0, gt=0, description=(
        "how long a vLLM OpenAI server may take to answer /health and /v1/models after its start"))
    sampling: bool = Field(default=True, description=(
        "with the engine check: the sampling test on vLLM's OpenAI server (each config a run "
        "would promote, and the plain server as a control); where it runs, it gates promotion "
        "in place of the own-engine sampling test"))
    sampling_rows: int | None = Field(default=None, ge=50, description=(
        "continuations per sampling setting in the sampling test on vLLM; None: validation.rows"))
    sampling_scope: Literal["config", "domain"] = Field(default="config", description=(
        "the sampling test on vLLM once per distinct served config and sampling settings, from "
        "the first such domain's context, the others sharing its result (config), or once per "
        "domain from its own context (domain: about 50 s more a domain on a 2-core CPU)"))
    sampling_tokens: int = Field(default=3, ge=2, le=8, description=(
        "tokens per continuation in the sampling test on vLLM (position 0 comes before any draft)"))
    fork_server: bool = Field(default=True, description=(
        "start the serving environment's processes (engine replays, cost measurements, probes, "
        "OpenAI servers) as forks of one process that has imported vLLM, instead of each "
        "importing torch and vLLM anew (15-20 s of CPU each on a small machine); off: each is a "
        "process of its own"))
    serving_image: str = Field(default="vllm/vllm-openai:v0.32.0", description=(
        "the vLLM image of the services `specdec config export --format compose` writes"))


class QueueSettings(_Group):
    """Airflow queues (CeleryExecutor / KubernetesExecutor workers; the LocalExecutor ignores them)."""

    gpu: str = Field(default="gpu", min_length=1, description=(
        "queue of the tasks that run the model: profile, estimate, confirm, validate, the run's "
        "greedy and fingerprint checks (finish), draft training"))
    cpu: str = Field(default="default", min_length=1, description=(
        "queue of the database and registry tasks: sample, check, plan bookkeeping, register, "
        "promote, reports (Airflow's [operators] default_queue is `default`)"))


class LoadCheckSettings(_Group):
    """The load check on vLLM's OpenAI server (tasks.steps.checks.load_check; docs/load-check.md)."""

    check: bool = Field(default=True, description=(
        "with the engine check: stream each domain's requests through the config's vLLM OpenAI "
        "server at K 0 and at its K, alternating in waves, at the concurrency levels its schedule "
        "claims; the exported schedule keeps K > 0 only up to the largest level whose measured "
        "speedup pays"))
    levels: tuple[Annotated[int, Field(ge=1)], ...] = Field(
        default=(1, 2, 4, 8), min_length=1, description=(
            "concurrency levels of the load check (those where the domain's schedule drafts)"))
    requests: int = Field(default=8, ge=1, description=(
        "requests per level and server (at least the level's concurrency): the domain's requests "
        "in draw order, repeated when it has fewer"))
    max_tokens: int = Field(default=32, ge=2, description=(
        "longest response of a load check request (the logged length, cut here)"))
    retries: int = Field(default=2, ge=0, description=(
        "a wave side during which other processes took more CPU than profile_contention_cores "
        "(and the cores the server left them) is served again up to this many times, its least "
        "contended result kept; a level's interval is over the pairs no neighbour reached where "
        "at least 5 are left"))
    more_requests: int = Field(default=16, ge=0, description=(
        "while a level's interval straddles min_speedup (its lower end under it, its upper end "
        "over it), up to this many more of the domain's requests are served at that level, "
        "load_requests at a time, none the level served already; still straddling after "
        "them, the point estimate decides and the reason says the level was unsure"))
    history: int = Field(default=16, ge=0, description=(
        "on a suffix server (its tree grows from every response it serves, K 0 included): this "
        "many of the domain's logged requests outside the run's sample, the newest its suffix "
        "index holds, are served at K 0 before the domain's first level, as a serving deployment's "
        "tree holds the domain's history and the estimate's index does; 0: none"))
    timeout_s: float = Field(default=300.0, gt=0, description=(
        "one level on one server; past it the level is a hang: the domain is not promotable and "
        "the reason names the server's log"))


class MonitorSettings(_Group):
    """The production monitor (`specdec monitor`, the DAG specdec_monitor; docs/monitoring.md)."""

    window_s: float = Field(default=1800.0, gt=0, description=(
        "the sustained window of the production check: the scrapes of a deployment's current "
        "champion version in the last this many seconds (never before the champion moved)"))
    min_drafts: int = Field(default=200, ge=1, description=(
        "drafts (vLLM verify steps) a window needs before it can raise a drift alert or a rollback"))
    auto_rollback: bool = Field(default=True, description=(
        "roll the champion back (compare-and-set, audit row) when a deployment's production E "
        "over the window falls below the break-even of its deployed K; off: the alert only"))
    scrape_timeout_s: float = Field(default=10.0, gt=0, description=(
        "how long one scrape of a server's /metrics may take, in total (connecting and reading)"))
    scrape_max_bytes: int = Field(default=64 * 2**20, ge=1024, description=(
        "the most bytes one scrape reads of a server's /metrics: a larger body is refused "
        "(nothing stored)"))


class RegistrySettings(_Group):
    """The promotion gates of the model registry."""

    regression_tolerance: float = Field(default=0.1, ge=0, lt=1, description=(
        "refuse a config when a domain's speedup falls more than this below the champion's"))


GROUPS: dict[str, type[_Group]] = {
    "traffic": TrafficSettings, "sample": SampleSettings, "quality": QualitySettings,
    "plan": PlanSettings, "profile": ProfileSettings, "live": LiveSettings,
    "validation": ValidationSettings, "engine": EngineSettings, "queues": QueueSettings,
    "registry": RegistrySettings, "monitor": MonitorSettings,
    "load": LoadCheckSettings,
}

# Every grouped setting's one name, `<group>_<field>`: name -> (group, field).
NAMES: dict[str, tuple[str, str]] = {f"{group}_{field}": (group, field)
                                     for group, model in GROUPS.items() for field in model.model_fields}

# The names from before every name was `<group>_<field>` (old name -> its name now): still accepted in
# the environment, the settings file, overrides and Settings.value(), each with a DeprecationWarning.
DEPRECATED_ALIASES: dict[str, str] = {
    **{field: f"{group}_{field}" for group in ("traffic", "quality") for field in GROUPS[group].model_fields},
    **{field: f"sample_{field}" for field in SampleSettings.model_fields if field not in ("window_days", "draw")},
    **{field: f"plan_{field}" for field in PlanSettings.model_fields if field not in ("k_max", "engine", "k_tolerance")},
    "eval_k_max": "plan_k_max",
    **{f"confirm_{field}": f"live_{field}" for field in ("requests", "max_new_tokens", "tolerance")},
    **{field: f"validation_{field}" for field in ("greedy_check_requests", "greedy_check_tokens")},
    **{field: f"engine_{field}" for field in ("serving_python", "serving_image")},
    **{f"load_check_{field}": f"load_{field}"
       for field in LoadCheckSettings.model_fields if field not in ("check", "history")},
    **{f"{field}_queue": f"queues_{field}" for field in QueueSettings.model_fields},
    "promotion_regression_tolerance": "registry_regression_tolerance",
}
# settings whose environment value is JSON (lists of objects or numbers); known_domains and
# plan_candidates take JSON when the value starts with "["
_JSON_SETTINGS = ("domain_rules", "redaction_rules", "profile_batch_sizes", "load_levels")


class Settings(BaseModel):
    """specdec's settings: the store and the domains at the top, the rest by concern
    (`settings.profile.max_age_days`, `settings.engine.check`); each has one name
    (`profile_max_age_days`, `engine_check`) in the environment, the settings file and overrides."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; None: sqlite:///$SPECDEC_HOME/specdec.db")
    known_domains: tuple[str, ...] = ("json", "code", "summarize", "qa", "chat", "creative", "general")
    fallback_domain: str = "general"
    domain_rules: tuple[DomainRule, ...] = DEFAULT_DOMAIN_RULES
    redaction_rules: tuple[RedactionRule, ...] = DEFAULT_REDACTION_RULES
    traffic: TrafficSettings = TrafficSettings()
    sample: SampleSettings = SampleSettings()
    quality: QualitySettings = QualitySettings()
    plan: PlanSettings = PlanSettings()
    profile: ProfileSettings = ProfileSettings()
    live: LiveSettings = LiveSettings()
    validation: ValidationSettings = ValidationSettings()
    engine: EngineSettings = EngineSettings()
    queues: QueueSettings = QueueSettings()
    registry: RegistrySettings = RegistrySettings()
    monitor: MonitorSettings = MonitorSettings()
    load: LoadCheckSettings = LoadCheckSettings()

    @field_validator("known_domains", mode="before")
    @classmethod
    def _comma_list(cls, value):
        if isinstance(value, str):
            return tuple(item.strip() for item in value.split(",") if item.strip())
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_rules_follow_known_domains(cls, data):
        """Without explicit domain_rules, keep the default rules whose domain is known."""
        if isinstance(data, dict) and "domain_rules" not in data and "known_domains" in data:
            known = cls._comma_list(data["known_domains"])
            data = {**data, "domain_rules": tuple(rule for rule in DEFAULT_DOMAIN_RULES
                                                  if rule.domain in known)}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "Settings":
        if self.fallback_domain not in self.known_domains:
            raise ValueError(f"fallback_domain {self.fallback_domain!r} is not in known_domains "
                             f"{list(self.known_domains)}")
        unknown = [rule.name for rule in self.domain_rules if rule.domain not in self.known_domains]
        if unknown:
            raise ValueError(f"domain rules {unknown} assign a domain outside known_domains")
        return self

    @property
    def resolved_database_url(self) -> str:
        """database_url, else $SPECDEC_HOME/specdec.db as SQLite."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(specdec_home() / 'specdec.db').resolve()}"

    def value(self, name: str):
        """A setting by its name: `settings.value("profile_max_age_days")` (a deprecated alias
        warns and gives the same)."""
        name = _current_name(name, f"setting {name!r}", repr, stacklevel=2)
        if name in NAMES:
            group, field = NAMES[name]
            return getattr(getattr(self, group), field)
        if name in _TOP_LEVEL:
            return getattr(self, name)
        raise SettingsError(f"unknown setting {name!r}; known: {', '.join(sorted(known_names()))}")

    def overrides(self) -> dict:
        """The settings that differ from the defaults, by name (JSON values): what a
        RunSpec carries so that every task of a run sees the same settings."""
        default = Settings()
        return {name: _json_value(self.value(name)) for name in known_names()
                if self.value(name) != default.value(name)}


_TOP_LEVEL = ("database_url", "known_domains", "fallback_domain", "domain_rules", "redaction_rules")


def known_names() -> list[str]:
    """Every setting's name (environment variable SPECDEC_<NAME.upper()>); no deprecated alias."""
    return [*_TOP_LEVEL, *NAMES]


def _current_name(name: str, where: str, spell, stacklevel: int) -> str:
    """`name`, or the name a deprecated alias stands for, with a DeprecationWarning: "`where` is
    deprecated: use `spell(new)`". stacklevel: as warnings.warn would take it in the caller."""
    new = DEPRECATED_ALIASES.get(name)
    if new is None:
        return name
    warnings.warn(f"{where} is deprecated: use {spell(new)}", DeprecationWarning, stacklevel=stacklevel + 1)
    return new


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _current_names(values: dict, where, spell, stacklevel: int) -> dict:
    """`values` by current names: each deprecated alias warns (where(alias) names it) and gives way
    to its new name when both are set."""
    current: dict = {}
    for name, value in values.items():
        new = _current_name(name, where(name), spell, stacklevel + 1)
        if new == name or new not in values:
            current[new] = value
    return current


def setting_default(name: str):
    """The class default of a setting by name (a DAG Param's default is the same wherever
    the DAG file is parsed, whatever the environment)."""
    default = Settings().value(name)
    return list(default) if isinstance(default, tuple) else default


def _json_value(value):
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, tuple):
        return [_json_value(item) for item in value]
    return value


def _nest(values: dict) -> dict:
    """Settings(**) keywords from names (flat, current) and group objects (nested dicts)."""
    nested: dict = {}
    for name, value in values.items():
        if name in GROUPS:
            if not isinstance(value, dict):
                raise SettingsError(f"setting group {name!r} must be an object of its settings, "
                                    f"got {value!r}")
            nested.setdefault(name, {}).update(value)
        elif name in NAMES:
            group, field = NAMES[name]
            nested.setdefault(group, {})[field] = value
        elif name in _TOP_LEVEL:
            nested[name] = value
        else:
            raise SettingsError(f"unknown setting {name!r}; known: {', '.join(sorted(known_names()))}")
    return nested


def _from_env(environ) -> dict:
    """The settings file's values, then the SPECDEC_* variables' over them, by current names (a
    deprecated alias warns; in one place its new name wins over it)."""
    values: dict = {}
    path = environ.get(SETTINGS_FILE_ENV)
    if path:
        try:
            from_file = json.loads(Path(path).read_text("utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise SettingsError(f"{SETTINGS_FILE_ENV}={path!r}: cannot read a JSON object from it "
                                f"({exc}); fix the file or unset the variable") from exc
        if isinstance(from_file, dict):
            from_file = _current_names(from_file, lambda old: f"{path}: key {old!r}", repr, stacklevel=3)
        values.update(from_file)
    raw_values = {name: environ[_env_name(name)] for name in (*DEPRECATED_ALIASES, *known_names())
                  if _env_name(name) in environ}
    for name, raw in _current_names(raw_values, _env_name, _env_name, stacklevel=3).items():
        complex_value = name in _JSON_SETTINGS or (
            name in ("known_domains", "plan_candidates") and raw.lstrip().startswith("["))
        if complex_value:
            try:
                values[name] = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise SettingsError(f"{_env_name(name)} must be JSON ({exc})") from exc
        else:
            values[name] = raw
    return values


def load_settings(environ=None, **overrides) -> Settings:
    """Settings from defaults, $SPECDEC_SETTINGS_FILE, SPECDEC_* variables and `overrides` (names,
    e.g. `load_settings(traffic_import_batch_size=50)`, or a group's dict; a deprecated alias
    warns)."""
    environ = os.environ if environ is None else environ
    values = _nest(_from_env(environ))
    overrides = _current_names({key: value for key, value in overrides.items() if value is not None},
                               lambda old: f"setting {old!r}", repr, stacklevel=2)
    for group, fields in _nest(overrides).items():
        if group in GROUPS:
            values.setdefault(group, {}).update(fields)
        else:
            values[group] = fields
    try:
        return Settings(**values)
    except ValidationError as exc:
        raise SettingsError(f"invalid settings (from {ENV_PREFIX}* variables, {SETTINGS_FILE_ENV} or "
                            f"arguments): {_problems(exc)}") from exc


def _problems(exc: ValidationError) -> str:
    """Pydantic's errors, each named by the setting's name and variable (SPECDEC_QUEUES_GPU
    (queues_gpu), not queues.gpu)."""
    public = {where: name for name, where in NAMES.items()}
    lines = []
    for error in exc.errors():
        loc = tuple(str(part) for part in error["loc"])
        name = public.get(loc[:2], ".".join(loc)) if loc else "settings"
        where = f"{ENV_PREFIX}{name.upper()} ({name})" if name in public.values() or name in _TOP_LEVEL else name
        lines.append(f"{where}: {error['msg']} (got {error.get('input')!r})"[:300])
    return "; ".join(lines)


WORKER_NAME_ENV = "SPECDEC_WORKER_NAME"


def worker_name() -> str:
    """This worker's name: $SPECDEC_WORKER_NAME, else the host's fully qualified name. Airflow
    records it as a task instance's hostname when `[core] hostname_callable` names this function
    (`tasks.settings.worker_name`): workers sharing a host (or a container image's host name) stay
    apart. The profile task stores it with the hardware it measured."""
    return os.environ.get(WORKER_NAME_ENV) or socket.getfqdn()
