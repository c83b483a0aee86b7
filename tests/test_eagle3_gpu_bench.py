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


def would_generate(script, count: int) -> list[dict]:
    """The first prompts the smoke run would generate to train on (its seed, 51)."""
    train, _ = script.split_shipped(script.shipped_rows(), smoke=True)
    return script.new_requests(64 - len(train), script.shipped_rows(),
                               script.ByteTokenizer().encode_chats, 51, 8)[:count]


@pytest.fixture(scope="module")
def extra_heldout(script, tmp_path_factory):
    """An extra held-out file (benchmarks/eagle3_heldout.py's format) holding six prompts that the
    smoke run would otherwise generate and train on."""
    path = tmp_path_factory.mktemp("extra") / "heldout.jsonl.gz"
    rows = [{**{f: r[f] for f in script.HELDOUT_FIELDS if f in r}, "response_token_ids": [5, 6, 7]}
            for r in would_generate(script, 6)]
    with gzip.open(path, "wt") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    return {"path": path, "rows": rows}


@pytest.fixture(scope="module")
def run(script, extra_heldout, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle3_gpu")
    # a budget that the 6 steps fit on any machine: the cut to what fits is tested on its own
    returned = script.main(["--smoke", "--out", str(out), "--steps", "6", "--train-seconds", "300",
                            "--train-batch", "auto", "--extra-heldout", str(extra_heldout["path"])])
    return {"out": out, "returned": returned, "curve": json.loads((out / "curve.json").read_text()),
            "markdown": (out / "curve.md").read_text()}


def test_every_phase_ran_and_new_requests_were_generated(run):
    curve = run["curve"]
    assert curve["errors"] == []
    for name in ("load", "prompts", "generate", "train_16", "score_16", "train_all", "score_all"):
        assert f"{name}_s" in curve["phases"]
    counts = curve["counts"]
    assert counts["generated"] > 0 and counts["shipped_train"] > 0
    assert counts["training_pool"] + counts["validation"] == counts["generated"] + counts["shipped_train"]
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
        # --train-batch auto: a step timed at 8, twice and four times it where the rows allow,
        # the batch that pays trained
        timed = {int(b): s for b, s in entry["step_s_by_batch"].items()}
        assert list(timed) == [b for b in (8, 16, 32) if b <= entry["rows_passed"]] and len(timed) >= 2
        assert all(seconds > 0 for seconds in timed.values())
        assert entry["train_batch"] == script.choose_batch(timed)
        assert entry["epochs"] == round(6 * entry["train_batch"] / entry["rows_passed"], 2)
        # the learning rate follows the batch trained (square-root rule, --lr-scaling sqrt)
        assert entry["lr"] == pytest.approx(1e-3 * (entry["train_batch"] / 8) ** 0.5)
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
        # the smoke run scores one held-out request a domain: no interval to speak of
        assert scored["requests"] == 1
        assert f"- {domain}: {scored['acceptance_k1']:.3f} vs {goal}: {met} (1 request: no interval)" in text
    for row, entry in zip(rows, curve["heads"]):
        cells = [cell.strip() for cell in row.split("|")[5:-1]]
        assert cells == [f"{s['acceptance_k1']:.3f} ({s['acceptance_k1_ci95'][0]:.2f}-"
                         f"{s['acceptance_k1_ci95'][1]:.2f})" for _, s in sorted(entry["heldout"].items())]
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


def test_no_extra_heldout_prompt_is_generated_or_trained_on(script, run, extra_heldout):
    """The larger held-out set scored after the run (benchmarks/eagle3_heldout.py) is left out of
    the prompts generated for training -- here six prompts the run would otherwise have made."""
    counts = run["curve"]["counts"]
    assert counts["extra_heldout"] == 6 and counts["new_prompts_equal_to_extra_heldout"] == 0
    assert (f"A further 6 held-out requests ({extra_heldout['path']}, benchmarks/eagle3_heldout.py) "
            "were left out of the generated prompts (0 equal to one)") in run["markdown"]
    extra = {json.dumps(r["messages"]) for r in extra_heldout["rows"]}
    assert extra <= {json.dumps(r["messages"]) for r in would_generate(script, 12)}   # they would be
    trained = {r.request_id for r in run["returned"]["train_requests"] + run["returned"]["validation_requests"]}
    assert not trained & {r["id"] for r in extra_heldout["rows"]}
    prompts = {tuple(r.prompt_ids) for r in run["returned"]["train_requests"]}
    assert not prompts & {tuple(r["prompt_token_ids"]) for r in extra_heldout["rows"]}


def test_an_extra_heldout_file_that_is_missing_or_short_of_a_field_names_the_fix(script, tmp_path):
    with pytest.raises(FileNotFoundError, match="benchmarks/eagle3_heldout.py --out"):
        script.extra_heldout_rows(tmp_path / "absent.jsonl.gz")
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as handle:
        handle.write(json.dumps({"id": "x", "domain": "json"}) + "\n")
    with pytest.raises(ValueError, match="row 1: no messages, temperature.*eagle3_heldout.py"):
        script.extra_heldout_rows(bad)
    assert script.extra_heldout_rows("none") == []


def test_the_vllm_check_serves_shipped_heldout_rows_first_then_the_extra_files(extra_heldout):
    """benchmarks/eagle3_vllm.py: per domain the shipped rows of eagle3_train.py's held-out split
    (never trained on), then the extra file's rows of that domain; an unknown domain is refused."""
    vllm_check = load_script("benchmarks/eagle3_vllm.py", "eagle3_vllm")
    extra_rows = extra_heldout["rows"]
    domains = sorted({r["domain"] for r in extra_rows})
    by_domain, extra_ids = vllm_check.heldout_by_domain(domains, extra_heldout["path"])
    assert extra_ids == {r["id"] for r in extra_rows}
    shipped = [r for r in vllm_check.shipped_requests() if in_heldout("eagle3-bench", r.request_id, 0.2)]
    for domain in domains:
        ids = [r.request_id for r in by_domain[domain]]
        own = [r.request_id for r in shipped if r.domain == domain]
        assert ids == own + [r["id"] for r in extra_rows if r["domain"] == domain]
        assert own and len(ids) > len(own)
        assert {r.domain for r in by_domain[domain]} == {domain}
    alone, none = vllm_check.heldout_by_domain(domains[:1], "none")
    assert none == set() and all(r.request_id not in extra_ids for r in alone[domains[0]])
    with pytest.raises(SystemExit, match="--domains jsn: no held-out request; the domains are chat, code"):
        vllm_check.heldout_by_domain(["jsn"], "none")


def test_scores_of_several_heldout_sets_come_from_one_pass_and_match_each_set_alone(script, run):
    """score_sets: each set's figures, and all of them together, equal what the estimate gives on
    those rows alone."""
    from specdec_core.estimate import estimate_acceptance
    from specdec_core.head import HeadDrafter

    target, _ = script.smoke_target(51)
    head = Eagle3Head.load(run["out"] / run["curve"]["heads"][-1]["dir"], target)
    first = run["returned"]["heldout_requests"]
    second = run["returned"]["validation_requests"]
    scored = script.score_sets(target, head, {"a": first, "b": second, "empty": []})
    assert set(scored) == {"a", "b", "empty", "all"} and scored["empty"] == {}
    for name, rows in (("a", first), ("b", second), ("all", first + second)):
        alone = estimate_acceptance(target, HeadDrafter(head), rows, [1, 2, 3, 4, 5], progress=False)
        assert set(scored[name]) == set(alone)
        for domain, by_k in alone.items():
            got = scored[name][domain]
            assert got["requests"] == by_k[1].requests
            assert got["acceptance_k1"] == pytest.approx(by_k[1].conditional_acceptance[0])
            assert got["length_by_k"] == {str(k): pytest.approx(e.expected_tokens_per_round, abs=1e-4)
                                          for k, e in by_k.items()}
    # two requests a domain in "all": an interval over them
    assert all(s["requests"] == 2 for s in scored["all"].values())
    assert script.score(target, head, first) == scored["a"]


def test_the_extra_heldout_script_makes_new_prompts_a_domain_each_with_the_targets_answer(tmp_path):
    """benchmarks/eagle3_heldout.py --smoke: balanced rows in the shipped file's format, none a
    shipped prompt, read back by eagle3_gpu.extra_heldout_rows, a sidecar that says how."""
    make = load_script("benchmarks/eagle3_heldout.py", "eagle3_heldout")
    path = tmp_path / "heldout.jsonl.gz"
    rows = make.main(["--smoke", "--out", str(path), "--per-domain", "3"])
    gpu = make.gpu
    read = gpu.extra_heldout_rows(path)
    assert read == rows
    domains = sorted({"json", "code", "summarize", "qa", "chat", "creative"})
    assert sorted(r["domain"] for r in rows) == sorted(domains * 3)
    shipped = gpu.shipped_rows()
    assert not {json.dumps(r["messages"]) for r in rows} & {json.dumps(r["messages"]) for r in shipped}
    assert len({r["id"] for r in rows}) == len(rows) and all(r["id"].startswith("heldout5100-") for r in rows)
    target, tokenizer = gpu.smoke_target(5100)
    for row in rows:
        assert row["prompt_token_ids"] == tokenizer.encode_chats([row["messages"]])[0]
        assert 2 <= len(row["response_token_ids"]) <= row["max_tokens"] <= 8
        greedy = row["temperature"] == 0
        if greedy:     # the target's own greedy answer
            ids = torch.tensor([row["prompt_token_ids"]])
            with torch.no_grad():
                out = target.generate(ids, max_new_tokens=len(row["response_token_ids"]), do_sample=False,
                                      attention_mask=torch.ones_like(ids), pad_token_id=0)
            assert out[0, ids.shape[1]:].tolist() == row["response_token_ids"]
    meta = json.loads((tmp_path / "heldout.meta.json").read_text())
    assert meta["rows_by_domain"] == {d: 3 for d in domains} and meta["seed"] == 5100
    assert "--smoke" in meta["command"]


def test_the_cpu_benchmark_tables_each_heldout_set_with_its_interval_and_the_goal(script, run):
    """benchmarks/eagle3_train.py's held-out table: a column per set and one for all of them, the
    goal line on all of them, the acceptance lengths."""
    bench = load_script("benchmarks/eagle3_train.py", "eagle3_train")
    target, _ = script.smoke_target(51)
    head = Eagle3Head.load(run["out"] / run["curve"]["heads"][-1]["dir"], target)
    sets = {"shipped held-out": run["returned"]["heldout_requests"],
            "extra held-out": run["returned"]["validation_requests"]}
    text = bench.heldout_table(target, head, sets)
    scored = script.score_sets(target, head, sets)
    assert "| domain | shipped held-out (requests) | extra held-out (requests) | all (requests) | goal, on all |" in text
    for domain, whole in scored["all"].items():
        cells = [f"{script.with_interval(scored[name][domain])} ({scored[name][domain]['requests']})"
                 for name in ("shipped held-out", "extra held-out", "all")]
        assert f"| {domain} | " + " | ".join(cells) + f" | {script.verdict(domain, whole)} | " in text


def test_the_head_kept_is_chosen_on_rows_neither_trained_on_nor_reported(run):
    """The training curve (which picks the head kept) is scored on validation rows taken from the
    training pool, one domain in turn, and trained on by no head; the held-out rows are only
    reported. Choosing on the rows reported would report the best of several looks."""
    returned = run["returned"]
    validation = returned["validation_requests"]
    assert len(validation) == run["curve"]["counts"]["validation"] == 6
    assert sorted(r.domain for r in validation) == sorted(
        {"json", "code", "summarize", "qa", "chat", "creative"})
    ids = {r.request_id for r in validation}
    assert not ids & {r.request_id for r in returned["train_requests"]}
    assert not ids & {r.request_id for r in returned["heldout_requests"]}
    for entry in run["curve"]["heads"]:
        assert set(entry["curve_requests"]) == ids     # what the trainee scored its curve on


def test_a_heldout_interval_holds_the_acceptance_and_narrows_with_requests(script):
    """score()'s interval: a bootstrap over requests of accepted / reached at the first draft."""
    from specdec_core.estimate import bootstrap_ratio

    accepted, reached = [3.0, 1.0, 4.0, 0.0, 2.0], [5.0, 4.0, 6.0, 3.0, 5.0]
    low, high = bootstrap_ratio(accepted, reached)
    assert low <= sum(accepted) / sum(reached) <= high and low < high
    wide = high - low
    low, high = bootstrap_ratio(accepted * 8, reached * 8)
    assert high - low < wide
    entry = {"acceptance_k1": 0.431, "acceptance_k1_ci95": [0.38, 0.49], "requests": 20}
    assert script.verdict("chat", entry) == ("0.431 vs 0.45: not met (95% interval 0.380-0.490 "
                                             "over 20 requests: spans the goal, not settled)")
    assert script.verdict("json", {**entry, "acceptance_k1": 0.777, "acceptance_k1_ci95": [0.71, 0.83]}
                          ).endswith("met (95% interval 0.710-0.830 over 20 requests: settled)")
    assert script.with_interval(entry) == "0.431 (0.38-0.49)"
    assert script.verdict("qa", {**entry, "requests": 1}) == "0.431 vs 0.45: not met (1 request: no interval)"


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
    # as many as fit after the start and end points, with a tenth of their time for those between
    (None, 10.0, int((10.0 - 2.2 * 0.5) / 0.11)),
    (3000, 400.0, 3000),                             # --steps where they fit
    (3000, 100.0, int((100.0 - 2.2 * 0.5) / 0.11)),   # cut to the budget where they do not
    (3000, 0.5, 4), (None, -5.0, 4),                 # at least 4
])
def test_planned_steps_keep_steps_asked_only_where_they_fit_the_budget(script, asked, left, expected):
    assert script.planned_steps(asked, left, step_s=0.1, eval_s=0.5) == expected


@pytest.mark.parametrize("steps, step_s, points", [
    (800, 0.045, [800]),                             # the second lease's heads: the end only
    (3000, 0.045, [750, 1500, 2250, 3000]),          # 13.5 s allowed: 3 points of 4.5 s between
    (20000, 0.007, [5000, 10000, 15000, 20000]),     # 14 s: 3 between
    (100000, 0.01, [20000, 40000, 60000, 80000, 100000]),   # at most 4 between
])
def test_curve_points_in_between_take_at_most_a_tenth_of_the_steps_time(script, steps, step_s, points):
    every = script.curve_every(steps, step_s, eval_s=4.5)
    scored = [s for s in range(1, steps + 1) if s % every == 0 or s == steps]   # optimise's rule
    assert scored == points
    assert (len(scored) - 1) * 4.5 <= 0.1 * steps * step_s                     # those between


@pytest.mark.parametrize("timed, chosen", [
    ({48: 0.040, 96: 0.042, 192: 0.050}, 192),       # launch-bound: each doubling nearly free
    ({48: 0.040, 96: 0.042, 192: 0.080}, 96),        # the second doubling costs as much as it buys
    ({48: 0.040, 96: 0.060, 192: 0.061}, 48),        # 1.33x the rows per second: not enough
    ({48: 0.040, 96: 0.0533}, 96),                   # 1.5x exactly
    ({8: 0.5}, 8),
])
def test_train_batch_auto_takes_a_doubled_batch_only_where_it_buys_rows_per_second(script, timed, chosen):
    assert script.choose_batch(timed) == chosen


def test_markdown_says_when_the_steps_asked_were_cut(script, run):
    curve = json.loads(json.dumps(run["curve"]))
    curve["heads"][-1].update(steps_asked=3000, steps_done=2410)
    text = script.markdown(curve)
    assert f"| {curve['heads'][-1]['requests']} | {curve['heads'][-1]['rows_passed']} | 2410 of 3000 asked |" in text
    assert "A training step (loss + backward, optimizer step estimated) by batch" in text
    last = curve["heads"][-1]
    assert f"; trained at batch {last['train_batch']} (--train-batch auto)" in text
    assert f"| 2410 of 3000 asked | {last['epochs']} ({last['train_batch']}) |" in text


def test_the_vllm_checks_table_says_what_the_sampling_test_on_vllm_found():
    """benchmarks/eagle3_vllm.py's last column: a pass with its figures, a failure with its
    reason, a domain that was not tested said so."""
    vllm_check = load_script("benchmarks/eagle3_vllm.py", "eagle3_vllm")
    passed = {"status": "passed", "passed": True, "reason": "r", "rows": 300, "positions": 6,
              "min_p": 0.0123, "shared_from": None}
    assert vllm_check.sampling_cell(passed) == "passed: 6 G-tests of 300 rows, smallest p 0.0123"
    assert vllm_check.sampling_cell(dict(passed, shared_from="code")).endswith(
        "smallest p 0.0123 (the test of code, shared)")
    failed = dict(passed, status="failed", passed=False, min_p=1e-5,
                  reason="vLLM sampling test FAILED with the config at T 1 position 1")
    assert vllm_check.sampling_cell(failed) == (
        "FAILED: vLLM sampling test FAILED with the config at T 1 position 1")
    assert vllm_check.sampling_cell(dict(failed, status="error", reason="the server died")) == (
        "ERROR: the server died")
    assert vllm_check.sampling_cell(None).startswith("not run")
