"""One logged row read: a parsed row (a dict) turned into a traffic_requests record (Normalizer), or
rejected with one of the quarantine reasons below (RowRejected). What a row may hold: the import's
docstring (tasks.steps.traffic.traffic_import); numbers are read with limits (MAX_NUMBER_DIGITS).
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime, timedelta, timezone

from ...settings import Settings
from ...timeutil import utcnow


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

TOO_DEEP = "JSON nested too deeply (arrays or objects over about 1,000 levels)"
RAW_KEEP_CHARS = 2000          # how much of a rejected row the quarantine keeps (after redaction)
EARLIEST = datetime(2000, 1, 1)
ROLES = {"system", "developer", "user", "assistant", "tool"}
ALIASES = {"request_id": "id", "created_at": "timestamp", "completion": "response",
           "fingerprint": "target_fingerprint"}


class RowRejected(Exception):
    """A row cannot be stored: `reason` is one of the quarantine reasons above."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


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
