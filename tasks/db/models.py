"""specdec's tables: the single source of the schema (Alembic migrations are written from these).

Conventions: every time is a naive UTC datetime (portable: SQLite has no time zones, and the SQL
reports group by `date(...)` the same way on both databases). Every row a run writes carries its
`run_id`; a re-run deletes its own rows and writes them again inside one transaction.
Requests are named by `request_id` everywhere outside traffic_requests, never by prompt text.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (JSON, Boolean, DateTime, Float, ForeignKey, Index, Integer, MetaData, String,
                        Text, UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint names: migrations and both databases agree on them.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID = String(200)      # request ids, run ids
NAME = String(200)    # drafter labels, model names, fingerprints


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class TrafficRequest(Base):
    """One logged production request with the target's response (imported from serving logs)."""

    __tablename__ = "traffic_requests"

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    requested_at: Mapped[datetime] = mapped_column(DateTime, index=True)
    domain: Mapped[str] = mapped_column(String(64))
    domain_source: Mapped[str] = mapped_column(String(100))   # "row", "rule:<name>" or "fallback"
    prompt: Mapped[str] = mapped_column(Text)                  # user-visible text, redacted
    messages: Mapped[list | None] = mapped_column(JSON)        # OpenAI chat format, redacted
    response: Mapped[str] = mapped_column(Text)
    temperature: Mapped[float] = mapped_column(Float)
    top_k: Mapped[int] = mapped_column(Integer, default=0)
    top_p: Mapped[float] = mapped_column(Float, default=1.0)
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(NAME)
    target_fingerprint: Mapped[str | None] = mapped_column(NAME)
    prompt_token_ids: Mapped[list | None] = mapped_column(JSON)
    response_token_ids: Mapped[list | None] = mapped_column(JSON)
    prompt_chars: Mapped[int] = mapped_column(Integer)
    response_chars: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    response_tokens: Mapped[int | None] = mapped_column(Integer)
    redactions: Mapped[int] = mapped_column(Integer, default=0)
    content_hash: Mapped[str] = mapped_column(String(64))      # sha256 of the normalised row
    source_file: Mapped[str] = mapped_column(String(500))
    source_line: Mapped[int] = mapped_column(Integer)
    imported_at: Mapped[datetime] = mapped_column(DateTime)
    # 0009: a row the target generated for draft training (tasks.steps.traffic.traffic_generate): the
    # generation run, and the logged request whose prompt and sampling params it answered. NULL on
    # production traffic; generated rows are never sampled, indexed or reported as traffic.
    generated_by: Mapped[str | None] = mapped_column(ID, index=True)
    generated_from: Mapped[str | None] = mapped_column(ID)

    __table_args__ = (Index("ix_traffic_requests_domain_requested_at", "domain", "requested_at"),)


def production_traffic():
    """The condition that keeps production traffic (what serving logged), leaving out the rows
    the target generated for training."""
    return TrafficRequest.generated_by.is_(None)


class QuarantinedRequest(Base):
    """An import row that was rejected, with where it came from and why (raw text truncated, redacted)."""

    __tablename__ = "quarantined_requests"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    source_file: Mapped[str] = mapped_column(String(500))
    line_number: Mapped[int] = mapped_column(Integer)
    request_id: Mapped[str | None] = mapped_column(ID)
    reason: Mapped[str] = mapped_column(String(64), index=True)
    detail: Mapped[str] = mapped_column(Text)
    raw: Mapped[str | None] = mapped_column(Text)
    imported_at: Mapped[datetime] = mapped_column(DateTime, index=True)
    # 0010: an entry quarantined by an import whose read of the file then failed (a corrupt gzip
    # yields garbled lines before its checksum fails): that read error. A later complete import
    # of the same file supersedes such entries: when, and the request id stored from that line
    # (NULL: the line holds no row in the intact file). Reports count open entries only.
    file_error: Mapped[str | None] = mapped_column(Text)
    superseded_at: Mapped[datetime | None] = mapped_column(DateTime)
    superseded_by: Mapped[str | None] = mapped_column(ID)

    __table_args__ = (UniqueConstraint("source_file", "line_number"),)


class EvalRun(Base):
    """One evaluation run: its id, window and parameters, and how far it got."""

    __tablename__ = "eval_runs"

    run_id: Mapped[str] = mapped_column(ID, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    updated_at: Mapped[datetime] = mapped_column(DateTime)
    status: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str | None] = mapped_column(NAME)
    target_fingerprint: Mapped[str | None] = mapped_column(NAME)
    hardware_profile: Mapped[str | None] = mapped_column(NAME)
    window_start: Mapped[datetime | None] = mapped_column(DateTime)
    window_end: Mapped[datetime | None] = mapped_column(DateTime)
    params: Mapped[dict | None] = mapped_column(JSON)
    # the worker the profile task ran on: {name, device, dtype, details, worker}
    worker_hardware: Mapped[dict | None] = mapped_column(JSON)


class EvalSample(Base):
    """A request drawn into a run's sample. request_id has no foreign key on purpose: retention
    purges traffic rows, and a run's record of what it sampled must outlive them."""

    __tablename__ = "eval_samples"

    run_id: Mapped[str] = mapped_column(ID, ForeignKey("eval_runs.run_id", ondelete="CASCADE"),
                                        primary_key=True)
    request_id: Mapped[str] = mapped_column(ID, primary_key=True)
    domain: Mapped[str] = mapped_column(String(64))
    position: Mapped[int] = mapped_column(Integer)   # order within the domain's draw


class QualityResult(Base):
    """One expectation's outcome in a data-quality check of a run (Great Expectations)."""

    __tablename__ = "quality_results"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ID, index=True)
    suite: Mapped[str] = mapped_column(String(100))
    scope: Mapped[str] = mapped_column(String(64))        # "table" or a domain name
    expectation: Mapped[str] = mapped_column(String(100))
    column_name: Mapped[str | None] = mapped_column(String(100))
    success: Mapped[bool] = mapped_column(Boolean)
    status: Mapped[str] = mapped_column(String(32))       # pass | fail | insufficient
    observed: Mapped[dict | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime)


class DataDocsPage(Base):
    """One Great Expectations Data Docs page (standalone HTML) of a run's data-quality check. Kept
    in the database, not on the worker's disk: the registration, maybe on another machine,
    attaches the pages to the run's MLflow page."""

    __tablename__ = "data_docs_pages"

    run_id: Mapped[str] = mapped_column(ID, primary_key=True)
    page: Mapped[str] = mapped_column(NAME, primary_key=True)    # file name, e.g. traffic_sample-table.html
    html: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime)


class AcceptanceEstimate(Base):
    """Per run, domain, drafter and K: acceptance estimated offline from logged responses."""

    __tablename__ = "acceptance_estimates"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ID, index=True)
    domain: Mapped[str] = mapped_column(String(64))
    drafter: Mapped[str] = mapped_column(NAME)
    k: Mapped[int] = mapped_column(Integer)
    requests: Mapped[int] = mapped_column(Integer)
    tokens: Mapped[int] = mapped_column(Integer)
    acceptance_rate: Mapped[float] = mapped_column(Float)
    mean_accepted_length: Mapped[float] = mapped_column(Float)
    conditional_acceptance: Mapped[list | None] = mapped_column(JSON)
    predicted_speedup: Mapped[float | None] = mapped_column(Float)
    predicted_speedup_lo: Mapped[float | None] = mapped_column(Float)
    predicted_speedup_hi: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # 0002: the interval of E(K) (bootstrap over requests), expected rounds, and the share of rounds
    # by number of tokens drafted (prompt lookup drafts fewer than K; costs follow the widths)
    mean_accepted_length_lo: Mapped[float | None] = mapped_column(Float)
    mean_accepted_length_hi: Mapped[float | None] = mapped_column(Float)
    rounds: Mapped[float | None] = mapped_column(Float)
    draft_width_share: Mapped[list | None] = mapped_column(JSON)
    drafter_spec: Mapped[dict | None] = mapped_column(JSON)   # {kind, params}
    # 0016: per draft position, the 95% interval [lo, hi] of conditional_acceptance (bootstrap
    # over requests); the acceptance plot draws it
    conditional_acceptance_ci: Mapped[list | None] = mapped_column(JSON)

    __table_args__ = (UniqueConstraint("run_id", "domain", "drafter", "k"),)


class CostProfile(Base):
    """Per run and hardware profile: seconds of one target step, verify(K) or draft step at a batch size."""

    __tablename__ = "cost_profiles"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ID, index=True)
    hardware_profile: Mapped[str] = mapped_column(NAME)
    component: Mapped[str] = mapped_column(String(32))    # target_step | verify | draft_step
    drafter: Mapped[str | None] = mapped_column(NAME)
    k: Mapped[int | None] = mapped_column(Integer)
    batch_size: Mapped[int] = mapped_column(Integer)
    seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # 0007: interquartile range of the repeated timings over the median (draft steps and overheads:
    # over the target step); None in profiles measured or imported without it
    spread: Mapped[float | None] = mapped_column(Float)


class CostProfileCheck(Base):
    """Per run and hardware profile: whether its costs are consistent and quiet enough to plan on."""

    __tablename__ = "cost_profile_checks"

    run_id: Mapped[str] = mapped_column(ID, primary_key=True)
    hardware_profile: Mapped[str] = mapped_column(NAME, primary_key=True)
    status: Mapped[str] = mapped_column(String(32))        # ok | noisy | unchecked (checks off)
    reasons: Mapped[list | None] = mapped_column(JSON)     # what failed, in words
    # checks made: after profile_repeats passes, then after each further pass (the last is stored)
    attempts: Mapped[int] = mapped_column(Integer)
    max_spread: Mapped[float | None] = mapped_column(Float)
    details: Mapped[dict | None] = mapped_column(JSON)     # settings of the check, earlier attempts
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # 0013: the profile's key, by which a later run reuses it (tasks.steps.costs.reuse.reusable_profile):
    # the hardware as hardware_profiles describes it (device, with a CPU's thread count; the CPU
    # model), the engine ("specdec" | "vllm") and its version, the dtype and the target's
    # fingerprint; the full hardware description it was measured on; when its costs were
    # measured, and the run that measured them when this run reused them (NULL: measured by this
    # run). NULL throughout in profiles stored before 0013 and imported ones (never reused).
    device: Mapped[str | None] = mapped_column(NAME)
    processor: Mapped[str | None] = mapped_column(NAME)
    engine: Mapped[str | None] = mapped_column(String(32))
    engine_version: Mapped[str | None] = mapped_column(NAME)
    dtype: Mapped[str | None] = mapped_column(String(32))
    target_fingerprint: Mapped[str | None] = mapped_column(NAME, index=True)
    hardware: Mapped[dict | None] = mapped_column(JSON)
    measured_at: Mapped[datetime | None] = mapped_column(DateTime)
    reused_from: Mapped[str | None] = mapped_column(ID)


class HardwareProfile(Base):
    """A named serving hardware profile (device, dtype) that cost profiles were measured on."""

    __tablename__ = "hardware_profiles"

    name: Mapped[str] = mapped_column(NAME, primary_key=True)
    device: Mapped[str] = mapped_column(NAME)          # e.g. "cpu (2 threads)", "NVIDIA H100 80GB HBM3"
    dtype: Mapped[str] = mapped_column(String(32))
    details: Mapped[dict | None] = mapped_column(JSON)  # torch version, threads, context length, ...
    updated_at: Mapped[datetime] = mapped_column(DateTime)


class LiveMeasurement(Base):
    """Per run, domain, drafter, K and batch size: real speculative decoding on a subset."""

    __tablename__ = "live_measurements"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ID, index=True)
    domain: Mapped[str] = mapped_column(String(64))
    drafter: Mapped[str] = mapped_column(NAME)
    k: Mapped[int] = mapped_column(Integer)
    batch_size: Mapped[int] = mapped_column(Integer, default=1)
    requests: Mapped[int] = mapped_column(Integer)
    tokens: Mapped[int] = mapped_column(Integer)
    acceptance_rate: Mapped[float | None] = mapped_column(Float)
    mean_accepted_length: Mapped[float | None] = mapped_column(Float)
    plain_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    spec_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    predicted_speedup: Mapped[float | None] = mapped_column(Float)
    measured_speedup: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # 0002: end-to-end latency (prefill included) per request, reported beside the decode speedup;
    # gap: |measured / predicted - 1| beyond the tolerance
    plain_latency_s: Mapped[float | None] = mapped_column(Float)
    spec_latency_s: Mapped[float | None] = mapped_column(Float)
    gap: Mapped[bool | None] = mapped_column(Boolean)
    # 0004: the prediction on the same requests (their own offline estimate and the cost model);
    # cost-model error = measured / that - 1 (the gap flag's figure); sampling error = the subset's
    # offline E / the domain's - 1; greedy rows whose live accepted counts equal the estimate's
    predicted_same_requests: Mapped[float | None] = mapped_column(Float)
    cost_model_error: Mapped[float | None] = mapped_column(Float)
    subset_expected_tokens: Mapped[float | None] = mapped_column(Float)
    domain_expected_tokens: Mapped[float | None] = mapped_column(Float)
    sampling_error: Mapped[float | None] = mapped_column(Float)
    greedy_checked: Mapped[int | None] = mapped_column(Integer)
    greedy_consistent: Mapped[int | None] = mapped_column(Integer)
    per_request: Mapped[list | None] = mapped_column(JSON)
    hardware: Mapped[dict | None] = mapped_column(JSON)    # the worker it ran on (as eval_runs)
    # 0007: 95% interval of measured_speedup by bootstrap over the confirm requests
    measured_speedup_lo: Mapped[float | None] = mapped_column(Float)
    measured_speedup_hi: Mapped[float | None] = mapped_column(Float)


class EngineCheck(Base):
    """Per run and domain: the domain's exported config served by the serving engine (vLLM) on the
    domain's requests, vLLM's own acceptance counters beside the offline estimate of the same
    requests at the same K, and the gate's verdict (tasks.steps.checks.engine_check)."""

    __tablename__ = "engine_checks"

    run_id: Mapped[str] = mapped_column(ID, primary_key=True)
    domain: Mapped[str] = mapped_column(String(64), primary_key=True)
    engine: Mapped[str] = mapped_column(String(32))                 # vllm
    engine_version: Mapped[str | None] = mapped_column(String(64))
    speculative_config: Mapped[dict | None] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(32))     # ok | below | unsupported | refused | died | timeout | contended
    passed: Mapped[bool | None] = mapped_column(Boolean)
    reason: Mapped[str | None] = mapped_column(String(2000))
    requests: Mapped[int | None] = mapped_column(Integer)
    k: Mapped[int | None] = mapped_column(Integer)
    estimate_e: Mapped[float | None] = mapped_column(Float)
    estimate_e_lo: Mapped[float | None] = mapped_column(Float)
    estimate_e_hi: Mapped[float | None] = mapped_column(Float)
    engine_e: Mapped[float | None] = mapped_column(Float)
    estimate_rates: Mapped[list | None] = mapped_column(JSON)       # per position: accepted / drafted rounds
    engine_rates: Mapped[list | None] = mapped_column(JSON)
    greedy_checked: Mapped[int | None] = mapped_column(Integer)     # greedy requests whose output equals the log
    greedy_equal: Mapped[int | None] = mapped_column(Integer)       # ... whose accepted counts equal the estimate's
    plain_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    spec_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    # decode phase (first token to last, vLLM's own timestamps), plain vs the config, same requests
    plain_decode_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    spec_decode_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    measured_speedup: Mapped[float | None] = mapped_column(Float)   # spec / plain decode tokens/s
    # from the engine's own cost profile (`specdec profile measure --engine vllm`) and the estimate
    predicted_speedup: Mapped[float | None] = mapped_column(Float)
    engine_profile: Mapped[str | None] = mapped_column(NAME)
    start_s: Mapped[float | None] = mapped_column(Float)            # the engine's start
    counters: Mapped[dict | None] = mapped_column(JSON)             # vLLM's vllm:spec_decode_* counters
    per_request: Mapped[list | None] = mapped_column(JSON)
    log_path: Mapped[str | None] = mapped_column(String(1000))
    created_at: Mapped[datetime] = mapped_column(DateTime)


class Validation(Base):
    """One losslessness check of a run (greedy exact match, sampling test, target fingerprint)."""

    __tablename__ = "validations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ID, index=True)
    domain: Mapped[str | None] = mapped_column(String(64))
    check_name: Mapped[str] = mapped_column(String(64))
    drafter: Mapped[str | None] = mapped_column(NAME)
    k: Mapped[int | None] = mapped_column(Integer)
    request_id: Mapped[str | None] = mapped_column(ID)   # the request a failure was seen on
    passed: Mapped[bool] = mapped_column(Boolean)
    statistic: Mapped[float | None] = mapped_column(Float)
    p_value: Mapped[float | None] = mapped_column(Float)
    details: Mapped[dict | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime)


class DomainConfig(Base):
    """The per-domain part of the config a run produced (mirrors the promoted JSON config)."""

    __tablename__ = "domain_configs"

    run_id: Mapped[str] = mapped_column(ID, primary_key=True)
    domain: Mapped[str] = mapped_column(String(64), primary_key=True)
    enabled: Mapped[bool] = mapped_column(Boolean)
    drafter: Mapped[str | None] = mapped_column(NAME)
    k: Mapped[int | None] = mapped_column(Integer)
    max_batch_size: Mapped[int | None] = mapped_column(Integer)
    predicted_speedup: Mapped[float | None] = mapped_column(Float)
    measured_speedup: Mapped[float | None] = mapped_column(Float)
    samples: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(32), default="ok")   # ok | insufficient (champion kept)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # 0002: the rest of the promoted per-domain config, and why the planner chose it
    drafter_spec: Mapped[dict | None] = mapped_column(JSON)          # {kind, params}
    mean_accepted_length: Mapped[float | None] = mapped_column(Float)
    conditional_acceptance: Mapped[list | None] = mapped_column(JSON)
    predicted_speedup_lo: Mapped[float | None] = mapped_column(Float)
    predicted_speedup_hi: Mapped[float | None] = mapped_column(Float)
    validation: Mapped[str | None] = mapped_column(String(32))       # passed | failed | not_run
    promotable: Mapped[bool | None] = mapped_column(Boolean)
    reason: Mapped[str | None] = mapped_column(Text)
    # 0005: K by batch size, [[first, last, K], ...] (tasks.steps.plan.plan.k_schedule)
    k_schedule: Mapped[list | None] = mapped_column(JSON)
    # 0007: whether the domain is on in the champion config the plan compared against, and the
    # live check's verdict ({verdict: pass | flag | veto | none, weak, measured, lo, hi, predicted,
    # requests, reason}; tasks.steps.checks.confirm.live_verdict)
    champion_on: Mapped[bool | None] = mapped_column(Boolean)
    live_check: Mapped[dict | None] = mapped_column(JSON)


class Promotion(Base):
    """Audit trail of the champion alias: who moved it to which run's config, when, with which gates."""

    __tablename__ = "promotions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # 0011: NULL on a refused rollback of a model without a champion (no run, no target known)
    run_id: Mapped[str | None] = mapped_column(ID, index=True)
    target_id: Mapped[str | None] = mapped_column(NAME)
    config_name: Mapped[str | None] = mapped_column(NAME)
    config_version: Mapped[str | None] = mapped_column(String(32))
    alias: Mapped[str] = mapped_column(String(32))           # champion | challenger
    action: Mapped[str] = mapped_column(String(32))          # register | promote | reject | rollback | ungated
    forced: Mapped[bool] = mapped_column(Boolean, default=False)
    actor: Mapped[str | None] = mapped_column(NAME)
    gates: Mapped[dict | None] = mapped_column(JSON)
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime)


class DraftModelRecord(Base):
    """A trained draft model and the target it was trained for."""

    __tablename__ = "draft_models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(NAME, unique=True)
    run_id: Mapped[str | None] = mapped_column(ID, index=True)
    base_model: Mapped[str | None] = mapped_column(NAME)
    model_uri: Mapped[str | None] = mapped_column(String(500))
    target_id: Mapped[str] = mapped_column(NAME)
    target_fingerprint: Mapped[str | None] = mapped_column(NAME)
    domains: Mapped[list | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # 0003: lineage and held-out results of a draft trained on the traffic it serves
    status: Mapped[str | None] = mapped_column(String(32))            # training | trained | registered
    version: Mapped[str | None] = mapped_column(String(32))           # MLflow model version
    window_start: Mapped[datetime | None] = mapped_column(DateTime)
    window_end: Mapped[datetime | None] = mapped_column(DateTime)
    train_requests: Mapped[int | None] = mapped_column(Integer)
    heldout_requests: Mapped[int | None] = mapped_column(Integer)
    params: Mapped[dict | None] = mapped_column(JSON)
    heldout: Mapped[dict | None] = mapped_column(JSON)                # acceptance per domain


class DraftTrainingRequest(Base):
    """Which logged requests a draft was trained on (split "train"), chose its checkpoint on
    ("validation") or was held out on ("heldout"): an evaluation of that draft never scores its
    training rows."""

    __tablename__ = "draft_training_requests"

    draft_name: Mapped[str] = mapped_column(NAME, primary_key=True)
    request_id: Mapped[str] = mapped_column(ID, primary_key=True)
    split: Mapped[str] = mapped_column(String(16))



class RequestSpecMetrics(Base):
    """0015: what the serving engine reported for one logged request (vLLM's per-request
    `metrics.speculative_decoding`, kept by `specdec traffic import`): verify steps, draft tokens
    proposed and accepted, and the histogram of accepted drafts per step; with the config version
    that served it when the gateway logged one. Deleted with its request (retention purge)."""

    __tablename__ = "request_spec_metrics"

    request_id: Mapped[str] = mapped_column(
        ID, ForeignKey("traffic_requests.id", ondelete="CASCADE"), primary_key=True)
    config_version: Mapped[str | None] = mapped_column(String(32), index=True)
    spec_steps: Mapped[int] = mapped_column(Integer)           # vLLM's num_spec_steps
    draft_tokens: Mapped[int] = mapped_column(Integer)         # num_draft_tokens
    accepted_tokens: Mapped[int] = mapped_column(Integer)      # num_accepted_draft_tokens
    num_spec_tokens: Mapped[int | None] = mapped_column(Integer)   # the K the server drafted up to
    acceptance_histogram: Mapped[list | None] = mapped_column(JSON)  # [steps accepting j drafts]
    created_at: Mapped[datetime] = mapped_column(DateTime)


class MonitorScrape(Base):
    """0015: one scrape of a serving deployment's /metrics (`specdec monitor scrape`): vLLM's
    spec-decode counters as read, and their deltas since the previous scrape of the same series.
    A series is one run of the server: counters that fall (a restart) start the next series,
    whose first deltas are the counters themselves (they count from zero since the restart); the
    first scrape of a deployment is a baseline (deltas 0: what came before it is unknown)."""

    __tablename__ = "monitor_scrapes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    deployment: Mapped[str] = mapped_column(NAME, index=True)
    url: Mapped[str] = mapped_column(String(500))
    scraped_at: Mapped[datetime] = mapped_column(DateTime, index=True)
    series: Mapped[int] = mapped_column(Integer)
    start: Mapped[str | None] = mapped_column(String(16))      # "baseline" | "restart" | NULL
    config_name: Mapped[str | None] = mapped_column(NAME)
    config_version: Mapped[str | None] = mapped_column(String(32))
    run_id: Mapped[str | None] = mapped_column(ID)             # the run that config came from
    domains: Mapped[list | None] = mapped_column(JSON)         # the deployment's domains then
    drafts: Mapped[int] = mapped_column(Integer)               # counters as read
    draft_tokens: Mapped[int] = mapped_column(Integer)
    accepted_tokens: Mapped[int] = mapped_column(Integer)
    accepted_per_pos: Mapped[list | None] = mapped_column(JSON)
    delta_drafts: Mapped[int] = mapped_column(Integer)         # since the previous scrape (>= 0)
    delta_draft_tokens: Mapped[int] = mapped_column(Integer)
    delta_accepted: Mapped[int] = mapped_column(Integer)
    delta_per_pos: Mapped[list | None] = mapped_column(JSON)


class MonitorPromise(Base):
    """0015: what a config version promised for one domain of a deployment, as the monitor read
    it when it first scraped that deployment under that version: the estimate's E and its
    interval at the deployed K, and the break-even E (predicted speedup 1.0 on the cost profile
    the config was planned with). The production report joins scrapes to it."""

    __tablename__ = "monitor_promises"

    deployment: Mapped[str] = mapped_column(NAME, primary_key=True)
    config_name: Mapped[str] = mapped_column(NAME, primary_key=True)
    config_version: Mapped[str] = mapped_column(String(32), primary_key=True)
    domain: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str | None] = mapped_column(ID)
    k: Mapped[int | None] = mapped_column(Integer)
    speculative_config: Mapped[dict | None] = mapped_column(JSON)
    promise_e: Mapped[float | None] = mapped_column(Float)
    promise_lo: Mapped[float | None] = mapped_column(Float)
    promise_hi: Mapped[float | None] = mapped_column(Float)
    break_even: Mapped[float | None] = mapped_column(Float)
    profile: Mapped[str | None] = mapped_column(NAME)          # the cost profile of break_even
    created_at: Mapped[datetime] = mapped_column(DateTime)

class MonitorEvent(Base):
    """0015: what the production check decided for a deployment of a config version: a drift
    alert (production E below the promise's interval over the window), an automatic rollback
    (E below the break-even of the deployed K), or a rollback the registry refused; with the
    window's evidence."""

    __tablename__ = "monitor_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(32))              # alert | rollback | rollback_refused
    deployment: Mapped[str] = mapped_column(NAME, index=True)
    config_name: Mapped[str | None] = mapped_column(NAME)
    config_version: Mapped[str | None] = mapped_column(String(32))
    series: Mapped[int | None] = mapped_column(Integer)
    domains: Mapped[list | None] = mapped_column(JSON)
    window_start: Mapped[datetime | None] = mapped_column(DateTime)
    window_end: Mapped[datetime | None] = mapped_column(DateTime)
    drafts: Mapped[int | None] = mapped_column(Integer)
    production_e: Mapped[float | None] = mapped_column(Float)
    promise_lo: Mapped[float | None] = mapped_column(Float)
    promise_hi: Mapped[float | None] = mapped_column(Float)
    break_even: Mapped[float | None] = mapped_column(Float)
    evidence: Mapped[dict | None] = mapped_column(JSON)
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime, index=True)

class LoadCheckDomain(Base):
    """Per run and domain: the load check on vLLM's OpenAI server (tasks.steps.checks.load_check): its
    verdict, the exported schedule before and after the cut the measurement made, the servers'
    logs."""

    __tablename__ = "load_check_domains"

    run_id: Mapped[str] = mapped_column(ID, primary_key=True)
    domain: Mapped[str] = mapped_column(String(64), primary_key=True)
    status: Mapped[str] = mapped_column(String(32))     # ok | cut | off | died | timeout | failed
    passed: Mapped[bool | None] = mapped_column(Boolean)
    reason: Mapped[str | None] = mapped_column(String(2000))
    speculative_config: Mapped[dict | None] = mapped_column(JSON)
    schedule_before: Mapped[list | None] = mapped_column(JSON)    # [[first, last, K], ...]
    schedule_after: Mapped[list | None] = mapped_column(JSON)
    max_level_paying: Mapped[int | None] = mapped_column(Integer)
    plain_log: Mapped[str | None] = mapped_column(String(1000))
    spec_log: Mapped[str | None] = mapped_column(String(1000))
    created_at: Mapped[datetime] = mapped_column(DateTime)


class LoadCheckLevel(Base):
    """Per run, domain and concurrency level: the domain's requests streamed through the plain
    and the config's OpenAI servers at that many concurrent requests, and what vLLM counted."""

    __tablename__ = "load_check_levels"

    run_id: Mapped[str] = mapped_column(ID, primary_key=True)
    domain: Mapped[str] = mapped_column(String(64), primary_key=True)
    concurrency: Mapped[int] = mapped_column(Integer, primary_key=True)
    k: Mapped[int | None] = mapped_column(Integer)                 # the schedule's K at this size
    requests: Mapped[int] = mapped_column(Integer)
    failed: Mapped[int] = mapped_column(Integer)                   # both servers' failed requests
    plain_tokens_per_s: Mapped[float | None] = mapped_column(Float)   # output tokens / level wall
    spec_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    measured_speedup: Mapped[float | None] = mapped_column(Float)     # decode phases, same requests
    measured_speedup_lo: Mapped[float | None] = mapped_column(Float)
    measured_speedup_hi: Mapped[float | None] = mapped_column(Float)
    predicted_speedup: Mapped[float | None] = mapped_column(Float)    # vLLM's profile at this size
    pays: Mapped[bool | None] = mapped_column(Boolean)
    plain_ttft_p50_s: Mapped[float | None] = mapped_column(Float)
    plain_ttft_p95_s: Mapped[float | None] = mapped_column(Float)
    spec_ttft_p50_s: Mapped[float | None] = mapped_column(Float)
    spec_ttft_p95_s: Mapped[float | None] = mapped_column(Float)
    plain_itl_p50_s: Mapped[float | None] = mapped_column(Float)
    plain_itl_p95_s: Mapped[float | None] = mapped_column(Float)
    spec_itl_p50_s: Mapped[float | None] = mapped_column(Float)
    spec_itl_p95_s: Mapped[float | None] = mapped_column(Float)
    engine_e: Mapped[float | None] = mapped_column(Float)             # from /metrics deltas
    engine_rates: Mapped[list | None] = mapped_column(JSON)           # per position, from /metrics
    counters: Mapped[dict | None] = mapped_column(JSON)               # /metrics deltas of the level
    request_sums: Mapped[dict | None] = mapped_column(JSON)           # per-request metrics summed
    counters_equal: Mapped[bool | None] = mapped_column(Boolean)
    per_request: Mapped[list | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # 0017: the predicted speedup along the tokens vLLM served (not the logged responses)
    predicted_served_speedup: Mapped[float | None] = mapped_column(Float)


# Tables whose rows belong to one run (deleted and rewritten when that run's step re-runs).
RUN_TABLES = ("eval_samples", "quality_results", "acceptance_estimates", "cost_profiles",
              "live_measurements", "validations", "domain_configs", "engine_checks")
