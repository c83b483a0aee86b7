"""Traffic files read as rows: JSONL or CSV, gzipped or not, streamed one row at a time with at most
`max_bytes` of one row in memory. A row that cannot be read comes with its rejection (RowRejected),
for the import to quarantine; a file that cannot be read at all raises TrafficFileError.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import json
from pathlib import Path
from typing import Iterator

from ...errors import TrafficFileError
from .traffic_rows import (ALIASES, MALFORMED_CSV, MALFORMED_JSON, NOT_AN_OBJECT, RAW_KEEP_CHARS,
                           TOO_DEEP, TOO_LARGE, RowRejected, load_json)


CSV_REQUIRED = {"id", "timestamp", "response"}


def open_binary(path: Path):
    raw = open(path, "rb")
    magic = raw.read(2)
    raw.seek(0)
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if magic == b"\x1f\x8b" else raw
    return raw, stream


def detect_format(path: Path, file_format: str | None) -> str:
    if file_format:
        if file_format not in ("jsonl", "csv"):
            raise TrafficFileError(f"format {file_format!r}: use jsonl or csv")
        return file_format
    suffixes = [s.lower() for s in path.suffixes if s.lower() != ".gz"]
    if suffixes and suffixes[-1] in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if suffixes and suffixes[-1] in (".csv",):
        return "csv"
    raise TrafficFileError(f"{path}: cannot tell the format from the name; name it .jsonl / .csv "
                           "(optionally .gz) or pass --format jsonl|csv")


def jsonl_rows(stream, max_bytes: int) -> Iterator[tuple[int, dict | None, str | None, RowRejected | None]]:
    """(line number, row, raw text, rejection) per non-empty line; never holds more than
    max_bytes of one line in memory."""
    number = 0
    while True:
        line = stream.readline(max_bytes + 1)
        if not line:
            return
        number += 1
        if number == 1 and line.startswith(codecs.BOM_UTF8):    # a UTF-8 byte order mark
            line = line[len(codecs.BOM_UTF8):]
        if len(line) > max_bytes and not line.endswith(b"\n"):
            head = line[:RAW_KEEP_CHARS].decode("utf-8", "replace")
            size = len(line)
            while True:   # skip the rest of the line in bounded chunks
                chunk = stream.readline(max_bytes + 1)
                size += len(chunk)
                if not chunk or chunk.endswith(b"\n"):
                    break
            yield number, None, head, RowRejected(
                TOO_LARGE, f"line is {size} bytes; the limit is {max_bytes} (setting traffic_max_row_bytes)")
            continue
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield number, None, line[:RAW_KEEP_CHARS].decode("utf-8", "replace"), RowRejected(
                MALFORMED_JSON, f"not UTF-8 ({exc.reason} at byte {exc.start})")
            continue
        try:
            row = load_json(text)
        except RowRejected as exc:
            yield number, None, text, exc
            continue
        except json.JSONDecodeError as exc:
            yield number, None, text, RowRejected(MALFORMED_JSON, f"{exc.msg} at column {exc.colno}")
            continue
        except RecursionError:
            yield number, None, text, RowRejected(MALFORMED_JSON, TOO_DEEP)
            continue
        if not isinstance(row, dict):
            yield number, None, text, RowRejected(NOT_AN_OBJECT,
                                                  f"expected a JSON object, got {type(row).__name__}")
            continue
        yield number, row, text, None


class _CsvLines:
    """The physical lines of a CSV file for csv.reader, each decoded on its own as UTF-8: a line
    with an undecodable byte is passed on with U+FFFD in its place (so the reader keeps its
    place) and noted in `bad` (line number -> where), and its record is quarantined. A UTF-8 byte
    order mark before the first line is dropped."""

    def __init__(self, stream):
        self.stream = stream
        self.number = 0
        self.offset = 0                  # bytes of the (decompressed) file before this line
        self.bad: dict[int, str] = {}

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = self.stream.readline()
        if not line:
            raise StopIteration
        self.number += 1
        start = self.offset
        self.offset += len(line)
        if self.number == 1 and line.startswith(codecs.BOM_UTF8):
            line = line[len(codecs.BOM_UTF8):]
            start += len(codecs.BOM_UTF8)
        try:
            return line.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.bad[self.number] = (f"not UTF-8 ({exc.reason} at byte {exc.start} of line "
                                     f"{self.number}, byte {start + exc.start} of the file)")
            return line.decode("utf-8", "replace")

    def first_bad(self, first: int, last: int) -> str | None:
        """Where the first undecodable byte of lines first..last is, or None."""
        return next((self.bad[n] for n in range(first, last + 1) if n in self.bad), None)


CSV_COLUMNS = ("id", "timestamp", "domain", "prompt", "messages", "response", "temperature", "top_k",
               "top_p", "max_tokens", "sampling", "model", "target_fingerprint", "prompt_token_ids",
               "response_token_ids", "metrics", "config_version")
PREVIEW_CHARS = 80   # how much of a bad header line an error message shows (redacted)


def _header_error(path: Path, header: list[str], line: str, redact) -> TrafficFileError:
    """The one-line error for a CSV whose first line does not name the needed columns: the file,
    what is missing, the columns expected, and a short redacted preview of the line."""
    missing = sorted(CSV_REQUIRED - set(header)) + ([] if {"prompt", "messages"} & set(header)
                                                    else ["prompt or messages"])
    preview = redact(line.strip())[0] if redact else line.strip()
    preview = preview[:PREVIEW_CHARS] + ("..." if len(preview) > PREVIEW_CHARS else "")
    known = set(CSV_COLUMNS) | set(ALIASES)
    what = ("has no header line" if not known & set(header) else
            f"has a header that lacks {', '.join(missing)}")
    return TrafficFileError(
        f"{path}: the CSV {what} (first line: {preview!r}); the first line must name the columns: "
        f"id, timestamp, response, prompt or messages, and optionally "
        f"{', '.join(c for c in CSV_COLUMNS if c not in CSV_REQUIRED | {'prompt', 'messages'})}")


def csv_rows(stream, max_bytes: int, path: Path, redact=None):
    lines = _CsvLines(stream)
    previous_limit = csv.field_size_limit()
    csv.field_size_limit(max_bytes)
    try:
        reader = csv.reader(lines)
        try:
            header = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise TrafficFileError(f"{path}: the CSV header cannot be read ({exc})") from exc
        bad = lines.first_bad(1, reader.line_num)
        if bad:
            raise TrafficFileError(f"{path}: the CSV header line is {bad}; save the file as UTF-8")
        first_line = ",".join(header)
        header = [ALIASES.get(name.strip(), name.strip()) for name in header]
        if (CSV_REQUIRED - set(header)) or not ({"prompt", "messages"} & set(header)):
            raise _header_error(path, header, first_line, redact)
        last_line = reader.line_num
        while True:
            start = last_line + 1
            try:
                values = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                last_line = reader.line_num
                reason = TOO_LARGE if "field larger" in str(exc) else MALFORMED_CSV
                detail = f"{exc} (setting traffic_max_row_bytes: {max_bytes})"
                yield start, None, None, RowRejected(reason, detail if reason == TOO_LARGE else str(exc))
                continue
            last_line = reader.line_num
            if not any(v.strip() for v in values):
                continue
            raw = ",".join(values)
            bad = lines.first_bad(start, last_line)
            if bad:
                yield start, None, raw[:RAW_KEEP_CHARS], RowRejected(MALFORMED_CSV, bad)
                continue
            if len(values) != len(header):
                yield start, None, raw, RowRejected(
                    MALFORMED_CSV, f"{len(values)} fields, the header has {len(header)}")
                continue
            if sum(len(v) for v in values) > max_bytes:
                yield start, None, raw[:RAW_KEEP_CHARS], RowRejected(
                    TOO_LARGE, f"record is over {max_bytes} characters (setting traffic_max_row_bytes)")
                continue
            yield start, {k: (v if v != "" else None) for k, v in zip(header, values)}, raw, None
    finally:
        csv.field_size_limit(previous_limit)
