"""benchmarks/eagle3_gpu.py in --smoke mode (a tiny random Llama on the CPU, ~40 new prompts, tiny
budgets): every phase runs, a head per size is saved in the speculators format and reads back,
curve.json and curve.md hold what they claim, and no held-out prompt is trained on. No timing
thresholds: the figures of a random model mean nothing."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from safetensors.torch import load_file

from specdec_core.eagle3 import Eagle3Head
from specdec_core.estimate import in_heldout

from .helpers import REPO
from .helpers.scripts import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/eagle3_gpu.py", "eagle3_gpu")


@pytest.fixture(scope="module")
def run(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle3_gpu")
    # a budget that the 6 steps fit on any machine: the cut to what fits is tested on its own
    returned = script.main(["--smoke", "--out", str(out), "--steps", "6", "--train-seconds", "300"])
    return {"out": out, "returned": returned, "curve": json.loads((out / "curve.json").read_text()),
            "markdown": (out / "curve.md").read_text()}


def test_every_phase_ran_and_new_requests_were_generated(run):
    curve = run["curve"]
    assert curve["errors"] == []
    for name in ("load", "prompts", "generate", "train_16", "score_16", "train_all", "score_all"):
        assert f"{name}_s" in curve["phases"]
    counts = curve["counts"]
    assert counts["generated"] > 0 and counts["shipped_train"] > 0
    assert counts["training_pool"] == counts["generated"] + counts["shipped_train"]
    assert counts["new_prompts_equal_to_heldout"] == 0


def test_one_head_per_size_saved_and_readable(script, run):
    curve = run["curve"]
    assert [h["size"] for h in curve["heads"]] == ["16", "all"]
    assert curve["sizes"] == [16, curve["counts"]["training_pool"]]
    target, _ = script.smoke_target(51)
    for entry in curve["heads"]:
        head = Eagle3Head.load(run["out"] / entry["dir"], target)
        assert head.vocab_size == entry["draft_vocab"]
        config = json.loads((run["out"] / entry["dir"] / "config.json").read_text())
        assert config["speculators_model_type"] == "eagle3"
        weights = load_file(str(run["out"] / entry["dir"] / "model.safetensors"))
        assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}
        assert 0 < entry["rows_passed"] <= entry["requests"]
        # --steps: every size trains the same steps, scored on the curve before and at the end
        assert entry["steps"] == entry["steps_done"] == entry["steps_asked"] == 6
        assert [point["step"] for point in entry["history"]] == [0, 6]
        # a step timed at the training batch and at twice it
        assert list(entry["step_s_by_batch"]) == ["8", "16"]
        assert all(seconds > 0 for seconds in entry["step_s_by_batch"].values())
        # --train-graphs auto: the eager and the captured step (the CPU stand-in here) both timed,
        # the faster trained
        assert set(entry["step_s_by_mode"]) == {"eager", "graphs"} and "graph_error" not in entry
        assert entry["train_graphs"] == min(entry["step_s_by_mode"], key=entry["step_s_by_mode"].get)


def test_heldout_acceptance_per_domain_in_range(run):
    domains = {"json", "code", "summarize", "qa", "chat", "creative"}
    for entry in run["curve"]["heads"]:
        assert set(entry["heldout"]) == domains
        for scored in entry["heldout"].values():
            assert 0.0 <= scored["acceptance_k1"] <= 1.0
            lengths = [scored["length_by_k"][str(k)] for k in range(1, 6)]
            assert all(1.0 <= value <= k + 1 for k, value in enumerate(lengths, start=1))


def test_markdown_table_and_goal_lines_say_what_the_json_says(run):
    text, curve = run["markdown"], run["curve"]
    assert "SMOKE RUN" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(row.split("|")[1]) for row in rows] == curve["sizes"]
    last = curve["heads"][-1]["heldout"]
    for domain, scored in last.items():
        goal = 0.6 if domain in ("json", "code") else 0.45
        met = "met" if scored["acceptance_k1"] >= goal else "not met"
        assert f"- {domain}: {scored['acceptance_k1']:.3f} vs {goal}: {met}" in text
    by_mode = curve["heads"][-1]["step_s_by_mode"]
    assert (f"The step at batch 8, largest head: eager {1e3 * by_mode['eager']:.1f} ms, graphs "
            f"{1e3 * by_mode['graphs']:.1f} ms (eager / graphs {by_mode['eager'] / by_mode['graphs']:.2f}x); "
            f"trained {curve['heads'][-1]['train_graphs']}") in text


def test_no_heldout_prompt_is_trained_on(run):
    with gzip.open(REPO / "tasks/data/sample_traffic.jsonl.gz", "rt") as handle:
        shipped = [json.loads(line) for line in handle]
    heldout_ids = {row["id"] for row in shipped if in_heldout("eagle3-bench", row["id"], 0.2)}
    heldout_prompts = {tuple(row["prompt_token_ids"]) for row in shipped if row["id"] in heldout_ids}
    train = run["returned"]["train_requests"]
    assert len(train) == run["curve"]["counts"]["training_pool"]
    assert not heldout_ids & {r.request_id for r in train}
    assert not heldout_prompts & {tuple(r.prompt_ids) for r in train}
    scored = run["returned"]["heldout_requests"]
    assert scored and {r.request_id for r in scored} <= heldout_ids


def test_head_step_benchmark_counts_fewer_operations_gathered_and_says_so(tmp_path):
    # benchmarks/head_step.py (the device script's head_step): both contenders ran the same
    # batches; the gathered batch's step has fewer operations (a row at a time: ~30 per row)
    bench = load_script("benchmarks/head_step.py", "head_step")
    result = bench.main(["--smoke", "--repeats", "1", "--out", str(tmp_path / "step.md"),
                         "--json", str(tmp_path / "step.json")])
    assert json.loads((tmp_path / "step.json").read_text()) == result
    ops = result["operations"]
    assert ops["rowwise"] > ops["packed"] + 2 * result["batch"], ops
    assert all(ms > 0 for ms in result["step_ms"].values())
    text = (tmp_path / "step.md").read_text()
    assert f"| gathered from the packed rows | {ops['packed']} |" in text
    assert f"a row at a time / gathered: {result['rowwise_over_packed']}x" in text
    # the captured step ran too (the CPU stand-in here), without a capture error
    assert result["graph_error"] is None and f"gathered / captured: {result['packed_over_graphs']}x" in text
    assert f"| gathered, forward and backward captured | {ops['graphs']} |" in text


@pytest.mark.parametrize("asked, left, expected", [
    (None, 10.0, int((10.0 - 3.2 * 0.5) / 0.1)),      # as many as fit after three curve points
    (3000, 400.0, 3000),                             # --steps where they fit
    (3000, 100.0, int((100.0 - 2.2 * 0.5) / 0.1)),    # cut to the budget where they do not
    (3000, 0.5, 4), (None, -5.0, 4),                 # at least 4
])
def test_planned_steps_keep_steps_asked_only_where_they_fit_the_budget(script, asked, left, expected):
    assert script.planned_steps(asked, left, step_s=0.1, eval_s=0.5) == expected


def test_markdown_says_when_the_steps_asked_were_cut(script, run):
    curve = json.loads(json.dumps(run["curve"]))
    curve["heads"][-1].update(steps_asked=3000, steps_done=2410)
    text = script.markdown(curve)
    assert f"| {curve['heads'][-1]['requests']} | {curve['heads'][-1]['rows_passed']} | 2410 of 3000 asked |" in text
    assert "A training step (loss + backward, optimizer step estimated) by batch" in text
