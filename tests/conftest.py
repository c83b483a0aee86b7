"""Shared fixtures: tiny random transformers models (built here, no downloads) and, for slow tests,
the embedded default. Models are session-scoped: build once, share across tests.

Database tests take the `db_url` fixture: every such test runs twice, on SQLite (a file in the
test's tmp_path) and on PostgreSQL (a fresh schema per test in the server named by
$SPECDEC_TEST_POSTGRES_URL, dropped afterwards). The PostgreSQL variant is skipped only when that
variable is unset; CI always sets it (.ci/run starts a server on loopback).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 97
REPO = Path(__file__).resolve().parent.parent

# The sampling test's streams come from this seed, not from run ids that carry the wall clock
# (DAG runs): a correct run fails that test by chance at rate alpha, which must not make CI flaky.
os.environ.setdefault("SPECDEC_VALIDATION_SEED", "11")


def stop_process_group(process, timeout_s: float) -> None:
    """SIGTERM to a process started with start_new_session=True and to its whole group (workers,
    supervisors), then SIGKILL to whatever is left of the group."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=timeout_s)


def load_script(relative_path: str, name: str):
    """A script of the repository (benchmarks/, scripts/) imported as a module, for its tests."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_llama(vocab: int = VOCAB, hidden: int = 64, layers: int = 4, heads: int = 4, seed: int = 0,
               initializer_range: float = 0.5) -> LlamaForCausalLM:
    """A random Llama-style causal LM. A large initializer range gives peaked logits, so greedy
    decoding has no near-ties and batched vs single-token passes agree exactly on the argmax."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(heads // 2, 1), max_position_embeddings=512,
                         initializer_range=initializer_range, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def draft():
    """A smaller, unrelated model with the target's vocabulary (partial acceptance)."""
    return tiny_llama(hidden=32, layers=2, heads=2, seed=1)


SPREAD_VOCAB = 24


@pytest.fixture(scope="session")
def spread_target():
    """A tiny target whose next-token distributions are spread over several tokens (power needs
    more than one likely token)."""
    return tiny_llama(vocab=SPREAD_VOCAB, hidden=32, layers=2, heads=2, seed=31, initializer_range=0.3)


@pytest.fixture(scope="session")
def spread_draft(spread_target):
    """A perturbed copy of the target: q close to p but not equal, so drafts are often accepted
    (bonus tokens occur) and often corrected (residual draws occur)."""
    draft = copy.deepcopy(spread_target)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5 * param.std())
    return draft


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded default, fetched into $SPECDEC_HOME/models once."""
    from specdec_core import load_model

    return load_model("smollm2-135m-instruct", device="cpu")


# --- database fixtures ----------------------------------------------------------------------
import gzip
import json
import uuid
from contextlib import contextmanager

import pytest

POSTGRES_ENV = "SPECDEC_TEST_POSTGRES_URL"


def _postgres_schema_url(base_url: str, schema: str) -> str:
    from sqlalchemy.engine import make_url

    url = make_url(base_url)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    return url.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
        hide_password=False)


@pytest.fixture(params=[
    "sqlite",
    pytest.param("postgresql", marks=pytest.mark.skipif(
        not os.environ.get(POSTGRES_ENV),
        reason=f"{POSTGRES_ENV} is not set: no PostgreSQL server configured (CI always sets it)")),
])
def db_backend(request) -> str:
    return request.param


@pytest.fixture
def empty_db_url(db_backend, tmp_path, monkeypatch):
    """A URL of an empty database (no schema yet) on the backend under test."""
    from tasks.db import dispose_engines

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECDEC_DATABASE_URL", raising=False)
    if db_backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'specdec.db'}"
        dispose_engines()
        return
    with postgres_schema("t", before_drop=dispose_engines) as url:
        yield url


@contextmanager
def postgres_schema(prefix: str, before_drop=None):
    """A fresh schema in the server named by $SPECDEC_TEST_POSTGRES_URL, as a SQLAlchemy URL whose
    search_path is that schema; dropped afterwards (after calling before_drop)."""
    from sqlalchemy import create_engine, text

    base = os.environ[POSTGRES_ENV]
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(_postgres_schema_url(base, "public"))
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield _postgres_schema_url(base, schema)
    finally:
        if before_drop is not None:
            before_drop()
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def db_url(empty_db_url):
    """A migrated (empty) specdec database on the backend under test."""
    from tasks.db import upgrade

    upgrade(empty_db_url)
    return empty_db_url


# ------------------------------------------------------------------------------------------------
# traffic rows
def request_row(index: int = 1, **overrides) -> dict:
    """One valid JSONL request; overrides replace fields (a value of None removes the field)."""
    row = {
        "id": f"req-{index:05d}",
        "timestamp": f"2025-11-{1 + index % 14:02d}T{index % 24:02d}:15:00Z",
        "domain": "qa",
        "messages": [{"role": "user", "content": f"What is the capital of country number {index}?"}],
        "response": f"The capital of country {index} is City {index}.",
        "temperature": 0.0 if index % 2 else 0.7,
        "top_p": 1.0 if index % 2 else 0.9,
        "model": "smollm2-135m-instruct",
        "target_fingerprint": "sha256:test",
        "prompt_token_ids": [1, 2, 3, index % 1000],
        "response_token_ids": [4, 5, 6],
    }
    for key, value in overrides.items():
        if value is None:
            row.pop(key, None)
        else:
            row[key] = value
    return row


def write_jsonl(path: Path, rows, compress: bool = False) -> Path:
    """Rows (dicts, or strings written as they are) one per line."""
    lines = "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return path


@pytest.fixture
def make_request():
    return request_row


@pytest.fixture
def jsonl_file(tmp_path):
    """jsonl_file(rows, name="traffic.jsonl", compress=False) -> Path"""
    def write(rows, name: str = "traffic.jsonl", compress: bool = False) -> Path:
        return write_jsonl(tmp_path / name, rows, compress=compress)
    return write


def save_tiny_target(model, directory: Path) -> Path:
    """Save a tiny model with a word-level tokenizer (t0..tN) as a local model directory that
    load_model reads like any other."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------------------
# Airflow (the DAG tests and the browser test share one metadata database per session)
@pytest.fixture(scope="session")
def airflow_env():
    """An Airflow home with a migrated SQLite metadata database and the timing pool; the DAG
    folder is the repository's dags/. Set before airflow is first imported in this process."""
    import tempfile

    from tasks.cli.main_job import airflow_environment, prepare_airflow

    env = airflow_environment(Path(tempfile.mkdtemp(prefix="airflow-home-")), REPO / "dags")
    prepare_airflow(env)        # the main job's own setup: migrate, the one-slot timing pool
    return env


@pytest.fixture(scope="session")
def dagbag(airflow_env):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


class LoopbackServer:
    """A server process on 127.0.0.1 in its own process group, up once `health` answers 200 (else
    the test fails with the server's output)."""

    def __init__(self, name: str, command: list[str], health: str, env: dict, log: Path,
                 cwd: Path | None = None, timeout_s: float = 120.0):
        import time
        import urllib.request

        self.name, self.log = name, log
        with open(log, "wb") as handle:
            self.process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                            cwd=cwd, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(health, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{name} did not answer {health} within {timeout_s:.0f} s (exit "
                            f"{self.process.returncode}); its output:\n"
                            + log.read_text(errors="replace")[-4000:])
            time.sleep(0.3)

    def stop(self) -> None:
        """The server's whole process group (server, workers)."""
        stop_process_group(self.process, 15)


def free_port() -> int:
    """A loopback port nothing listens on right now (a server may take it, or a test may count on
    nothing answering there)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------------------
# one line at the end: what this machine skipped, and how to run it (.ci/run sets everything up)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import re
    from collections import Counter

    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = Counter()
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = re.sub(r"^Skipped: ", "", reason)
        reasons[reason.split(":")[0].split(" (")[0][:60]] += 1
    summary = ", ".join(f"{count} {reason}" for reason, count in reasons.most_common())
    terminalreporter.write_line(
        f"skipped {len(skipped)} here ({summary}); `bash .ci/run` sets up PostgreSQL, Chromium, "
        "Redis and the serving environment and runs them all (a CUDA GPU for the GPU-only ones)")
