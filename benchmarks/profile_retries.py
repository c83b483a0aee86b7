"""How a cost profile's check fares on this machine, and what its retries cost, under two policies
replayed over the same timed passes.

Each round builds the main job's CostSampler (the embedded model, the default candidates, batch
sizes 1, 2, 4, 8, K up to 8) and times --passes passes of every figure, recording when each
ended. Then both policies are replayed over those passes with the pipeline's own check
(tasks.steps.costs.costs.checked_table, the default bounds):

- afresh: the check after 3 passes; a failing profile is measured again (3 more passes) and
  checked over those pooled with the 3 before (passes 1-6, then 4-9);
- one more: the check after 3 passes; a failing profile gets one more pass at a time and is
  checked after each over its last 6 passes (1-4, 1-5, 1-6, 2-7, 3-8, 4-9): what
  tasks.steps.costs.costs.measure_until_consistent does.

For each round and policy: the verdict, the passes it took, the seconds the profile had run by
then, and the largest spread of the last check. Both policies stop at 9 passes.

    python benchmarks/profile_retries.py --rounds 3 --out benchmarks/results/profile_retries.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from specdec_core.home import DEFAULT_MODEL  # noqa: E402
from vs_vllm import report  # noqa: E402

REPEATS = 3
POLICIES = {
    "afresh": [(0, 3), (0, 6), (3, 9)],
    "one more": [(0, 3), (0, 4), (0, 5), (0, 6), (1, 7), (2, 8), (3, 9)],
}


def replay(sampler, timings: dict, windows, check) -> tuple[str, int, float, list[str]]:
    """The first window whose check passes (else the last): (verdict, passes, largest spread,
    reasons). The sampler is given each window's timings in turn."""
    for lo, hi in windows:
        for name, store in timings.items():
            setattr(sampler, name, {key: values[lo:hi] for key, values in store.items()})
        table, reasons = check()
        if not reasons:
            break
    return ("ok" if not reasons else "noisy"), hi, max(table.spread.values()), reasons


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    from specdec_core import cpu_kernels, load_model
    from specdec_core.profile import CostSampler
    from tasks.settings import load_settings
    from tasks.steps.drafters.candidates import build_drafters
    from tasks.steps.costs.costs import checked_table, cpu_model

    settings = load_settings()
    passes = REPEATS * settings.profile.attempts
    model, tokenizer = load_model(args.model)
    cpu_kernels.prepare(model)
    drafters = {label: d for label, (_, d) in build_drafters(settings.plan.candidates, model, tokenizer).items()}
    lines = [f"# Cost-profile retries on {cpu_model()}, "
             f"{args.rounds} rounds of {passes} passes", "",
             "| round | policy | verdict | passes | seconds | largest spread | last reasons |",
             "|---|---|---|---|---|---|---|"]
    totals = {name: [0, 0.0] for name in POLICIES}
    for round_ in range(1, args.rounds + 1):
        sampler = CostSampler(model, drafters, settings.plan.k_max, settings.profile.batch_sizes,
                              settings.profile.context_len)
        start, ended = time.perf_counter(), []
        for n in range(passes):
            sampler.sample(1)
            ended.append(time.perf_counter() - start)
            print(f"round {round_}: pass {n + 1} of {passes} at {ended[-1]:.0f} s", flush=True)
        timings = {name: dict(getattr(sampler, name)) for name in ("forward", "draft", "outside")}
        for name, windows in POLICIES.items():
            verdict, used, widest, reasons = replay(
                sampler, timings, windows, lambda: checked_table(sampler, settings))
            totals[name][0] += verdict == "ok"
            totals[name][1] += ended[used - 1]
            lines.append(f"| {round_} | {name} | {verdict} | {used} | {ended[used - 1]:.0f} | "
                         f"{100 * widest:.0f}% | {'; '.join(reasons)[:160] or '-'} |")
    lines += ["", "| policy | passed | mean seconds |", "|---|---|---|"]
    lines += [f"| {name} | {ok} of {args.rounds} | {seconds / args.rounds:.0f} |"
              for name, (ok, seconds) in totals.items()]
    lines += ["", "seconds: the profile's time at its last check, the first pass including "
              "the warm-up pass and the sampler's set-up excluded"]
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
