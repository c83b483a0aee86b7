"""Drafts trained on the traffic they serve: the trainer on a tiny target (held-out KL down,
estimated acceptance up, resume, vocabulary check), and the tasks around it (data split recorded,
MLflow registration, the next evaluation takes the draft as a candidate and never scores its
training rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sqlalchemy import create_engine, select

from tasks.db.store import Store
from specdec_core import SamplingParams, SpecDecoder, TokenizerMismatch
from specdec_core.estimate import LoggedRequest
from specdec_core.train import TrainConfig, init_draft_from_target, train_draft

from .helpers.evaluation import SETTINGS
from .helpers.models import VOCAB, save_tiny_target, tiny_llama
from .helpers.traffic import traffic_rows, write_jsonl

COSTS = (0.3, [1.2] * 4)        # fixed cost ratios: no timing in unit tests


@pytest.fixture(scope="module")
def logged():
    """A peaked tiny target and 200 of its own sampled responses (T = 1)."""
    torch.manual_seed(0)
    target = tiny_llama(seed=0)
    prompts = torch.randint(3, VOCAB, (200, 6))
    sampling = SamplingParams(temperature=1.0)
    out = SpecDecoder(target, None).generate_plain(prompts, 16, sampling=sampling, seed=1)
    requests = [LoggedRequest(f"r{i}", prompts[i].tolist(), out.tokens[i].tolist(), sampling,
                              "json" if i % 2 else "qa") for i in range(200)]
    return target, requests[:160], requests[160:]


def test_training_lowers_heldout_kl_and_raises_estimated_acceptance(logged, tmp_path):
    target, train, heldout = logged
    draft = init_draft_from_target(target, num_layers=1)
    config = TrainConfig(steps=80, eval_every=40, k_max=4, warmup_steps=5, lr=3e-3)
    result = train_draft(draft, target, train, heldout, config, tmp_path, costs=COSTS, progress=False)
    first, last = result.history[0], result.history[-1]
    assert [h["step"] for h in result.history] == [0, 40, 80]
    assert last["heldout_kl"] < first["heldout_kl"] - 0.3
    assert last["expected_tokens_per_round"] > first["expected_tokens_per_round"]
    assert last["acceptance_rate"] > first["acceptance_rate"]
    assert set(last["domains"]) == {"json", "qa"}
    # the kept checkpoint is the best by predicted speedup (then acceptance), not by loss
    best = max(result.history, key=lambda h: (h["predicted_speedup"], h["expected_tokens_per_round"]))
    assert result.best_step == best["step"] and (tmp_path / "best" / "model.safetensors").exists()


def test_the_kept_checkpoint_is_scored_once_on_rows_that_did_not_choose_it(logged, tmp_path):
    """report: the checkpoint chosen on `heldout` (the curve's rows) is scored on other rows once;
    the module keeps the weights it ended with."""
    from specdec_core.train import evaluate_draft

    target, train, heldout = logged
    curve, report = heldout[:20], heldout[20:]
    draft = init_draft_from_target(target, num_layers=1)
    config = TrainConfig(steps=30, eval_every=10, k_max=3, warmup_steps=3, lr=3e-3)
    result = train_draft(draft, target, train, curve, config, tmp_path, costs=COSTS, progress=False,
                         report=report)
    assert all(h["requests"] == len(curve) for h in result.history)
    assert result.report["step"] == result.best_step and result.report["requests"] == len(report)
    # the checkpoint kept, scored on the report rows: what a fresh load of it scores there
    kept = init_draft_from_target(target, num_layers=1)
    from safetensors.torch import load_model

    load_model(kept, str(tmp_path / "best" / "model.safetensors"))
    again = evaluate_draft(kept, target, report, 3, *COSTS)
    assert result.report["expected_tokens_per_round"] == pytest.approx(again["expected_tokens_per_round"])
    assert result.report["predicted_speedup"] == pytest.approx(again["predicted_speedup"])
    # the draft trained in place still holds the last step's weights
    load_model(kept, str(tmp_path / "last" / "model.safetensors"))
    for a, b in zip(draft.state_dict().values(), kept.state_dict().values()):
        assert torch.equal(a, b)
    assert train_draft(init_draft_from_target(target, num_layers=1), target, train, curve, config,
                       tmp_path / "none", costs=COSTS, progress=False).report is None


def test_where_nothing_pays_the_most_accepting_checkpoint_is_kept(logged, tmp_path):
    # a draft as expensive as the target: every K is "off" (1.0x) at every checkpoint
    target, train, heldout = logged
    draft = init_draft_from_target(target, num_layers=1)
    config = TrainConfig(steps=40, eval_every=20, k_max=3, warmup_steps=4, lr=3e-3)
    result = train_draft(draft, target, train, heldout, config, tmp_path, costs=(1.0, [2.0] * 3),
                         progress=False)
    assert {h["predicted_speedup"] for h in result.history} == {1.0}
    best = max(result.history, key=lambda h: h["expected_tokens_per_round"])
    assert best["step"] > 0 and result.best_step == best["step"]


def test_teacher_topk_kl_trains_a_narrower_draft(logged, tmp_path):
    target, train, heldout = logged
    draft = init_draft_from_target(target, num_layers=1, hidden_size=32)
    assert draft.config.hidden_size == 32 and draft(torch.tensor([[3, 4, 5]])).logits.shape[-1] == VOCAB
    config = TrainConfig(steps=40, eval_every=40, k_max=4, warmup_steps=5, lr=3e-3, teacher_topk=8)
    result = train_draft(draft, target, train[:80], heldout, config, tmp_path, costs=COSTS, progress=False)
    assert result.history[-1]["heldout_kl"] < result.history[0]["heldout_kl"]


def test_resumed_training_continues_from_the_checkpoint_step(logged, tmp_path):
    target, train, heldout = logged
    config = TrainConfig(steps=40, eval_every=10, k_max=3, warmup_steps=4, lr=3e-3)
    straight = init_draft_from_target(target, num_layers=1)
    whole = train_draft(straight, target, train, heldout, config, tmp_path / "a", costs=COSTS,
                        progress=False)
    interrupted = init_draft_from_target(target, num_layers=1)
    first = train_draft(interrupted, target, train, heldout, config, tmp_path / "b", costs=COSTS,
                        progress=False, stop_after=20)
    assert first.step == 20
    again = init_draft_from_target(target, num_layers=1)          # a new process: fresh weights
    resumed = train_draft(again, target, train, heldout, config, tmp_path / "b", costs=COSTS,
                          progress=False)
    assert resumed.step == 40
    assert [h["step"] for h in resumed.history] == [h["step"] for h in whole.history] == [0, 10, 20, 30, 40]
    for a, b in zip(straight.state_dict().values(), again.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6)                     # same run as without the stop


def test_a_draft_with_another_vocabulary_is_refused(logged, tmp_path):
    target, train, heldout = logged
    other = tiny_llama(vocab=VOCAB + 8, seed=2)
    with pytest.raises(TokenizerMismatch, match="target's tokenizer"):
        train_draft(other, target, train, heldout, TrainConfig(steps=1), tmp_path, costs=COSTS,
                    progress=False)


# ------------------------------------------------------------------------------------------------
# tasks: data, registration, the next evaluation
def heldout_ids(db_url, train_id, split: str = "heldout") -> set[str]:
    from tasks.db.models import DraftTrainingRequest

    engine = create_engine(db_url)
    with engine.connect() as connection:
        ids = set(connection.execute(select(DraftTrainingRequest.request_id).where(
            (DraftTrainingRequest.draft_name == train_id)
            & (DraftTrainingRequest.split == split))).scalars())
    engine.dispose()
    return ids


def scored_per_drafter(db_url, run_id) -> dict[str, int]:
    """{drafter label: requests its K=1 estimates scored, summed over domains} of a run."""
    from tasks.db.models import AcceptanceEstimate

    engine = create_engine(db_url)
    with engine.connect() as connection:
        scored = connection.execute(select(AcceptanceEstimate.drafter, AcceptanceEstimate.requests)
                                    .where((AcceptanceEstimate.run_id == run_id)
                                           & (AcceptanceEstimate.k == 1))).all()
    engine.dispose()
    per_drafter: dict[str, int] = {}
    for label, requests in scored:
        per_drafter[label] = per_drafter.get(label, 0) + requests
    return per_drafter


def test_trained_draft_is_registered_and_joins_the_next_evaluation(tiny_store):
    from tasks.db.models import DraftModelRecord, DraftTrainingRequest
    from tasks.steps.drafters.draft_recipes import DraftModelRecipe
    from tasks.steps.drafters.draft_training import draft_candidates, train_draft_from_traffic
    from tasks.steps.evaluate import evaluate
    from tasks.settings import load_settings

    db_url = tiny_store["db_url"]
    config = TrainConfig(steps=20, eval_every=10, k_max=3, warmup_steps=2, lr=3e-3)
    recipe = DraftModelRecipe(num_layers=1, config=config)
    result = train_draft_from_traffic("draft-1", recipe, target=tiny_store["target"], store=Store.open(db_url),
                                      model=tiny_store["model"], tokenizer=tiny_store["tokenizer"],
                                      progress=False)
    assert result["model_uri"].endswith("/1")
    assert result["train_requests"] + result["validation_requests"] + result["heldout_requests"] == 32
    assert result["validation_requests"] >= 1
    again = train_draft_from_traffic("draft-1", recipe, target=tiny_store["target"], store=Store.open(db_url),
                                     model=tiny_store["model"], tokenizer=tiny_store["tokenizer"],
                                     progress=False)
    assert again["version"] == "1" and again["steps"] == 20          # resumed and reused, not redone
    engine = create_engine(db_url)
    with engine.connect() as connection:
        record = connection.execute(select(DraftModelRecord).where(DraftModelRecord.name == "draft-1")).one()
        trained = set(connection.execute(select(DraftTrainingRequest.request_id).where(
            DraftTrainingRequest.split == "train")).scalars())
    engine.dispose()
    assert record.status == "registered" and record.model_uri == result["model_uri"]
    assert record.window_start is not None and len(trained) == result["train_requests"]
    # the three splits are disjoint; the checkpoint was chosen on the validation rows and the
    # registry reports its one score on the held-out rows
    validation, heldout = heldout_ids(db_url, "draft-1", "validation"), heldout_ids(db_url, "draft-1")
    assert len(validation) == result["validation_requests"] and len(heldout) == result["heldout_requests"]
    assert not validation & heldout and not (validation | heldout) & trained
    assert all(h["requests"] == len(validation) for h in result["result"]["history"])
    assert result["heldout"]["requests"] == len(heldout) and result["heldout"]["step"] == result["best"]["step"]
    from tasks.registry.tracking import client

    version = client().get_model_version(result["model_uri"].split("/")[1], result["version"])
    assert version.tags["heldout_predicted_speedup"] == f"{result['heldout']['predicted_speedup']:.3f}"
    assert version.tags["validation_predicted_speedup"] == f"{result['best']['predicted_speedup']:.3f}"
    assert version.tags["validation_requests"] == str(len(validation))
    assert record.heldout == result["result"]["report"]
    metrics = client().get_run(version.run_id).data.metrics
    assert metrics["heldout_predicted_speedup"] == pytest.approx(result["heldout"]["predicted_speedup"])
    assert metrics["validation_predicted_speedup"] == pytest.approx(result["result"]["history"][-1]["predicted_speedup"])
    candidates = draft_candidates(tiny_store["target"], result["fingerprint"])
    assert candidates == [{"kind": "draft_model", "params": {"model": result["model_uri"]}}]
    assert draft_candidates(tiny_store["target"], "sha256:" + "1" * 32) == []   # another target: never

    settings = load_settings({}, **{**SETTINGS, "plan_candidates": ("prompt_lookup",),
                                    "sample_min_per_domain": 1, "sample_max_per_domain": 16,
                                    "plan_min_speedup": 0.01})
    run = evaluate(run_id="after-draft", target=tiny_store["target"], store=Store.open(db_url), settings=settings,
                   model=tiny_store["model"], tokenizer=tiny_store["tokenizer"], progress=False)
    assert run["excluded"]["trained_on"] == len(trained)               # all sampled: 16 per domain
    draft_label = f"draft_model(model={result['model_uri']})"
    per_drafter = scored_per_drafter(db_url, "after-draft")
    # both drafters scored exactly the held-out rows, never a row the draft was trained on
    untrained = result["heldout_requests"] + result["validation_requests"]
    assert per_drafter == {"prompt_lookup": untrained, draft_label: untrained}


def test_trained_head_is_registered_by_kind_and_joins_the_next_evaluation(tiny_store):
    from tasks.steps.drafters.draft_recipes import DraftModelRecipe, HeadRecipe, TrainingData
    from tasks.steps.drafters.draft_training import draft_candidates, train_draft_from_traffic
    from tasks.steps.evaluate import evaluate
    from tasks.settings import load_settings
    from tasks.registry.tracking import client

    db_url = tiny_store["db_url"]
    config = TrainConfig(steps=8, eval_every=4, k_max=2, warmup_steps=1, lr=3e-3)
    result = train_draft_from_traffic("head-1", HeadRecipe(vocab_size=64, unroll=2, config=config),
                                      target=tiny_store["target"], store=Store.open(db_url),
                                      model=tiny_store["model"], tokenizer=tiny_store["tokenizer"],
                                      progress=False)
    version = client().get_model_version(result["model_uri"].split("/")[1], result["version"])
    assert version.tags["kind"] == "head" and version.tags["vocab_size"] == "64"
    # a draft trained with split_from is held out on exactly the same requests
    other = train_draft_from_traffic(
        "draft-same-split", DraftModelRecipe(config=TrainConfig(steps=1, eval_every=1, k_max=2,
                                                                 warmup_steps=1)),
        TrainingData(split_from="head-1"), target=tiny_store["target"], store=Store.open(db_url),
        model=tiny_store["model"], tokenizer=tiny_store["tokenizer"], progress=False, register=False)
    assert other["heldout_requests"] == result["heldout_requests"]
    assert heldout_ids(db_url, "draft-same-split") == heldout_ids(db_url, "head-1")
    assert heldout_ids(db_url, "head-1", "validation") == heldout_ids(db_url, "draft-same-split", "validation")
    # offered as a head for this fingerprint only; a head of another target is never offered
    assert draft_candidates(tiny_store["target"], result["fingerprint"]) == [
        {"kind": "head", "params": {"model": result["model_uri"]}}]
    assert draft_candidates(tiny_store["target"], "sha256:" + "1" * 32) == []

    settings = load_settings({}, **{**SETTINGS, "plan_candidates": ("prompt_lookup",),
                                    "sample_min_per_domain": 1, "sample_max_per_domain": 16,
                                    "plan_min_speedup": 0.01})
    run = evaluate(run_id="after-head", target=tiny_store["target"], store=Store.open(db_url), settings=settings,
                   model=tiny_store["model"], tokenizer=tiny_store["tokenizer"], progress=False)
    assert run["excluded"]["trained_on"] == result["train_requests"]
    from tasks.db.models import CostProfile

    engine = create_engine(db_url)
    with engine.connect() as connection:
        costed = set(connection.execute(select(CostProfile.drafter).where(
            (CostProfile.run_id == "after-head") & (CostProfile.component == "draft_step"))).scalars())
    engine.dispose()
    head_label = f"head(model={result['model_uri']})"
    per_drafter = scored_per_drafter(db_url, "after-head")
    untrained = result["heldout_requests"] + result["validation_requests"]
    assert per_drafter == {"prompt_lookup": untrained, head_label: untrained}
    assert head_label in costed                       # its step is profiled like every drafter's


# ------------------------------------------------------------------------------------------------
# EAGLE-3 heads: trained on the domain's traffic like a head, saved in the speculators format
def test_head_vocabulary_from_responses_only_ignores_prompt_tokens():
    from specdec_core.train import head_vocabulary

    greedy = SamplingParams()
    # prompts full of 50..59, responses of 3..9 (3 most often): a draft proposes response tokens
    requests = [LoggedRequest(f"r{i}", [50 + i % 10] * 20, [3, 3, 3, 4 + i % 6], greedy, "qa")
                for i in range(30)]
    both = head_vocabulary(requests, 4, VOCAB)
    responses = head_vocabulary(requests, 4, VOCAB, responses_only=True)
    assert set(both.tolist()) <= set(range(50, 60)) | {3}       # prompts dominate the counts
    assert responses[0] == 3 and set(responses.tolist()) <= set(range(3, 10))
    assert responses.tolist() == sorted(responses.tolist())


def test_eagle3_is_trained_from_the_cli_registered_and_served_as_a_candidate(tiny_store, capsys):
    import json

    from specdec_core.eagle3 import Eagle3Head, is_eagle3_dir
    from specdec_core.train import head_vocabulary
    from tasks.cli.app import main
    from tasks.db.models import DraftTrainingRequest, TrafficRequest
    from tasks.registry.tracking import client
    from tasks.steps.drafters.candidates import build_drafters
    from tasks.steps.drafters.draft_training import draft_candidates, resolve_model_uri
    from tasks.steps.estimate.offline_estimate import request_token_ids

    target, model, db_url = tiny_store["target"], tiny_store["model"], tiny_store["db_url"]
    rc = main(["draft", "train", "--id", "eagle3-1", "--model", target, "--kind", "eagle3",
               "--vocab-size", "24", "--steps", "6", "--eval-every", "3", "--batch-size", "4",
               "--k-max", "2", "--lr", "3e-3", "--url", db_url, "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "eagle3" and out["steps"] == 6 and out["model_uri"].endswith("/1")
    name, version = out["model_uri"].split("/")[1:]
    tags = client().get_model_version(name, version).tags
    assert {k: tags[k] for k in ("kind", "vocab_size", "unroll", "layer_ids", "format", "train_id",
                                 "target_fingerprint")} == {
        "kind": "eagle3", "vocab_size": "24", "unroll": "3", "layer_ids": "1,2",
        "format": "speculators", "train_id": "eagle3-1",
        "target_fingerprint": out["fingerprint"]}
    # the registered artifact: the speculators files, with the planned K and the target as verifier
    directory = resolve_model_uri(out["model_uri"])
    assert is_eagle3_dir(directory)
    config = json.loads((Path(directory) / "config.json").read_text())
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert proposal["speculative_tokens"] == (out["best"]["k"] or 2)
    # the same id again (it resumes: nothing to train), for people: what chose the checkpoint
    # and its one held-out score
    assert main(["draft", "train", "--id", "eagle3-1", "--model", target, "--kind", "eagle3",
                 "--vocab-size", "24", "--steps", "6", "--eval-every", "3", "--batch-size", "4",
                 "--k-max", "2", "--lr", "3e-3", "--url", db_url]) == 0
    text = capsys.readouterr().out
    assert (f"step {out['best']['step']} of 6 kept, chosen on {out['validation_requests']} validation "
            f"requests (predicted {out['best']['predicted_speedup']:.2f}x there); "
            f"{out['train_requests']} train / {out['validation_requests']} validation / "
            f"{out['heldout_requests']} held-out requests") in text
    assert f"held-out KL {out['heldout']['heldout_kl']:.4f}" in text
    assert config["speculators_config"]["verifier"]["name_or_path"] == target
    assert config["specdec"]["train_id"] == "eagle3-1" and config["draft_vocab_size"] == 24
    assert config["specdec"]["target_fingerprint"] == out["fingerprint"]
    head = Eagle3Head.load(directory, model)
    assert head.layer_ids == [1, 2] and head.vocab_size == 24       # vLLM's default, 4 layers
    # its vocabulary: the 24 most frequent tokens of the training rows' responses, prompts aside
    engine = create_engine(db_url)
    with engine.connect() as connection:
        trained = set(connection.execute(select(DraftTrainingRequest.request_id).where(
            (DraftTrainingRequest.draft_name == "eagle3-1")
            & (DraftTrainingRequest.split == "train"))).scalars())
        rows = connection.execute(select(TrafficRequest).where(TrafficRequest.id.in_(trained))).all()
    engine.dispose()
    greedy = SamplingParams()
    train = [LoggedRequest(r.id, *request_token_ids(r, None), greedy, r.domain) for r in rows]
    assert head.vocab_ids.tolist() == head_vocabulary(train, 24, VOCAB, responses_only=True).tolist()
    assert head.vocab_ids.tolist() != head_vocabulary(train, 24, VOCAB).tolist()
    # offered to the next evaluation of this target as an eagle3 candidate, built as one
    assert {"kind": "eagle3", "params": {"model": out["model_uri"]}} in draft_candidates(
        target, out["fingerprint"])
    built = build_drafters([f"eagle3:model={out['model_uri']}"], model, tiny_store["tokenizer"])
    (_, drafter), = built.values()
    assert drafter.head.kind == "eagle3" and drafter.head.vocab_size == 24


def test_eagle3_wrong_kind_or_another_target_is_a_clear_error_naming_the_input(tmp_path):
    from specdec_core.eagle3 import Eagle3Head
    from tasks.steps.drafters.candidates import CandidateError, build_drafters
    from tasks.steps.drafters.draft_recipes import recipe_for
    from tasks.steps.drafters.draft_training import DraftTrainingError, train_draft_from_traffic

    target = tiny_llama(seed=0)
    with pytest.raises(DraftTrainingError, match=r"draft kind 'eagle'.*'eagle3'"):
        recipe_for("eagle")
    with pytest.raises(DraftTrainingError, match=r"layer_ids \[1, 2\] are for kind eagle3, not head"):
        recipe_for("head", layer_ids=[1, 2])
    for wrong in ([1, 9], [2, 1]):
        with pytest.raises(DraftTrainingError, match=rf"layer_ids \[{wrong[0]}, {wrong[1]}\]: "
                                                     r"distinct, ascending, each in 0..4 .* target tiny"):
            train_draft_from_traffic("x", recipe_for("eagle3", layer_ids=wrong), target="tiny",
                                     model=target)
    checkpoint = Eagle3Head(target, vocab_ids=torch.arange(10, 40)).save(tmp_path / "e3", k=2)
    # an EAGLE-3 checkpoint offered as a head (or a draft model): the message names it and the fix
    for kind in ("head", "draft_model"):
        with pytest.raises(CandidateError, match=rf"{tmp_path / 'e3'} holds a eagle3 checkpoint, "
                                                 rf"not a {kind} one: use eagle3:model="):
            build_drafters([f"{kind}:model={checkpoint}"], target)
    # a head trained for another target (another width): the candidate and the file are named
    other = tiny_llama(hidden=32, heads=2, seed=3)
    with pytest.raises(CandidateError) as caught:
        build_drafters([f"eagle3:model={checkpoint}"], other)
    message = str(caught.value)
    assert f"candidate eagle3(model={checkpoint})" in message
    assert str(checkpoint / "model.safetensors") in message and "train a head for this target" in message


def test_eagle3_without_vocab_size_drafts_over_the_full_vocabulary(tmp_path):
    from safetensors.torch import load_file

    from specdec_core.eagle3 import Eagle3Head
    from tasks.steps.drafters.draft_engine import eagle3_head

    target = tiny_llama(seed=0)
    head = eagle3_head(target, [], None, [1, 3])
    assert head.vocab_size == VOCAB and head.layer_ids == [1, 3]
    saved = head.save(tmp_path / "full", k=2, verifier="tiny")
    assert "d2t" not in load_file(str(saved / "model.safetensors"))     # as vLLM wants it
    assert Eagle3Head.load(saved, target).vocab_size == VOCAB


def test_one_recipe_per_kind_built_from_flat_options_with_the_librarys_defaults():
    from specdec_core.train_config import TrainConfig
    from tasks.cli.app import build_parser
    from tasks.cli.draft import train_recipe
    from tasks.steps.drafters.draft_recipes import (DraftModelRecipe, DraftTrainingError, Eagle3Recipe,
                                                    HeadRecipe, TrainingData, recipe_for)

    # `specdec draft train` without flags trains what the library trains by default
    recipe, data = train_recipe(build_parser().parse_args(["draft", "train"]))
    assert recipe == DraftModelRecipe() and recipe.config == TrainConfig() and data == TrainingData()
    recipe, data = train_recipe(build_parser().parse_args(
        ["draft", "train", "--kind", "head", "--vocab-size", "64", "--layers", "3", "--steps", "50",
         "--domains", "json,qa"]))
    assert recipe == HeadRecipe(vocab_size=64, unroll=1, config=TrainConfig(steps=50, warmup_steps=5))
    assert data.domains == ("json", "qa") and data.heldout_fraction == 0.2
    assert data.validation_fraction == 0.1
    _, data = train_recipe(build_parser().parse_args(["draft", "train", "--validation-fraction", "0.25"]))
    assert data.validation_fraction == 0.25
    # each kind keeps its own options; another kind's are left out, layer_ids is eagle3's only
    assert recipe_for("eagle3", num_layers=4) == Eagle3Recipe(unroll=3)
    assert recipe_for("draft_model", vocab_size=64, unroll=None) == DraftModelRecipe()
    assert recipe_for("head").params() == {"vocab_size": None, "unroll": 1}
    assert DraftModelRecipe(num_layers=3).params() == {"num_layers": 3, "hidden_size": None}
    with pytest.raises(DraftTrainingError, match="unroll 0: train at least one draft step"):
        recipe_for("eagle3", unroll=0)
    with pytest.raises(DraftTrainingError, match=r"draft options \['layers'\]"):
        recipe_for("draft_model", layers=3)
