"""benchmarks/gpu_breakdown.py: the event counting on hand-made profiler events (the CUDA rules,
checkable without a GPU), and one --smoke run on the CPU: seven configurations (one compiled), per-round figures
that agree with the totals, the Markdown summary table, greedy exactness. No timing thresholds."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from .helpers.scripts import load_script

CONFIGS = ["plain_eager", "plain_graphs", "plain_unfused", "plain_compiled", "spec_k4", "spec_k6",
           "spec_k8", "plain_tuned"]
COMPILED = ("plain_compiled", "plain_tuned")
SUMMARY_HEADER = ["configuration", "unit", "rounds", "tokens/round", "wall ms", "device busy ms",
                  "kernels", "eager launches", "graph launches", "host syncs", "DtoH copies",
                  "aten ops", "busy % of wall", "captures, eager rounds (timed call)",
                  "compiled bodies, s (warm-up)", "mismatched rows"]
DEVICE_SIDE = ["device_busy_us", "kernels", "eager_launches", "graph_launches", "host_syncs",
               "dtoh_copies", "memcpy_calls"]


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/gpu_breakdown.py", "gpu_breakdown")


# ------------------------------------------------------------------------------------------------
# counting, on events shaped like torch.profiler's FunctionEvents
def event(name, start, end, device=False, kind=None, parent=None, self_us=None, annotation=False,
          with_kind=True):
    fields = dict(name=name, time_range=SimpleNamespace(start=start, end=end),
                  device_type=DeviceType.CUDA if device else DeviceType.CPU, cpu_parent=parent,
                  self_cpu_time_total=(end - start) if self_us is None else self_us,
                  is_user_annotation=annotation)
    if with_kind:
        fields["activity_type"] = kind
    return SimpleNamespace(**fields)


def fake_profile(script, with_kind=True):
    """One call in [0, 100] us: a top-level aten op with a nested one, runtime calls inside and one
    sync after the window; device work (two gemm kernels, an empty kernel, a DtoH copy) and what
    must not count as work (the range's device annotation, a sync wait)."""
    def e(*args, **kw):
        return event(*args, with_kind=with_kind, **kw)

    run = e(script.RUN_RANGE, 0, 100, kind="user_annotation", annotation=True)
    linear = e("aten::linear", 10, 50, kind="cpu_op", parent=run, self_us=4)
    return [
        run, linear,
        e("aten::mm", 12, 48, kind="cpu_op", parent=linear, self_us=30),
        e("cudaLaunchKernel_v7000", 20, 21, kind="cuda_runtime", parent=linear),
        e("cuLaunchKernel", 22, 23, kind="cuda_driver", parent=linear),
        e("cudaGraphLaunch", 30, 31, kind="cuda_runtime", parent=run),
        e("cudaMemcpyAsync", 59, 60, kind="cuda_runtime", parent=run),
        e("cudaStreamSynchronize", 60, 61, kind="cuda_runtime", parent=run),
        e("cudaDeviceSynchronize", 150, 151, kind="cuda_runtime"),        # after the window
        e("gemm", 25, 35, device=True, kind="kernel"),
        e("gemm", 36, 40, device=True, kind="kernel"),
        e("empty", 41, 41, device=True, kind="kernel"),
        e("Memcpy DtoH (Device -> Pageable)", 55, 56, device=True, kind="gpu_memcpy"),
        e(script.RUN_RANGE, 20, 60, device=True, kind="gpu_user_annotation", annotation=True),
        e("Stream Sync", 56, 58, device=True, kind="cuda_sync"),
    ]


@pytest.mark.parametrize("with_kind", [True, False], ids=["activity_type", "older_torch"])
def test_counts_follow_the_documented_rules(script, with_kind):
    totals = script.count_events(fake_profile(script, with_kind), (0, 100), device_profiled=True)
    assert totals["kernels"] == 3                       # two gemms and the copy; not the empty one
    assert totals["device_busy_us"] == pytest.approx(10 + 4 + 1)
    assert totals["eager_launches"] == 2                # cudaLaunchKernel_v7000, cuLaunchKernel
    assert totals["graph_launches"] == 1
    assert totals["host_syncs"] == 1                    # the one after the window left out
    assert totals["dtoh_copies"] == 1
    assert totals["memcpy_calls"] == 1
    assert totals["aten_ops"] == 1                      # aten::mm is nested in aten::linear
    assert totals["host_events"] == 7


def test_the_call_window_is_the_host_range_not_its_device_annotation(script):
    # with CUDA profiled, torch 2.11 lists the range twice: on the host and as a GPU annotation
    events = fake_profile(script)
    assert sum(e.name == script.RUN_RANGE for e in events) == 2
    assert script.call_window(events) == (0, 100)
    with pytest.raises(RuntimeError, match="expected one host"):
        script.call_window([e for e in events if e.name != script.RUN_RANGE])


def test_without_cuda_the_device_side_is_none(script):
    totals = script.count_events(fake_profile(script), (0, 100), device_profiled=False)
    assert all(totals[key] is None for key in DEVICE_SIDE)
    assert totals["aten_ops"] == 1


def test_top_entries_rank_kernels_on_cuda_and_host_ops_on_cpu(script):
    events = fake_profile(script)
    kernels = script.top_entries(events, (0, 100), device_profiled=True)
    assert [(k["name"], k["calls"], k["us"]) for k in kernels[:2]] == [("gemm", 2, 14),
                                                                       ("Memcpy DtoH (Device -> Pageable)", 1, 1)]
    assert sum(k["pct"] for k in kernels) == pytest.approx(100)
    host = script.top_entries(events, (0, 100), device_profiled=False, n=2)
    assert [h["name"] for h in host] == ["aten::mm", "aten::linear"]


def test_per_step_divides_totals_by_rounds(script):
    totals = script.count_events(fake_profile(script), (0, 100), device_profiled=True)
    per = script.per_step(totals, wall_s=0.003, wall_rounds=3, profiled_rounds=3)
    assert per["wall_ms"] == pytest.approx(1.0)
    assert per["kernels"] == pytest.approx(1.0) and per["eager_launches"] == pytest.approx(2 / 3)
    assert per["device_busy_ms"] == pytest.approx(0.005)
    assert per["busy_pct"] == pytest.approx(0.5)


def test_an_unknown_configuration_is_refused_before_any_model_is_built(script, capsys):
    # a misspelt name in the device script's list would otherwise measure nothing, silently
    with pytest.raises(SystemExit, match="no configuration named plain_compile; use some of "
                                         "plain_eager, plain_graphs"):
        script.main(["--smoke", "--configs", "plain_graphs,plain_compile"])
    assert "device" not in capsys.readouterr().err        # the first log line names the device


# ------------------------------------------------------------------------------------------------
# one smoke run
@pytest.fixture(scope="module")
def smoke(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_breakdown")
    returned = script.main(["--smoke", "--out", str(out / "b.md"), "--json", str(out / "b.json")])
    return {"markdown": (out / "b.md").read_text(), "raw": json.loads((out / "b.json").read_text()),
            "returned": returned}


def test_the_seven_configurations_ran(smoke):
    raw = smoke["raw"]
    assert raw == json.loads(json.dumps(smoke["returned"]))     # main returns what it dumps
    assert [c["name"] for c in raw["configs"]] == CONFIGS
    for config in raw["configs"]:
        assert "error" not in config, config
    assert raw["meta"]["device"] == "cpu" and raw["meta"]["smoke"] is True


def test_rounds_and_walls_are_consistent(smoke):
    new = smoke["raw"]["meta"]["new_tokens"]
    for config in smoke["raw"]["configs"]:
        rounds = config["rounds"]
        assert isinstance(rounds, int) and 1 <= rounds < new
        assert config["profiled_rounds"] == rounds               # same tokens, same rounds
        assert config["wall_s"] > 0 and config["profiled_wall_s"] > 0
        assert config["per_round"]["wall_ms"] == pytest.approx(1e3 * config["wall_s"] / rounds)
        # every token after the prefill's comes from a step / round
        assert rounds * config["tokens_per_round"] == pytest.approx(new - 1)
        if config["mode"] == "plain":
            assert config["k"] is None and config["unit"] == "step" and rounds == new - 1
        else:
            assert config["unit"] == "round" and config["tokens_per_round"] > 1
    by_name = {c["name"]: c for c in smoke["raw"]["configs"]}
    assert (by_name["spec_k4"]["k"], by_name["spec_k8"]["k"]) == (4, 8)
    assert [by_name[n]["cuda_graphs"] for n in CONFIGS] == [False, True, True, True, True, True, True, True]
    # every configuration on the fused target but plain_unfused, which runs on an unfused copy
    layers = {n: by_name[n]["fused_projections"]["attention"] for n in CONFIGS}
    assert layers["plain_unfused"] == 0 and all(layers[n] > 0 for n in CONFIGS if n != "plain_unfused")
    # warmed up twice: the timed call replays every round (the CPU stand-in counts like CUDA)
    assert all((c["timed_captures"], c["timed_eager_rounds"]) == (0, 0) for c in smoke["raw"]["configs"]
               if c["cuda_graphs"]), [(c["name"], c["timed_captures"]) for c in smoke["raw"]["configs"]]


def test_only_the_compiled_configurations_compile_and_their_bodies_are_made_in_the_warm_up(smoke):
    # the smoke run traces with torch.compile's eager backend (the same bodies, no code generated);
    # the other configurations follow --engine-compile "auto": off on a CPU
    assert smoke["raw"]["meta"]["compile_backend"] == "eager"
    # and only for the run: later tests in this process compile with the engine's own backend and
    # options
    from specdec_core import static_cache
    assert static_cache.COMPILE_BACKEND == "inductor" and static_cache.COMPILE_OPTIONS == ""
    by_name = {c["name"]: c for c in smoke["raw"]["configs"]}
    assert {n for n in CONFIGS if by_name[n]["compiled"]} == set(COMPILED)
    # plain_tuned is compiled with coordinate descent tuning, plain_compiled with the defaults:
    # each made bodies of its own (the tuned one reusing plain_compiled's would time it again)
    assert by_name["plain_compiled"]["inductor_options"] == {}
    assert by_name["plain_tuned"]["inductor_options"] == {"coordinate_descent_tuning": True}
    for name in COMPILED:
        compiled = by_name[name]
        # a step body at least (and the prefill's, if any), all before the timed and profiled calls
        assert compiled["compiled_bodies"] >= 1 and compiled["compile_s"] > 0, name
        # the compiled step is replayed as the graphed one is: nothing captured or run eagerly when timed
        assert (compiled["timed_captures"], compiled["timed_eager_rounds"]) == (0, 0), name
        assert compiled["rounds"] == by_name["plain_graphs"]["rounds"]
    assert all(by_name[n]["compiled_bodies"] == 0 and by_name[n]["compile_s"] == 0
               for n in CONFIGS if n not in COMPILED)
    rows = {r[0]: r for r in table_after(smoke["markdown"], "## Summary")[2:]}
    column = SUMMARY_HEADER.index("compiled bodies, s (warm-up)")
    compiled, tuned = by_name["plain_compiled"], by_name["plain_tuned"]
    assert rows["plain_compiled"][column] == f"{compiled['compiled_bodies']}, {compiled['compile_s']:.1f}"
    assert rows["plain_tuned"][column] == (f"{tuned['compiled_bodies']}, {tuned['compile_s']:.1f}; "
                                           "coordinate_descent_tuning=True")


def test_counts_are_ints_or_none_and_per_round_figures_match(smoke):
    for config in smoke["raw"]["configs"]:
        totals, per = config["totals"], config["per_round"]
        for key in DEVICE_SIDE:                                   # CPU run: not measurable
            assert totals[key] is None
        for key in ("device_busy_ms", "kernels", "eager_launches", "graph_launches", "host_syncs",
                    "dtoh_copies", "busy_pct"):
            assert per[key] is None
        assert isinstance(totals["aten_ops"], int) and totals["aten_ops"] > 0
        assert isinstance(totals["host_events"], int) and totals["host_events"] >= totals["aten_ops"]
        assert per["aten_ops"] == pytest.approx(totals["aten_ops"] / config["profiled_rounds"])


def test_top_tables_list_host_operators_by_time(smoke):
    for config in smoke["raw"]["configs"]:
        top = config["top"]
        assert config["top_kind"] == "host operators by self CPU time"
        assert 0 < len(top) <= 10
        spent = [entry["us"] for entry in top]
        assert spent == sorted(spent, reverse=True) and spent[0] > 0
        assert all(entry["calls"] >= 1 and "::" in entry["name"] for entry in top)
        assert sum(entry["pct"] for entry in top) <= 100 + 1e-6


def test_speculative_tokens_equal_plain_greedy_tokens(smoke):
    assert [c["mismatched_rows"] for c in smoke["raw"]["configs"]] == [0] * len(CONFIGS)


def table_after(text: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after the heading line starting with `heading`."""
    lines = text.split("\n" + heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
    return rows


def test_markdown_summary_has_one_row_per_configuration(smoke):
    text, raw = smoke["markdown"], smoke["raw"]
    assert text.startswith("# Where decoding time goes: cpu (")
    assert "SMOKE RUN" in text and "Failed" not in text
    rows = table_after(text, "## Summary")
    assert rows[0] == SUMMARY_HEADER
    assert rows[1] == ["---"] * len(SUMMARY_HEADER)
    body = rows[2:]
    assert [row[0] for row in body] == CONFIGS
    column = {name: i for i, name in enumerate(SUMMARY_HEADER)}
    for row, config in zip(body, raw["configs"]):
        assert len(row) == len(SUMMARY_HEADER)
        assert row[column["unit"]] == config["unit"]
        assert int(row[column["rounds"]]) == config["rounds"]
        assert float(row[column["wall ms"]]) == pytest.approx(config["per_round"]["wall_ms"], abs=1e-3)
        # printed to one decimal: at most half a unit off (a tie such as 482.75 -> 482.8 included)
        assert float(row[column["aten ops"]]) == pytest.approx(config["per_round"]["aten_ops"],
                                                               abs=0.05 + 1e-9)
        assert row[column["kernels"]] == "n/a" and row[column["device busy ms"]] == "n/a"
        assert row[column["mismatched rows"]] == "0"


def test_markdown_has_a_top_table_per_configuration(smoke):
    text = smoke["markdown"]
    for name in CONFIGS:
        rows = table_after(text, f"## {name}: ")
        assert rows[0] == ["name", "calls", "us", "% of total"]
        assert 0 < len(rows[2:]) <= 10
        assert all(len(row) == 4 for row in rows[2:])
