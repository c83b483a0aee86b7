"""Suffix decoding: draft tokens from what followed the same text before, in this request and in a
domain's logged responses (after Oliaro et al., "SuffixDecoding", 2024).

`SuffixIndex` holds token sequences (one domain's logged responses) concatenated, separated by -1,
with a suffix array over the REVERSED concatenation, sorted on the first `depth` tokens. A suffix
of the current context, read backwards, is then a prefix of reversed text: the occurrences of ever
longer suffixes of the context are nested ranges of the array, narrowed one token at a time by
binary search, so the longest match costs O(match length x log n). The tokens that followed the
matched occurrences (forward) are the candidate continuations.

`propose_path` picks the continuation as a suffix tree would: from the matched occurrences, the
most frequent next token, then among the occurrences that continue with it the most frequent next
one, and so on -- stopping when a token's empirical probability (occurrences continuing with it /
occurrences reaching it) falls below `min_token_prob`, or after `max_spec_factor` x match length
tokens (fewer tokens when the match is short: the adaptive draft length of suffix decoding).

The index is saved as a NumPy .npz archive of plain integer arrays plus JSON metadata, read with
pickling disabled (a stored index cannot run code), with a format name, a version and a SHA-256
checksum of its arrays.

Build: O(n log depth) (prefix doubling, log2(depth) sorts). Memory: 4 bytes per token for the
text and 4 (or 8 above 2^31 tokens) for the array.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from .errors import SpecDecError

FORMAT = "specdec-suffix-index"
VERSION = 1
SEPARATOR = -1
# most occurrences looked at when choosing a continuation (evenly spread over the matched range)
MAX_OCCURRENCES = 512
# below this many matched occurrences, ranges are narrowed with one vectorised gather
_GATHER_BELOW = 2048


class IndexFileError(SpecDecError, ValueError):
    """A stored suffix index cannot be read: corrupted, foreign or of another version."""


def _dense_rank(*keys: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Ranks 0.. of the rows (key tuples) in `order` (sorted by them); equal tuples share a rank."""
    changed = np.zeros(len(order), dtype=bool)
    for key in keys:
        sorted_key = key[order]
        changed[1:] |= sorted_key[1:] != sorted_key[:-1]
    ranks = np.empty(len(order), dtype=np.int64)
    ranks[order] = np.cumsum(changed)
    return ranks


def _suffix_array(text: np.ndarray, depth: int) -> np.ndarray:
    """Start positions of the suffixes of `text`, sorted on their first `depth` tokens (prefix
    doubling: ranks on 1, 2, 4, ... tokens; ties beyond `depth` keep position order)."""
    n = len(text)
    order = np.argsort(text, kind="stable")
    rank = _dense_rank(text, order=order)
    width = 1
    while width < depth and n:
        shifted = np.full(n, -1, dtype=np.int64)
        shifted[: n - width] = rank[width:]
        order = np.lexsort((shifted, rank))             # by (rank, shifted), stable
        rank = _dense_rank(rank, shifted, order=order)
        width *= 2
        if rank[order[-1]] == n - 1:                    # every suffix already distinct
            break
    return order.astype(np.int32 if n < 2**31 else np.int64)


def _checksum(*arrays: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def greedy_path(windows: np.ndarray, limit: int, min_token_prob: float) -> tuple[np.ndarray, float]:
    """The most frequent continuation path through windows [M, W] (rows: continuations of the
    matched occurrences, SEPARATOR where a sequence ended), at most `limit` tokens, each with
    empirical probability >= min_token_prob. Returns (tokens, score): score is the expected number
    of accepted tokens if the probabilities were right (sum of the path's running products)."""
    tokens: list[int] = []
    score, running = 0.0, 1.0
    rows = windows
    for column in range(min(limit, windows.shape[1])):
        if len(rows) == 0:
            break
        values = rows[:, column]
        values = values[values != SEPARATOR]
        if values.size == 0:
            break
        candidates, counts = np.unique(values, return_counts=True)
        best = int(np.argmax(counts))
        probability = counts[best] / len(rows)
        if probability < min_token_prob:
            break
        token = int(candidates[best])
        tokens.append(token)
        running *= probability
        score += running
        rows = rows[rows[:, column] == token]
    return np.asarray(tokens, dtype=np.int64), score


def _spread(lo: int, hi: int, most: int) -> np.ndarray:
    """At most `most` indices spread evenly over [lo, hi)."""
    if hi - lo <= most:
        return np.arange(lo, hi)
    return np.linspace(lo, hi - 1, most).astype(np.int64)


class SuffixIndex:
    """Logged token sequences indexed for longest-suffix matching (see the module docstring).

    SuffixIndex.build(sequences, request_ids=..., depth=32, meta={...}); index.save(path);
    SuffixIndex.load(path); index.match(context) -> (length, lo, hi);
    index.continuations(lo, hi, width) -> windows [M, width].
    """

    def __init__(self, text: np.ndarray, order: np.ndarray, depth: int,
                 request_ids: list[str] | None = None, meta: dict | None = None):
        self.text = text                              # int32 [n], sequences separated by -1
        self.order = order                            # suffix array of text[::-1]
        self.depth = int(depth)
        self.request_ids = list(request_ids or [])
        self.meta = dict(meta or {})
        # the reversed text, padded so reads past its end see separators
        self._reversed = np.concatenate([text[::-1], np.full(self.depth + 1, SEPARATOR, text.dtype)])
        self._padded = np.concatenate([text, np.full(self.depth + 64, SEPARATOR, text.dtype)])

    # -- building and files ---------------------------------------------------------------------
    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], request_ids: Sequence[str] | None = None,
              depth: int = 32, meta: dict | None = None) -> "SuffixIndex":
        """Index the sequences (e.g. one domain's logged responses); depth: the longest match
        the array is sorted for (longer matches are cut to it)."""
        parts, count = [], 0
        for sequence in sequences:
            array = np.asarray(sequence, dtype=np.int64)
            if array.size and (array.min() < 0 or array.max() >= 2**31):
                raise ValueError("token ids must lie in [0, 2^31)")
            parts.append(array.astype(np.int32))
            parts.append(np.array([SEPARATOR], dtype=np.int32))
            count += 1
        text = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        order = _suffix_array(text[::-1].astype(np.int64), depth)
        meta = dict(meta or {})
        meta.update(sequences=count, tokens=int(len(text) - count))
        return cls(text, order, depth, list(request_ids or []), meta)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        header = {"format": FORMAT, "version": VERSION, "depth": self.depth,
                  "checksum": _checksum(self.text, self.order), "meta": self.meta,
                  "request_ids": self.request_ids}
        with path.open("wb") as handle:
            np.savez_compressed(handle, text=self.text, order=self.order,
                                header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SuffixIndex":
        path = Path(path)
        fix = "rebuild it (specdec draft index build) or pass the right file"
        if not path.is_file():
            raise IndexFileError(f"suffix index {str(path)!r} does not exist; {fix}")
        try:
            with np.load(path, allow_pickle=False) as archive:
                if not {"text", "order", "header"} <= set(archive.files):
                    raise IndexFileError(f"{str(path)!r} is not a specdec suffix index (it holds "
                                         f"{sorted(archive.files)}); {fix}")
                header = json.loads(archive["header"].tobytes().decode())
                text, order = archive["text"], archive["order"]
        except IndexFileError:
            raise
        except Exception as exc:  # noqa: BLE001 - zip, zlib, JSON, NumPy: any of them means unreadable
            raise IndexFileError(f"suffix index {str(path)!r} cannot be read ({type(exc).__name__}: "
                                 f"{exc}); the file is corrupted or not an index: {fix}") from exc
        if header.get("format") != FORMAT:
            raise IndexFileError(f"{str(path)!r} is not a specdec suffix index (format "
                                 f"{header.get('format')!r}); {fix}")
        if header.get("version") != VERSION:
            raise IndexFileError(f"suffix index {str(path)!r} has format version "
                                 f"{header.get('version')!r}, this code reads {VERSION}; {fix}")
        if _checksum(text, order) != header.get("checksum"):
            raise IndexFileError(f"suffix index {str(path)!r} fails its checksum: the file is "
                                 f"corrupted; {fix}")
        return cls(text, order, header["depth"], header.get("request_ids"), header.get("meta"))

    # -- lookups --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.meta.get("sequences", 0))

    @property
    def tokens(self) -> int:
        return int(self.meta.get("tokens", 0))

    def _narrow(self, lo: int, hi: int, column: int, token: int) -> tuple[int, int]:
        """The sub-range of [lo, hi) whose reversed suffixes hold `token` at `column`."""
        reversed_text, order = self._reversed, self.order
        if hi - lo <= _GATHER_BELOW:
            keys = reversed_text[order[lo:hi].astype(np.int64) + column]
            return (lo + int(np.searchsorted(keys, token, "left")),
                    lo + int(np.searchsorted(keys, token, "right")))

        def key(j):
            return reversed_text[order[j] + column]

        return (bisect.bisect_left(range(hi), token, lo, hi, key=key),
                bisect.bisect_right(range(hi), token, lo, hi, key=key))

    def match(self, context: Sequence[int], max_depth: int | None = None) -> tuple[int, int, int]:
        """(length, lo, hi): the longest suffix of `context` (at most max_depth / the index's
        depth tokens) that occurs in the index, and the range of its occurrences (length 0: none)."""
        limit = min(self.depth, max_depth or self.depth, len(context))
        lo, hi, length = 0, len(self.order), 0
        for column in range(limit):
            token = int(context[len(context) - 1 - column])
            new_lo, new_hi = self._narrow(lo, hi, column, token)
            if new_lo >= new_hi:
                break
            lo, hi, length = new_lo, new_hi, column + 1
        return length, lo, hi

    def continuations(self, lo: int, hi: int, width: int) -> np.ndarray:
        """[M, width]: the tokens that followed (some of) the occurrences in [lo, hi) of the
        latest match; SEPARATOR past the end of a sequence."""
        n = len(self.text)
        starts = n - self.order[_spread(lo, hi, MAX_OCCURRENCES)].astype(np.int64)
        return self._padded[starts[:, None] + np.arange(width)]


def context_match(sequence: np.ndarray, max_depth: int) -> tuple[int, np.ndarray]:
    """(length, positions): the longest suffix (at most max_depth tokens) of `sequence` that also
    occurs earlier in it, and the positions just after each such earlier occurrence."""
    n = len(sequence)
    if n < 2:
        return 0, np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(sequence[:-1] == sequence[-1])       # earlier occurrences of the last token
    length = 1 if ends.size else 0
    while ends.size and length < max_depth:
        back = ends - length
        keep = back >= 0
        keep[keep] = sequence[back[keep]] == sequence[n - 1 - length]
        if not keep.any():
            break
        ends, length = ends[keep], length + 1
    return length, ends + 1


def propose_path(sequence: np.ndarray, limit: int, index: SuffixIndex | None, max_depth: int,
                 min_token_prob: float, max_spec_factor: float) -> np.ndarray:
    """Up to `limit` draft tokens continuing `sequence` (prompt + output so far): the better of
    the continuation found in the sequence itself and the one found in the index."""
    best, best_key = np.zeros(0, dtype=np.int64), (0.0, 0)
    if limit <= 0:
        return best
    own_length, positions = context_match(sequence, max_depth)
    candidates = []
    if own_length:
        padded = np.concatenate([sequence, np.full(limit, SEPARATOR, dtype=sequence.dtype)])
        windows = padded[positions[-MAX_OCCURRENCES:, None] + np.arange(limit)]
        candidates.append((own_length, windows))
    if index is not None and len(index.order):
        length, lo, hi = index.match(sequence, max_depth)
        if length:
            candidates.append((length, index.continuations(lo, hi, limit)))
    for length, windows in candidates:
        cap = min(limit, max(1, int(max_spec_factor * length)))
        tokens, score = greedy_path(windows, cap, min_token_prob)
        if (score, length) > best_key:
            best, best_key = tokens, (score, length)
    return best
