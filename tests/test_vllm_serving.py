"""The export and the n-gram estimate against the real vLLM, in the serving environment
(`make serving-env`; vLLM's CPU build in its own virtual environment, driven as a process).

Skipped when there is no serving environment, unless SPECDEC_REQUIRE_SERVING=1 (.ci/run sets it):
then its absence is a failure."""

from __future__ import annotations

import os

import numpy as np
import pytest

from specdec_core.drafters import find_continuation
from specdec_core.lookup import lookup_batch
from tasks import serving_env
from tasks.config_schema import parse_config
from tasks.vllm import vllm_export

from .conftest import save_tiny_target, tiny_llama

REQUIRED = os.environ.get("SPECDEC_REQUIRE_SERVING") == "1"
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not REQUIRED and not serving_env.available(),
                                 reason="no serving environment (make serving-env); .ci/run builds "
                                        "one and sets SPECDEC_REQUIRE_SERVING=1")]


@pytest.fixture(scope="module")
def serving():
    # required (CI): a missing environment fails here with how to make one
    return serving_env.probe("versions", {}, timeout_s=300)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # vLLM needs a head size it has kernels for: 4 heads of 32
    return save_tiny_target(tiny_llama(vocab=256, hidden=128, heads=4, layers=2),
                            tmp_path_factory.mktemp("tiny-target"))


def domain(kind, params, k, schedule=None, model_uri=None):
    return {"enabled": True, "drafter": {"kind": kind, "params": params, "model_uri": model_uri},
            "k": k, "max_batch_size": (max(last for _, last, kk in schedule if kk) if schedule else None),
            "k_schedule": schedule or [], "conditional_acceptance": [0.5] * k,
            "mean_accepted_length": 1.5, "predicted_speedup": 1.3, "samples": 30}


def test_every_exported_config_is_accepted_by_vllm(serving, tiny_dir):
    schedule = [[1, 1, 4], [2, 4, 2], [5, 8, 0]]
    config = parse_config({
        "schema_version": 2, "target": {"id": "tiny", "fingerprint": "sha256:0"},
        "hardware_profile": "cpu", "run_id": "r", "created_at": "2026-11-24T00:00:00",
        "domains": {
            "ngram": domain("prompt_lookup", {"max_ngram": 3, "min_ngram": 2}, 4),
            "ngram_schedule": domain("prompt_lookup", {"max_ngram": 4, "min_ngram": 1}, 4, schedule),
            "suffix": domain("suffix", {"max_depth": 24, "min_token_prob": 0.1}, 3),
            "suffix_schedule": domain("suffix", {"max_depth": 16}, 4, schedule),
            "draft": domain("draft_model", {"model": str(tiny_dir)}, 3),
            "draft_schedule": domain("draft_model", {"model": str(tiny_dir)}, 4, schedule)},
        "default": {"enabled": False}})
    exported = vllm_export(config, target_path=str(tiny_dir))
    assert exported["unsupported"] == {}
    configs = {name: spec for name, spec in exported["speculative_config"].items()}
    verdicts = serving_env.probe("check-configs", {"model": str(tiny_dir), "configs": configs},
                                 timeout_s=600)
    refused = {name: v["error"] for name, v in verdicts.items() if not v["ok"]}
    assert refused == {}, f"vLLM {serving['vllm']} refused: {refused}"
    # the old export's object of "lo-hi" keys is what vLLM refuses: the check can fail
    bad = dict(configs["ngram_schedule"], num_speculative_tokens_per_batch_size={"1-1": 4, "2-8": 2})
    verdict = serving_env.probe("check-configs", {"model": str(tiny_dir), "configs": {"bad": bad}},
                                timeout_s=600)["bad"]
    assert verdict["ok"] is False and verdict["error"]


def test_ngram_proposals_equal_vllms(serving):
    rng = np.random.default_rng(0)
    sequences = []
    for vocab in (3, 5, 20):              # small vocabularies: many (and repeated) matches
        sequences += [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(1, 60, 60)]
    # real traffic: token ids of the shipped json and code responses
    from tasks.traffic import sample_traffic_path
    import gzip
    import json

    with gzip.open(sample_traffic_path(), "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for _, line in zip(range(40), handle)]
    for row in rows:
        ids = list(row.get("prompt_token_ids") or []) + list(row.get("response_token_ids") or [])
        if ids:
            sequences += [ids[:cut] for cut in range(max(len(ids) - 60, 2), len(ids), 7)]
    assert len(sequences) > 300
    for min_n, max_n, k in ((1, 3, 4), (2, 3, 8), (2, 5, 3), (1, 1, 2)):
        answer = serving_env.probe("ngram", {"min_n": min_n, "max_n": max_n, "k": k,
                                             "sequences": sequences}, timeout_s=300)["proposals"]
        ours = [find_continuation(np.asarray(s), max_n, k, min_n).tolist() for s in sequences]
        mismatched = [(s, a, b) for s, a, b in zip(sequences, answer, ours) if a != b]
        assert not mismatched, f"{len(mismatched)} of {len(sequences)} differ, e.g. {mismatched[0]}"
        # and the batched kernel the decode loop uses proposes the same
        for start in range(0, len(sequences), 50):
            chunk = sequences[start:start + 50]
            width = max(len(s) for s in chunk)
            prompts = np.zeros((len(chunk), width), dtype=np.int64)
            for row, s in enumerate(chunk):
                prompts[row, width - len(s):] = s
            tokens, counts = lookup_batch(prompts, np.array([len(s) for s in chunk]),
                                          np.zeros((len(chunk), 1), dtype=np.int64),
                                          np.zeros(len(chunk), dtype=np.int64),
                                          np.full(len(chunk), k), k, max_n, min_n)
            for row in range(len(chunk)):
                assert tokens[row, :counts[row]].tolist() == answer[start + row]
