"""Unit tests for specdec_core.verify: exact rejection sampling, greedy and relaxed verification.

The distribution tests feed the verifier fixed, position-independent target distributions p_j and
draft distributions q_j (valid here because target_probs are inputs, not computed from a prefix).
Then the token emitted at output position j follows p_j among the rows that reached it, where
"reached" means num_accepted >= j (and j <= num_draft): that event depends only on what happened at
positions < j, never on the value emitted at j.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec_core.verify import greedy_verify, rejection_sample, relaxed_verify

# ---------------------------------------------------------------------------------------------
# The fixed small case for the distribution tests: V = 6, K = 3.
# At every draft position some q(x) > p(x), some q(x) < p(x), one token has q > 0 but p = 0, and
# one token has p > 0 but q = 0 (reachable only through the residual).
# ---------------------------------------------------------------------------------------------
P = torch.tensor([
    [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],   # p_0: token 5 has p = 0 (q = 0.30), token 4 has q = 0
    [0.05, 0.40, 0.00, 0.25, 0.20, 0.10],   # p_1: token 2 has p = 0 (q = 0.15)
    [0.50, 0.00, 0.10, 0.10, 0.10, 0.20],   # p_2: token 1 has p = 0 (q = 0.10)
    [0.10, 0.20, 0.30, 0.00, 0.25, 0.15],   # p_3: the bonus position
], dtype=torch.float64)
Q = torch.tensor([
    [0.10, 0.30, 0.10, 0.20, 0.00, 0.30],
    [0.20, 0.30, 0.15, 0.25, 0.05, 0.05],
    [0.35, 0.10, 0.25, 0.05, 0.10, 0.15],
], dtype=torch.float64)
K, V = Q.shape
# rows per draft length: full drafts, a short draft, and no draft at all
GROUPS = {3: 30_000, 1: 10_000, 0: 6_000}
# family-wise false-alarm rate 1e-3, Bonferroni over the (group, position) tests
N_TESTS = sum(d + 1 for d in GROUPS)
THRESHOLD = 1e-3 / N_TESTS


def _make_batch(seed: int = 0):
    """Drafts drawn from Q at every position (valid ids past num_draft too), probs, num_draft."""
    gen = torch.Generator().manual_seed(seed)
    num_draft = torch.cat([torch.full((n,), d, dtype=torch.long) for d, n in GROUPS.items()])
    batch = num_draft.numel()
    draft_tokens = torch.stack(
        [torch.multinomial(Q[j], batch, replacement=True, generator=gen) for j in range(K)], dim=1)
    draft_probs = Q.float().expand(batch, K, V).contiguous()
    target_probs = P.float().expand(batch, K + 1, V).contiguous()
    return draft_tokens, draft_probs, target_probs, num_draft


def _position_pvalues(out_tokens, num_accepted, num_draft):
    """{(d, j): (chi-square p-value vs P[j] on its p > 0 bins, rows reached, tokens with p = 0)}."""
    results = {}
    for d in GROUPS:
        for j in range(d + 1):
            reached = (num_draft == d) & (num_accepted >= j)
            tokens = out_tokens[reached, j]
            counts = torch.bincount(tokens, minlength=V).double()
            support = P[j] > 0
            n = int(reached.sum())
            # expected counts over the support, scaled to the observed total there (a broken
            # verifier may emit tokens with p = 0; those are counted separately)
            observed = counts[support]
            expected = P[j][support] / P[j][support].sum() * observed.sum()
            pvalue = chisquare(observed.numpy(), expected.numpy()).pvalue
            results[(d, j)] = (float(pvalue), n, int(counts[~support].sum()))
    return results


@pytest.fixture(scope="module")
def batch():
    return _make_batch(seed=0)


def test_rejection_sample_preserves_target_distribution_at_every_position(batch):
    """Exact verification: every emitted position (drafts, corrections, bonus) follows p_j."""
    draft_tokens, draft_probs, target_probs, num_draft = batch
    out, acc = rejection_sample(draft_tokens, draft_probs, target_probs,
                                generator=torch.Generator().manual_seed(1), num_draft=num_draft)
    results = _position_pvalues(out, acc, num_draft)
    assert set(results) == {(3, 0), (3, 1), (3, 2), (3, 3), (1, 0), (1, 1), (0, 0)}
    for key, (pvalue, n, zero_hits) in results.items():
        assert n >= 2_000, (key, n)  # enough rows reached every position for the test to bite
        assert zero_hits == 0, (key, zero_hits)
        assert pvalue > THRESHOLD, (key, pvalue)


def test_rejection_sample_acceptance_rate_matches_sum_min_p_q(batch):
    """The first draft is accepted with probability sum_x min(p_0(x), q_0(x)) = 0.6."""
    draft_tokens, draft_probs, target_probs, num_draft = batch
    _, acc = rejection_sample(draft_tokens, draft_probs, target_probs,
                              generator=torch.Generator().manual_seed(2), num_draft=num_draft)
    full = num_draft == K
    rate = (acc[full] >= 1).double().mean().item()
    alpha0 = torch.minimum(P[0], Q[0]).sum().item()
    n = int(full.sum())
    assert abs(rate - alpha0) < 5 * (alpha0 * (1 - alpha0) / n) ** 0.5


def test_chi_square_detects_relaxed_verify(batch):
    """Power check: the lossy relaxed verifier is caught by the same per-position test."""
    draft_tokens, draft_probs, target_probs, num_draft = batch
    out, acc = relaxed_verify(draft_tokens, draft_probs, target_probs,
                              generator=torch.Generator().manual_seed(1), num_draft=num_draft)
    results = _position_pvalues(out, acc, num_draft)
    assert min(pvalue for pvalue, _, _ in results.values()) < 1e-12


def test_chi_square_detects_p_and_q_swapped(batch):
    """Power check: a verifier that uses q as the target and p as the draft is caught."""
    draft_tokens, draft_probs, target_probs, num_draft = batch
    swapped_target = torch.cat([draft_probs, target_probs[:, K:]], dim=1)  # q_0..q_2, then p_3
    swapped_draft = target_probs[:, :K]
    out, acc = rejection_sample(draft_tokens, swapped_draft, swapped_target,
                                generator=torch.Generator().manual_seed(1), num_draft=num_draft)
    results = _position_pvalues(out, acc, num_draft)
    assert min(pvalue for pvalue, _, _ in results.values()) < 1e-12


def test_chi_square_detects_short_draft_padded_with_forced_rejections(batch):
    """Power check: padding a short draft with a p = 0 token (forced rejection) is caught."""
    draft_tokens, draft_probs, target_probs, num_draft = batch
    zero_p_token = torch.tensor([5, 2, 1])  # p_j(token) = 0 at positions 0, 1, 2
    pad = torch.arange(K) >= num_draft[:, None]
    forced = torch.where(pad, zero_p_token.expand_as(draft_tokens), draft_tokens)
    out, acc = rejection_sample(forced, draft_probs, target_probs,
                                generator=torch.Generator().manual_seed(1), num_draft=None)
    results = _position_pvalues(out, acc, num_draft)
    # the drafted positions stay exact; the "one more token" of short rows no longer follows p
    assert results[(3, 0)][0] > THRESHOLD
    assert results[(1, 1)][0] < 1e-12
    assert results[(0, 0)][0] < 1e-12


# ---------------------------------------------------------------------------------------------
# Shapes and contract of rejection_sample
# ---------------------------------------------------------------------------------------------

def _random_case(batch: int, k: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(batch, k, vocab, generator=gen).softmax(-1)
    p = (3 * torch.rand(batch, k + 1, vocab, generator=gen)).softmax(-1)
    tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    return tokens, q, p, num_draft


def test_rejection_sample_output_layout():
    """out is [B, K+1] long: accepted drafts, one token, then -1; 0 <= num_accepted <= num_draft."""
    tokens, q, p, num_draft = _random_case(batch=500, k=4, vocab=8, seed=3)
    out, acc = rejection_sample(tokens, q, p, generator=torch.Generator().manual_seed(4),
                                num_draft=num_draft)
    assert out.shape == (500, 5) and out.dtype == torch.long
    assert acc.shape == (500,) and acc.dtype == torch.long
    assert bool(((acc >= 0) & (acc <= num_draft)).all())
    pos = torch.arange(5)
    accepted = pos < acc[:, None]
    assert torch.equal(out[:, :4][accepted[:, :4]], tokens[accepted[:, :4]])
    one_more = out.gather(1, acc[:, None]).squeeze(1)
    assert bool(((one_more >= 0) & (one_more < 8)).all())
    assert bool((out[pos > acc[:, None]] == -1).all())
    # both outcomes occur in this case, so the layout checks above covered them
    assert bool((acc == num_draft).any()) and bool((acc < num_draft).any())


def test_rejection_sample_num_draft_none_means_k():
    """num_draft=None verifies all K drafts, exactly as num_draft=K does."""
    tokens, q, p, _ = _random_case(batch=200, k=3, vocab=5, seed=5)
    out_none, acc_none = rejection_sample(tokens, q, p, generator=torch.Generator().manual_seed(6))
    out_k, acc_k = rejection_sample(tokens, q, p, generator=torch.Generator().manual_seed(6),
                                    num_draft=torch.full((200,), 3))
    assert torch.equal(out_none, out_k) and torch.equal(acc_none, acc_k)


def test_rejection_sample_is_deterministic_given_seed():
    """The same generator seed gives the same result."""
    tokens, q, p, num_draft = _random_case(batch=200, k=3, vocab=5, seed=7)
    first = rejection_sample(tokens, q, p, generator=torch.Generator().manual_seed(8),
                             num_draft=num_draft)
    second = rejection_sample(tokens, q, p, generator=torch.Generator().manual_seed(8),
                              num_draft=num_draft)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_rejection_sample_k0_emits_one_token_from_p():
    """K = 0: out is [B, 1], nothing accepted, and the token is drawn from p (one-hot rows)."""
    target = torch.tensor([2, 0, 4, 1])
    p = torch.nn.functional.one_hot(target, 5).float()[:, None, :]  # [4, 1, 5]
    out, acc = rejection_sample(torch.empty(4, 0, dtype=torch.long), torch.empty(4, 0, 5), p,
                                generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, target[:, None])
    assert torch.equal(acc, torch.zeros(4, dtype=torch.long))


def test_rejection_sample_k0_never_emits_zero_probability_token():
    """K = 0 with p supported on {1, 3}: only 1 and 3 are emitted, both of them."""
    p = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0]).expand(2000, 1, 5)
    out, _ = rejection_sample(torch.empty(2000, 0, dtype=torch.long), torch.empty(2000, 0, 5), p,
                              generator=torch.Generator().manual_seed(0))
    assert set(out[:, 0].tolist()) == {1, 3}


def test_draft_token_with_zero_target_probability_is_never_accepted():
    """p(x) = 0 rejects x for every u, and the correction is never x."""
    n = 5000
    q = torch.tensor([0.9, 0.1, 0.0]).expand(n, 1, 3)
    p = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]]).expand(n, 2, 3)
    tokens = torch.zeros(n, 1, dtype=torch.long)
    out, acc = rejection_sample(tokens, q, p, generator=torch.Generator().manual_seed(0))
    assert int(acc.sum()) == 0
    assert bool((out[:, 0] != 0).all())
    assert bool((out[:, 1] == -1).all())


def test_q_equal_p_accepts_every_draft():
    """q == p: min(1, p/q) = 1 for every drafted token with p > 0, so all K are accepted."""
    tokens, _, p, _ = _random_case(batch=1000, k=4, vocab=6, seed=9)
    q = p[:, :4]
    tokens = torch.multinomial(q.reshape(-1, 6), 1,
                               generator=torch.Generator().manual_seed(10)).reshape(1000, 4)
    out, acc = rejection_sample(tokens, q, p, generator=torch.Generator().manual_seed(11))
    assert torch.equal(acc, torch.full((1000,), 4))
    assert torch.equal(out[:, :4], tokens)


def test_identical_one_hot_p_and_q_accept_all_and_bonus_is_argmax():
    """One-hot p == q (greedy): all drafts accepted and the bonus is p's argmax at position K."""
    path = torch.tensor([[3, 1, 4, 0], [2, 2, 0, 5]])  # K = 3 drafts, then the bonus argmax
    p = torch.nn.functional.one_hot(path, 6).float()
    out, acc = rejection_sample(path[:, :3], p[:, :3], p,
                                generator=torch.Generator().manual_seed(0))
    assert torch.equal(acc, torch.tensor([3, 3]))
    assert torch.equal(out, path)


def test_rejection_after_mismatch_emits_residual_token():
    """One-hot q on x and one-hot p on y != x: reject, and the residual max(0, p - q) gives y."""
    q = torch.nn.functional.one_hot(torch.tensor([[1, 0]]), 4).float()
    p = torch.nn.functional.one_hot(torch.tensor([[2, 0, 3]]), 4).float()
    out, acc = rejection_sample(torch.tensor([[1, 0]]), q, p,
                                generator=torch.Generator().manual_seed(0))
    assert torch.equal(acc, torch.tensor([0]))
    assert torch.equal(out, torch.tensor([[2, -1, -1]]))


def test_num_draft_stops_acceptance_and_takes_bonus_from_p_at_that_position():
    """num_draft = 1 with drafts that p would accept: 1 accepted, then p's token at position 1."""
    path = torch.tensor([[3, 1, 4, 0]])
    p = torch.nn.functional.one_hot(path, 6).float()
    q = torch.nn.functional.one_hot(torch.tensor([[3, 5, 5]]), 6).float()  # q != p after position 0
    out, acc = rejection_sample(torch.tensor([[3, 5, 5]]), q, p,
                                generator=torch.Generator().manual_seed(0),
                                num_draft=torch.tensor([1]))
    assert torch.equal(acc, torch.tensor([1]))
    assert torch.equal(out, torch.tensor([[3, 1, -1, -1]]))


# ---------------------------------------------------------------------------------------------
# greedy_verify
# ---------------------------------------------------------------------------------------------

def _logits_with_argmax(argmax: list[list[int]], vocab: int = 6) -> torch.Tensor:
    """[B, K+1, V] logits whose argmax at each position is the given token (ramps elsewhere)."""
    argmax_t = torch.tensor(argmax)
    base = torch.linspace(0.0, 1.0, vocab).expand(*argmax_t.shape, vocab).clone()
    return base.scatter(-1, argmax_t[..., None], 5.0)


def test_greedy_verify_accepts_until_first_mismatch_then_corrects():
    """Drafts equal to the argmax are accepted; at the first mismatch the argmax is emitted."""
    logits = _logits_with_argmax([[2, 4, 1, 3]])
    out, acc = greedy_verify(torch.tensor([[2, 0, 1]]), logits)
    assert torch.equal(acc, torch.tensor([1]))
    assert torch.equal(out, torch.tensor([[2, 4, -1, -1]]))


def test_greedy_verify_no_acceptance_after_a_mismatch():
    """A later draft that matches its argmax is not accepted once an earlier one mismatched."""
    logits = _logits_with_argmax([[2, 4, 1, 3]])
    out, acc = greedy_verify(torch.tensor([[0, 4, 1]]), logits)
    assert torch.equal(acc, torch.tensor([0]))
    assert torch.equal(out, torch.tensor([[2, -1, -1, -1]]))


def test_greedy_verify_all_accepted_emits_bonus_argmax():
    """All K drafts match: K accepted and the bonus is the argmax at position K."""
    logits = _logits_with_argmax([[2, 4, 1, 3]])
    out, acc = greedy_verify(torch.tensor([[2, 4, 1]]), logits)
    assert torch.equal(acc, torch.tensor([3]))
    assert torch.equal(out, torch.tensor([[2, 4, 1, 3]]))


def test_greedy_verify_respects_num_draft():
    """Matching drafts past num_draft are ignored; the token at num_draft is the argmax there."""
    logits = _logits_with_argmax([[2, 4, 1, 3]] * 3)
    drafts = torch.tensor([[2, 4, 1]] * 3)  # all would match
    out, acc = greedy_verify(drafts, logits, num_draft=torch.tensor([2, 0, 3]))
    assert torch.equal(acc, torch.tensor([2, 0, 3]))
    assert torch.equal(out, torch.tensor([[2, 4, 1, -1], [2, -1, -1, -1], [2, 4, 1, 3]]))


def test_greedy_verify_k0_emits_argmax():
    """K = 0: one token, the argmax of the single target position."""
    logits = _logits_with_argmax([[5], [0]])
    out, acc = greedy_verify(torch.empty(2, 0, dtype=torch.long), logits)
    assert torch.equal(out, torch.tensor([[5], [0]]))
    assert torch.equal(acc, torch.tensor([0, 0]))


def test_greedy_verify_batch_equals_row_by_row():
    """Vectorised over B: each row of a batched call equals the call on that row alone."""
    gen = torch.Generator().manual_seed(12)
    batch, k, vocab = 64, 5, 4
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    argmax = logits.argmax(-1)
    # drafts that match the argmax with probability ~0.7, so acceptance lengths vary
    noise = torch.randint(0, vocab, (batch, k), generator=gen)
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.7, argmax[:, :k], noise)
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    out, acc = greedy_verify(drafts, logits, num_draft=num_draft)
    for b in range(batch):
        out_b, acc_b = greedy_verify(drafts[b:b + 1], logits[b:b + 1], num_draft=num_draft[b:b + 1])
        assert torch.equal(out[b:b + 1], out_b) and torch.equal(acc[b:b + 1], acc_b), b
    assert len(set(acc.tolist())) >= 4  # the batch mixes many acceptance lengths
