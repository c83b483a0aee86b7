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

import codecs
import csv
import gzip
import hashlib
import json
import logging
import math
import re
import time
import zlib
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from importlib import resources
from pathlib import Path
from typing import Iterator

from sqlalchemy.exc import DBAPIError

from ...db.engine import database_error
from ...db.queries_monitor import insert_request_metrics
from ...db.queries_traffic import (delete_request, insert_new_requests, insert_quarantined, mark_file_error,
                                   purge_before, quarantined_lines, replace_quarantined,
                                   stored_content_hashes, supersede_broken_entries)
from ...db.store import Store
from ...errors import TrafficFileError
from ...settings import Settings
from ...timeutil import utcnow

log = logging.getLogger(__name__)

# Quarantine reasons: one per kind of defect.
MALFORMED_JSON = "malformed_json"
MALFORMED_CSV = "malformed_csv"
NOT_AN_OBJECT = "not_an_object"
MISSING_FIELD = "missing_field"
INVALID_FIELD = "invalid_field"
BAD_TIMESTAMP = "bad_timestamp"
UNKNOWN_DOMAIN = "unknown_domain"
INVALID_SAMPLING = "invalid_sampling"
TOO_LARGE = "too_large"
DUPLICATE_ID = "duplicate_id"
IMPLAUSIBLE_VALUE = "implausible_value"
EMPTY_RESPONSE = "empty_response"
NUL_CHARACTER = "nul_character"

MAX_TOKENS_LIMIT = 10_000_000   # a max_tokens above it is a logging bug, not a request
EXIT_QUARANTINED = 3            # `specdec traffic import` exit status when rows were quarantined

TOO_DEEP = "JSON nested too deeply (arrays or objects over about 1,000 levels)"
RAW_KEEP_CHARS = 2000          # how much of a rejected row the quarantine keeps (after redaction)
EARLIEST = datetime(2000, 1, 1)
ROLES = {"system", "developer", "user", "assistant", "tool"}
ALIASES = {"request_id": "id", "created_at": "timestamp", "completion": "response",
           "fingerprint": "target_fingerprint"}
CSV_REQUIRED = {"id", "timestamp", "response"}


class RowRejected(Exception):
    """A row cannot be stored: `reason` is one of the quarantine reasons above."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


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


# ------------------------------------------------------------------------------------------------
# normalising one row
class Normalizer:
    """Turns one parsed row (a dict) into a traffic_requests record, or raises RowRejected."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.known = set(settings.known_domains)
        self.rules = [(rule, re.compile(rule.pattern, re.IGNORECASE | re.MULTILINE))
                      for rule in settings.domain_rules]
        self.redactions = [(re.compile(rule.pattern), rule.replacement)
                           for rule in settings.redaction_rules]
        self.latest_allowed = utcnow() + timedelta(days=1)

    def redact(self, text: str) -> tuple[str, int]:
        total = 0
        for pattern, replacement in self.redactions:
            text, count = pattern.subn(replacement, text)
            total += count
        return text, total

    def __call__(self, row: dict) -> dict:
        row = {ALIASES.get(key, key): value for key, value in row.items()}
        request_id = _request_id(row)
        requested_at = parse_timestamp(row.get("timestamp"))
        if requested_at < EARLIEST or requested_at > self.latest_allowed:
            raise RowRejected(BAD_TIMESTAMP, f"timestamp {row.get('timestamp')!r} is outside "
                                             f"{EARLIEST:%Y-%m-%d} .. now + 1 day")
        messages, prompt, last_user = _prompt_of(row)
        response = row.get("response")
        if response is None:
            raise RowRejected(MISSING_FIELD, "no \"response\": the target's logged response is required")
        if not isinstance(response, str):
            raise RowRejected(INVALID_FIELD, f"\"response\" must be a string, got {type(response).__name__}")
        if response == "" or row.get("response_token_ids") == []:
            raise RowRejected(EMPTY_RESPONSE, "\"response\" is empty: there is nothing to score a "
                                              "draft against (a failed or cancelled request?)")
        for name, text in (("prompt", prompt), ("response", response), ("id", request_id),
                           ("model", row.get("model")), ("domain", row.get("domain"))):
            if isinstance(text, str) and "\x00" in text:
                raise RowRejected(NUL_CHARACTER, f"\"{name}\" contains a NUL character (at "
                                                 f"{text.index(chr(0))}): a binary or corrupted field")
        temperature, top_k, top_p, max_tokens = self._sampling(row)
        model = row.get("model")
        if model is None or (isinstance(model, str) and not model.strip()):
            raise RowRejected(MISSING_FIELD, "no \"model\": name the target that produced the response")
        if not isinstance(model, str) or len(model) > 200:
            raise RowRejected(INVALID_FIELD, "\"model\" must be a string of at most 200 characters")
        fingerprint = row.get("target_fingerprint")
        if fingerprint is not None and (not isinstance(fingerprint, str) or len(fingerprint) > 200):
            raise RowRejected(INVALID_FIELD, "\"target_fingerprint\" must be a string of at most 200 characters")
        prompt_ids = _token_ids(row, "prompt_token_ids")
        response_ids = _token_ids(row, "response_token_ids")

        domain, domain_source = self._domain(row.get("domain"), last_user)

        # privacy: redact before anything is stored; token ids of a redacted text would leak it
        response, response_hits = self.redact(response)
        if messages is None:
            prompt, prompt_hits = self.redact(prompt)
        else:
            prompt_hits, redacted_messages = 0, []
            for message in messages:
                content, hits = self.redact(message["content"])
                prompt_hits += hits
                redacted_messages.append({**message, "content": content})
            messages = redacted_messages
            prompt = _join_messages(messages)
        self._check_lengths(prompt, response)
        if prompt_hits:
            prompt_ids = None
        if response_hits:
            response_ids = None
        return {
            "id": request_id, "requested_at": requested_at, "domain": domain,
            "domain_source": domain_source, "prompt": prompt, "messages": messages,
            "response": response, "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "max_tokens": max_tokens, "model": model, "target_fingerprint": fingerprint,
            "prompt_token_ids": prompt_ids, "response_token_ids": response_ids,
            "prompt_chars": len(prompt), "response_chars": len(response),
            "prompt_tokens": len(prompt_ids) if prompt_ids is not None else None,
            "response_tokens": len(response_ids) if response_ids is not None else None,
            "redactions": prompt_hits + response_hits,
            "spec_metrics": _spec_metrics(row),     # stored apart (request_spec_metrics)
        }

    def _check_lengths(self, prompt: str, response: str) -> None:
        """A prompt or response longer than the sample's quality gate allows is too_large here,
        at import: stored, it would fail the gate of every run (every domain) until purged."""
        quality = self.settings.quality
        for name, text, limit in (("prompt", prompt, quality.max_prompt_chars),
                                  ("response", response, quality.max_response_chars)):
            if len(text) > limit:
                raise RowRejected(TOO_LARGE, f"{name} is {len(text)} characters; at most {limit} "
                                             f"(setting max_{name}_chars, the sample's quality gate)")

    def _domain(self, value, last_user: str) -> tuple[str, str]:
        if value is not None and not (isinstance(value, str) and not value.strip()):
            if not isinstance(value, str):
                raise RowRejected(INVALID_FIELD, f"\"domain\" must be a string, got {type(value).__name__}")
            domain = value.strip().lower()
            if domain not in self.known:
                raise RowRejected(UNKNOWN_DOMAIN, f"domain {value!r} is not in the known set "
                                                  f"{sorted(self.known)} (setting known_domains)")
            return domain, "row"
        for rule, pattern in self.rules:
            if pattern.search(last_user):
                return rule.domain, f"rule:{rule.name}"
        return self.settings.fallback_domain, "fallback"

    def _sampling(self, row: dict) -> tuple[float, int, float, int | None]:
        nested = row.get("sampling")
        if nested is not None and not isinstance(nested, dict):
            raise RowRejected(INVALID_SAMPLING, "\"sampling\" must be an object "
                                                "{temperature, top_k, top_p}")
        source = {**(nested or {}), **{k: row[k] for k in ("temperature", "top_k", "top_p",
                                                             "max_tokens") if row.get(k) is not None}}
        temperature = source.get("temperature", self.settings.traffic.default_temperature)
        if temperature is None:
            raise RowRejected(MISSING_FIELD, "no \"temperature\": the offline estimate needs the "
                                             "logged sampling params (or set default_temperature)")
        temperature = _number(temperature, "temperature", INVALID_SAMPLING)
        top_k = _number(source.get("top_k", 0), "top_k", INVALID_SAMPLING)
        top_p = _number(source.get("top_p", 1.0), "top_p", INVALID_SAMPLING)
        if not 0.0 <= temperature <= 100.0:
            raise RowRejected(INVALID_SAMPLING, f"temperature {temperature} must be in [0, 100] (0: greedy)")
        if top_k < 0 or top_k != int(top_k):
            raise RowRejected(INVALID_SAMPLING, f"top_k {top_k} must be an integer >= 0 (0: off)")
        if not 0.0 < top_p <= 1.0:
            raise RowRejected(INVALID_SAMPLING, f"top_p {top_p} must be in (0, 1] (1: off)")
        max_tokens = source.get("max_tokens")
        if max_tokens is not None:
            max_tokens = _number(max_tokens, "max_tokens", INVALID_FIELD)
            if max_tokens < 1 or max_tokens != int(max_tokens):
                raise RowRejected(INVALID_FIELD, f"max_tokens {max_tokens} must be an integer >= 1")
            if max_tokens > MAX_TOKENS_LIMIT:
                raise RowRejected(IMPLAUSIBLE_VALUE, f"max_tokens {max_tokens:.0f} is implausible "
                                                     f"(above {MAX_TOKENS_LIMIT:,})")
            max_tokens = int(max_tokens)
        return float(temperature), int(top_k), float(top_p), max_tokens


def _request_id(row: dict) -> str:
    value = row.get("id")
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RowRejected(MISSING_FIELD, "no \"id\": every request needs a unique id")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowRejected(INVALID_FIELD, f"\"id\" must be a string or an integer, got {type(value).__name__}")
    value = str(value).strip()
    if len(value) > 200:
        raise RowRejected(INVALID_FIELD, f"\"id\" is {len(value)} characters long; at most 200")
    return value


def parse_timestamp(value) -> datetime:
    """A naive UTC datetime from ISO 8601 (naive = UTC) or epoch seconds/milliseconds."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RowRejected(MISSING_FIELD, "no \"timestamp\" (ISO 8601 or epoch seconds)")
    if isinstance(value, bool):
        raise RowRejected(BAD_TIMESTAMP, f"timestamp {value!r} is not a time")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            try:
                parsed = datetime.fromisoformat(text[:-1] + "+00:00" if text[-1:] in "zZ" else text)
            except ValueError:
                raise RowRejected(BAD_TIMESTAMP, f"timestamp {text[:60]!r} is neither ISO 8601 "
                                                 "(2025-11-03T14:05:00Z) nor epoch seconds") from None
            if parsed.tzinfo is not None:
                parsed = parsed.astimezone(timezone.utc).replace(tzinfo=None)
            return parsed
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise RowRejected(BAD_TIMESTAMP, f"timestamp {value!r} is not finite")
        seconds = value / 1000.0 if abs(value) > 1e11 else float(value)   # milliseconds
        try:
            return datetime.fromtimestamp(seconds, timezone.utc).replace(tzinfo=None)
        except (OverflowError, OSError, ValueError):
            raise RowRejected(BAD_TIMESTAMP, f"timestamp {value!r} is out of range") from None
    raise RowRejected(BAD_TIMESTAMP, f"timestamp of type {type(value).__name__} is not a time")


def _prompt_of(row: dict) -> tuple[list | None, str, str]:
    """(messages or None, prompt text, last user message) from `messages` or `prompt`."""
    messages = row.get("messages")
    if isinstance(messages, str) and messages.strip():
        try:
            messages = load_json(messages, "messages")   # CSV carries messages as JSON text
        except json.JSONDecodeError:
            raise RowRejected(INVALID_FIELD, "\"messages\" is a string but not JSON") from None
        except RecursionError:
            raise RowRejected(INVALID_FIELD, f"\"messages\": {TOO_DEEP}") from None
    if messages is not None and messages != "":
        if not isinstance(messages, list) or not messages:
            raise RowRejected(INVALID_FIELD, "\"messages\" must be a non-empty list of "
                                             "{\"role\", \"content\"} objects")
        normalised = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise RowRejected(INVALID_FIELD, f"messages[{index}] needs a \"role\" in {sorted(ROLES)}")
            content = message.get("content")
            if isinstance(content, list):   # content parts: keep the text parts
                content = "".join(part.get("text", "") for part in content
                                  if isinstance(part, dict) and part.get("type") == "text")
            if not isinstance(content, str):
                raise RowRejected(INVALID_FIELD, f"messages[{index}].content must be text")
            normalised.append({"role": message["role"], "content": content})
        users = [m["content"] for m in normalised if m["role"] == "user"]
        if not users:
            raise RowRejected(INVALID_FIELD, "\"messages\" has no user message")
        return normalised, _join_messages(normalised), users[-1]
    prompt = row.get("prompt")
    if prompt is None or prompt == "":
        raise RowRejected(MISSING_FIELD, "neither \"messages\" nor \"prompt\" is given")
    if not isinstance(prompt, str):
        raise RowRejected(INVALID_FIELD, f"\"prompt\" must be a string, got {type(prompt).__name__}")
    return None, prompt, prompt


def _join_messages(messages: list[dict]) -> str:
    """The prompt text of a chat: every turn's content, separated by blank lines."""
    return "\n\n".join(m["content"] for m in messages)


MAX_NUMBER_DIGITS = 200         # an integer literal longer than this is a logging bug, not a value
_LONG_NUMBER = re.compile(r"[0-9]{%d,}" % (MAX_NUMBER_DIGITS + 1))


class _Oversized:
    """Where json.loads met an integer literal of more than MAX_NUMBER_DIGITS digits."""

    def __init__(self, digits: int):
        self.digits = digits


def _bounded_int(text: str):
    digits = len(text.lstrip("-"))
    return _Oversized(digits) if digits > MAX_NUMBER_DIGITS else int(text)


def _oversized_path(value) -> tuple[str, _Oversized] | None:
    """(path, marker) of the first _Oversized in a parsed JSON value, walked without recursion."""
    stack = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, _Oversized):
            return path, item
        if isinstance(item, dict):
            stack += [(f"{path}.{key}" if path else str(key), v) for key, v in reversed(item.items())]
        elif isinstance(item, list):
            stack += [(f"{path}[{i}]", v) for i, v in reversed(list(enumerate(item)))]
    return None


def load_json(text: str, name: str = ""):
    """json.loads with integer literals of at most MAX_NUMBER_DIGITS digits: a longer one (Python
    refuses to convert one over 4,300 digits, and one over 308 is no float) is RowRejected
    (implausible_value) naming where it is, `name` (the field the text came from) first.
    JSONDecodeError and RecursionError pass as json.loads raises them."""
    try:
        value = json.loads(text)
        if not _LONG_NUMBER.search(text):       # the common case: no long run of digits at all
            return value
    except json.JSONDecodeError:
        raise
    except ValueError:                          # Python's integer-conversion limit
        pass
    value = json.loads(text, parse_int=_bounded_int)
    found = _oversized_path(value)
    if found is None:
        return value                            # the long digits were inside a string
    path, marker = found
    where = f"{name}{'.' if name and path[:1] not in ('', '[') else ''}{path}" or "the line"
    raise RowRejected(IMPLAUSIBLE_VALUE, f"\"{where}\" is a number of {marker.digits} digits; "
                                         f"at most {MAX_NUMBER_DIGITS} are read (a logging bug?)")


def _number(value, name: str, reason: str) -> float:
    if isinstance(value, bool):
        raise RowRejected(reason, f"{name} {value!r} is not a number")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise RowRejected(reason, f"{name} {value[:40]!r} is not a number") from None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RowRejected(reason, f"{name} {value!r} is not a finite number")
    return value


MAX_METRIC_COUNT = 100_000_000   # a count above it in a request's metrics is a logging bug


def _count(value, name: str, required: bool = True) -> int | None:
    """A non-negative integer count of `metrics.speculative_decoding`; RowRejected otherwise."""
    if value is None:
        if required:
            raise RowRejected(MISSING_FIELD, f"metrics.speculative_decoding has no \"{name}\"")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or value < 0:
        raise RowRejected(INVALID_FIELD, f"metrics.speculative_decoding.{name} {str(value)[:40]!r} "
                                         "must be an integer >= 0")
    if value > MAX_METRIC_COUNT:
        raise RowRejected(IMPLAUSIBLE_VALUE, f"metrics.speculative_decoding.{name} {value:.0f} is "
                                             f"implausible (above {MAX_METRIC_COUNT:,})")
    return int(value)


def _spec_metrics(row: dict) -> dict | None:
    """vLLM's per-request `metrics.speculative_decoding` of a logged response (verify steps, draft
    tokens, accepted drafts, the histogram of accepted drafts per step, K) and the `config_version`
    that served it; None when the row has none. A malformed or inconsistent object: RowRejected
    naming the field (the row is quarantined: its counts would corrupt production's E)."""
    metrics = row.get("metrics")
    if isinstance(metrics, str) and metrics.strip():
        try:
            metrics = load_json(metrics, "metrics")     # CSV carries it as JSON text
        except (json.JSONDecodeError, RecursionError):
            raise RowRejected(INVALID_FIELD, "\"metrics\" is a string but not a JSON object") from None
    if metrics is None or metrics == "":
        return None
    if not isinstance(metrics, dict):
        raise RowRejected(INVALID_FIELD, f"\"metrics\" must be an object, got {type(metrics).__name__}")
    spec = metrics.get("speculative_decoding")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise RowRejected(INVALID_FIELD, "metrics.speculative_decoding must be an object")
    steps = _count(spec.get("num_spec_steps"), "num_spec_steps")
    drafted = _count(spec.get("num_draft_tokens"), "num_draft_tokens")
    accepted = _count(spec.get("num_accepted_draft_tokens"), "num_accepted_draft_tokens")
    k = _count(spec.get("num_spec_tokens"), "num_spec_tokens", required=False)
    histogram = spec.get("acceptance_histogram")
    if histogram is not None:
        if not isinstance(histogram, list):
            raise RowRejected(INVALID_FIELD, "metrics.speculative_decoding.acceptance_histogram "
                                             "must be a list of counts")
        histogram = [_count(h, "acceptance_histogram[]") for h in histogram]
        if sum(histogram) != steps or sum(j * h for j, h in enumerate(histogram)) != accepted:
            raise RowRejected(INVALID_FIELD, "metrics.speculative_decoding is inconsistent: its "
                                             "acceptance_histogram does not sum to num_spec_steps "
                                             "and num_accepted_draft_tokens")
    if accepted > drafted or (k is not None and drafted > k * steps):
        raise RowRejected(IMPLAUSIBLE_VALUE, f"metrics.speculative_decoding: {accepted} accepted of "
                                             f"{drafted} draft tokens in {steps} steps"
                                             + ("" if k is None else f" at K = {k}"))
    version = row.get("config_version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))
                                or not str(version).strip() or len(str(version)) > 32):
        raise RowRejected(INVALID_FIELD, "\"config_version\" must be a registered version (a "
                                         "string or integer of at most 32 characters)")
    return {"config_version": None if version is None else str(version).strip(),
            "spec_steps": steps, "draft_tokens": drafted, "accepted_tokens": accepted,
            "num_spec_tokens": k, "acceptance_histogram": histogram}


def _token_ids(row: dict, name: str) -> list[int] | None:
    value = row.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = load_json(value, name)
        except json.JSONDecodeError:
            raise RowRejected(INVALID_FIELD, f"{name} is a string but not a JSON array") from None
        except RecursionError:
            raise RowRejected(INVALID_FIELD, f"{name}: {TOO_DEEP}") from None
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 10_000_000 for t in value):
        raise RowRejected(INVALID_FIELD, f"{name} must be a list of token ids (integers >= 0)")
    return value


# ------------------------------------------------------------------------------------------------
# reading files
def _open_binary(path: Path):
    raw = open(path, "rb")
    magic = raw.read(2)
    raw.seek(0)
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if magic == b"\x1f\x8b" else raw
    return raw, stream


def _detect_format(path: Path, file_format: str | None) -> str:
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


def _jsonl_rows(stream, max_bytes: int) -> Iterator[tuple[int, dict | None, str | None, RowRejected | None]]:
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


def _csv_rows(stream, max_bytes: int, path: Path, redact=None):
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


# ------------------------------------------------------------------------------------------------
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
    # imported here: tqdm: the data commands load no torch (tests/test_store.py)
    from tqdm import tqdm

    settings = settings or store.settings
    path = Path(path)
    if path.is_dir():
        raise TrafficFileError(f"traffic file {str(path)!r} is a directory; give a .jsonl or .csv "
                               "file (optionally .gz) in it, one import per file")
    if not path.is_file():
        raise TrafficFileError(f"traffic file {str(path)!r} does not exist; give a .jsonl or .csv "
                               "file (optionally .gz)")
    file_format = _detect_format(path, file_format)
    source_file = str(path.resolve())[-500:]
    report = ImportReport(file=str(path), database=store.display_url)
    normalize = Normalizer(settings)
    writer = _BatchWriter(store, source_file, report, normalize.redact)
    started = time.perf_counter()
    raw, stream = _open_binary(path)
    size = path.stat().st_size
    try:
        line = 0
        rows = (_jsonl_rows(stream, settings.traffic.max_row_bytes) if file_format == "jsonl"
                else _csv_rows(stream, settings.traffic.max_row_bytes, path, normalize.redact))
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
