"""`specdec evaluate` end to end on a tiny target whose own responses are the logged traffic:
every step's rows stored by run id, idempotent re-runs, fingerprint exclusion, validation verdicts,
and a broken verifier that makes a domain unpromotable."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, func, select

from specdec_core.validation import fingerprint_id, target_fingerprint
from tasks.db.models import (AcceptanceEstimate, CostProfile, DomainConfig, EvalRun, LiveMeasurement,
                             Validation)
from tasks.db.store import Store
from tasks.registry.registry import Registry
from tasks.steps.evaluate import evaluate
from tasks.settings import load_settings
from tasks.steps.traffic.traffic_import import import_traffic

from .helpers.evaluation import SETTINGS, run
from .helpers.models import VOCAB
from .helpers.traffic import traffic_rows, write_jsonl


def counts(db_url, run_id):
    engine = create_engine(db_url)
    with engine.connect() as connection:
        out = {model.__tablename__: connection.execute(
            select(func.count()).select_from(model).where(model.run_id == run_id)).scalar()
            for model in (AcceptanceEstimate, CostProfile, DomainConfig, LiveMeasurement, Validation)}
    engine.dispose()
    return out


def test_evaluate_end_to_end_stores_every_step_by_run_id(tiny_db, tiny_target):
    result = run(tiny_db, tiny_target, "e2e", plan_min_speedup=0.01)   # every domain on: all steps run
    table = {row["domain"]: row for row in result["table"]}
    assert set(table) == {"json", "qa"}
    assert result["excluded"]["other_fingerprint"] == 2          # the foreign rows are not scored
    for row in table.values():
        assert row["enabled"] and row["status"] == "ok" and row["k"] in (1, 2, 3)
        assert row["predicted_speedup_lo"] <= row["predicted_speedup"] <= row["predicted_speedup_hi"]
        # the gap flag fires when the live speedup is off the cost model's prediction for the
        # same requests by more than confirm_tolerance (the default here, 25%)
        assert row["measured_speedup"] > 0 and row["predicted_same_requests"] > 0
        assert row["cost_model_error"] == pytest.approx(
            row["measured_speedup"] / row["predicted_same_requests"] - 1.0)
        assert row["gap"] is (abs(row["cost_model_error"]) > load_settings({}).live.tolerance)
        assert row["validation"] == "passed" and row["promotable"] is True
        assert row["max_batch_size"] in (1, 2)
    stored = counts(tiny_db, "e2e")
    # 2 domains x 2 drafters x K = 1..3; target step + 3 verify + 2 drafts + 3 round overheads
    # (plain and each drafter) at 2 batch sizes; per domain a config, a live measurement, a
    # sampling test and a greedy check; 1 fingerprint
    assert stored == {"acceptance_estimates": 12, "cost_profiles": 18, "domain_configs": 2,
                      "live_measurements": 2, "validations": 5}
    engine = create_engine(tiny_db)
    with engine.connect() as connection:
        status = connection.execute(select(EvalRun.status, EvalRun.target_fingerprint)
                                    .where(EvalRun.run_id == "e2e")).one()
        shared = connection.execute(select(Validation.domain, Validation.details).where(
            (Validation.run_id == "e2e") & (Validation.check_name == "sampling"))).all()
    engine.dispose()
    assert status.status == "evaluated"
    assert status.target_fingerprint == fingerprint_id(target_fingerprint(tiny_target))
    # one sampling test per distinct (drafter, K, sampling settings): both domains' traffic is
    # sampled at T0.7/top-p 0.9, so a second domain shares only when drafter and K are equal too
    settings = {(row["drafter"], row["k"]) for row in table.values()}
    shared_from = [d["shared_from"] for _, d in shared]
    assert shared_from.count(None) == len(settings)

    # re-running the run id replaces its rows; another run's rows stay
    run(tiny_db, tiny_target, "other", plan_min_speedup=0.01)
    again = run(tiny_db, tiny_target, "e2e", plan_min_speedup=0.01)
    assert counts(tiny_db, "e2e") == stored and counts(tiny_db, "other") == stored
    assert [r["domain"] for r in again["table"]] == ["json", "qa"]


def test_policy_minimum_turns_domains_off_and_skips_validation(tiny_db, tiny_target):
    result = run(tiny_db, tiny_target, "strict", plan_min_speedup=50.0, validation_rows=50)
    for row in result["table"]:
        assert not row["enabled"] and row["max_batch_size"] is None
        assert row["validation"] == "not_needed" and row["drafter"] is not None
        assert row["measured_speedup"] is not None        # the best candidate is still measured


def test_insufficient_domain_stays_off_and_the_rest_goes_on(tiny_db, tiny_target):
    # json has 10 requests and qa 12, 2 of them from another target: a minimum of 10 passes both at
    # sampling, but qa keeps only 10 usable rows; a minimum of 11 leaves json short at sampling
    # and qa short after the fingerprint exclusion
    result = run(tiny_db, tiny_target, "ten", plan_min_speedup=0.01, sample_min_per_domain=10,
                 sample_max_per_domain=12)
    assert all(row["status"] == "ok" and row["enabled"] for row in result["table"])
    result = run(tiny_db, tiny_target, "thin", plan_min_speedup=0.01, sample_min_per_domain=11,
                 sample_max_per_domain=12)
    table = {row["domain"]: row for row in result["table"]}
    for domain in ("json", "qa"):
        assert table[domain]["status"] == "insufficient" and not table[domain]["enabled"]
        assert table[domain]["drafter"] is None and table[domain]["measured_speedup"] is None
    assert counts(tiny_db, "thin")["live_measurements"] == 0
    engine = create_engine(tiny_db)
    with engine.connect() as connection:
        reasons = dict(connection.execute(select(DomainConfig.domain, DomainConfig.reason)
                                          .where(DomainConfig.run_id == "thin")).all())
    engine.dispose()
    assert "10 usable requests" in reasons["json"] and "10 usable requests" in reasons["qa"]
    assert "champion's setting is kept" in reasons["qa"]


def test_failing_sampling_test_makes_the_domain_unpromotable(tiny_db, tiny_target):
    from specdec_core.faults import BROKEN_VARIANTS
    from tasks.steps.drafters.candidates import build_drafters
    from tasks.steps.estimate.offline_estimate import load_sample_requests
    from tasks.steps.checks.validate import validate_domain, validate_run

    settings = load_settings({}, **{**SETTINGS, "plan_min_speedup": 0.01, "validation_rows": 400})
    run(tiny_db, tiny_target, "broken", plan_min_speedup=0.01)
    drafters = build_drafters(settings.plan.candidates, tiny_target)
    requests, _ = load_sample_requests("broken", Store.open(tiny_db))
    verdict = validate_domain("broken", "qa", tiny_target, drafters, requests["qa"], Store.open(tiny_db),
                              settings=load_settings({}, **{**SETTINGS, "validation_per_domain": True,
                                                            "validation_rows": 400}),
                              check_kwargs=BROKEN_VARIANTS["swapped_p_q"])
    assert verdict["validation"] == "failed"
    failure = verdict["failures"][0]
    assert failure["domain"] == "qa" and failure["position"] in (0, 1, 2)
    assert failure["p_value"] < failure["threshold"] and failure["statistic"] > 0
    # the failed first draw was drawn again afresh at 4 times the rows (validation_confirm_factor),
    # which failed too and decided
    engine = create_engine(tiny_db)
    with engine.connect() as connection:
        details = connection.execute(select(Validation.details).where(
            Validation.run_id == "broken", Validation.domain == "qa", Validation.check_name == "sampling")).scalar_one()
    engine.dispose()
    assert details["first"]["rows"] == 400 and not details["first"]["passed"] and details["first"]["failures"]
    assert details["report"]["rows_per_test"] == 1600
    summary = validate_run("broken", tiny_target, None, drafters, requests, target_id="tiny",
                           store=Store.open(tiny_db), settings=settings)
    assert summary["domains"]["qa"] == "failed"
    engine = create_engine(tiny_db)
    with engine.connect() as connection:
        promotable = dict(connection.execute(select(DomainConfig.domain, DomainConfig.promotable)
                                             .where(DomainConfig.run_id == "broken")).all())
    engine.dispose()
    assert promotable["qa"] is False


def test_a_failing_domain_is_recorded_and_the_others_go_on(db_url, tmp_path, tiny_target):
    rows = traffic_rows(tiny_target, foreign=0)
    broken = [dict(row, id=row["id"].replace("qa", "code"), domain="code",
                   response_token_ids=[VOCAB + 5] + row["response_token_ids"][1:])
              for row in rows if row["domain"] == "qa"]
    import_traffic(write_jsonl(tmp_path / "t.jsonl", rows + broken), store=Store.open(db_url), progress=False)
    result = run(db_url, tiny_target, "partial", plan_min_speedup=0.01)
    table = {row["domain"]: row for row in result["table"]}
    assert result["failed"] == [] and table["code"]["status"] == "failed"
    assert not table["code"]["enabled"] and "outside the target's vocabulary" in table["code"]["reason"]
    assert "code-" in table["code"]["reason"]               # the request is named by its id
    for domain in ("json", "qa"):
        assert table[domain]["status"] == "ok" and table[domain]["validation"] == "passed"


def test_confirm_predicts_the_same_requests_and_checks_greedy_rows(tiny_db, tiny_target):
    result = run(tiny_db, tiny_target, "same", plan_min_speedup=0.01, live_requests=4,
                 live_tolerance=0.25)
    engine = create_engine(tiny_db)
    with engine.connect() as connection:
        rows = connection.execute(select(LiveMeasurement).where(LiveMeasurement.run_id == "same")
                                  ).mappings().all()
        configs = {r.domain: r for r in connection.execute(
            select(DomainConfig).where(DomainConfig.run_id == "same")).all()}
    engine.dispose()
    assert {row["domain"] for row in rows} == {"json", "qa"} and result["table"]
    for row in rows:
        assert row["requests"] == 4 and len(row["per_request"]) == 4
        # the flag fires on the cost-model error (same requests), not on the domain-level gap
        assert row["cost_model_error"] == pytest.approx(
            row["measured_speedup"] / row["predicted_same_requests"] - 1.0)
        assert row["gap"] == (abs(row["cost_model_error"]) > 0.25)
        assert row["domain_expected_tokens"] == pytest.approx(configs[row["domain"]].mean_accepted_length)
        assert row["sampling_error"] == pytest.approx(
            row["subset_expected_tokens"] / row["domain_expected_tokens"] - 1.0)
        for item in row["per_request"]:
            assert item["predicted"] > 0 and item["measured"] > 0
        # the logged responses are the target's own: every greedy row decodes them again, and its
        # live rounds and accepted drafts equal the offline estimate's
        greedy = [item for item in row["per_request"] if item["greedy_comparable"]]
        assert row["greedy_checked"] == len(greedy) >= 1
        assert row["greedy_consistent"] == row["greedy_checked"]
        assert all(item["first_difference_from_log"] is None for item in greedy)


def test_confirm_requests_are_stratified_on_offline_e():
    from tasks.steps.checks.confirm import _stratified

    requests = ["a", "b", "c", "d", "e", "f", "g", "h"]
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 0.0, 7.0, 6.0]
    picked = _stratified(requests, values, 4)
    # by value: f b d e c a h g; ranks 1, 3, 5, 7 are b, e, a, g -- kept in sample order
    assert picked == ["a", "b", "e", "g"]
    assert _stratified(requests, values, 10) == requests


# ------------------------------------------------------------------------------------------------
# live evidence can veto a domain turning on
def timed(speedups, tokens=40, plain_s=1.0, predicted=None):
    """per_request records of confirm: each request's measured speedup (and its prediction)."""
    rows = []
    for i, speedup in enumerate(speedups):
        row = {"request_id": f"r{i}", "plain_tokens": tokens, "plain_decode_s": plain_s,
               "spec_tokens": tokens, "spec_decode_s": plain_s / speedup,
               "offline_tokens": None, "offline_cost": None}
        if predicted is not None:     # cost in plain steps: tokens / predicted speedup
            row.update(offline_tokens=float(tokens), offline_cost=tokens / predicted[i])
        rows.append(row)
    return rows


def test_live_verdict_rules():
    from tasks.steps.checks.confirm import live_verdict

    settings = load_settings({})          # min_speedup 1.1, confirm_tolerance 0.25
    turning_on = {"enabled": True, "champion_on": False, "predicted_speedup": 1.4}
    # a quiet machine's correct "on": measured well above the minimum stands, and says it is weak
    verdict = live_verdict(timed([1.5, 1.7, 1.6]), turning_on, settings, 1.55)
    assert verdict["verdict"] == "pass" and verdict["weak"] and verdict["requests"] == 3
    assert verdict["lo"] <= verdict["measured"] <= verdict["hi"]
    assert verdict["reason"].startswith("live check: 1.60x measured [") and "weak evidence: 3" in verdict["reason"]
    # slower than plain decoding
    verdict = live_verdict(timed([0.95, 0.99, 0.97]), turning_on, settings, 1.35)
    assert verdict["verdict"] == "veto" and "predicted: slower than plain decoding (weak" in verdict["reason"]
    assert "vs 1.35x predicted" in verdict["reason"]
    # confidently below the policy minimum: 1.02x with every request below 1.1
    verdict = live_verdict(timed([1.0, 1.03, 1.05, 1.02, 1.01]), turning_on, settings, 1.34)
    assert verdict["verdict"] == "veto" and "below min_speedup 1.10x" in verdict["reason"]
    assert verdict["weak"] is False
    # slower than predicted beyond the tolerance, on every request
    verdict = live_verdict(timed([1.3, 1.3, 1.3], predicted=[2.0, 2.0, 2.0]), turning_on, settings, 2.0)
    assert verdict["verdict"] == "veto" and "beyond the 25% tolerance" in verdict["reason"]
    # one request far off is not confident: the interval reaches past the bar
    verdict = live_verdict(timed([1.0, 1.6, 1.5]), turning_on, settings, 1.5)
    assert verdict["verdict"] == "pass"
    # a domain already on in the champion is not vetoed (flagged), nor is one the plan keeps off
    for config in ({**turning_on, "champion_on": True}, {**turning_on, "enabled": False}):
        assert live_verdict(timed([0.95, 0.99, 0.97]), config, settings, 1.35)["verdict"] == "flag"
    # the setting switches the veto off
    assert live_verdict(timed([0.95, 0.99, 0.97]), turning_on, load_settings({}, live_veto=False),
                        1.35)["verdict"] == "flag"


def test_confirm_vetoes_a_domain_turning_on_and_it_keeps_the_champions_setting(tiny_db, tiny_target):
    from tasks.steps.pipeline import RunSpec, step_confirm
    from tasks.registry.run_config import build_config

    run(tiny_db, tiny_target, "veto", plan_min_speedup=0.01)          # planned: every domain on
    # the live check against a minimum no tiny model reaches: the domain turning on is vetoed
    overrides = {**SETTINGS, "plan_candidates": list(SETTINGS["plan_candidates"]), "plan_min_speedup": 100.0,
                 "live_veto": True}
    spec = RunSpec(run_id="veto", target="tiny", db_url=tiny_db, overrides=overrides)
    engine = create_engine(tiny_db)
    with engine.begin() as connection:      # qa is on in the champion: not vetoed, only flagged
        connection.execute(DomainConfig.__table__.update().where(
            (DomainConfig.run_id == "veto") & (DomainConfig.domain == "qa")).values(champion_on=True))
    step_confirm(spec, "json")
    step_confirm(spec, "qa")
    with engine.connect() as connection:
        rows = {r.domain: r for r in connection.execute(
            select(DomainConfig).where(DomainConfig.run_id == "veto")).all()}
        live = {r.domain: r for r in connection.execute(
            select(LiveMeasurement).where(LiveMeasurement.run_id == "veto")).all()}
    engine.dispose()
    json_row, qa_row = rows["json"], rows["qa"]
    assert json_row.enabled is False and json_row.live_check["verdict"] == "veto"
    assert json_row.reason.startswith("live check: ")
    # a tiny model may even measure slower than plain decoding: that veto reason comes first
    assert ("below min_speedup 100.00x" in json_row.reason
            or "slower than plain decoding" in json_row.reason)
    assert "the champion's setting is kept (off)" in json_row.reason
    assert json_row.k_schedule is None and json_row.max_batch_size is None
    assert live["json"].measured_speedup_lo <= live["json"].measured_speedup <= live["json"].measured_speedup_hi
    assert qa_row.enabled is True and qa_row.live_check["verdict"] == "flag"
    config = build_config("veto", Store.open(tiny_db))
    assert config.domains["json"].enabled is False
    assert config.domains["json"].reason.startswith("live check: ")
    assert config.domains["qa"].enabled is True


def test_each_domain_gets_its_own_sampling_test_unless_drafter_k_and_settings_are_equal(
        db_url, tiny_target, caplog):
    # json and qa planned with one drafter at K=3 and serving T0.7/top-p 0.9: qa shares json's test
    # (and says so); a different K, or traffic at other settings, makes qa run its own test from
    # its own context. Each test leaves a line in the task's log.
    import logging

    from specdec_core import SamplingParams
    from specdec_core.estimate import LoggedRequest
    from tasks.steps.drafters.candidates import build_drafters
    from tasks.steps.checks.validate import validate_domain

    from .helpers.registry import finished_run

    finished_run(db_url, "own", {"json": {}, "qa": {}})
    drafters = build_drafters(("prompt_lookup:max_ngram=3",), tiny_target)
    settings = load_settings({}, **{**SETTINGS, "validation_rows": 60, "validation_alpha": 0.0001})
    rows = {domain: [r for r in traffic_rows(tiny_target, foreign=0) if r["domain"] == domain]
            for domain in ("json", "qa")}

    def requests(domain, sampling=None):
        return [LoggedRequest(r["id"], r["prompt_token_ids"], r["response_token_ids"],
                              sampling or SamplingParams(temperature=r["temperature"], top_p=r["top_p"]),
                              domain) for r in rows[domain]]

    def set_k(domain, k):
        engine = create_engine(db_url)
        with engine.begin() as connection:
            connection.execute(DomainConfig.__table__.update().where(
                (DomainConfig.run_id == "own") & (DomainConfig.domain == domain)).values(k=k))
        engine.dispose()

    caplog.set_level(logging.INFO, logger="tasks")
    first = validate_domain("own", "json", tiny_target, drafters, requests("json"), Store.open(db_url),
                            settings=settings)
    assert first["shared_from"] is None and first["validation"] == "passed"
    assert first["key"]["ks"] == [1, 3] and first["key"]["samplings"] == [
        {"temperature": 0.7, "top_k": 0, "top_p": 0.9}]
    assert ("run own, domain json: sampling test of prompt_lookup(max_ngram=3) K=3 (tested at K 1, 3) "
            "at T0.7 top-p 0.9 from request json-") in caplog.text
    same = validate_domain("own", "qa", tiny_target, drafters, requests("qa"), Store.open(db_url),
                           settings=settings)
    assert same["shared_from"] == "json" and same["key"] == first["key"]
    assert "run own, domain qa: sampling test of prompt_lookup(max_ngram=3) K=3 (tested at K 1, 3) at " \
           "T0.7 top-p 0.9 shared from json (same drafter, K and sampling settings): passed" in caplog.text

    set_k("qa", 2)                                          # another K: its own test
    other_k = validate_domain("own", "qa", tiny_target, drafters, requests("qa"), Store.open(db_url),
                              settings=settings)
    assert other_k["shared_from"] is None and other_k["key"]["ks"] == [1, 2]
    set_k("qa", 3)                                          # other sampling settings: its own test
    hot = validate_domain("own", "qa", tiny_target, drafters, requests("qa", SamplingParams(temperature=1.0)),
                          Store.open(db_url), settings=settings)
    assert hot["shared_from"] is None and hot["key"]["samplings"] == [{"temperature": 1.0, "top_k": 0,
                                                                       "top_p": 1.0}]
    engine = create_engine(db_url)
    with engine.connect() as connection:
        stored = {row.domain: row for row in connection.execute(select(
            Validation.domain, Validation.k, Validation.request_id, Validation.details).where(
            (Validation.run_id == "own") & (Validation.check_name == "sampling")))}
    engine.dispose()
    assert stored["qa"].k == 3 and stored["qa"].request_id.startswith("qa-")    # qa's own context
    assert stored["qa"].details["shared_from"] is None and stored["qa"].details["seconds"] > 0


def test_the_table_shows_the_sampling_test_on_vllm(db_url):
    # `specdec evaluate`'s table: the version page's rows (tasks.registry.run_view), one "vLLM
    # sampling" cell per domain from the stored rows, "-" where vLLM did not test the domain
    from rich.console import Console

    from tasks.cli.evaluation import evaluation_rich_table
    from tasks.registry.run_view import build_run_view, table_rows
    from tasks.steps.evaluate import evaluation_table

    from .helpers.registry import engine_sampling, finished_run

    finished_run(db_url, "r1", {"json": {}, "qa": {}, "chat": {}})
    engine_sampling(db_url, "r1", "json", rows=300, positions=6, min_p=0.021)
    engine_sampling(db_url, "r1", "qa", status="failed", min_p=1e-9, control=True)
    table = {row["domain"]: row for row in evaluation_table("r1", Store.open(db_url))}
    assert table["json"]["engine_sampling"]["status"] == "passed" and table["chat"]["engine_sampling"] is None
    assert (table["qa"]["engine_sampling"]["rows"], table["qa"]["engine_sampling"]["positions"]) == (300, 6)
    assert table["qa"]["validation"] == "failed" and table["qa"]["promotable"] is False
    view = build_run_view("r1", Store.open(db_url), load_settings({}))
    console = Console(width=400, record=True)
    console.print(evaluation_rich_table(view, 1.0))
    lines = console.export_text().splitlines()
    header = [c.strip() for c in next(line for line in lines if "┃ domain" in line).split("┃")]
    column = header.index("vLLM sampling")
    assert header[column - 1] == "validation"
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")] for line in lines
            if line.count("│") > 3 and line.split("│")[1].strip() in table}
    assert rows["json"][column] == "passed (300 rows, 6 tests, p>=0.021)"
    assert rows["qa"][column] == "FAILED (300 rows, 6 tests, p>=1e-09, plain server passed)"
    assert rows["chat"][column] == "-"
    # the same cells as the page's table, every one of them
    assert [rows[r[0]][1:-1] for r in table_rows(view)] == table_rows(view)


def test_finish_register_promote_alert_and_report_each_log_a_summary_line(tiny_db, tiny_target, tmp_path,
                                                                          caplog, mlflow_uri):
    # what the Airflow task log of finish, register, promote, acceptance_alert and report holds
    # (the tasks call these functions; validate's line: the test above)
    import logging

    from tasks.steps.evaluate import report_table
    from tasks.steps.pipeline import low_acceptance_domains
    from tasks.steps.traffic.reports import materialise_report

    caplog.set_level(logging.INFO, logger="tasks")
    uri = mlflow_uri
    settings = load_settings({}, **{**SETTINGS, "plan_min_speedup": 0.01})
    result = evaluate(run_id="logged", target="tiny", store=Store.open(tiny_db), settings=settings, model=tiny_target,
                      progress=False, promote=True, registry=Registry.open(uri))
    name, version = result["registered"]["name"], result["registered"]["version"]

    def line(start):
        messages = [record.getMessage() for record in caplog.records]
        found = [m for m in messages if m.startswith(start)]
        assert found, (start, messages)
        return found[-1]

    finish = line("run logged: finished: target fingerprint sha256:")
    assert "greedy check json passed, qa passed; validation json passed, qa passed; failed domains none" in finish
    register = line(f"run logged: registered {name} version {version} (alias challenger; champion none); "
                    "validation passed; gates (preview): validation pass, live_check ")
    assert f"page: #/models/{name}/versions/{version} of the MLflow UI on {uri}" in register
    promote = line(f"run logged: {name} version {version} promoted to champion: no gate failed: ")
    assert "; gates: validation pass, live_check " in promote
    spec = {"run_id": "logged", "target": "tiny", "db_url": tiny_db}
    assert {row["domain"] for row in low_acceptance_domains(spec, 50.0)} == {"json", "qa"}
    assert line("run logged: low-acceptance alert (expected tokens per round below 50.00): json (on, ")
    assert low_acceptance_domains(spec, 1.0) == []
    assert line("run logged: no domain below the low-acceptance alert (E < 1.00)")
    assert [row["domain"] for row in report_table(spec)] == ["json", "qa"]
    assert line("run logged, domain qa: on, ") and "validation passed" in line("run logged, domain json: on, ")
    written = materialise_report("current_config_per_domain", store=Store.open(tiny_db), directory=tmp_path)
    assert line(f"report current_config_per_domain: {written['rows']} rows written to {written['path']}")
