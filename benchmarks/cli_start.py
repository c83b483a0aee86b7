"""How long `specdec COMMAND` takes from start to exit, for two checkouts, contenders interleaved.

    python benchmarks/cli_start.py --before /tmp/before-checkout [--repeats 5]

Each command runs as a new process (`python -m tasks.cli ...`, as users and the tests start it)
of the checkout under test, on a fresh SQLite database (migrated once per checkout); the before
and after processes alternate, so load on the machine falls on both. Prints a table of median
seconds per command and the ratio before / after, and whether each process imported torch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {
    "--help": ["--help"],
    "db current": ["db", "current", "--url", "{url}"],
    "report current_config_per_domain": ["report", "current_config_per_domain", "--format", "json",
                                         "--url", "{url}"],
    "traffic import --help": ["traffic", "import", "--help"],
}
# the same command again, asking afterwards whether torch was imported (not timed)
TORCH_PROBE = ("import runpy, sys; sys.argv = ['specdec', *sys.argv[1:]]\n"
               "try:\n    runpy.run_module('tasks.cli', run_name='__main__')\n"
               "except SystemExit:\n    pass\n"
               "print('TORCH', 'torch' in sys.modules, file=sys.stderr)")


def timed(checkout: Path, command: list[str], env: dict | None = None) -> tuple[float, str, str]:
    """(seconds, stdout, stderr) of one new process running `command` in `checkout` (its code
    first on the path); a failure stops the benchmark with the process's error."""
    env = {**os.environ, "PYTHONPATH": str(checkout), **(env or {})}
    began = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {command[1:]} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return seconds, done.stdout, done.stderr


def two_checkouts(description: str) -> tuple[dict[str, Path], int]:
    """({"before": checkout, "after": checkout}, repeats) from the command line."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a checkout to compare with (git worktree)")
    parser.add_argument("--after", type=Path, default=REPO, help="default: this checkout")
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    return {"before": options.before.resolve(), "after": options.after.resolve()}, options.repeats


def run(checkout: Path, args: list[str], home: Path, probe: bool = False) -> tuple[float, str]:
    command = [sys.executable, "-c", TORCH_PROBE, *args] if probe else [sys.executable, "-m", "tasks.cli", *args]
    seconds, _, stderr = timed(checkout, command, {"SPECDEC_HOME": str(home), "OMP_NUM_THREADS": "1"})
    return seconds, stderr


def main() -> int:
    contenders, repeats = two_checkouts(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        homes, urls = {}, {}
        for name, checkout in contenders.items():
            homes[name] = Path(tmp) / name
            homes[name].mkdir()
            urls[name] = f"sqlite:///{homes[name] / 'specdec.db'}"
            run(checkout, ["db", "upgrade", "--url", urls[name]], homes[name])
        times: dict[tuple[str, str], list[float]] = {}
        torch_loaded: dict[tuple[str, str], bool] = {}
        for label, template in COMMANDS.items():
            for name, checkout in contenders.items():
                args = [part.format(url=urls[name]) for part in template]
                _, stderr = run(checkout, args, homes[name], probe=True)
                torch_loaded[label, name] = "TORCH True" in stderr
        for repeat in range(repeats):
            for label, template in COMMANDS.items():
                for name, checkout in contenders.items():
                    args = [part.format(url=urls[name]) for part in template]
                    seconds, _ = run(checkout, args, homes[name])
                    times.setdefault((label, name), []).append(seconds)
            print(f"repeat {repeat + 1}/{repeats} done", file=sys.stderr, flush=True)
    print(f"`specdec COMMAND` start to exit, median of {repeats} (interleaved), seconds\n")
    print("| command | before | after | before / after | torch imported (before, after) |")
    print("|---|---|---|---|---|")
    for label in COMMANDS:
        before, after = (statistics.median(times[label, n]) for n in ("before", "after"))
        print(f"| specdec {label} | {before:.2f} | {after:.2f} | {before / after:.2f}x | "
              f"{torch_loaded[label, 'before']}, {torch_loaded[label, 'after']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
