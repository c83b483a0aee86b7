"""Prompt lookup for a whole batch in one compiled call.

`find_continuation` (drafters.py) searches one row with numpy; over a batch that is one Python
search per row, about 37 us each, so at batch 64 the host alone costs more than half a GPU step.
`lookup_batch` runs the same search for every row in one call compiled by numba (the n-gram
proposer of vLLM is compiled the same way): each row is scanned backwards from its end once, for
every n at the same time, and the latest occurrence of the longest n -- usually close by -- ends
the scan early. It reads the decode state's
left-padded prompts and the generated tokens in place (no concatenated copy): position p of row b
is prompts[b, p] for p < T, else out[b, p - T]; a row's text starts after its padding and ends
after its n_out[b] generated tokens.

The result equals find_continuation row by row (tested): the offline estimate, which walks rounds
with the per-row function, and the decode loop see the same drafts.
"""

from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:          # pragma: no cover - numba is a dependency; kept importable without it
    numba = None


def _lookup_rows(prompts, prompt_len, out, n_out, limits, max_ngram, min_ngram, tokens, counts):
    """Fill tokens[b, :counts[b]] with row b's continuation (see lookup_batch).

    One backward pass per row: at each earlier position m holding the row's last token, the match
    length L (tokens equal going back from m and from the row's end, at most max_ngram) says for
    which n the window ending at m matches; the latest m for each n is kept, and an m with
    L = max_ngram ends the scan (no n can do better). The largest n >= min_ngram found wins, as
    find_continuation's loop from max_ngram down picks it."""
    batch, width = prompts.shape
    best = np.full(max_ngram + 1, -1, dtype=np.int64)
    for b in range(batch):
        counts[b] = 0
        limit = limits[b]
        if limit <= 0:
            continue
        start = width - prompt_len[b]
        end = width + n_out[b]
        if end - start <= min_ngram:
            continue
        best[:] = -1
        q = end - 1
        last = prompts[b, q] if q < width else out[b, q - width]
        # m: the last position of a window; the window needs a token after it (m <= end - 2)
        for m in range(end - 2, start - 1, -1):
            a = prompts[b, m] if m < width else out[b, m - width]
            if a != last:
                continue
            length = 1
            while length < max_ngram and m - length >= start:
                p = m - length
                q = end - 1 - length
                a = prompts[b, p] if p < width else out[b, p - width]
                c = prompts[b, q] if q < width else out[b, q - width]
                if a != c:
                    break
                length += 1
            for n in range(1, length + 1):
                if best[n] < 0:
                    best[n] = m
            if length == max_ngram:
                break
        for n in range(max_ngram, min_ngram - 1, -1):
            if best[n] >= 0 and end - start > n:
                first = best[n] + 1
                count = min(limit, end - first)
                for i in range(count):
                    p = first + i
                    tokens[b, i] = prompts[b, p] if p < width else out[b, p - width]
                counts[b] = count
                break


_compiled = None


def _kernel():
    global _compiled
    if _compiled is None:
        _compiled = (numba.njit(cache=True, nogil=True)(_lookup_rows) if numba is not None
                     else _lookup_rows)
    return _compiled


def lookup_batch(prompts: np.ndarray, prompt_len: np.ndarray, out: np.ndarray, n_out: np.ndarray,
                 limits: np.ndarray, k: int, max_ngram: int, min_ngram: int = 1,
                 tokens: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, k], counts [B]): for each row, up to min(k, limits[b]) tokens that followed the
    latest earlier occurrence of its text's last n tokens, n = max_ngram down to min_ngram.

    prompts [B, T] left-padded (the last prompt_len[b] columns are row b's prompt), out [B, N]
    generated tokens (the first n_out[b] are row b's), limits [B] (0: nothing for that row).
    tokens: an int64 [B, >= k] buffer to fill (reused across rounds); zero past counts[b].
    """
    batch = prompts.shape[0]
    if tokens is None:
        tokens = np.zeros((batch, k), dtype=np.int64)
    else:
        tokens[:, :k] = 0
    counts = np.zeros(batch, dtype=np.int64)
    limits = np.minimum(np.asarray(limits, dtype=np.int64), k)
    _kernel()(np.ascontiguousarray(prompts, dtype=np.int64), np.asarray(prompt_len, dtype=np.int64),
              np.ascontiguousarray(out, dtype=np.int64), np.asarray(n_out, dtype=np.int64), limits,
              int(max_ngram), int(min_ngram), tokens, counts)
    return tokens[:, :k], counts


def warm_up() -> None:
    """Compile the kernel now (once per process; numba's cache makes later processes fast), so
    that no decode -- a timed one above all -- pays for it."""
    empty = np.zeros((1, 2), dtype=np.int64)
    lookup_batch(empty, np.array([2]), empty, np.array([0]), np.array([1]), 1, 1, 1)
