"""A child process's torch threads beside a busy neighbour: why `make test`'s workers hand their
share of the cores to the processes their tests start (tests/helpers/workers.py).

    python benchmarks/worker_threads.py [--repeats 5] [--steps 30]

Each measurement is a new process that loads the embedded default (CPU, float32) with
OMP_NUM_THREADS set to its contender's thread count and times single-token forwards (after
warm-up); beside a neighbour, one more process runs single-threaded matrix products the whole
time, as the other pytest worker's test does. Contenders are interleaved (every repeat runs each
once, in turn). Prints median milliseconds per forward and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORWARDS = """
import sys, time, torch
from specdec_core import load_model
model, _ = load_model("smollm2-135m-instruct", device="cpu")
token = torch.tensor([[42]])
with torch.no_grad():
    for _ in range(3):
        model(token)
    began = time.perf_counter()
    for _ in range({steps}):
        model(token)
print(torch.get_num_threads(), 1000 * (time.perf_counter() - began) / {steps})
"""
NEIGHBOUR = ("import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\n"
             "while True:\n    a @ a\n")


def measure(threads: int, busy: bool, steps: int) -> float:
    """Milliseconds per forward of one new process at `threads` threads, beside a busy
    single-threaded neighbour when `busy`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    neighbour = (subprocess.Popen([sys.executable, "-c", NEIGHBOUR], env={**env, "OMP_NUM_THREADS": "1"})
                 if busy else None)
    try:
        done = subprocess.run([sys.executable, "-c", FORWARDS.format(steps=steps)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=900, check=False)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    if done.returncode != 0:
        raise SystemExit(f"the forwards at {threads} threads exited {done.returncode}:\n{done.stderr[-2000:]}")
    used, ms = done.stdout.split()
    if int(used) != threads:
        raise SystemExit(f"asked for {threads} threads, torch ran {used}")
    return float(ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed forwards per process")
    options = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    contenders = [(cores, False), (max(1, cores // 2), False), (cores, True), (max(1, cores // 2), True)]
    times: dict[tuple[int, bool], list[float]] = {c: [] for c in contenders}
    for repeat in range(options.repeats):
        for threads, busy in contenders:
            ms = measure(threads, busy, options.steps)
            times[(threads, busy)].append(ms)
            print(f"repeat {repeat + 1}/{options.repeats}: {threads} threads, "
                  f"{'beside a busy neighbour' if busy else 'alone'}: {ms:.1f} ms", file=sys.stderr, flush=True)
    median = {c: statistics.median(v) for c, v in times.items()}
    print(f"{cores} cores, {options.repeats} repeats of {options.steps} forwards (embedded default, "
          f"CPU float32, batch 1, one token), median ms per forward:\n")
    print("| threads | alone | beside one busy single-threaded process |")
    print("|---|---|---|")
    for threads in sorted({t for t, _ in contenders}, reverse=True):
        print(f"| {threads} | {median[(threads, False)]:.1f} | {median[(threads, True)]:.1f} |")
    half = max(1, cores // 2)
    if half != cores:
        print(f"\nbeside the neighbour, {cores} threads / {half}: "
              f"{median[(cores, True)] / median[(half, True)]:.2f}x the time; "
              f"alone: {median[(cores, False)] / median[(half, False)]:.2f}x")


if __name__ == "__main__":
    main()
