"""benchmarks/gpu_decode.py in --smoke mode (tiny fp32 models on the CPU): the report's sections and
Must-show table, the raw numbers in its JSON, and greedy exactness of every speculative run. No
timing thresholds: on a loaded CPU the timings mean nothing."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specdec_core.planner import expected_tokens_per_round

from .helpers.scripts import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/gpu_decode.py", "gpu_decode")


# the engine's general path (CPU default) and its static-cache fast path (the GPU's, without graphs)
@pytest.fixture(scope="module", params=["auto", "on"], ids=["general_path", "static_path"])
def smoke(script, tmp_path_factory, request):
    out = tmp_path_factory.mktemp("gpu_decode")
    returned = script.main(["--smoke", "--static-cache", request.param, "--out", str(out / "x.md"),
                            "--json", str(out / "x.json")])
    return {"markdown": (out / "x.md").read_text(), "raw": json.loads((out / "x.json").read_text()),
            "returned": returned}


def test_every_item_ran(smoke):
    for item in ("item1", "item2", "item3", "item4", "item5"):
        assert "error" not in smoke["raw"][item], smoke["raw"][item]


def test_markdown_has_the_header_five_sections_and_the_must_show_table(smoke):
    text = smoke["markdown"]
    assert "Failed" not in text and "Not measured" not in text
    header = text.split("## 1.")[0]
    for needed in ("cpu (", "float32", f"torch {torch.__version__}", "transformers 5.", "UTC"):
        assert needed in header
    for number in range(1, 6):
        assert f"\n## {number}. " in text
    must = text.split("## Must show")[1].strip().splitlines()
    assert must[0].startswith("| claim | status | figure |")
    rows = must[2:]
    assert len(rows) == 3
    # each row states what the raw figures say: its claim, met or not met, and the figure
    for row, claim in zip(rows, smoke["raw"]["must_show"]):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells == [claim["claim"], "met" if claim["met"] else "not met", claim["figure"]]
    assert "bandwidth limit" in rows[0] and "planner" in rows[1] and "assisted generation" in rows[2]


def test_json_holds_plain_throughput_bandwidth_limit_and_verify_ratios(script, smoke):
    raw = smoke["raw"]
    assert raw == json.loads(json.dumps(smoke["returned"]))      # main returns what it dumps
    plain = raw["item1"]
    assert plain["ours"]["decode_tokens_per_s"] > 0 and plain["hf"]["decode_tokens_per_s"] > 0
    assert plain["copy_bandwidth_bytes_per_s"] > 0
    assert plain["limit_tokens_per_s"] == pytest.approx(
        plain["copy_bandwidth_bytes_per_s"] / plain["weight_bytes"])
    # the smoke target: tied embeddings counted once, fp32
    shape = script.TARGET_SMOKE
    assert raw["meta"]["target_params"] * 4 == plain["weight_bytes"]
    assert plain["weight_bytes"] < (raw["meta"]["target_params"] + shape["vocab_size"]
                                    * shape["hidden_size"]) * 4
    assert plain["ours"]["pct_of_limit"] == pytest.approx(
        100 * plain["ours"]["decode_tokens_per_s"] / plain["limit_tokens_per_s"])
    costs = raw["item2"]
    assert set(costs["verify_ratio"]) == {"1", "2"}
    assert all(ratio > 0 for ratio in costs["verify_ratio"].values())
    assert set(costs["forward_s"]) == {"1", "2", "3"} and costs["step_s"] > 0


def test_grid_of_two_alphas_by_two_ks_with_acceptance_close_to_alpha(smoke):
    item = smoke["raw"]["item3"]
    grid = item["grid"]
    assert {(row["alpha"], row["k"]) for row in grid} == {(0.5, 1), (0.5, 2), (0.85, 1), (0.85, 2)}
    for row in grid:
        alpha, n = row["alpha"], row["reached"]
        assert n > 0
        # generous binomial bound: 4 standard deviations plus one count
        assert abs(row["measured_alpha"] - alpha) <= 4 * math.sqrt(alpha * (1 - alpha) / n) + 1 / n
        # the prediction at the measured tokens per round uses the same measured costs
        cost_k = item["c_round"][str(row["k"])] + smoke["raw"]["item2"]["verify_ratio"][str(row["k"])]
        assert row["predicted_at_measured_tokens_per_round"] == pytest.approx(
            row["tokens_per_round"] / cost_k)
        # the prediction is the planner's formula on the measured costs
        k = str(row["k"])
        cost = item["c_round"][k] + smoke["raw"]["item2"]["verify_ratio"][k]
        assert row["predicted"] == pytest.approx(expected_tokens_per_round(alpha, row["k"]) / cost)
        assert row["ratio"] == pytest.approx(row["speedup"] / row["predicted"])
        assert row["within"] == (abs(row["ratio"] - 1) <= 0.15)
    reference = item["seed_reference"]
    assert reference["planner_speedup"] == pytest.approx(2.8, abs=0.05)     # the seeds' 2.8x
    assert item["best_k"] in (1, 2)


def test_every_speculative_run_reproduces_plain_greedy_tokens(smoke):
    raw = smoke["raw"]
    assert raw["item1"]["greedy_margin"]["argmax_is_continuation"]
    assert raw["item1"]["greedy_margin"]["relative_min"] > 0.1       # far from any near-tie
    assert raw["item1"]["hf"]["mismatched_rows_vs_ours"] == 0
    assert all(row["mismatched_rows"] == 0 for row in raw["item3"]["grid"])
    for row in raw["item4"]["rows"]:
        assert row["ours_mismatched_rows"] == 0 and row["hf_mismatched_rows"] == 0
    assert {row["batch"] for row in raw["item5"]["rows"]} == {1, 2}
    assert all(row["mismatched_rows"] == 0 for row in raw["item5"]["rows"])


def test_assisted_generation_extremes_and_must_show_follow_the_figures(smoke):
    raw = smoke["raw"]
    same, unrelated = raw["item4"]["rows"]
    assert same["measured_alpha"] == 1.0 and same["acceptance_rate"] == 1.0
    assert unrelated["acceptance_rate"] < 0.2
    # transformers' own rounds, counted: the same pair accepts the same way
    assert same["hf_acceptance_rate"] == 1.0 and unrelated["hf_acceptance_rate"] < 0.2
    assert same["hf_rounds"]["rounds"] < unrelated["hf_rounds"]["rounds"]
    assert all(row["ours_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 for row in (same, unrelated))
    plain, grid, assisted = raw["must_show"]
    assert plain["met"] == (raw["item1"]["ours"]["pct_of_limit"] >= 60)
    assert grid["met"] == all(row["within"] for row in raw["item3"]["grid"])
    assert f"/{len(raw['item3']['grid'])} within" in grid["figure"]
    assert assisted["met"] == (same["ratio"] > 1 and unrelated["ratio"] > 1)


def test_sharpened_target_walks_its_orbit_with_clear_margins(script):
    # token (b, s) -> (b, s + 1 mod d_kv): a non-constant greedy continuation, far from ties
    model = script.build_model(script.TARGET_SMOKE, torch.device("cpu"), torch.float32, seed=3)
    usable = script.sharpen_greedy(model, seed=3)
    shape = script.TARGET_SMOKE
    d_kv = shape["num_key_value_heads"] * shape["head_dim"]
    assert usable == shape["vocab_size"] // d_kv * d_kv
    prompts = torch.tensor([[5, 77, 300, 41], [9, 2, 130, 201]])
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=12, do_sample=False, pad_token_id=0,
                             eos_token_id=None)[:, prompts.shape[1]:]
    expected = []
    for token in prompts[:, -1].tolist():
        row = []
        for _ in range(12):
            token = token // d_kv * d_kv + (token % d_kv + 1) % d_kv
            row.append(token)
        expected.append(row)
    assert out.tolist() == expected
    margins = script.greedy_margins(model, prompts, out)
    assert margins["argmax_is_continuation"] and margins["relative_min"] > 0.1
