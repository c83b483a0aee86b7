"""What one pytest-xdist worker (`make test` runs two) takes of the machine's cores, for itself and
for the processes its tests start.

A worker's own torch gets its share of the cores (torch.set_num_threads in conftest), but a process
a test starts -- an Airflow task process, a Celery worker, the command line, vLLM's engine --
reads its thread count from the environment. Without a share there, such a process runs torch
with every core while the other worker is busy, and OpenMP's threads wait on each other at every
operation: on this project's 2-core machine a forward of the embedded default took 240 ms at 2
threads and 108 ms at 1 thread beside one busy single-threaded process, 66 ms and 108 ms alone
(benchmarks/worker_threads.py; results/worker_threads.md).
vLLM's CPU engine binds its threads itself ("auto": every engine on the first core, the second
left to its scheduler), so two workers' engines shared one core; each worker's engines get their
own cores instead.
"""

from __future__ import annotations

import os


def allowed_cores() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def worker_index(worker: str | None) -> int:
    """0 for `gw0` (or no worker id), 1 for `gw1`, ..."""
    if worker and worker.startswith("gw") and worker[2:].isdigit():
        return int(worker[2:])
    return 0


def worker_environment(workers: int, worker: str | None, cores: list[int],
                       threads: int) -> dict[str, str]:
    """The variables a worker's child processes inherit: OMP_NUM_THREADS (torch's threads: the
    worker's own `threads`) and VLLM_CPU_OMP_THREADS_BIND (the cores vLLM's CPU engine binds its
    threads to: this worker's even slice of `cores`). Empty for a run in one process, which keeps
    every core."""
    if workers <= 1 or not cores:
        return {}
    share = max(1, len(cores) // workers)
    start = (worker_index(worker) * share) % len(cores)
    mine = cores[start:start + share] or cores[:share]
    return {"OMP_NUM_THREADS": str(max(1, threads)),
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine))}
