"""A run's candidates are frozen when it is sampled: a draft registered in the middle of the run
(real MLflow local store) changes neither what estimate scores nor what confirm decodes."""

from __future__ import annotations

from sqlalchemy import create_engine, select

from tasks.db.store import Store
from specdec_core.train import TrainConfig
from tasks.db.models import AcceptanceEstimate, EvalRun, LiveMeasurement
from tasks.settings import load_settings
from tasks.steps.context import RunContext, RunSpec, use_model
from tasks.steps.drafters.draft_recipes import DraftModelRecipe
from tasks.steps.drafters.draft_training import draft_candidates, train_draft_from_traffic
from tasks.steps.pipeline import step_check, step_confirm, step_estimate, step_profile, step_sample

from .helpers.evaluation import SETTINGS

CONFIG = TrainConfig(steps=4, eval_every=2, k_max=2, warmup_steps=1, lr=3e-3)


def test_a_draft_registered_after_sampling_does_not_change_the_candidates(tiny_store):
    db_url, target = tiny_store["db_url"], tiny_store["target"]
    train = dict(recipe=DraftModelRecipe(num_layers=1, config=CONFIG), target=target, store=Store.open(db_url),
                 model=tiny_store["model"], tokenizer=tiny_store["tokenizer"], progress=False)
    first = train_draft_from_traffic("draft-before", **train)
    use_model(target, tiny_store["model"], tiny_store["tokenizer"])
    overrides = {**SETTINGS, "plan_candidates": ["prompt_lookup"], "sample_min_per_domain": 1,
                 "sample_max_per_domain": 16, "plan_min_speedup": 0.01}
    spec = RunSpec(run_id="frozen", target=target, db_url=db_url, overrides=overrides)

    sampled = step_sample(spec)
    frozen = RunSpec.of(sampled["spec"])
    before = {"kind": "draft_model", "params": {"model": first["model_uri"]}}
    assert frozen.candidates == ["prompt_lookup"] and frozen.drafts == {first["fingerprint"]: [before]}
    checked = step_check(frozen)
    profile = step_profile(frozen)

    # a new draft is registered mid-run: it takes the alias `candidate`, so a fresh listing offers it
    second = train_draft_from_traffic("draft-after", **train)
    after = {"kind": "draft_model", "params": {"model": second["model_uri"]}}
    assert second["model_uri"] != first["model_uri"]
    assert draft_candidates(target, first["fingerprint"]) == [after]

    context = RunContext.build(frozen)
    assert context.candidates == ("prompt_lookup", before)
    assert set(context.drafters) == {"prompt_lookup", f"draft_model(model={first['model_uri']})"}
    # a spec without the frozen list (the CLI's engine check) reads the one stored at sample time
    unfrozen = RunSpec(run_id="frozen", target=target, db_url=db_url, overrides=overrides)
    assert RunContext.build(unfrozen).candidates == context.candidates
    # ... and the configured candidates it was sampled with, not today's settings (the CLI's
    # `engine check RUN_ID` of a run evaluated with --candidate)
    bare = RunSpec(run_id="frozen", target=target, db_url=db_url,
                   overrides={k: v for k, v in overrides.items() if k != "plan_candidates"})
    assert "prompt_lookup" not in load_settings(**bare.overrides).plan.candidates
    assert RunContext.build(bare).candidates == context.candidates

    domain = checked["ok"][0]
    plan = step_estimate(frozen, domain, profile)
    step_confirm(frozen, domain)
    engine = create_engine(db_url)
    with engine.connect() as connection:
        scored = set(connection.execute(select(AcceptanceEstimate.drafter).where(
            AcceptanceEstimate.run_id == "frozen")).scalars())
        confirmed = connection.execute(select(LiveMeasurement.drafter).where(
            LiveMeasurement.run_id == "frozen")).scalar()
        params = connection.execute(select(EvalRun.params).where(EvalRun.run_id == "frozen")).scalar()
    engine.dispose()
    assert scored == set(context.drafters)
    assert confirmed == plan["drafter"] and confirmed in context.drafters
    assert params["drafts"] == {first["fingerprint"]: [before]}
