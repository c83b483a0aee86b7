"""Traffic import (JSONL / CSV, optionally gzipped) into traffic_requests, and retention purge.

One request per line (JSONL) or record (CSV):

    id          string, unique                       (alias: request_id)
    timestamp   ISO 8601 (naive means UTC) or epoch seconds / milliseconds   (alias: created_at)
    domain      optional; must be in the known set, else the row is quarantined; missing: rules
    messages    OpenAI chat format [{"role", "content"}]  -- or --  prompt: a plain string
    response    the target's response text            (alias: completion)
    temperature, top_k, top_p, max_tokens   top level or under "sampling"
    model       the target that answered; target_fingerprint optional
    prompt_token_ids, response_token_ids    optional lists of token ids
    metrics     optional: vLLM's per-request metrics object; its `speculative_decoding` (served
                with --per-request-spec-decode-metrics) is kept in request_spec_metrics
    config_version   optional: the registered config version that served the request

CSV has the same columns (messages and token ids as JSON text; an empty cell is a missing value).

The import streams in constant memory: rows are normalised, redacted and written in batches, one
transaction per batch, so a killed import keeps every batch it committed and a re-run skips them.
Ids are unique: a row whose id is stored with the same content is skipped; with different content
it is quarantined as `duplicate_id`. Rejected rows go to quarantined_requests with their file,
line number and reason ((file, line) is unique, so re-importing adds nothing there either).
Numbers are read with limits: an integer literal of more than MAX_NUMBER_DIGITS digits anywhere in
a row (a JSONL line, or a CSV cell holding JSON) quarantines that row as `implausible_value`, naming
the field; the rows around it are imported as usual.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import zlib
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from importlib import resources
from pathlib import Path

from sqlalchemy.exc import DBAPIError
from tqdm import tqdm

from ...db.engine import database_error
from ...db.queries_monitor import insert_request_metrics
from ...db.queries_traffic import (delete_request, insert_new_requests, insert_quarantined, mark_file_error,
                                   purge_before, quarantined_lines, replace_quarantined,
                                   stored_content_hashes, supersede_broken_entries)
from ...db.store import Store
from ...errors import TrafficFileError
from ...settings import Settings
from ...timeutil import utcnow
from .traffic_files import csv_rows, detect_format, jsonl_rows, open_binary
from .traffic_rows import DUPLICATE_ID, RAW_KEEP_CHARS, Normalizer, RowRejected

log = logging.getLogger(__name__)

EXIT_QUARANTINED = 3            # `specdec traffic import` exit status when rows were quarantined


@dataclass
class ImportReport:
    """What one import did. `quarantine_examples`: the first rejected rows (line, reason, detail)."""

    file: str
    database: str
    rows_read: int = 0
    inserted: int = 0
    skipped_existing: int = 0
    quarantined: int = 0
    quarantined_new: int = 0
    quarantined_by_reason: dict[str, int] = field(default_factory=dict)
    quarantine_examples: list[dict] = field(default_factory=list)
    domains_by_rule: dict[str, int] = field(default_factory=dict)
    redacted_rows: int = 0
    superseded: int = 0        # entries of an earlier broken read of this file, now superseded
    seconds: float = 0.0

    @property
    def rows_per_s(self) -> float:
        return self.rows_read / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "rows_per_s": round(self.rows_per_s, 1)}


def sample_traffic_path() -> Path:
    """The shipped sample traffic file (tasks/data/sample_traffic.jsonl.gz)."""
    return Path(str(resources.files("tasks").joinpath("data/sample_traffic.jsonl.gz")))


def _content_hash(row: dict) -> str:
    return hashlib.sha256(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
                          .encode("utf-8")).hexdigest()


def _printable_nul(text: str | None) -> str | None:
    """A quarantined field as stored: a NUL character (which PostgreSQL's text cannot hold, and
    which is often the reason the row is quarantined) written as the four characters \\x00."""
    return text.replace("\x00", "\\x00") if text else text


class _BatchWriter:
    """Writes normalised rows and rejections, one transaction per flush."""

    def __init__(self, store: Store, source_file: str, report: ImportReport, redact):
        self.store = store
        self.source_file = source_file
        self.report = report
        self.redact = redact
        self.rows: list[dict] = []
        self.rejected: list[dict] = []
        self.quarantined_lines: set[int] = set()   # lines this import quarantined

    def add_row(self, record: dict) -> None:
        self.rows.append(record)

    def add_rejection(self, line: int, request_id: str | None, rejection: RowRejected,
                      raw: str | None) -> None:
        report = self.report
        report.quarantined += 1
        report.quarantined_by_reason[rejection.reason] = report.quarantined_by_reason.get(rejection.reason, 0) + 1
        if len(report.quarantine_examples) < 20:
            report.quarantine_examples.append({"line": line, "reason": rejection.reason,
                                               "detail": rejection.detail})
        self.quarantined_lines.add(line)
        if raw is not None:
            raw = _printable_nul(self.redact(raw[:RAW_KEEP_CHARS])[0])
        self.rejected.append({"source_file": self.source_file, "line_number": line,
                              "request_id": _printable_nul(request_id), "reason": rejection.reason,
                              "detail": _printable_nul(rejection.detail[:2000]), "raw": raw,
                              "imported_at": utcnow()})

    def pending(self) -> int:
        return len(self.rows) + len(self.rejected)

    def flush(self) -> None:
        """Write the pending rows and rejections in one transaction. Each row is inserted
        (INSERT ... ON CONFLICT DO NOTHING RETURNING id), and only a row the database did not take
        is compared with the stored one: the same content is skipped, other content quarantined as
        duplicate_id in the same transaction. So a concurrent import of the same ids can neither
        make a row vanish nor be counted as inserted by both: every row read is inserted, skipped
        or quarantined, and the report counts what this import did."""
        if not self.rows and not self.rejected:
            return
        now = utcnow()
        inserted: list[dict] = []
        skipped = 0
        with self.store.transaction() as tx:
            if self.rows:
                inserted, skipped = self._insert_rows(tx, now)
            quarantined_new = self._insert_rejections(tx) if self.rejected else 0
        report = self.report
        report.inserted += len(inserted)
        report.skipped_existing += skipped
        report.quarantined_new += quarantined_new
        for row in inserted:
            source = row["domain_source"]
            report.domains_by_rule[source] = report.domains_by_rule.get(source, 0) + 1
            report.redacted_rows += row["redactions"] > 0
        self.rows.clear()
        self.rejected.clear()

    def _insert_rows(self, tx, now) -> tuple[list[dict], int]:
        """Insert the batch's rows, the first of each id (in id order: concurrent imports take
        their row locks in the same order, so PostgreSQL sees no deadlock); the others of the
        batch, and the rows whose id the database already held, are compared with what is stored
        now: skipped when equal, else quarantined (duplicate_id). Returns (inserted rows, skipped)."""
        first: dict[str, dict] = {}
        for row in self.rows:
            first.setdefault(row["id"], row)
        candidates = [first[key] for key in sorted(first)]
        metrics = {}
        for row in candidates:
            row["imported_at"] = now
            metrics[row["id"]] = row.pop("spec_metrics", None)
        taken = insert_new_requests(tx, candidates)
        inserted = [row for row in candidates if row["id"] in taken]
        # vLLM's per-request spec-decode metrics of the rows inserted, in the same transaction
        insert_request_metrics(tx, [dict(metrics[row["id"]], request_id=row["id"],
                                                 created_at=now)
                                            for row in inserted if metrics[row["id"]]])
        rest = [row for row in self.rows if not (row["id"] in taken and first[row["id"]] is row)]
        ids = sorted({row["id"] for row in rest})
        stored = stored_content_hashes(tx, ids)
        skipped = 0
        for row in rest:
            known = stored.get(row["id"])
            if known is None:       # deleted (a purge) since our insert found it: nothing to skip
                raise TrafficFileError(f"request {row['id']!r} was deleted while this import ran "
                                       "(a concurrent purge?); import the file again")
            if known == row["content_hash"]:
                skipped += 1
            else:
                self.add_rejection(row["source_line"], row["id"], RowRejected(
                    DUPLICATE_ID, f"id {row['id']!r} is already stored with different content"), None)
        return inserted, skipped

    def _insert_rejections(self, tx) -> int:
        """Store the batch's rejections; how many lines of this file are newly quarantined."""
        lines = [row["line_number"] for row in self.rejected]
        seen = quarantined_lines(tx, self.source_file, lines)
        # an entry of a broken read (or superseded) is replaced by what this read found
        stale = [row for row in self.rejected if seen.get(row["line_number"])]
        for row in stale:
            replace_quarantined(tx, self.source_file, row)
        added = insert_quarantined(tx, self.rejected)
        return len(added) + len({row["line_number"] for row in stale})

    def mark_read_error(self, error: str) -> None:
        """The read of the file failed: the entries this import quarantined may be garbled lines
        of a corrupt stream (a gzip yields them before its checksum fails); say so on them."""
        lines = sorted(self.quarantined_lines)
        with self.store.transaction() as tx:
            mark_file_error(tx, self.source_file, lines, error)

    def supersede_broken_reads(self) -> int:
        """The file was read to its end: the open entries an earlier, broken read of it left
        (file_error set) are superseded, by the request stored from that line when there is one.
        Returns how many."""
        with self.store.transaction() as tx:
            superseded = supersede_broken_entries(tx, self.source_file)
        self.report.superseded = superseded
        return superseded


def import_traffic(path: str | Path, store: Store, settings: Settings | None = None,
                   file_format: str | None = None, progress: bool = True) -> dict:
    """Import one traffic file (JSONL or CSV, gzipped or not) into traffic_requests.

    Inputs: the file, the Store, settings (known domains, rules,
    redaction, batch size, row size limit). Output: ImportReport.to_dict(): rows read, inserted,
    skipped (already stored), quarantined by reason with the first examples (line numbers).
    Raises TrafficFileError when the file cannot be read at all, DatabaseUnavailable /
    DatabaseNotMigrated when the database is not ready.
    """
    settings = settings or store.settings
    path = Path(path)
    if path.is_dir():
        raise TrafficFileError(f"traffic file {str(path)!r} is a directory; give a .jsonl or .csv "
                               "file (optionally .gz) in it, one import per file")
    if not path.is_file():
        raise TrafficFileError(f"traffic file {str(path)!r} does not exist; give a .jsonl or .csv "
                               "file (optionally .gz)")
    file_format = detect_format(path, file_format)
    source_file = str(path.resolve())[-500:]
    report = ImportReport(file=str(path), database=store.display_url)
    normalize = Normalizer(settings)
    writer = _BatchWriter(store, source_file, report, normalize.redact)
    started = time.perf_counter()
    raw, stream = open_binary(path)
    size = path.stat().st_size
    try:
        line = 0
        rows = (jsonl_rows(stream, settings.traffic.max_row_bytes) if file_format == "jsonl"
                else csv_rows(stream, settings.traffic.max_row_bytes, path, normalize.redact))
        with tqdm(total=size, unit="B", unit_scale=True, desc=path.name, disable=not progress,
                  leave=False) as bar:
            for line, row, text, rejection in rows:
                report.rows_read += 1
                request_id = None
                if rejection is None:
                    try:
                        record = normalize(row)
                        request_id = record["id"]
                        record["content_hash"] = _content_hash(row)
                        record["source_file"] = source_file
                        record["source_line"] = line
                        writer.add_row(record)
                    except RowRejected as exc:
                        rejection = exc
                        request_id = row.get("id") if isinstance(row.get("id"), str) else None
                if rejection is not None:
                    writer.add_rejection(line, request_id[:200] if request_id else None, rejection, text)
                if writer.pending() >= settings.traffic.import_batch_size:
                    writer.flush()
                    bar.n = raw.tell()
                    bar.set_postfix(rows=report.rows_read, refresh=False)
                    bar.refresh()
            writer.flush()
            writer.supersede_broken_reads()
            bar.n = size
            bar.refresh()
    except DBAPIError as exc:                          # read-only, full or gone mid-import
        raise database_error(store.url, exc) from None
    except (OSError, EOFError, zlib.error) as exc:   # a truncated or corrupt gzip, a bad disk
        writer.flush()                                  # every complete row before the break
        writer.mark_read_error(f"reading stopped at line {line + 1} ({type(exc).__name__}: {exc})")
        raise TrafficFileError(
            f"{path}: reading stopped at line {line + 1} ({type(exc).__name__}: {exc}); the "
            f"{report.inserted} new rows before it are stored ({report.quarantined} quarantined). "
            "Fix or re-copy the file and import it again: stored rows are skipped") from exc
    finally:
        stream.close()
        raw.close()
    report.seconds = time.perf_counter() - started
    log.info("imported %s: %d read, %d inserted, %d already stored, %d quarantined (%s) in %.1f s",
             path, report.rows_read, report.inserted, report.skipped_existing, report.quarantined,
             report.quarantined_by_reason, report.seconds)
    return report.to_dict()


def purge_request(request_id: str, store: Store, dry_run: bool = False) -> None:
    """Delete one stored request by id (one a quality gate names); TrafficFileError when no
    request has that id (nothing deleted)."""
    with store.transaction() as tx:
        found = delete_request(tx, request_id, dry_run)
    if not found:
        raise TrafficFileError(f"request {request_id[:200]!r} is not stored; nothing deleted")
    log.info("purged request %r%s", request_id, " (dry run)" if dry_run else "")


def purge_traffic(older_than_days: float, store: Store, now: datetime | None = None,
                  dry_run: bool = False) -> dict:
    """Retention: delete traffic rows requested, and quarantined rows imported, before
    now - older_than_days (UTC). Returns {"cutoff", "traffic_requests", "quarantined_requests"}."""
    if not (math.isfinite(older_than_days) and 0 <= older_than_days <= 100_000):
        raise TrafficFileError(f"--older-than {older_than_days}: give a number of days from 0 to 100,000")
    cutoff = (now or utcnow()) - timedelta(days=older_than_days)
    with store.transaction() as tx:
        counts = purge_before(tx, cutoff, dry_run)
    log.info("purge before %s: %s%s", cutoff, counts, " (dry run)" if dry_run else "")
    return {"cutoff": cutoff.isoformat(), "dry_run": dry_run, **counts}
