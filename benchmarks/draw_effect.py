"""What the sample's draw alone does to a run's plan (issue: decisions that hold on a busy machine).

Plans the same traffic on one stored vLLM cost profile several times, each in a copy of a store
that holds the profile (a home the main job left behind, e.g. one of benchmarks/busy_neighbour.py's
runs), with `specdec evaluate --hardware-profile NAME` and the engine check off, so that nothing
is timed and only the sample differs: drawn anew per run id (`sample_draw=per_run`) and with the
stable draw (the default) under two run ids. Prints one table: per domain and run, on/off, drafter,
K and the predicted speedup with its 95% interval; writes benchmarks/results/draw_effect.md.

    python benchmarks/draw_effect.py --home /tmp/busy_neighbour/quiet-1 --write
    python benchmarks/draw_effect.py --home H --runs per_run:a,stable:s1 --work /tmp/draws
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = "per_run:a,per_run:b,per_run:c,stable:s1,stable:s2"


def vllm_profile(home: Path) -> str:
    """The name of the vLLM cost profile stored in the home's database."""
    with sqlite3.connect(home / "specdec.db") as db:
        names = [row[0] for row in db.execute(
            "SELECT DISTINCT hardware_profile FROM cost_profiles WHERE hardware_profile LIKE 'vllm-%'")]
    if not names:
        raise SystemExit(f"{home / 'specdec.db'} holds no vLLM cost profile: give the home of a main "
                         "job that planned on vLLM (benchmarks/busy_neighbour.py's --work/quiet-1)")
    return names[0]


def plan_once(source: Path, work: Path, draw: str, tag: str, profile: str, models: Path) -> Path:
    """One evaluation in a copy of the source store: its JSON output's path."""
    home = work / tag
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    shutil.copy(source / "specdec.db", home / "specdec.db")
    (home / "models").symlink_to(models.resolve())
    env = {"SPECDEC_HOME": str(home), "SPECDEC_SAMPLE_DRAW": draw, "SPECDEC_ENGINE_CHECK": "0",
           "SPECDEC_PLAN_ENGINE": "vllm"}
    out = work / f"{tag}.json"
    with out.open("w") as stdout, (work / f"{tag}.err").open("w") as stderr:
        subprocess.run([str(Path(sys.executable).parent / "specdec"), "evaluate", "--run-id", f"draw-{tag}",
                        "--hardware-profile", profile, "--no-register", "--no-progress", "--json"],
                       cwd=ROOT, env={**_environ(), **env}, stdout=stdout, stderr=stderr, check=True)
    return out


def _environ() -> dict:
    return {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}


def table(outputs: dict[str, Path]) -> str:
    """Per domain and run: on/off, drafter, K, predicted speedup [95% interval]."""
    plans = {tag: {row["domain"]: row for row in json.loads(path.read_text())["table"]}
             for tag, path in outputs.items()}
    domains = sorted(next(iter(plans.values())))
    lines = ["| domain | " + " | ".join(plans) + " |", "|---|" + "---|" * len(plans)]
    for domain in domains:
        cells = []
        for plan in plans.values():
            row = plan[domain]
            cells.append(f"{'on' if row['enabled'] else 'off'} {row['drafter']} K{row['k']} "
                         f"{row['predicted_speedup']:.2f}x [{row['predicted_speedup_lo']:.2f}, "
                         f"{row['predicted_speedup_hi']:.2f}]")
        lines.append(f"| {domain} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, required=True, help="a main job's home holding a vLLM profile")
    parser.add_argument("--runs", default=RUNS, help="DRAW:TAG,... (draw: per_run or stable)")
    parser.add_argument("--models", type=Path, default=ROOT / ".specdec" / "models")
    parser.add_argument("--work", type=Path, default=Path("/tmp/draw_effect"))
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    profile = vllm_profile(args.home)
    outputs = {}
    for item in args.runs.split(","):
        draw, tag = item.split(":")
        started = time.perf_counter()
        outputs[f"{draw} {tag}"] = plan_once(args.home, args.work, draw, tag, profile, args.models)
        print(f"{draw} {tag}: {time.perf_counter() - started:.0f} s", flush=True)
    text = table(outputs)
    print(text)
    if args.write:
        out = ROOT / "benchmarks" / "results" / "draw_effect.md"
        out.write_text("# What the draw alone does to a plan\n\n"
                       f"Command: `python benchmarks/draw_effect.py --home HOME --runs {args.runs} --write` "
                       f"(profile {profile}; the engine check off: only the sample differs).\n\n"
                       + text + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
