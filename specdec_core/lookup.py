"""Prompt lookup for a whole batch in one compiled call.

`find_continuation` (drafters.py) searches one row with numpy; over a batch that is one Python
search per row, about 37 us each, so at batch 64 the host alone costs more than half a GPU step.
`lookup_batch` runs the same search for every row in one call compiled by numba (the n-gram
proposer of vLLM is compiled the same way): each row is scanned once, for every n at the same
time, and the first full-length match ends the scan early (forwards for the earliest occurrence,
vLLM's rule; backwards for the latest). It reads the decode state's
left-padded prompts and the generated tokens in place (no concatenated copy): position p of row b
is prompts[b, p] for p < T, else out[b, p - T]; a row's text starts after its padding and ends
after its n_out[b] generated tokens.

The result equals find_continuation row by row (tested): the offline estimate, which walks rounds
with the per-row function, and the decode loop see the same drafts.
"""

from __future__ import annotations

import numpy as np

from .suffix import MAX_OCCURRENCES, SEPARATOR

try:
    import numba
except ImportError:          # pragma: no cover - numba is a dependency; kept importable without it
    numba = None


def _lookup_rows(prompts, prompt_len, out, n_out, limits, max_ngram, min_ngram, earliest, tokens,
                 counts):
    """Fill tokens[b, :counts[b]] with row b's continuation (see lookup_batch).

    One pass per row over the earlier positions m holding the row's last token (forwards from the
    text's start when `earliest`, else backwards from its end): the match length L (tokens equal
    going back from m and from the row's end, at most max_ngram) says for which n the window
    ending at m matches; the first m met for each n is kept, and an m with L = max_ngram ends the
    scan (no n can do better). The largest n >= min_ngram found wins, as find_continuation's loop
    from max_ngram down picks it."""
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
        first_m, stop, step = (start, end - 1, 1) if earliest else (end - 2, start - 1, -1)
        for m in range(first_m, stop, step):
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
                 tokens: np.ndarray | None = None, earliest: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, k], counts [B]): for each row, up to min(k, limits[b]) tokens that followed the
    earliest (earliest=False: the latest) earlier occurrence of its text's longest matched last n
    tokens, n = max_ngram down to min_ngram (find_continuation's rule).

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
              int(max_ngram), int(min_ngram), bool(earliest), tokens, counts)
    return tokens[:, :k], counts


def warm_up() -> None:
    """Compile the kernel now (once per process; numba's cache makes later processes fast), so
    that no decode -- a timed one above all -- pays for it."""
    empty = np.zeros((1, 2), dtype=np.int64)
    lookup_batch(empty, np.array([2]), empty, np.array([0]), np.array([1]), 1, 1, 1)


# --- suffix decoding over a batch ------------------------------------------------------------------


def _greedy_path(windows, rows, cap, min_token_prob, out):
    """suffix.greedy_path on windows[:rows]: the most frequent continuation (ties: the smallest
    token, as np.unique + argmax pick), written to out; returns (tokens, score)."""
    alive = np.ones(rows, dtype=np.bool_)
    n_alive = rows
    values = np.empty(rows, dtype=np.int64)
    score, running, count = 0.0, 1.0, 0
    for column in range(min(cap, windows.shape[1])):
        if n_alive == 0:
            break
        n_values = 0
        for r in range(rows):
            if alive[r] and windows[r, column] != SEPARATOR:
                values[n_values] = windows[r, column]
                n_values += 1
        if n_values == 0:
            break
        ordered = np.sort(values[:n_values])
        best_token, best_count, run = ordered[0], 0, 1
        for i in range(1, n_values + 1):
            if i < n_values and ordered[i] == ordered[i - 1]:
                run += 1
            else:
                if run > best_count:
                    best_count, best_token = run, ordered[i - 1]
                run = 1
        probability = best_count / n_alive
        if probability < min_token_prob:
            break
        out[count] = best_token
        count += 1
        running *= probability
        score += running
        n_alive = 0
        for r in range(rows):
            if alive[r]:
                if windows[r, column] == best_token:
                    n_alive += 1
                else:
                    alive[r] = False
    return count, score


def _take_better(windows, rows, length, limit, max_spec_factor, min_token_prob, found, out,
                 best_score, best_length, best_count):
    """The greedy path of one candidate (a match of `length` tokens and its continuations): it
    replaces the best so far in `out` when (score, length) is larger, as propose_path compares."""
    cap = min(limit, max(1, int(max_spec_factor * length)))
    got, score = _greedy_path(windows, rows, cap, min_token_prob, found)
    if score > best_score or (score == best_score and length > best_length):
        for j in range(got):
            out[j] = found[j]
        return score, length, got
    return best_score, best_length, best_count


def _own_windows(seq, n, limit, max_depth, most):
    """The row's own text: the longest suffix that occurs earlier in it; (windows [rows, limit] of
    what followed its last `most` occurrences, their number, the matched length)."""
    ends = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n - 1):
        if seq[i] == seq[n - 1]:
            ends[m] = i
            m += 1
    length = 1 if m else 0
    while m and length < max_depth:
        kept = 0
        for j in range(m):
            back = ends[j] - length
            if back >= 0 and seq[back] == seq[n - 1 - length]:
                ends[kept] = ends[j]
                kept += 1
        if kept == 0:
            break
        m, length = kept, length + 1
    first = max(m - most, 0) if length else m
    rows = m - first
    windows = np.empty((rows, limit), dtype=np.int64)
    for r in range(rows):
        for j in range(limit):
            p = ends[first + r] + 1 + j
            windows[r, j] = seq[p] if p < n else SEPARATOR
    return windows, rows, length


def _index_windows(seq, n, limit, reversed_text, order, padded_text, n_text, depth, max_depth,
                   most):
    """The index: the range of occurrences of the row's suffix, narrowed one token at a time
    (binary search); (windows [rows, limit] of what followed up to `most` of them, spread as
    np.linspace picks, their number, the matched length)."""
    lo, hi, length = 0, len(order), 0
    for column in range(min(depth, max_depth, n)):
        token = seq[n - 1 - column]
        a, z = lo, hi
        while a < z:                                  # first key >= token
            mid = (a + z) // 2
            if reversed_text[order[mid] + column] < token:
                a = mid + 1
            else:
                z = mid
        new_lo = a
        z = hi
        while a < z:                                  # first key > token
            mid = (a + z) // 2
            if reversed_text[order[mid] + column] <= token:
                a = mid + 1
            else:
                z = mid
        if new_lo >= a:
            break
        lo, hi, length = new_lo, a, column + 1
    rows = min(hi - lo, most) if length else 0
    windows = np.empty((rows, limit), dtype=np.int64)
    step = (hi - 1 - lo) / (most - 1) if hi - lo > most else 0.0
    for r in range(rows):
        if hi - lo <= most:
            j_order = lo + r
        elif r == rows - 1:                       # np.linspace: the end exactly
            j_order = hi - 1
        else:
            j_order = int(r * step + lo)
        s = n_text - order[j_order]
        for j in range(limit):
            windows[r, j] = padded_text[s + j]
    return windows, rows, length


def _suffix_rows(prompts, prompt_len, out, n_out, limits, k, use_index, reversed_text, order,
                 padded_text, n_text, depth, max_depth, min_token_prob, max_spec_factor,
                 most, tokens, counts):
    """suffix.propose_path for every row (see suffix_batch): the row's own text, then the index."""
    batch, width = prompts.shape
    found = np.empty(k, dtype=np.int64)
    for b in range(batch):
        counts[b] = 0
        limit = min(k, limits[b])
        if limit <= 0:
            continue
        start = width - prompt_len[b]
        n = prompt_len[b] + n_out[b]
        seq = np.empty(n, dtype=np.int64)
        for i in range(n):
            p = start + i
            seq[i] = prompts[b, p] if p < width else out[b, p - width]
        best_score, best_length, best_count = 0.0, 0, 0
        if n >= 2:
            windows, rows, length = _own_windows(seq, n, limit, max_depth, most)
            if length:
                best_score, best_length, best_count = _take_better(
                    windows, rows, length, limit, max_spec_factor, min_token_prob, found, tokens[b],
                    best_score, best_length, best_count)
        if use_index:
            windows, rows, length = _index_windows(seq, n, limit, reversed_text, order, padded_text,
                                                   n_text, depth, max_depth, most)
            if length:
                best_score, best_length, best_count = _take_better(
                    windows, rows, length, limit, max_spec_factor, min_token_prob, found, tokens[b],
                    best_score, best_length, best_count)
        for j in range(best_count, k):
            tokens[b, j] = 0
        counts[b] = best_count


_suffix_compiled = None


def _suffix_kernel():
    global _suffix_compiled
    if _suffix_compiled is None:
        if numba is None:
            _suffix_compiled = _suffix_rows
        else:
            jit = numba.njit(cache=True, nogil=True)
            global _greedy_path, _take_better, _own_windows, _index_windows
            # the kernel calls the compiled helpers
            _greedy_path = jit(_greedy_path)
            _take_better = jit(_take_better)
            _own_windows = jit(_own_windows)
            _index_windows = jit(_index_windows)
            _suffix_compiled = jit(_suffix_rows)
    return _suffix_compiled


def suffix_batch(prompts: np.ndarray, prompt_len: np.ndarray, out: np.ndarray, n_out: np.ndarray,
                 limits: np.ndarray, k: int, index, max_depth: int, min_token_prob: float,
                 max_spec_factor: float) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, k], counts [B]): suffix.propose_path for every row of the batch in one compiled
    call (equal to it row by row; tested), on the same left-padded layout as lookup_batch.
    index: a suffix.SuffixIndex or None (the rows' own text only)."""
    batch = prompts.shape[0]
    tokens = np.zeros((batch, k), dtype=np.int64)
    counts = np.zeros(batch, dtype=np.int64)
    use_index = index is not None and len(index.order) > 0
    if use_index:      # read in place (int32 text; the kernel is compiled for their dtypes)
        arrays = (index._reversed, index.order, index._padded, len(index.text), index.depth)
    else:
        empty = np.zeros(1, dtype=np.int32)
        arrays = (empty, empty, empty, 0, 0)
    _suffix_kernel()(np.ascontiguousarray(prompts, dtype=np.int64), np.asarray(prompt_len, dtype=np.int64),
                     np.ascontiguousarray(out, dtype=np.int64), np.asarray(n_out, dtype=np.int64),
                     np.minimum(np.asarray(limits, dtype=np.int64), k), int(k), use_index, *arrays,
                     int(max_depth), float(min_token_prob), float(max_spec_factor),
                     int(MAX_OCCURRENCES), tokens, counts)
    return tokens, counts


def warm_up_suffix(index=None) -> None:
    """Compile the suffix kernel for this index's array types (and for no index) now, not inside
    a timed decode."""
    empty = np.zeros((1, 2), dtype=np.int64)
    for each in (None, index):
        suffix_batch(empty, np.array([2]), empty, np.array([0]), np.array([1]), 1, each, 4, 0.1, 1.0)
