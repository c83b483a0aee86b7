"""A short production replay in real time: does the monitor see what vLLM serves, alert on drift
and roll back, through the commands an operator runs?

One vLLM OpenAI server of the serving environment on loopback serves the champion's deployment
(a tiny bigram target, tests/helpers/models.copying_llama; the champion is seeded as in
tests/helpers/monitor.py: E 3.8 [3.5, 4.0] promised per domain, break-even 1.65). Every
`--interval-s`, six greedy requests are replayed and `specdec monitor scrape` runs (it checks
after scraping): first `--steady` rounds of json traffic (prompts that count up, which vLLM's
n-gram proposer continues), then `--degraded` rounds of another domain's traffic (qa: prompts in
which no token is followed by its successor). The responses are logged as a gateway logs them
(with `metrics.speculative_decoding` and the config version) and imported with
`specdec traffic import`; `specdec monitor show` prints the result.

    PYTHONPATH=. SPECDEC_ENGINE_SERVING_PYTHON=.venv-serving/bin/python \\
        python benchmarks/monitor_replay.py [--steady 3] [--degraded 2] [--interval-s 20]

Prints each command's output and the replay's table (markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "tasks.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    shown = " ".join(a if " " not in a else repr(a) for a in args)
    print(f"$ specdec {shown}\n{done.stdout.rstrip()}\n{done.stderr.rstrip()}".rstrip(), flush=True)
    return done


def main() -> int:
    from tests.helpers.models import copying_llama, save_tiny_target
    from tests.helpers.monitor import DEPLOYMENT, SERVED, monitored_champion
    from tests.test_monitor_serving import counting, replay, scrambled

    from tasks.db import upgrade
    from tasks.serving.server import VllmServer
    from tasks.settings import load_settings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steady", type=int, default=3)
    parser.add_argument("--degraded", type=int, default=2)
    parser.add_argument("--interval-s", type=float, default=20.0)
    parser.add_argument("--window-s", type=float, default=50.0)
    parser.add_argument("--min-drafts", type=int, default=20)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="monitor-replay-"))
    db_url, tracking = f"sqlite:///{home / 'specdec.db'}", f"sqlite:///{home / 'mlflow.db'}"
    env = dict(os.environ, SPECDEC_HOME=str(home), SPECDEC_DATABASE_URL=db_url,
               MLFLOW_TRACKING_URI=tracking, SPECDEC_MONITOR_WINDOW_S=str(args.window_s),
               SPECDEC_MONITOR_MIN_DRAFTS=str(args.min_drafts), PYTHONPATH=str(REPO))
    os.environ.update(SPECDEC_HOME=str(home))
    upgrade(db_url)
    target = "Replay-Org/Tiny-Monitored"
    monitored_champion(db_url, tracking, target)
    model_dir = save_tiny_target(copying_llama(vocab=64), home / "tiny")
    common = ["--target", target]
    log: list[dict] = []
    with VllmServer(str(model_dir), SERVED, home / "served.log", dtype="float32", max_model_len=512,
                    settings=load_settings()) as server:
        began = datetime.now(timezone.utc).replace(tzinfo=None)
        print(f"server {server.url} ready in {server.start_s:.0f} s; replay starts {began:%H:%M:%S} UTC")
        cli("monitor", "scrape", "--url", server.url, "--deployment", DEPLOYMENT, *common, env=env)
        for round_ in range(args.steady + args.degraded):
            tick = time.monotonic()
            now = datetime.now(timezone.utc).replace(tzinfo=None)
            if round_ < args.steady:
                replay(server, [counting(7 * round_ + j) for j in range(6)], "json", now, log)
            else:
                replay(server, [scrambled(10 * round_ + j) for j in range(6)], "qa", now, log)
            time.sleep(max(0.0, args.interval_s - (time.monotonic() - tick)))
            print(f"-- round {round_ + 1} ({'steady' if round_ < args.steady else 'degraded'}) "
                  f"at {datetime.now(timezone.utc):%H:%M:%S} UTC")
            cli("monitor", "scrape", "--url", server.url, "--deployment", DEPLOYMENT, *common, env=env)
    path = home / "gateway.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in log))
    cli("traffic", "import", str(path), "--no-progress", env=env)
    cli("config", "show", *common, env=env)
    shown = cli("monitor", "show", "--since", began.isoformat(), "--json", env=env)
    cli("monitor", "show", "--since", began.isoformat(), env=env)
    print_table(json.loads(shown.stdout))
    cli("report", "production_vs_promised", "--format", "csv", env=env)
    return 0


def print_table(shown: dict) -> None:
    print("\n| domain | promised E [95% interval] | scraped E (deployment, shared) | per-request E |")
    print("|---|---|---|---|")
    for d in shown["deployments"]:
        for row in d["domains"]:
            s, r = row["scraped"], row["per_request"]
            print(f"| {row['domain']} | {row['promise_e']:.2f} [{row['promise_lo']:.2f}, "
                  f"{row['promise_hi']:.2f}] | {s['e']:.3f} ({s['drafts']} drafts, {d['deployment']}) | "
                  f"{r['e']:.3f} ({r['drafts']} drafts, {r['requests']} requests) |")
    for event in shown["events"]:
        print(f"- {event['kind']} at {event['created_at'][11:19]} UTC (window to "
              f"{event['window_end'][11:19]}): {event['reason']}")


if __name__ == "__main__":
    sys.exit(main())
