"""More training data from the target itself (tasks.steps.traffic.traffic_generate): responses generated
for logged prompts under their logged sampling params, stored as traffic rows marked as generated;
the count is respected, a re-run of the same id is idempotent and an interrupted one continues;
training reads them only when asked (training split only), and sampling, estimates, suffix indexes
and the SQL reports never see them."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, select

from specdec_core import SpecDecoder
from specdec_core.train import TrainConfig

from tasks.db.store import Store



def stored(db_url, generated: bool | None = None) -> dict[str, dict]:
    """traffic_requests rows by id (generated: only those / only production ones)."""
    from tasks.db.models import TrafficRequest

    engine = create_engine(db_url)
    with engine.connect() as connection:
        rows = {row.id: dict(row._mapping) for row in connection.execute(select(TrafficRequest.__table__))}
    engine.dispose()
    if generated is None:
        return rows
    return {k: v for k, v in rows.items() if (v["generated_by"] is not None) == generated}


def generate(store, run_id, domains, count, **kwargs):
    from tasks.steps.traffic.traffic_generate import generate_traffic

    return generate_traffic(run_id, domains, count, target=store["target"], store=Store.open(store["db_url"]),
                            model=store["model"], tokenizer=store["tokenizer"], progress=False,
                            **kwargs)


def test_generated_rows_follow_their_logged_prompt_and_sampling_and_are_marked(tiny_store):
    out = generate(tiny_store, "gen-1", "json", 5, batch_size=2)
    assert out["generated"] == 5
    assert out["domains"]["json"] == {"available": 16, "planned": 5, "before": 0, "generated": 5,
                                      "rows": 5}
    production, generated = stored(tiny_store["db_url"], False), stored(tiny_store["db_url"], True)
    assert len(production) == 32 and len(generated) == 5
    for row in generated.values():
        source = production[row["generated_from"]]
        assert row["generated_by"] == "gen-1" and row["id"].startswith("gen-")
        assert source["domain"] == row["domain"] == "json"
        assert row["prompt_token_ids"] == source["prompt_token_ids"]
        assert row["requested_at"] == source["requested_at"]
        assert (row["temperature"], row["top_p"], row["top_k"]) == (
            source["temperature"], source["top_p"], source["top_k"])
        assert row["target_fingerprint"] == out["fingerprint"] == source["target_fingerprint"]
        response, logged = row["response_token_ids"], source["response_token_ids"]
        # the logged length caps the answer: it stops there, or earlier at an end-of-sequence token
        assert len(response) >= 1 and (len(response) == len(logged) or response[-1] == 2)
        assert 2 not in response[:-1]
        assert row["response"] == tiny_store["tokenizer"].decode(response, skip_special_tokens=True)
        if source["temperature"] == 0:
            # greedy rows: the target's logged answer again, up to an end-of-sequence token
            assert response == logged[:len(response)]
            assert len(response) == len(logged) or response[-1] == 2


def test_count_is_respected_a_rerun_is_idempotent_and_an_interrupted_run_continues(
        tiny_store, monkeypatch):
    db_url = tiny_store["db_url"]
    first = generate(tiny_store, "gen-a", ["json", "qa"], 3)
    assert first["generated"] == 6 and len(stored(db_url, True)) == 6
    again = generate(tiny_store, "gen-a", ["json", "qa"], 3)
    assert again["generated"] == 0 and len(stored(db_url, True)) == 6
    assert {d: c["rows"] for d, c in again["domains"].items()} == {"json": 3, "qa": 3}
    # a larger count under the same id adds the next prompts of the same order
    more = generate(tiny_store, "gen-a", "json", 5)
    assert more["domains"]["json"]["before"] == 3 and more["generated"] == 2
    # more than there are prompts: one row per logged prompt
    assert generate(tiny_store, "gen-b", "qa", 100)["domains"]["qa"]["rows"] == 16

    # interrupted after its first batch: that batch is kept, and the re-run does the rest
    calls = {"n": 0}
    plain = SpecDecoder.generate_plain

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("worker lost")
        return plain(self, *args, **kwargs)

    monkeypatch.setattr(SpecDecoder, "generate_plain", failing)
    with pytest.raises(RuntimeError, match="worker lost"):
        generate(tiny_store, "gen-c", "json", 8, batch_size=2)
    kept = {k for k, v in stored(db_url, True).items() if v["generated_by"] == "gen-c"}
    assert len(kept) == 2
    resumed = generate(tiny_store, "gen-c", "json", 8, batch_size=2)
    rows = {k for k, v in stored(db_url, True).items() if v["generated_by"] == "gen-c"}
    assert resumed["domains"]["json"]["before"] == 2 and resumed["generated"] == 6
    assert len(rows) == 8 and kept <= rows


def test_cli_generates_resumes_by_id_and_names_bad_input(tiny_store, capsys):
    import json

    from specdec_core.estimate import in_heldout
    from tasks.cli.app import main
    from tasks.steps.traffic.traffic_generate import GenerationError

    argv = ["draft", "generate", "--domain", "json,qa", "--count", "2", "--id", "gen-cli",
            "--model", tiny_store["target"], "--url", tiny_store["db_url"], "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["generated"] == 4
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["generated"] == 0 and {d: c["rows"] for d, c in out["domains"].items()} == {"json": 2, "qa": 2}
    assert {v["generated_by"] for v in stored(tiny_store["db_url"], True).values()} == {"gen-cli"}
    assert main([*argv[:5], "-1", *argv[6:]]) == 2
    assert "GenerationError: count -1" in capsys.readouterr().err
    with pytest.raises(GenerationError, match=r"no logged requests answered by this target .*\['code'\]"):
        generate(tiny_store, "gen-x", "code", 4)
    # --for-training: that training's held-out prompts (at its --heldout-fraction) and its
    # validation prompts (at its --validation-fraction) are skipped
    from specdec_core.estimate import in_validation

    assert main(["draft", "generate", "--domain", "qa", "--count", "100", "--id", "gen-cli-f",
                 "--for-training", "d-later", "--heldout-fraction", "0.5",
                 "--validation-fraction", "0.3", *argv[8:]]) == 0
    out = json.loads(capsys.readouterr().out)
    sources = {v["generated_from"] for v in stored(tiny_store["db_url"], True).values()
               if v["generated_by"] == "gen-cli-f"}
    qa = {k for k, v in stored(tiny_store["db_url"], False).items() if v["domain"] == "qa"}
    skipped = {k for k in qa if in_heldout("d-later", k, 0.5) or in_validation("d-later", k, 0.3)}
    assert {k for k in qa if in_validation("d-later", k, 0.3) and not in_heldout("d-later", k, 0.5)}
    assert sources and out["domains"]["qa"]["rows"] == len(sources) == len(qa - skipped) < 16
    assert sources == qa - skipped


def test_training_takes_generated_rows_only_when_asked_and_never_from_heldout_prompts(tiny_store):
    from tasks.db.models import DraftTrainingRequest
    from tasks.steps.drafters.draft_recipes import DraftModelRecipe, TrainingData
    from tasks.steps.drafters.draft_training import in_heldout, train_draft_from_traffic

    db_url = tiny_store["db_url"]
    generate(tiny_store, "gen-t", ["json", "qa"], 16)
    config = TrainConfig(steps=1, eval_every=1, k_max=2, warmup_steps=1)
    common = dict(recipe=DraftModelRecipe(num_layers=1, config=config), target=tiny_store["target"],
                  store=Store.open(db_url), model=tiny_store["model"], tokenizer=tiny_store["tokenizer"],
                  progress=False, register=False)
    without = train_draft_from_traffic("d-plain", **common)
    with_generated = train_draft_from_traffic(
        "d-gen", data=TrainingData(include_generated=True, split_from="d-plain"), **common)
    engine = create_engine(db_url)
    with engine.connect() as connection:
        splits = {name: dict(connection.execute(
            select(DraftTrainingRequest.request_id, DraftTrainingRequest.split)
            .where(DraftTrainingRequest.draft_name == name)).all()) for name in ("d-plain", "d-gen")}
    engine.dispose()
    generated = stored(db_url, True)
    assert without["generated_requests"] == 0 and not set(splits["d-plain"]) & set(generated)
    # the generated rows of training prompts join the training split; those of held-out prompts
    # are left out; the held-out rows are the same production rows either way
    validation = {k for k, s in splits["d-plain"].items() if s == "validation"}
    assert validation and {k for k, s in splits["d-gen"].items() if s == "validation"} == validation
    # nor from the validation prompts, which choose the checkpoint
    from_train = {k for k, v in generated.items() if not in_heldout("d-plain", v["generated_from"], 0.2)
                  and v["generated_from"] not in validation
                  and len(v["response_token_ids"]) >= 2}       # as for logged rows: 2 tokens at least
    assert 0 < len(from_train) < len(generated) == 32
    assert {k for k, s in splits["d-gen"].items() if k in generated} == from_train
    assert all(splits["d-gen"][k] == "train" for k in from_train)
    assert {k for k, s in splits["d-gen"].items() if s == "heldout"} == \
        {k for k, s in splits["d-plain"].items() if s == "heldout"}
    assert with_generated["generated_requests"] == len(from_train)
    assert with_generated["train_requests"] == without["train_requests"] + len(from_train)


def test_generation_skips_the_prompts_its_training_holds_out_and_draws_apart_from_the_split(
        tiny_store):
    from specdec_core.estimate import in_heldout
    from tasks.steps.traffic.traffic_generate import GenerationError

    production = stored(tiny_store["db_url"], False)
    # the prompt order is not the split's hash: over ten run ids, the first 3 prompts of a domain
    # drawn without `heldout` are held out by a training of the same id about as often as any
    # prompt (20%), not always (the order once sorted by the split's own hash: held-out first)
    firsts = []
    for n in range(10):
        out = generate(tiny_store, f"gen-o{n}", "json", 3)
        firsts += [v["generated_from"] for v in stored(tiny_store["db_url"], True).values()
                   if v["generated_by"] == f"gen-o{n}"]
        assert out["generated"] == 3
    heldout_share = sum(in_heldout(f"gen-o{n}", source, 0.2) for n in range(10)
                        for source in firsts[3 * n:3 * n + 3]) / 30
    assert heldout_share < 0.6
    # with heldout: none of the training's held-out prompts is answered, the count is kept, and
    # "available" counts the prompts it may answer
    held = {k for k, v in production.items() if v["domain"] == "qa" and in_heldout("gen-h", k, 0.2)}
    assert held                                              # the split holds some out
    out = generate(tiny_store, "gen-h", "qa", 100, heldout=("gen-h", 0.2))
    sources = {v["generated_from"] for v in stored(tiny_store["db_url"], True).values()
               if v["generated_by"] == "gen-h"}
    assert out["domains"]["qa"]["available"] == 16 - len(held) == len(sources)
    assert not sources & held
    with pytest.raises(GenerationError, match=r"heldout \('gen-h', 2\)"):
        generate(tiny_store, "gen-h", "qa", 1, heldout=("gen-h", 2))
    with pytest.raises(GenerationError, match=r"heldout \('gen-h', 0.2, 1.5\): give \(split key, "
                                              r"held-out fraction\[, validation fraction\]\)"):
        generate(tiny_store, "gen-h", "qa", 1, heldout=("gen-h", 0.2, 1.5))


def test_sampling_estimates_indexes_and_reports_never_see_generated_rows(tiny_store):
    from specdec_core.validation import fingerprint_id, target_fingerprint
    from tasks.steps.estimate.offline_estimate import load_sample_requests
    from tasks.steps.traffic.reports import run_report
    from tasks.steps.drafters.suffix_index import index_sequences
    from tasks.steps.traffic.traffic_sample import sample_traffic

    db_url = tiny_store["db_url"]
    generate(tiny_store, "gen-s", ["json", "qa"], 16)
    generated = set(stored(db_url, True))
    assert len(generated) == 32
    sample = sample_traffic("eval-1", store=Store.open(db_url), min_per_domain=1, max_per_domain=1000)
    assert {d: c["available"] for d, c in sample["domains"].items()} == {"json": 16, "qa": 16}
    assert sample["sampled"] == 32
    requests, _ = load_sample_requests("eval-1", Store.open(db_url), tokenizer=tiny_store["tokenizer"])
    scored = {r.request_id for rows in requests.values() for r in rows}
    assert len(scored) == 32 and not scored & generated
    fingerprint = fingerprint_id(target_fingerprint(tiny_store["model"]))
    ids, _ = index_sequences(Store.open(db_url), "json", fingerprint, tiny_store["tokenizer"])
    assert len(ids) == 16 and not set(ids) & generated
    report = run_report("traffic_by_domain_per_day", Store.open(db_url))
    column = report["columns"].index("requests")
    assert sum(row[column] for row in report["rows"]) == 32
