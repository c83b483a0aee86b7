"""The production monitor's bookkeeping without a serving engine: scrapes of a loopback HTTP server
that serves vLLM's spec-decode counters as Prometheus text (parsed by prometheus-client), so the
counters can rise, fall (a restart) and be garbage on demand; the drift alert with the automatic
rollback turned off; the SQL report `production_vs_promised` and `specdec monitor show`.
The loop on a real vLLM server is tests/test_monitor_serving.py."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, func, select

from .helpers.metrics import exposition
from .helpers.monitor import BREAK_EVEN, DEPLOYMENT, PROMISE, monitored_champion, scrape_times
from .helpers.processes import specdec

from tasks.db.store import Store
from tasks.registry.registry import Registry


@pytest.fixture
def tracking(tmp_path, monkeypatch) -> str:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_scrapes_store_deltas_and_a_restart_starts_a_new_series_never_negative(db_url, metrics_server):
    from tasks.db.models import MonitorScrape
    from tasks.errors import MonitorScrapeError
    from tasks.settings import load_settings
    from tasks.steps.monitor.monitor import MonitorContext
    from tasks.steps.monitor.scrape import scrape

    ctx = MonitorContext.open(Store.open(db_url), None, "Test-Org/None", load_settings({}))
    metrics_server.text = exposition(100, 300, 150, [60, 50, 40])
    first = scrape(ctx, metrics_server.url, "vllm-a", config=False)
    assert (first["series"], first["start"], first["delta_drafts"], first["delta_per_pos"]) == (
        1, "baseline", 0, [0, 0, 0])
    metrics_server.text = exposition(130, 390, 170, [70, 60, 40])
    second = scrape(ctx, metrics_server.url + "/metrics", "vllm-a", config=False)
    assert (second["series"], second["start"]) == (1, None)
    assert (second["delta_drafts"], second["delta_draft_tokens"], second["delta_accepted"],
            second["delta_per_pos"]) == (30, 90, 20, [10, 10, 0])
    # the server restarted: its counters fell; they count from zero since, so they are the deltas
    metrics_server.text = exposition(12, 36, 9, [5, 3, 1])
    third = scrape(ctx, metrics_server.url, "vllm-a", config=False)
    assert (third["series"], third["start"], third["delta_drafts"], third["delta_accepted"],
            third["delta_per_pos"]) == (2, "restart", 12, 9, [5, 3, 1])
    # one counter falling is enough (the per-position ones too)
    metrics_server.text = exposition(20, 60, 15, [4, 6, 5])
    assert scrape(ctx, metrics_server.url, "vllm-a", config=False)["series"] == 3
    # another deployment has series of its own
    assert scrape(ctx, metrics_server.url, "vllm-b", config=False)["start"] == "baseline"

    # something that is not vLLM's metrics: one error naming the fix, nothing stored
    engine = create_engine(db_url)

    def count() -> int:
        with engine.connect() as connection:
            return connection.execute(select(func.count()).select_from(MonitorScrape)).scalar()

    stored = count()
    metrics_server.text = "# HELP up Up.\n# TYPE up gauge\nup 1\n"
    with pytest.raises(MonitorScrapeError, match="serves no vLLM metrics .*nothing stored"):
        scrape(ctx, metrics_server.url, "vllm-a", config=False)
    metrics_server.text = "vllm:spec_decode_num_drafts_total{ this is not an exposition\n"
    with pytest.raises(MonitorScrapeError, match="not a Prometheus text exposition"):
        scrape(ctx, metrics_server.url, "vllm-a", config=False)
    assert count() == stored
    with engine.connect() as connection:
        assert all(row.delta_drafts >= 0 for row in connection.execute(select(MonitorScrape)))
    engine.dispose()


def test_drift_alert_without_rollback_when_it_is_off_in_the_report_and_show(
        db_url, tracking, metrics_server, tmp_path):
    from tasks.registry.tracking import client
    from tasks.settings import load_settings
    from tasks.steps.monitor.drift import check
    from tasks.steps.monitor.monitor import MonitorContext, show
    from tasks.steps.monitor.scrape import scrape
    from tasks.steps.traffic.reports import run_report

    target = f"Test-Org/Off-{tmp_path.name[-8:]}"
    name = monitored_champion(db_url, tracking, target)
    settings = load_settings({}, monitor_window_s=600, monitor_min_drafts=50, monitor_auto_rollback=False)
    ctx = MonitorContext.open(Store.open(db_url), Registry.open(tracking), target, settings)
    at = scrape_times(4)
    served = [(0, 0), (40, 120), (80, 240), (200, 250)]     # (drafts, accepted) as counted
    for i, (drafts, accepted) in enumerate(served):
        metrics_server.text = exposition(drafts, 3 * drafts, accepted, [accepted // 3] * 3)
        scrape(ctx, metrics_server.url, DEPLOYMENT, at=at[i])
        result = check(ctx, at=at[i])
        if i < 2:       # the baseline, then 40 drafts: fewer than monitor_min_drafts, nothing said
            assert result["events"] == [] and result["deployments"][0]["state"].startswith("insufficient")
        elif i == 2:    # E 4.0 over 80 drafts: within the promise
            assert result["events"] == [] and result["deployments"][0]["state"] == "ok", result
    # E over the window 1 + 250 / 200 = 2.25: below the promise's interval, above the break-even
    assert [e["kind"] for e in result["events"]] == ["alert"]
    metrics_server.text = exposition(400, 1200, 255, [87, 85, 83])
    scrape(ctx, metrics_server.url, DEPLOYMENT, at=at[3] + timedelta(seconds=60))
    result = check(ctx, at=at[3] + timedelta(seconds=60))
    status = result["deployments"][0]
    assert status["e"] == pytest.approx(1 + 255 / 400) and status["e"] < BREAK_EVEN, status
    assert status["state"] == "below break-even" and result["events"] == []   # alerted once; no rollback
    assert str(client(tracking).get_model_version_by_alias(name, "champion").version) == "2"

    # the version page: a Production section, and the plot over time in the version's run
    mlflow_client = client(tracking)
    page = mlflow_client.get_model_version(name, "2").description
    production = page[page.index("### Production"):]
    assert "vllm-json-qa" in production and "3.80 [3.50, 4.00]" in production and "1.64" in production
    assert "**alert**" in production and "plots/production_e.png" in production
    run_id = mlflow_client.get_model_version(name, "2").run_id
    assert "plots/production_e.png" in [a.path for a in mlflow_client.list_artifacts(run_id, "plots")]

    report = run_report("production_vs_promised", Store.open(db_url))
    rows = [dict(zip(report["columns"], row)) for row in report["rows"]]
    assert {r["domain"] for r in rows} == {"json", "qa"} and len(rows) == 2
    row = rows[0]
    assert (row["deployment"], row["config_version"], row["drafts"], row["accepted"]) == (
        DEPLOYMENT, "2", 400, 255)
    assert (row["promise_e"], row["promise_lo"], row["promise_hi"]) == PROMISE
    assert row["break_even"] == pytest.approx(BREAK_EVEN) and row["verdict"] == "below break-even"
    assert (row["alerts"], row["rollbacks"]) == (1, 0) and "below the promise's interval" in row["alert"]

    shown = show(ctx.store, settings, since=at[0] - timedelta(seconds=1), until=at[3] + timedelta(seconds=60))
    (deployment,) = shown["deployments"]
    assert deployment["deployment"] == DEPLOYMENT and deployment["config_version"] == "2"
    json_row = deployment["domains"][0]
    assert json_row["scraped"]["drafts"] == 400 and json_row["scraped"]["position_rates"] == [0.2175, 0.2125, 0.2075]
    assert json_row["per_request"]["requests"] == 0 and json_row["per_request"]["e"] is None
    done = specdec("monitor", "show", "--json", "--url", db_url, "--since",
                   (at[0] - timedelta(seconds=1)).isoformat(), "--until",
                   (at[3] + timedelta(seconds=60)).isoformat())
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["deployments"][0]["domains"][1]["domain"] == "qa"


def test_show_keeps_what_was_scraped_of_a_deployment_whose_config_version_is_unknown(
        db_url, metrics_server, capsys):
    """Issue 83 item 14: a scrape stored without a config version is shown with its figures (the
    deployment's), in `--json` and in the table, never as `"domains": []` and nothing else."""
    from tasks.cli.app import main
    from tasks.settings import load_settings
    from tasks.steps.monitor.monitor import MonitorContext, show
    from tasks.steps.monitor.scrape import scrape

    ctx = MonitorContext.open(Store.open(db_url), None, "Test-Org/None", load_settings({}))
    metrics_server.text = exposition(0, 0, 0, [0, 0, 0])
    scrape(ctx, metrics_server.url, "vllm-x", config=False)
    metrics_server.text = exposition(108, 857, 336, [100, 90, 80])
    scrape(ctx, metrics_server.url, "vllm-x", config=False)
    (deployment,) = show(ctx.store, ctx.settings)["deployments"]
    assert deployment["config_version"] is None and deployment["domains"] == []
    scraped = deployment["scraped"]
    assert (scraped["drafts"], scraped["draft_tokens"], scraped["accepted"]) == (108, 857, 336)
    assert scraped["e"] == pytest.approx(1 + 336 / 108)
    assert "config version unknown" in deployment["note"]
    assert main(["monitor", "show", "--url", db_url]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "vllm-x" in printed and "108" in printed and f"{1 + 336 / 108:.2f}" in printed, printed


def _served_request(index: int, domain: str, at, accepted_per_step: int, steps: int = 10) -> dict:
    """A gateway's logged request that vLLM served with K 3: `steps` verify steps, each accepting
    `accepted_per_step` of its 3 drafts."""
    from .helpers.traffic import request_row

    histogram = [0] * 4
    histogram[accepted_per_step] = steps
    return request_row(index, id=f"{domain}-{index}", domain=domain, timestamp=at.isoformat() + "Z",
                       config_version="2", metrics={"speculative_decoding": {
                           "num_spec_steps": steps, "num_draft_tokens": 3 * steps,
                           "num_accepted_draft_tokens": accepted_per_step * steps,
                           "num_spec_tokens": 3, "acceptance_histogram": histogram}})


def test_one_domain_falling_behind_a_busy_one_is_alerted_then_rolled_back_from_its_own_requests(
        db_url, tracking, tmp_path):
    """One deployment serves json and qa; json's many requests keep the deployment's E up while
    qa's falls. The per-request metrics of the imported traffic judge each domain on its own:
    qa below its promise is an alert naming qa alone, below its break-even a rollback."""
    from tasks.db.models import Promotion
    from tasks.registry.tracking import client
    from tasks.settings import load_settings
    from tasks.steps.monitor.drift import check
    from tasks.steps.monitor.monitor import MonitorContext
    from tasks.steps.traffic.traffic_import import import_traffic

    from .helpers.monitor import now
    from .helpers.traffic import write_jsonl

    target = f"Test-Org/Domains-{tmp_path.name[-8:]}"
    name = monitored_champion(db_url, tracking, target)
    settings = load_settings({}, monitor_window_s=600, monitor_min_drafts=50)
    ctx = MonitorContext.open(Store.open(db_url), Registry.open(tracking), target, settings)
    at = now() + timedelta(seconds=60)       # every request served after the promotion
    # json: 20 requests accepting all 3 drafts a step (E 4.0); qa: 6 accepting 1 (E 2.0): 260
    # steps in all at E 1 + (600 + 60) / 260 = 3.54, within the promise [3.5, 4.0]
    rows = ([_served_request(i, "json", at - timedelta(seconds=50 - i), 3) for i in range(20)]
            + [_served_request(100 + i, "qa", at - timedelta(seconds=30 - i), 1) for i in range(6)])
    assert import_traffic(write_jsonl(tmp_path / "a.jsonl", rows), store=ctx.store, settings=settings,
                          progress=False)["inserted"] == 26
    result = check(ctx, at=at)
    (status,) = result["deployments"]
    domains = {d["domain"]: d for d in status["domain_checks"]}
    assert domains["json"]["e"] == pytest.approx(4.0) and domains["json"]["state"] == "ok"
    assert domains["qa"]["e"] == pytest.approx(2.0) and domains["qa"]["state"] == "below promise"
    assert [(e["kind"], e["domains"]) for e in result["events"]] == [("alert", ["qa"])]
    assert "domain qa: production E 2.000 over 60 drafts of 6 requests" in result["events"][0]["reason"]
    assert check(ctx, at=at)["events"] == []                          # alerted once
    # qa's drafts all rejected now (E 1.0 over its window: below the break-even 1.65)
    later = at + timedelta(seconds=30)
    more = [_served_request(200 + i, "qa", later - timedelta(seconds=20 - i), 0) for i in range(10)]
    import_traffic(write_jsonl(tmp_path / "b.jsonl", more), store=ctx.store, settings=settings,
                   progress=False)
    result = check(ctx, at=later)
    assert [(e["kind"], e["domains"]) for e in result["events"]] == [("rollback", ["qa"])], result
    assert str(client(tracking).get_model_version_by_alias(name, "champion").version) == "1"
    engine = create_engine(db_url)
    with engine.connect() as connection:
        audit = connection.execute(select(Promotion).order_by(Promotion.id.desc()).limit(1)).mappings().one()
    engine.dispose()
    assert (audit["action"], audit["actor"]) == ("rollback", "specdec monitor")
    assert "domain qa" in audit["reason"] and "requests' own metrics" in audit["reason"]
    assert audit["gates"]["evidence"]["source"] == "per-request metrics"
