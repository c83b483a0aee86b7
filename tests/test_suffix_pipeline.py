"""The suffix drafter in the pipeline: a candidate kind whose per-domain index never holds the
requests it scores, registered indexes with their lineage, the config schema and the vLLM export."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, select

from specdec_core.drafters import SuffixDrafter
from tasks.db.store import Store
from tasks.registry.registry import Registry
from tasks.steps.drafters.candidates import parse_candidate
from tasks.registry.config_schema import DrafterSpec
from tasks.db.models import AcceptanceEstimate, DomainConfig, DraftTrainingRequest, EvalSample
from tasks.steps.drafters.suffix_index import SuffixIndexError, build_and_register, resolve_index_uri
from tasks.steps.traffic.traffic_import import import_traffic

from tasks.steps.evaluate import evaluate
from tasks.settings import load_settings

from .helpers.evaluation import SETTINGS, run
from .helpers.traffic import traffic_rows, write_jsonl

SUFFIX = "suffix:max_depth=16,min_token_prob=0.1,max_spec_factor=1.0"


@pytest.fixture
def suffix_db(db_url, tmp_path, tiny_target):
    # 16 requests per domain, at most 10 sampled: the rest can be indexed
    import_traffic(write_jsonl(tmp_path / "tiny.jsonl", traffic_rows(tiny_target, per_domain=16)),
                   store=Store.open(db_url), progress=False)
    return db_url


def test_a_runs_suffix_index_never_holds_the_requests_it_scores(suffix_db, tiny_target):
    out = run(suffix_db, tiny_target, "suffix-run",
              plan_candidates=("prompt_lookup:max_ngram=3:min_ngram=1", SUFFIX))
    assert not out["failed"]
    engine = create_engine(suffix_db)
    with engine.connect() as connection:
        sampled = {(d, r) for d, r in connection.execute(
            select(EvalSample.domain, EvalSample.request_id).where(EvalSample.run_id == "suffix-run"))}
        indexed = connection.execute(select(DraftTrainingRequest.draft_name,
                                            DraftTrainingRequest.request_id)).all()
        labels = set(connection.execute(select(AcceptanceEstimate.drafter).where(
            AcceptanceEstimate.run_id == "suffix-run")).scalars())
    engine.dispose()
    by_domain: dict[str, set[str]] = {}
    for name, request_id in indexed:
        assert name.startswith("suffix-index:suffix-run:")
        by_domain.setdefault(name.rsplit(":", 1)[1], set()).add(request_id)
    assert set(by_domain) == {"json", "qa"}
    sampled_ids = {r for _, r in sampled}
    for domain, ids in by_domain.items():
        assert ids and not ids & sampled_ids                       # disjoint from the sample
        assert all(i.startswith(domain) for i in ids)              # the domain's own traffic
    assert any(label.startswith("suffix(") for label in labels)


def test_a_runs_suffix_history_is_the_newest_of_what_its_index_holds(suffix_db, tiny_target):
    # the load check serves a suffix server this history first: requests of the domain the
    # run's index holds (never one the run scores), the newest first, at most `count`
    from specdec_core.validation import fingerprint_id, target_fingerprint
    from tasks.steps.drafters.suffix_index import index_sequences, run_history, run_window_and_sample

    out = run(suffix_db, tiny_target, "history-run", plan_candidates=(SUFFIX,))
    assert not out["failed"]
    store = Store.open(suffix_db)
    fingerprint = fingerprint_id(target_fingerprint(tiny_target))
    until, sampled = run_window_and_sample(store, "history-run")
    indexed, _ = index_sequences(store, "json", fingerprint, None, until=until, exclude=sampled)
    history = run_history("history-run", "json", store, fingerprint, None, 3)
    assert [row.id for row, _, _ in history] == indexed[::-1][:3]
    assert not {row.id for row, _, _ in history} & sampled
    assert all(len(prompt) > 0 and len(response) >= 2 for _, prompt, response in history)
    times = [row.requested_at for row, _, _ in history]
    assert times == sorted(times, reverse=True)
    # more asked than the index holds: all of it; none asked: none
    assert len(run_history("history-run", "json", store, fingerprint, None, 100)) == len(indexed)
    assert run_history("history-run", "json", store, fingerprint, None, 0) == []
    # the other target's rows (qa has two) are never history
    qa = run_history("history-run", "qa", store, fingerprint, None, 100)
    assert qa and all(row.target_fingerprint in (None, fingerprint) for row, _, _ in qa)


def test_registered_index_has_lineage_and_its_requests_are_not_scored(suffix_db, tiny_target,
                                                                        tmp_path, monkeypatch, mlflow_uri):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    tracking = mlflow_uri
    registered = build_and_register("tiny", "json", store=Store.open(suffix_db), registry=Registry.open(tracking),
                                    model=tiny_target)
    assert registered["model_uri"].startswith("models:/specdec-suffix-tiny/")
    assert registered["requests"] == 16 and registered["tokens"] > 0
    path = resolve_index_uri(registered["model_uri"], Registry.open(tracking))
    drafter = SuffixDrafter(path)
    assert drafter.index.meta["domain"] == "json" and len(drafter.index.request_ids) == 16
    # used as a candidate: every json request is in the index, so none is left to score
    from tasks.steps.context import RunContext, RunSpec

    candidates = (f"suffix:index={registered['model_uri']}",)
    settings = load_settings({}, **{**SETTINGS, "plan_candidates": candidates})
    evaluate(run_id="registered-run", target="tiny", store=Store.open(suffix_db), settings=settings,
             model=tiny_target, progress=False, registry=Registry.open(tracking))
    spec = RunSpec(run_id="registered-run", target="tiny", db_url=suffix_db, tracking_uri=tracking,
                   overrides=settings.overrides())
    json_requests, excluded = RunContext.build(spec).domain_requests("json")
    qa_requests, qa_excluded = RunContext.build(spec).domain_requests("qa")
    assert json_requests == [] and len(excluded["indexed"]) == 10     # all json rows are indexed
    assert qa_requests and qa_excluded["indexed"] == []               # qa is scored as usual
    engine = create_engine(suffix_db)
    with engine.connect() as connection:
        status = dict(connection.execute(select(DomainConfig.domain, DomainConfig.status).where(
            DomainConfig.run_id == "registered-run")).all())
    engine.dispose()
    assert status == {"json": "insufficient", "qa": "ok"}
    with pytest.raises(SuffixIndexError, match="no stored traffic"):
        build_and_register("tiny", "chat", store=Store.open(suffix_db), registry=Registry.open(tracking),
                           model=tiny_target)


def test_suffix_is_a_candidate_kind_a_config_kind_and_a_vllm_method():
    spec = parse_candidate(SUFFIX)
    assert spec == {"kind": "suffix", "params": {"max_depth": 16, "min_token_prob": 0.1,
                                                 "max_spec_factor": 1.0}}
    assert DrafterSpec(kind="suffix", params=spec["params"]).kind == "suffix"
    from tasks.registry.vllm_export import speculative_config

    exported = speculative_config(DrafterSpec(kind="suffix", params=spec["params"]), k=6)
    assert exported["method"] == "suffix"
    assert exported["suffix_decoding_max_tree_depth"] == 16
    assert exported["suffix_decoding_min_token_prob"] == 0.1
    assert exported["suffix_decoding_max_spec_factor"] == 1.0
    assert exported["num_speculative_tokens"] == 6
