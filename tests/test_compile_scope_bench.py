"""benchmarks/compile_scope.py on the tiny shape, its bodies traced with torch.compile's "eager"
backend (no code generated): the cold processes in the order `--scopes` gives, one step body and one
verify body per scope (a verify of another width compiles nothing), the steady table, and a run
stopped after its first process keeping that process's row (the device script's limit stops runs
between processes). No timing thresholds."""

from __future__ import annotations

import json
import subprocess

import pytest

from specdec_core import static_cache

from .helpers.scripts import load_script

pytestmark = pytest.mark.integration      # the cold compiles run in new Python processes


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/compile_scope.py", "compile_scope_bench")


@pytest.fixture(scope="module")
def full(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("compile_scope")
    settings = static_cache.COMPILE_SCOPE, static_cache.COMPILE_BACKEND
    returned = script.main(["--smoke", "--repeats", "1", "--backend", "eager", "--steps", "2",
                            "--scopes", "layer,model", "--out", str(out / "s.md"), "--json", str(out / "s.json")])
    return {"returned": returned, "markdown": (out / "s.md").read_text(),
            "raw": json.loads((out / "s.json").read_text()), "settings_before": settings,
            "settings_after": (static_cache.COMPILE_SCOPE, static_cache.COMPILE_BACKEND)}


def table_rows(markdown: str, header_start: str) -> list[list[str]]:
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_cold_processes_run_in_the_order_of_scopes_with_two_bodies_each(full):
    assert full["returned"] == 0
    cold = full["raw"]["cold"]
    assert [c["scope"] for c in cold] == ["layer", "model"]
    # a step body and one verify body for widths 4 and 6: the second verify compiled nothing
    assert [c["bodies"] for c in cold] == [2, 2]
    rows = table_rows(full["markdown"], "| scope |")
    assert [row[0] for row in rows] == ["layer", "model"]
    assert [int(row[4]) for row in rows] == [2, 2]
    assert "`python benchmarks/compile_scope.py --smoke --scopes layer,model --backend eager`" in full["markdown"]
    assert "Cold compile, median: model " in full["markdown"] and "x less**)." in full["markdown"]


def test_steady_forwards_of_both_scopes_match_eager_ones(full):
    steady = full["raw"]["steady"]
    assert set(steady["ms"]) == {f"{name} w{width}" for name in ("eager", "model", "layer") for width in (1, 4)}
    assert all(value > 0 for value in steady["ms"].values())
    assert set(steady["max_logit_diff"]) == {"model", "layer"}
    assert max(steady["max_logit_diff"].values()) < 1e-4, steady["max_logit_diff"]
    assert [row[0] for row in table_rows(full["markdown"], "| forward |")] == ["width 1", "width 4"]


def test_the_engines_compile_settings_are_as_before_the_run(full):
    # the steady part sets the scope and backend of this process's engine; later tests in it
    # would otherwise compile with the eager backend and the layer scope
    assert full["settings_after"] == full["settings_before"]


def test_a_run_stopped_after_its_first_process_keeps_that_process(script, tmp_path, monkeypatch):
    real_run, calls = subprocess.run, []

    def second_process_stopped(*args, **kwargs):
        calls.append(kwargs["env"]["SPECDEC_COMPILE_SCOPE"])
        if len(calls) == 1:
            return real_run(*args, **kwargs)
        return subprocess.CompletedProcess(args[0], -15, "", "Terminated")     # as a limit stops it

    monkeypatch.setattr(script.subprocess, "run", second_process_stopped)
    out, raw = tmp_path / "s.md", tmp_path / "s.json"
    with pytest.raises(RuntimeError, match=r"child \(model\) exited -15"):
        script.main(["--smoke", "--repeats", "1", "--backend", "eager", "--scopes", "layer,model",
                     "--cold-only", "--out", str(out), "--json", str(raw)])
    assert calls == ["layer", "model"]
    assert [c["scope"] for c in json.loads(raw.read_text())["cold"]] == ["layer"]
    text = out.read_text()
    assert [row[0] for row in table_rows(text, "| scope |")] == ["layer"]
    assert "Cold compile, median: layer " in text and "x less" not in text     # no ratio of one scope


def test_scopes_are_checked(script, capsys):
    with pytest.raises(SystemExit):
        script.main(["--scopes", "layer,whole"])
    assert "--scopes 'layer,whole': a comma-separated list of model, layer" in capsys.readouterr().err
