"""Fuzz of `specdec traffic import` (issue 33): seeded malformed rows -- bytes that are not UTF-8,
broken and deeply nested JSON, wrong types, missing fields, oversize rows, NUL characters,
duplicate ids, a CSV header repeated mid-file or missing, malformed vLLM per-request metrics
(`metrics.speculative_decoding`: wrong types, negative or fractional counts, a histogram that
disagrees with its totals, more accepted than drafted) -- mixed with good rows over JSONL and
CSV files (plain and gzipped), each imported twice by the CLI in a new process. Every good row
lands exactly once, every bad row is quarantined at its own line, nothing prints a traceback, and
the exit status is the documented one (0 all stored, 3 rows quarantined, 2 file unusable).
The good rows' metrics are stored once each in request_spec_metrics, and only theirs."""

from __future__ import annotations

import csv
import gzip
import io
import json
import random
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select

from tasks.db.models import QuarantinedRequest, RequestSpecMetrics

from .helpers.processes import specdec
from .helpers.traffic import traffic

SEED = 33
MAX_ROW_BYTES = 8192          # SPECDEC_TRAFFIC_MAX_ROW_BYTES of the imports: oversize rows are cheap
TEXT = ["plain words", "virgule, and \"quotes\"", "ünïcödé ✓", "中文 テキスト", "emoji 🚀🔥",
        "tab\there", "line one\nline two", "back\\slash", "  spaced  ", "'single'"]
DOMAINS = ["json", "code", "summarize", "qa", "chat", "creative", None]
CSV_COLUMNS = ["id", "timestamp", "domain", "prompt", "messages", "response", "temperature",
               "top_k", "top_p", "max_tokens", "model", "response_token_ids", "metrics",
               "config_version"]


def spec_metrics(r: random.Random) -> dict:
    """vLLM's per-request metrics object as its OpenAI server returns it (summary level)."""
    k = r.randint(1, 5)
    histogram = [r.randint(0, 6) for _ in range(k + 1)]
    steps = sum(histogram)
    accepted = sum(j * count for j, count in enumerate(histogram))
    drafted = r.randint(accepted, k * steps)
    return {"time_to_first_token_ms": 3.5, "speculative_decoding": {
        "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": histogram, "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted, "num_draft_tokens": drafted, "num_spec_tokens": k}}


def bad_metrics(r: random.Random) -> dict:
    """A malformed metrics object (each is quarantined, naming the field)."""
    good = spec_metrics(r)
    spec = good["speculative_decoding"]
    return r.choice([
        "fast", [1, 2], {"speculative_decoding": "summary"},
        {"speculative_decoding": {k: v for k, v in spec.items() if k != "num_draft_tokens"}},
        {"speculative_decoding": dict(spec, num_spec_steps=-1)},
        {"speculative_decoding": dict(spec, num_accepted_draft_tokens=2.5)},
        {"speculative_decoding": dict(spec, num_draft_tokens="many")},
        {"speculative_decoding": dict(spec, num_spec_steps=True)},
        {"speculative_decoding": dict(spec, acceptance_histogram=spec["acceptance_histogram"] + [1])},
        {"speculative_decoding": dict(spec, acceptance_histogram="[1, 2]")},
        {"speculative_decoding": dict(spec, num_accepted_draft_tokens=spec["num_draft_tokens"] + 1,
                                      acceptance_histogram=None)},
        {"speculative_decoding": dict(spec, num_draft_tokens=10 ** 12)}])


class Traffic:
    """Good and bad rows of one seeded run; `expected` keeps what each line must become."""

    def __init__(self, seed: int):
        self.random = random.Random(seed)
        self.count = 0
        self.good: dict[str, dict] = {}               # id -> the row as generated
        self.bad = Counter()                          # category -> rows

    def text(self) -> str:
        return " ".join(self.random.choice(TEXT) for _ in range(self.random.randint(1, 4)))

    def row(self, prefix: str) -> dict:
        self.count += 1
        r = self.random
        row = {"id": f"{prefix}-{self.count:04d}",
               "timestamp": r.choice([f"2025-11-{r.randint(1, 28):02d}T{r.randint(0, 23):02d}:05:00Z",
                                      1762351200 + r.randint(0, 10 ** 6)]),
               "response": self.text(), "temperature": r.choice([0.0, 0.7, 1.3]),
               "top_p": r.choice([1.0, 0.9]), "model": "fuzz-target"}
        if r.random() < 0.5:
            row["messages"] = [{"role": "user", "content": self.text()}]
        else:
            row["prompt"] = self.text()
        domain = r.choice(DOMAINS)
        if domain:
            row["domain"] = domain
        if r.random() < 0.3:
            row["max_tokens"] = r.randint(1, 4096)
        if r.random() < 0.3:
            row["response_token_ids"] = [r.randint(0, 5000) for _ in range(r.randint(1, 6))]
        if r.random() < 0.3:
            row["metrics"] = spec_metrics(r)
            if r.random() < 0.5:
                row["config_version"] = str(r.randint(1, 9))
        return row

    def keep(self, row: dict) -> dict:
        self.good[row["id"]] = row
        return row


# ------------------------------------------------------------------------------------------------
# JSONL: (bytes of the line, bad category or None)
def jsonl_lines(t: Traffic, prefix: str, rows: int) -> list[tuple[bytes, str | None]]:
    r = t.random
    lines: list[tuple[bytes, str | None]] = []
    stored: list[dict] = []

    def dump(row) -> bytes:
        return json.dumps(row, ensure_ascii=r.random() < 0.5).encode()

    def wrong(field: str, value) -> bytes:
        return dump({**t.row(prefix), field: value})

    makers = {
        "not_utf8": lambda: dump(t.row(prefix)).replace(b'"response": "', b'"response": "\xff\xfe', 1),
        "latin1": lambda: json.dumps(t.row(prefix) | {"response": "café"}, ensure_ascii=False)
        .encode("latin-1", "replace"),
        "truncated_json": lambda: (lambda b: b[: len(b) // 2])(dump(t.row(prefix))),
        "not_an_object": lambda: r.choice([b"[1, 2, 3]", b"42", b'"just text"', b"null", b"true"]),
        "deep_nesting": lambda: b'{"id": "deep", "messages": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        "wrong_type": lambda: r.choice([
            wrong("id", [1, 2]), wrong("id", True), wrong("temperature", "hot"), wrong("top_p", 0),
            wrong("response", 12345), wrong("messages", {"role": "user"}), wrong("top_k", 2.5),
            wrong("prompt_token_ids", "abc"), wrong("max_tokens", -5), wrong("model", ["m"]),
            wrong("sampling", "greedy"), wrong("domain", 7)]),
        "missing_field": lambda: (lambda row, key: dump({k: v for k, v in row.items() if k != key}))(
            t.row(prefix), r.choice(["id", "response", "model", "timestamp"])),
        "oversize": lambda: dump(t.row(prefix) | {"response": "z" * (MAX_ROW_BYTES * 2)}),
        "nul_character": lambda: dump(t.row(prefix) | {"response": "before\x00after"}),
        "empty_response": lambda: dump(t.row(prefix) | {"response": ""}),
        "implausible": lambda: dump(t.row(prefix) | {"max_tokens": 10 ** 12}),
        "unknown_domain": lambda: dump(t.row(prefix) | {"domain": "astrology"}),
        "bad_timestamp": lambda: dump(t.row(prefix) | {"timestamp": r.choice(
            ["yesterday", 1e20, "1970-01-02T00:00:00Z", "2999-01-01T00:00:00Z", True])}),
        "duplicate_id": lambda: dump(dict(r.choice(stored), response="a different answer")),
        "bad_metrics": lambda: dump(t.row(prefix) | r.choice([
            {"metrics": bad_metrics(r)}, {"metrics": spec_metrics(r), "config_version": ["3"]}])),
    }
    for _ in range(rows):
        roll = r.random()
        if roll < 0.45 or not stored:
            row = t.keep(t.row(prefix))
            stored.append(row)
            lines.append((dump(row), None))
        elif roll < 0.5:                              # the same row again: stored once
            lines.append((dump(r.choice(stored)), None))
        elif roll < 0.53:
            lines.append((b"   ", None))             # blank: skipped, numbered
        else:
            category = r.choice(sorted(makers))
            lines.append((makers[category](), category))
    return lines


def write_jsonl(path: Path, lines: list[tuple[bytes, str | None]]) -> dict[int, str]:
    data = b"".join(line + b"\n" for line, _ in lines)
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return {number: category for number, (_, category) in enumerate(lines, 1) if category}


# ------------------------------------------------------------------------------------------------
# CSV: records written one by one, each starting at a known line
def csv_record(values) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow(values)
    return out.getvalue()


def csv_values(row: dict) -> list[str]:
    cells = dict(row)
    if "messages" in cells:
        cells["messages"] = json.dumps(cells["messages"])
    if "response_token_ids" in cells:
        cells["response_token_ids"] = json.dumps(cells["response_token_ids"])
    if "metrics" in cells:
        cells["metrics"] = json.dumps(cells["metrics"])
    return ["" if cells.get(c) is None else str(cells[c]) for c in CSV_COLUMNS]


def csv_records(t: Traffic, prefix: str, rows: int) -> list[tuple[bytes, str | None]]:
    r = t.random
    records: list[tuple[bytes, str | None]] = [(csv_record(CSV_COLUMNS).encode(), "header")]
    stored: list[dict] = []

    def cells(**changes) -> list[str]:
        values = dict(zip(CSV_COLUMNS, csv_values(t.row(prefix))))
        values.update(changes)
        return [values[c] for c in CSV_COLUMNS]

    makers = {
        "not_utf8": lambda: csv_record(cells(response="caf@ au lait")).encode().replace(b"@", b"\xe9"),
        "not_utf8_in_a_multiline_cell": lambda: csv_record(cells(prompt="two\nlines @"))
        .encode().replace(b"@", b"\xff"),
        "field_count": lambda: csv_record(r.choice([cells()[:5], cells() + ["extra", "cells"]])).encode(),
        "repeated_header": lambda: csv_record(CSV_COLUMNS).encode(),
        "wrong_type": lambda: csv_record(r.choice([
            cells(temperature="hot"), cells(top_k="-1"), cells(max_tokens="0"),
            cells(messages="not json", prompt=""), cells(response_token_ids="[1,"),
            cells(top_p="2")])).encode(),
        "deep_nesting": lambda: csv_record(cells(messages="[" * 3000 + "]" * 3000, prompt="")).encode(),
        "missing_field": lambda: csv_record(r.choice([cells(id=""), cells(response=""),
                                                      cells(model=""), cells(timestamp="")])).encode(),
        "oversize": lambda: csv_record(cells(prompt="p" * (MAX_ROW_BYTES // 2 + 10),
                                             response="r" * (MAX_ROW_BYTES // 2 + 10))).encode(),
        "nul_character": lambda: csv_record(cells(response="nul\x00here")).encode(),
        "unknown_domain": lambda: csv_record(cells(domain="astrology")).encode(),
        "bad_timestamp": lambda: csv_record(cells(timestamp=r.choice(["soon", "1e20", "0"]))).encode(),
        "duplicate_id": lambda: csv_record(csv_values(dict(r.choice(stored), response="other"))).encode(),
        "bad_metrics": lambda: csv_record(r.choice([
            cells(metrics="{not json"), cells(metrics=json.dumps(bad_metrics(r)))])).encode(),
    }
    for _ in range(rows):
        roll = r.random()
        if roll < 0.45 or not stored:
            row = t.keep(t.row(prefix))
            stored.append(row)
            records.append((csv_record(csv_values(row)).encode(), None))
        elif roll < 0.5:
            records.append((csv_record(csv_values(r.choice(stored))).encode(), None))
        else:
            category = r.choice(sorted(makers))
            records.append((makers[category](), category))
    return records


def write_csv(path: Path, records: list[tuple[bytes, str | None]]) -> dict[int, str]:
    expected, line = {}, 1
    for record, category in records:
        if category and category != "header":
            expected[line] = category
        line += record.count(b"\n")
    data = b"".join(record for record, _ in records)
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return expected


# ------------------------------------------------------------------------------------------------
def quarantined_lines(db_url: str, path: Path) -> dict[int, tuple[str, str]]:
    engine = create_engine(db_url)
    with engine.connect() as connection:
        rows = connection.execute(select(QuarantinedRequest.line_number, QuarantinedRequest.reason,
                                         QuarantinedRequest.detail)
                                  .where(QuarantinedRequest.source_file == str(path.resolve()))).all()
    engine.dispose()
    return {line: (reason, detail) for line, reason, detail in rows}


@pytest.mark.integration
def test_fuzzed_traffic_imports_every_good_row_once_and_quarantines_every_bad_row_at_its_line(
        db_url, tmp_path):
    t = Traffic(SEED)
    files = {
        tmp_path / "fuzz-a.jsonl": lambda p: write_jsonl(p, jsonl_lines(t, "ja", 160)),
        tmp_path / "fuzz-b.jsonl.gz": lambda p: write_jsonl(p, jsonl_lines(t, "jb", 120)),
        tmp_path / "fuzz-c.csv": lambda p: write_csv(p, csv_records(t, "ca", 160)),
        tmp_path / "fuzz-d.csv.gz": lambda p: write_csv(p, csv_records(t, "cb", 120)),
    }
    expected = {path: make(path) for path, make in files.items()}
    no_header = tmp_path / "fuzz-no-header.csv"
    no_header.write_text("".join(csv_record(csv_values(t.row("nh"))) for _ in range(5)))
    bad = Counter(category for lines in expected.values() for category in lines.values())
    assert sum(bad.values()) >= 200 and len(bad) >= 14, bad

    env = {"SPECDEC_TRAFFIC_MAX_ROW_BYTES": str(MAX_ROW_BYTES)}
    for attempt in range(2):                               # the re-import adds nothing
        for path, lines in expected.items():
            result = specdec("traffic", "import", str(path), "--url", db_url, "--no-progress",
                             "--json", env=env)
            assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
            assert result.returncode == 3, (path.name, result.stdout[-2000:], result.stderr[-2000:])
            report = json.loads(result.stdout)
            got = quarantined_lines(db_url, path)
            assert set(got) == set(lines), (path.name, {n: lines.get(n) for n in set(got) ^ set(lines)})
            assert report["quarantined"] == len(lines), path.name
            if attempt:
                assert (report["inserted"], report["quarantined_new"]) == (0, 0), path.name
        result = specdec("traffic", "import", str(no_header), "--url", db_url, "--no-progress", env=env)
        assert result.returncode == 2 and "has no header line" in result.stderr, result.stderr
        assert "Traceback" not in result.stdout + result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and not result.stdout.strip()

    stored = traffic(db_url)
    assert set(stored) == set(t.good)                      # every good row, no other
    assert all(stored[i]["response"] == row["response"] for i, row in t.good.items())
    assert all(stored[i]["model"] == "fuzz-target" for i in stored)
    # vLLM's per-request metrics: kept for exactly the good rows that carried them, as logged
    engine = create_engine(db_url)
    with engine.connect() as connection:
        kept = {row.request_id: row for row in connection.execute(select(RequestSpecMetrics))}
    engine.dispose()
    carried = {i: row for i, row in t.good.items() if "metrics" in row}
    assert set(kept) == set(carried) and len(carried) >= 30, (len(kept), len(carried))
    for i, row in carried.items():
        spec = row["metrics"]["speculative_decoding"]
        assert (kept[i].spec_steps, kept[i].draft_tokens, kept[i].accepted_tokens,
                kept[i].acceptance_histogram, kept[i].config_version) == (
            spec["num_spec_steps"], spec["num_draft_tokens"], spec["num_accepted_draft_tokens"],
            spec["acceptance_histogram"], row.get("config_version")), i
    print(f"fuzz: {len(t.good)} good rows, {sum(bad.values())} bad rows in {len(expected)} files "
          f"(+1 without header), by category: {dict(sorted(bad.items()))}")
