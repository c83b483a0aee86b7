"""Traffic import throughput (rows/s) and peak memory on SQLite and PostgreSQL.

Imports the shipped sample and a generated file of --rows requests (built from the shipped
sample: same prompts and responses, new ids, timestamps spread over two weeks) into a fresh
database per backend, each import in its own process so its peak RSS is its own. A second import
of the same file measures the idempotent re-run (every row skipped).

    python benchmarks/import_throughput.py                                   # SQLite only
    python benchmarks/import_throughput.py --postgres-url postgresql+psycopg://u:p@127.0.0.1/db
    (or set SPECDEC_TEST_POSTGRES_URL; a fresh schema is created there and dropped afterwards)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path


def child_import(path: str, url: str, batch_size: int) -> None:
    """Runs in the child process: one import, then its figures as JSON on stdout."""
    from tasks.db.store import Store
    from tasks.settings import load_settings
    from tasks.steps.traffic.traffic_import import import_traffic

    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = import_traffic(path, Store.open(url),
                            settings=load_settings(traffic_import_batch_size=batch_size), progress=False)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rows_read": report["rows_read"], "inserted": report["inserted"],
                      "skipped": report["skipped_existing"], "quarantined": report["quarantined"],
                      "seconds": report["seconds"], "rows_per_s": report["rows_per_s"],
                      "baseline_rss_mb": baseline_kb / 1024, "peak_rss_mb": peak_kb / 1024}))


def make_large_file(source: Path, target: Path, rows: int) -> None:
    """`rows` requests cycled from `source`, with fresh ids and timestamps over 14 days."""
    with gzip.open(source, "rt", encoding="utf-8") as handle:
        base = [json.loads(line) for line in handle]
    start = datetime(2025, 11, 3)
    step = timedelta(days=14) / rows
    with gzip.open(target, "wt", encoding="utf-8", compresslevel=1) as out:
        for index in range(rows):
            row = dict(base[index % len(base)])
            row["id"] = f"bench-{index:07d}"
            row["timestamp"] = (start + step * index).isoformat() + "Z"
            out.write(json.dumps(row) + "\n")


def run_import(path: Path, url: str, batch_size: int) -> dict:
    command = [sys.executable, __file__, "--child", str(path), "--url", url,
               "--batch-size", str(batch_size)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"import of {path} into {url} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def postgres_schema(base_url: str):
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    url = make_url(base_url)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(url)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    scoped = url.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
        hide_password=False)

    def drop() -> None:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()

    return scoped, drop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--postgres-url", default=os.environ.get("SPECDEC_TEST_POSTGRES_URL"))
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_import(args.child, args.url, args.batch_size)
        return

    from tasks.db import upgrade
    from tasks.steps.traffic.traffic_import import sample_traffic_path

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="specdec-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sample = sample_traffic_path()
    large = workdir / f"traffic-{args.rows}.jsonl.gz"
    if not large.exists():
        started = time.perf_counter()
        make_large_file(sample, large, args.rows)
        print(f"generated {large} ({large.stat().st_size / 1e6:.1f} MB compressed) in "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr)

    backends = [("sqlite", None)]
    if args.postgres_url:
        backends.append(("postgresql", args.postgres_url))
    else:
        print("no --postgres-url / SPECDEC_TEST_POSTGRES_URL: PostgreSQL skipped", file=sys.stderr)

    results = []
    for backend, base_url in backends:
        for label, path in (("shipped sample", sample), (f"generated {args.rows}", large)):
            drop = None
            if backend == "sqlite":
                db_file = workdir / f"{backend}-{uuid.uuid4().hex[:6]}.db"
                url = f"sqlite:///{db_file}"
            else:
                url, drop = postgres_schema(base_url)
            try:
                upgrade(url)
                first = run_import(path, url, args.batch_size)
                again = run_import(path, url, args.batch_size)
            finally:
                if drop:
                    from tasks.db import dispose_engines

                    dispose_engines()
                    drop()
            results.append((backend, label, first, again))

    header = (f"{'backend':<11} {'file':<18} {'rows':>7} {'inserted':>8} {'seconds':>8} {'rows/s':>8} "
              f"{'peak RSS MB':>11} {'(baseline)':>10} {'re-import rows/s':>16}")
    print(header)
    print("-" * len(header))
    for backend, label, first, again in results:
        print(f"{backend:<11} {label:<18} {first['rows_read']:>7} {first['inserted']:>8} "
              f"{first['seconds']:>8.1f} {first['rows_per_s']:>8.0f} {first['peak_rss_mb']:>11.0f} "
              f"{first['baseline_rss_mb']:>10.0f} {again['rows_per_s']:>16.0f}")
    print(f"batch size {args.batch_size}; peak RSS is the importing process's maximum resident set, "
          "baseline its size after loading the code, before the import", file=sys.stderr)


if __name__ == "__main__":
    main()
