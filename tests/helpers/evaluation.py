"""`evaluate` on a tiny target with small settings (tiny-model timings are noise: the profile
checks, the live veto and the engine check are off)."""

from __future__ import annotations

SETTINGS = dict(sample_min_per_domain=5, sample_max_per_domain=10, plan_k_max=3, profile_batch_sizes=(1, 2),
                profile_repeats=1, profile_context_len=32, live_requests=2,
                profile_checks=False, live_veto=False,     # tiny-model timings are noise
                engine_check=False,            # vLLM: test_vllm_serving.py and test_embedded.py
                live_max_new_tokens=12, validation_rows=100, validation_greedy_check_requests=2,
                validation_greedy_check_tokens=8, plan_bootstrap_samples=200,
                plan_candidates=("prompt_lookup:max_ngram=3:min_ngram=1", "layer_skip:num_layers=2"))


def run(db_url, target, run_id, **overrides):
    """Every step of `evaluate` for run_id on the already loaded tiny `target`."""
    from tasks.db.store import Store
    from tasks.steps.evaluate import evaluate
    from tasks.settings import load_settings

    settings = load_settings({}, **{**SETTINGS, **overrides})
    return evaluate(run_id=run_id, target="tiny", store=Store.open(db_url), settings=settings, model=target,
                    progress=False)
