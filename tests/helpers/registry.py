"""The config registry without an evaluation: the rows an evaluation leaves (eval_runs,
domain_configs, optionally acceptance_estimates) written straight into the specdec database, and
registration and promotion with the documented default settings."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import create_engine, insert

from tasks.db.domain_records import PlannedDomain
from tasks.db.store import Store
from tasks.db.models import AcceptanceEstimate, DomainConfig, EvalRun, LiveMeasurement, Validation
from tasks.registry.promotion import promote
from tasks.registry.registration import register_config
from tasks.registry.registry import Registry
from tasks.settings import load_settings

DEFAULTS = load_settings({})          # the documented defaults, whatever SPECDEC_* says
LABEL = "prompt_lookup(max_ngram=3)"
SPEC = {"kind": "prompt_lookup", "params": {"max_ngram": 3}}


def now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def domain_row(run_id: str, domain: str, enabled: bool = True, **overrides) -> dict:
    """A finished domain_configs row: on (prompt lookup, K=3, 1.5x measured, validation passed)
    or off (no drafter, validation not needed)."""
    row = dict(run_id=run_id, domain=domain, enabled=enabled, status="ok", samples=25,
               created_at=now(), reason="test row")
    if enabled:
        row.update(drafter=LABEL, drafter_spec=SPEC, k=3, max_batch_size=4, predicted_speedup=1.6,
                   predicted_speedup_lo=1.3, predicted_speedup_hi=1.9, measured_speedup=1.5,
                   mean_accepted_length=2.2, conditional_acceptance=[0.8, 0.6, 0.4],
                   validation="passed", promotable=True)
    else:
        row.update(drafter=None, drafter_spec=None, k=None, max_batch_size=None, predicted_speedup=None,
                   predicted_speedup_lo=None, predicted_speedup_hi=None, measured_speedup=0.9,
                   mean_accepted_length=None, conditional_acceptance=None, validation="not_needed",
                   promotable=False)
    row.update(overrides)
    return row


def finished_run(db_url: str, run_id: str, domains: dict, target_id: str = "tiny-target",
                 fingerprint: str | None = "sha256:aaa", hardware: str | None = "cpu-test",
                 estimates: bool = False) -> None:
    """An evaluated run: an eval_runs row and one domain_configs row per domain.

    domains: {name: overrides of domain_row (e.g. {"enabled": False}, {"validation": "failed"})}.
    estimates: also acceptance_estimates for K = 1..3 of each enabled domain (the plots' data).
    """
    at = now()
    engine = create_engine(db_url)
    with engine.begin() as connection:
        connection.execute(insert(EvalRun).values(
            run_id=run_id, created_at=at - timedelta(minutes=5), updated_at=at, status="evaluated",
            target_id=target_id, target_fingerprint=fingerprint, hardware_profile=hardware,
            params={"min_per_domain": 20, "max_per_domain": 30}))
        for name, overrides in domains.items():
            row = domain_row(run_id, name, **overrides)
            connection.execute(insert(DomainConfig).values(**row))
            if estimates and row["enabled"]:
                for k in (1, 2, 3):
                    rates = [0.8, 0.6, 0.4][:k]
                    connection.execute(insert(AcceptanceEstimate).values(
                        run_id=run_id, domain=name, drafter=LABEL, k=k, requests=25, tokens=400,
                        acceptance_rate=sum(rates) / k, mean_accepted_length=1 + sum(rates),
                        conditional_acceptance=rates, predicted_speedup=1.0 + 0.2 * k,
                        predicted_speedup_lo=0.9 + 0.2 * k, predicted_speedup_hi=1.1 + 0.2 * k,
                        created_at=at, drafter_spec=SPEC))
    engine.dispose()


def live_evidence(db_url: str, run_id: str, domain: str, measured: float, predicted: float,
                  interval: tuple[float, float], verdict: str = "pass", requests: int = 3,
                  e: float = 2.2, width_share: list[float] | None = None,
                  shared_from: str | None = None, k: int = 3) -> None:
    """What confirm, estimate and validate leave for a domain planned with LABEL at K: the live
    measurement (and its stored verdict, judged at the default min_speedup and tolerance), the
    chosen estimate's share of rounds by draft width, and a passed sampling test (its own, or
    shared from another domain)."""
    settings = DEFAULTS
    error = measured / predicted - 1.0
    reason = (f"live check: {measured:.2f}x measured [{interval[0]:.2f}, {interval[1]:.2f}] over "
              f"{requests} requests vs {predicted:.2f}x predicted")
    if verdict != "pass":
        reason += ": slower than plain decoding" if measured < 1 else ": below min_speedup"
    engine = create_engine(db_url)
    with engine.begin() as connection:
        connection.execute(insert(LiveMeasurement).values(
            run_id=run_id, domain=domain, drafter=LABEL, k=k, batch_size=1, requests=requests,
            tokens=100, measured_speedup=measured, predicted_speedup=predicted,
            predicted_same_requests=predicted, cost_model_error=error,
            gap=abs(error) > settings.live.tolerance, measured_speedup_lo=interval[0],
            measured_speedup_hi=interval[1], created_at=now()))
        connection.execute(DomainConfig.__table__.update().where(
            (DomainConfig.run_id == run_id) & (DomainConfig.domain == domain)).values(
            measured_speedup=measured, live_check={
                "verdict": verdict, "measured": measured, "lo": interval[0], "hi": interval[1],
                "requests": requests, "weak": requests < 5, "reason": reason,
                "min_speedup": settings.plan.min_speedup, "tolerance": settings.live.tolerance,
                "live_veto": settings.live.veto}))
        share = width_share or [0.0, 0.0, 0.0, 1.0]
        connection.execute(insert(AcceptanceEstimate).values(
            run_id=run_id, domain=domain, drafter=LABEL, k=k, requests=25, tokens=400,
            acceptance_rate=0.5, mean_accepted_length=e, conditional_acceptance=[0.8, 0.6, 0.4][:k],
            predicted_speedup=predicted, draft_width_share=share, created_at=now(), drafter_spec=SPEC))
        connection.execute(insert(Validation).values(
            run_id=run_id, domain=domain, check_name="sampling", drafter=LABEL, k=k,
            request_id=f"{domain}-1", passed=True, statistic=1.0, p_value=0.5, created_at=now(),
            details={"shared_from": shared_from, "ks": [1, k], "samplings": [], "failures": []}))
    engine.dispose()


def engine_sampling(db_url: str, run_id: str, domain: str, status: str = "passed", rows: int = 300,
                    positions: int = 6, min_p: float = 0.021, control: bool | None = None,
                    shared_from: str | None = None, k: int = 3, first_rows: int | None = None) -> None:
    """What the sampling test on vLLM leaves for a domain (tasks.steps.checks.engine_validate, stored by
    its own _store: a row that does not pass also marks the domain failed and unpromotable).
    status: passed | failed | engine_differs | error (error: the server could not run, no
    figures); control: the plain server's verdict where it ran; first_rows: the rows of a failed
    first draw whose confirmation (these figures) decided."""
    from tasks.steps.checks.engine_validate import EngineSamplingResult, _store

    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    passed = status == "passed"
    reason = {"passed": f"vLLM sampling test passed: {positions} G-tests of {rows} rows, smallest p "
                        f"{min_p:.3g}",
              "failed": "vLLM sampling test FAILED with the config at T0.7 position 2: G=80.0, "
                        "p=1e-09 < 0.0021 (the plain server passes): vLLM with this config changes "
                        "the output distribution",
              "engine_differs": "vLLM sampling test failed at T0.7 position 2, and the plain server "
                                "fails too: not called lossless",
              "error": "vLLM sampling test could not run: the server died; its log: x.log"}[status]
    if status == "error":
        result = EngineSamplingResult(domain, status, False, reason,
                                      details={"speculative_config": spec, "error": "the server died"})
    else:
        def summary(ok: bool) -> dict:
            return {"passed": ok, "positions": positions, "rows": rows, "min_p": min_p,
                    "statistic": 80.0 if not ok else 9.0, "threshold": 0.0021,
                    "failures": [] if ok else [{"position": 2, "p_value": min_p}]}
        result = EngineSamplingResult(
            domain, status, passed, reason, rows=rows, positions=positions, min_p=min_p,
            shared_from=shared_from,
            details={"engine": "vllm", "speculative_config": spec, "mended": True, "mends": [],
                     "log": "x.log", "tokens": 8, "context_tokens": 40, "samplings": [],
                     "status": status, "reason": reason, "seconds": 1.0, "config": summary(passed),
                     "report": {}, "control": None if control is None else summary(control),
                     "first": None if first_rows is None else dict(summary(False), rows=first_rows),
                     "shared_from": shared_from})
    _store(Store.open(db_url), run_id, result, PlannedDomain(domain=domain, drafter=LABEL), spec, f"{domain}-1")


def register(run_id: str, db_url: str, uri: str) -> dict:
    store = Store.open(db_url)
    return register_config(run_id, store, settings=DEFAULTS, actor="pytest",
                           registry=Registry.open(uri, store))


def promote_(name: str, version: str, db_url: str, uri: str, **kwargs) -> dict:
    store = Store.open(db_url)
    return promote(name, version, store, settings=DEFAULTS, actor="pytest",
                   registry=Registry.open(uri, store), **kwargs)


def page_text(description: str) -> str:
    """A version page as a reviewer reads it: the description rendered as MLflow renders it
    (Markdown with raw HTML: markdown-it, CommonMark + tables), then reduced to its text: a
    table row becomes `| cell | cell |`, a list item `- text`, bold and code marks are gone."""
    from html.parser import HTMLParser

    from markdown_it import MarkdownIt

    html = MarkdownIt("commonmark", {"html": True}).enable("table").render(description)

    class Text(HTMLParser):
        def __init__(self):
            super().__init__()
            self.lines, self.current, self.row, self.cell = [], [], None, None

        def handle_starttag(self, tag, attrs):
            if tag == "tr":
                self.row = []
            elif tag in ("td", "th"):
                self.cell = []
            elif tag in ("p", "li", "h1", "h2", "h3", "table"):
                self.flush()
                if tag == "li":
                    self.current.append("- ")

        def handle_endtag(self, tag):
            if tag in ("td", "th") and self.row is not None:
                self.row.append(" ".join("".join(self.cell or []).split()))
                self.cell = None
            elif tag == "tr" and self.row is not None:
                self.lines.append("| " + " | ".join(self.row) + " |")
                self.row = None
            elif tag in ("p", "li", "h1", "h2", "h3"):
                self.flush()

        def handle_data(self, data):
            (self.cell if self.cell is not None else self.current).append(data)

        def flush(self):
            text = " ".join("".join(self.current).split())
            if text:
                self.lines.append(text)
            self.current = []

    parser = Text()
    parser.feed(html)
    parser.flush()
    return "\n".join(parser.lines)
