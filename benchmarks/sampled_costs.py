"""What a sampled request costs vLLM, by how it samples (issue: decisions that hold on a busy machine).

A serving engine's cost profile times sampled requests apart from greedy ones (sampled_step,
sampled_verify). This times them at three samplings, each in an ngram engine of its own
(`profile_vllm` with no other candidate, the sampled setting the only difference), the settings
interleaved round by round: top-p 0.9 (the profile's own, SAMPLED), temperature alone, and top-k
50 alone. Every figure is in greedy steps of the same engine, so engines are compared by ratios
taken inside each: the sampled step over the greedy step, and a sampled and a greedy round at K
over that engine's greedy step. Prints one table; writes benchmarks/results/sampled_costs.md.

    python benchmarks/sampled_costs.py --models .specdec/models --write
    python benchmarks/sampled_costs.py --models .specdec/models --rounds 1 --work /tmp/sampled
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {"top-p 0.9": {"temperature": 0.7, "top_p": 0.9, "seed": 0},
            "temperature only": {"temperature": 0.7, "seed": 0},
            "top-k 50": {"temperature": 0.8, "top_k": 50, "seed": 0}}
TARGET = "smollm2-135m-instruct"


def figures(table, sizes: list[int]) -> dict:
    """Per batch size timed with sampled requests (`sizes`; the profile fills in the others): the
    sampled step, and greedy and sampled rounds at each K timed sampled, all over the same
    engine's greedy step."""
    out = {}
    for b in sizes:
        sampled = table.sampled_step[b]
        step = table.target_step[b]
        out[b] = {"sampled step": sampled / step,
                  **{f"K{k} greedy": table.verify[b][k] / step for k in sorted(table.sampled_verify[b])},
                  **{f"K{k} sampled": v / step for k, v in sorted(table.sampled_verify[b].items())}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, required=True, help="the embedded default's models directory")
    parser.add_argument("--work", type=Path, default=Path("/tmp/sampled_costs"))
    parser.add_argument("--rounds", type=int, default=1, help="profiles per setting, interleaved")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--stored", action="store_true",
                        help="report the profiles an earlier run stored in --work, timing nothing")
    args = parser.parse_args()
    if not args.stored:
        if args.work.exists():
            shutil.rmtree(args.work)
        args.work.mkdir(parents=True)
        (args.work / "models").symlink_to(args.models.resolve())
    os.environ["SPECDEC_HOME"] = str(args.work)
    os.environ.pop("SPECDEC_DATABASE_URL", None)

    from tasks.db.engine import upgrade
    from tasks.db.store import Store
    from tasks.steps.costs.cost_table import hardware_of, load_costs
    from tasks.steps.costs.engine_costs import profile_vllm

    if not args.stored:
        upgrade()                # a new store in the work directory
    store = Store.open()
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    began = time.perf_counter()
    for round_ in range(args.rounds):
        for index, (name, sampled) in enumerate(SETTINGS.items()):
            run_id = f"sampled-{round_}-{index}"
            if not args.stored:
                result = profile_vllm(run_id, TARGET, [], store, name=run_id, sampled=sampled,
                                      progress=False)
                print(f"{name}, round {round_ + 1}: {result['seconds']:.0f} s, load average "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
            engine = hardware_of(run_id, store)["details"]["engine"]
            assert engine["sampled"] == sampled, (run_id, engine["sampled"])
            results[name].append(figures(load_costs(run_id, store, run_id), engine["sampled_batch_sizes"]))
    text = report(results, time.perf_counter() - began, args)
    print(text)
    if args.write:
        out = ROOT / "benchmarks" / "results" / "sampled_costs.md"
        out.write_text(text)
        print(f"wrote {out}")


def report(results: dict, seconds: float, args) -> str:
    columns = sorted({c for runs in results.values() for run in runs for b in run.values() for c in b},
                     key=lambda c: (c != "sampled step", int(c.split()[0][1:]) if c.startswith("K") else 0, c))
    lines = ["# What a sampled request costs vLLM, by how it samples", "",
             f"Command: `python benchmarks/sampled_costs.py --models .specdec/models --rounds {args.rounds}"
             f"{' --write' if args.write else ''}`; vLLM's CPU build, the embedded default, one ngram "
             f"engine per setting and round, {seconds:.0f} s in all; load average "
             f"{' / '.join(f'{v:.2f}' for v in os.getloadavg())} at the end.", "",
             "Each figure is over the same engine's greedy step at that batch size (a ratio inside one "
             "engine: engines differ from each other by more than the ratios inside them do).", "",
             "| sampling | round | batch | " + " | ".join(columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    for name, runs in results.items():
        for index, run in enumerate(runs):
            for b, row in run.items():
                lines.append(f"| {name} | {index + 1} | {b} | "
                             + " | ".join(f"{row[c]:.2f}" if c in row else "-" for c in columns) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
