"""The production monitor against a real vLLM OpenAI server of the serving environment on loopback
(one server for the module: the champion's exported deployment, per-request spec-decode metrics
on), on a tiny bigram target (copying_llama: greedy continues x with x + 1).

Requests are replayed and logged as a gateway logs them (the response's
`metrics.speculative_decoding` and the serving config version), then imported; the scrapes'
deltas equal the per-request metrics' sums exactly. Steady serving (prompts that count up, which
vLLM's n-gram proposer continues correctly) raises nothing; another domain's traffic (prompts in
which no token is followed by its successor: every draft is rejected) raises the drift alert at
the first scrape after it and rolls the champion back at the second, with an audit row naming the
evidence; a server that is down during a scrape is one line and no stored row.

Scrape times are given (a minute apart, after the promotions), so the window is exact; skipped
without a serving environment unless SPECDEC_REQUIRE_SERVING=1."""

from __future__ import annotations

import json
import os
import random
import shutil
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, func, select

from tasks.db.store import Store
from tasks.registry.registry import Registry
from tasks.serving import environment as serving_env

from .helpers.models import copying_llama, save_tiny_target
from .helpers.monitor import BREAK_EVEN, DEPLOYMENT, PROMISE, SERVED, monitored_champion, scrape_times
from .helpers.processes import specdec
from .helpers.traffic import write_jsonl

REQUIRED = os.environ.get("SPECDEC_REQUIRE_SERVING") == "1"
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not REQUIRED and not serving_env.available(),
                                 reason="no serving environment (make serving-env); `make test-all` "
                                        "and CI build one and set SPECDEC_REQUIRE_SERVING=1")]
VOCAB = 64
TOKENS = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tasks.serving.server import VllmServer
    from tasks.settings import load_settings

    directory = save_tiny_target(copying_llama(vocab=VOCAB), tmp_path_factory.mktemp("tiny-monitored"))
    with VllmServer(str(directory), SERVED, tmp_path_factory.mktemp("logs") / "served.log",
                    dtype="float32", max_model_len=512, settings=load_settings()) as running:
        yield running
    assert not running.alive()


@pytest.fixture
def tracking(tmp_path, monkeypatch) -> str:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def counting(offset: int) -> list[int]:
    return [(offset + t) % VOCAB for t in range(100)]


def scrambled(seed: int) -> list[int]:
    """100 tokens in which no token is followed by its successor."""
    r, out = random.Random(seed), []
    while len(out) < 100:
        x = r.randrange(VOCAB)
        if not out or x != (out[-1] + 1) % VOCAB:
            out.append(x)
    return out


def replay(server, prompts: list[list[int]], domain: str, at, log: list[dict]) -> None:
    """Serve each prompt (greedy) and log it as a gateway does: the response with its metrics
    and the config version that served it."""
    for i, prompt in enumerate(prompts):
        answer = server.complete(prompt, max_tokens=TOKENS, temperature=0.0)
        log.append({"id": f"{domain}-{len(log)}", "timestamp": (at + timedelta(seconds=i)).isoformat(),
                    "domain": domain, "prompt": " ".join(f"t{t}" for t in prompt),
                    "prompt_token_ids": prompt, "response": answer["choices"][0]["text"],
                    "response_token_ids": answer["choices"][0]["token_ids"], "temperature": 0.0,
                    "model": "tiny-monitored", "metrics": answer["metrics"], "config_version": "2"})


def test_production_loop_on_a_real_server(server, db_url, tracking, tmp_path, monkeypatch):
    from tasks.db.models import Promotion
    from tasks.registry.compose_export import deployments
    from tasks.registry.tracking import client
    from tasks.settings import load_settings
    from tasks.steps.monitor.drift import check
    from tasks.steps.monitor.monitor import MonitorContext, show
    from tasks.steps.monitor.scrape import scrape
    from tasks.steps.traffic.traffic_import import import_traffic

    target = f"Test-Org/Monitored-{tmp_path.name[-8:]}"
    name = monitored_champion(db_url, tracking, target)
    settings = load_settings({}, monitor_window_s=150, monitor_min_drafts=20)
    ctx = MonitorContext.open(Store.open(db_url), Registry.open(tracking), target, settings)
    version, config = ctx.champion()
    # the server serves what the champion exports for its one deployment
    assert version == "2" and [(d["name"], d["speculative_config"]) for d in deployments(config)] == [
        (DEPLOYMENT, SERVED)]
    at = scrape_times(5)
    log: list[dict] = []

    first = scrape(ctx, server.url, DEPLOYMENT, at=at[0])
    assert (first["start"], first["delta_drafts"], first["series"]) == ("baseline", 0, 1)
    steady = []
    for i in (1, 2):                                   # steady serving: nothing is raised
        replay(server, [counting(7 * i + j) for j in range(6)], "json", at[i] - timedelta(seconds=30), log)
        steady.append(scrape(ctx, server.url, DEPLOYMENT, at=at[i]))
        result = check(ctx, at=at[i])
        assert result["events"] == [] and result["deployments"][0]["state"] == "ok", result
    # the scrapes' deltas equal the per-request metrics' sums, exactly
    per_request = [row["metrics"]["speculative_decoding"] for row in log]
    assert sum(s["delta_drafts"] for s in steady) == sum(m["num_spec_steps"] for m in per_request) > 0
    assert sum(s["delta_draft_tokens"] for s in steady) == sum(m["num_draft_tokens"] for m in per_request)
    assert sum(s["delta_accepted"] for s in steady) == sum(m["num_accepted_draft_tokens"] for m in per_request)

    # degradation: another domain's traffic, on which every draft is rejected
    replay(server, [scrambled(seed) for seed in range(6)], "qa", at[3] - timedelta(seconds=30), log)
    scrape(ctx, server.url, DEPLOYMENT, at=at[3])
    alert = check(ctx, at=at[3])
    assert [e["kind"] for e in alert["events"]] == ["alert"], alert
    e = alert["events"][0]
    assert BREAK_EVEN < e["production_e"] < PROMISE[1] and e["promise_lo"] == PROMISE[1]
    replay(server, [scrambled(seed) for seed in range(6, 12)], "qa", at[4] - timedelta(seconds=30), log)
    scrape(ctx, server.url, DEPLOYMENT, at=at[4])
    rolled = check(ctx, at=at[4])
    assert [e["kind"] for e in rolled["events"]] == ["rollback"], rolled
    assert rolled["events"][0]["production_e"] < BREAK_EVEN
    assert str(client(tracking).get_model_version_by_alias(name, "champion").version) == "1"
    engine = create_engine(db_url)
    with engine.connect() as connection:
        audit = connection.execute(select(Promotion).order_by(Promotion.id.desc()).limit(1)).mappings().one()
    assert (audit["action"], audit["config_version"], audit["actor"]) == ("rollback", "1", "specdec monitor")
    evidence = audit["gates"]["evidence"]
    assert evidence["deployment"] == DEPLOYMENT and evidence["break_even"] == pytest.approx(BREAK_EVEN)
    assert len(evidence["scrape_ids"]) == 3 and "below the break-even" in audit["reason"]
    # the server still runs the config it started with: its next scrape (same series) is version
    # 2's, not the restored champion's, and the check raises nothing more
    after = scrape(ctx, server.url, DEPLOYMENT, at=at[4] + timedelta(seconds=30))
    assert (after["config_version"], after["series"], after["start"]) == ("2", 1, None)
    assert check(ctx, at=at[4] + timedelta(seconds=30))["events"] == []

    # the gateway's log imported: per domain, the per-request E; summed, the scrapes' deltas
    report = import_traffic(write_jsonl(tmp_path / "gateway.jsonl", log), store=Store.open(db_url),
                            settings=settings, progress=False)
    assert report["inserted"] == len(log) == 24 and report["quarantined"] == 0
    shown = show(ctx.store, settings, DEPLOYMENT, since=at[0], until=at[4] + timedelta(seconds=30))
    rows = {row["domain"]: row for row in shown["deployments"][0]["domains"]}
    scraped = rows["json"]["scraped"]
    requests = [rows[d]["per_request"] for d in ("json", "qa")]
    assert scraped["drafts"] == sum(r["drafts"] for r in requests)
    assert scraped["accepted"] == sum(r["accepted"] for r in requests)
    assert rows["json"]["per_request"]["e"] == 4.0 and rows["qa"]["per_request"]["e"] == 1.0
    assert [e["kind"] for e in shown["events"]] == ["alert", "rollback"]
    print_must_show(shown, version)

    engine.dispose()


def test_a_server_down_during_a_scrape_is_one_line_and_no_stored_row(server, db_url, tmp_path):
    # runs after the loop above (the module's server is stopped here; a second run finds it down)
    from tasks.db.models import MonitorScrape
    from tasks.settings import load_settings
    from tasks.steps.monitor.monitor import MonitorContext
    from tasks.steps.monitor.scrape import scrape

    ctx = MonitorContext.open(Store.open(db_url), Registry.open(f"sqlite:///{tmp_path / 'mlflow.db'}"), "Test-Org/Down",
                              load_settings({}))
    if server.alive():
        assert scrape(ctx, server.url, DEPLOYMENT, config=False)["start"] == "baseline"
    engine = create_engine(db_url)
    with engine.connect() as connection:
        before = connection.execute(select(func.count()).select_from(MonitorScrape)).scalar()
    server.stop()
    done = specdec("monitor", "scrape", "--url", server.url, "--deployment", DEPLOYMENT,
                   "--db-url", db_url, "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert done.returncode == 2 and not done.stdout.strip(), done
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"deployment {DEPLOYMENT}: no answer from {server.url}/metrics" in done.stderr
    assert "nothing stored" in done.stderr and "Traceback" not in done.stderr
    with engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(MonitorScrape)).scalar() == before
    engine.dispose()


def print_must_show(shown: dict, version: str) -> None:
    """The replay's table (pytest -s shows it)."""
    print(f"\n| domain | promised E [interval] | scraped E (deployment {DEPLOYMENT}) | per-request E |")
    print("|---|---|---|---|")
    for row in shown["deployments"][0]["domains"]:
        print(f"| {row['domain']} | {row['promise_e']:.2f} [{row['promise_lo']:.2f}, "
              f"{row['promise_hi']:.2f}] | {row['scraped']['e']:.3f} over {row['scraped']['drafts']} "
              f"drafts | {row['per_request']['e']:.3f} over {row['per_request']['drafts']} drafts |")
    for event in shown["events"]:
        print(f"- {event['kind']} at scrape {event['window_end']:%H:%M:%S} (raised "
              f"{event['created_at']:%H:%M:%S}): {event['reason']}")
