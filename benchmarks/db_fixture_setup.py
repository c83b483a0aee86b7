"""The `db_url` test fixture's setup and teardown per test, before (every migration per test) and
after (a copy of a template migrated once, tests/helpers/db.py MigratedTemplates), interleaved,
on SQLite and on the PostgreSQL server named by $SPECDEC_TEST_POSTGRES_URL.

Run from the repository root: PYTHONPATH=$PWD .venv/bin/python benchmarks/db_fixture_setup.py 8
(results: benchmarks/results/ci_speed.md)."""
import os, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, os.getcwd())
from tasks.db import upgrade, dispose_engines
from tests.helpers.db import MigratedTemplates, postgres_schema

N = int(sys.argv[1])
tmp = Path(tempfile.mkdtemp())
templates = MigratedTemplates(tmp / "tpl"); (tmp / "tpl").mkdir()
def sqlite_before(i):
    upgrade(f"sqlite:///{tmp / f'b{i}.db'}"); dispose_engines()
def sqlite_after(i):
    templates.sqlite_copy(tmp / f"a{i}.db"); dispose_engines()
def pg_before(i):
    with postgres_schema("t", before_drop=dispose_engines) as url:
        upgrade(url)
def pg_after(i):
    with templates.postgres_copy(before_drop=dispose_engines) as url:
        pass
t = time.perf_counter(); sqlite_after(-1); print(f"sqlite template (once per session): {time.perf_counter()-t:.2f}s")
t = time.perf_counter(); pg_after(-1); print(f"postgresql template (once per session) + first copy: {time.perf_counter()-t:.2f}s")
times = {k: [] for k in ("sqlite before", "sqlite after", "pg before", "pg after")}
for i in range(N):
    for name, fn in (("sqlite before", sqlite_before), ("sqlite after", sqlite_after),
                     ("pg before", pg_before), ("pg after", pg_after)):
        t = time.perf_counter(); fn(i); times[name].append(time.perf_counter() - t)
import statistics
for name, values in times.items():
    print(f"{name}: median {statistics.median(values)*1000:.0f} ms, mean {statistics.mean(values)*1000:.0f} ms over {N}")
print("load", open("/proc/loadavg").read().split()[0])
templates.close()
