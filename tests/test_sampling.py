"""Unit tests for specdec_core.sampling: SamplingParams, logits_to_probs, sample_from."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from specdec_core.sampling import (InvalidSamplingParams, SamplingParams, logits_to_probs,
                                   sample_from)


def _logits(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax is `probs` (all > 0)."""
    return torch.tensor(probs, dtype=torch.float64).log().float()


# ---------------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.5},
    {"temperature": float("nan")},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"top_p": -0.1},
    {"top_k": -1},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_invalid_sampling_params_raise(kwargs):
    """Out-of-range temperature, top_p or top_k raises InvalidSamplingParams (a ValueError)."""
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(**kwargs)
    assert issubclass(InvalidSamplingParams, ValueError)


def test_boundary_sampling_params_are_valid():
    """top_p = 1.0, top_k = 0 and temperature = 0 are the valid 'off' values."""
    params = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    assert params.to_dict() == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}


def test_default_sampling_params_are_greedy():
    """The default is greedy (temperature 0), per the public contract."""
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy


# ---------------------------------------------------------------------------------------------
# logits_to_probs
# ---------------------------------------------------------------------------------------------

def test_greedy_gives_one_hot_argmax():
    """Temperature 0: a one-hot distribution on the argmax of each row."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams())
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_greedy_ignores_top_k_and_top_p():
    """Temperature 0 stays one-hot on the argmax whatever top_k / top_p say."""
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.5))
    assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_equals_softmax_of_scaled_logits(temperature):
    """temperature T > 0 without truncation gives softmax(logits / T)."""
    logits = torch.tensor([[1.0, -0.5, 2.0, 0.3, 0.0], [0.2, 0.2, -3.0, 1.5, 4.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, (logits / temperature).softmax(-1))


def test_output_is_float32_for_half_precision_logits():
    """Probabilities come back as float32 even from bfloat16 logits."""
    probs = logits_to_probs(torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16),
                            SamplingParams(temperature=1.0))
    assert probs.dtype == torch.float32


def test_top_k_keeps_exactly_k_tokens_renormalised():
    """top_k = 3 (no ties): the 3 largest logits keep their relative mass, the rest get 0."""
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0, 0.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    kept = torch.tensor([1, 3, 4])
    assert torch.equal((probs > 0).nonzero().squeeze(1), kept)
    torch.testing.assert_close(probs[kept], logits[kept].softmax(-1))


def test_top_k_at_least_vocab_keeps_everything():
    """top_k >= V is the same as no top-k."""
    logits = torch.tensor([0.5, 3.0, -1.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    torch.testing.assert_close(probs, logits.softmax(-1))


def test_top_p_keeps_smallest_prefix_reaching_top_p():
    """probs (.1, .5, .15, .25), top_p = .7: keep .5 and .25 (mass .75), renormalised."""
    logits = _logits([0.10, 0.50, 0.15, 0.25])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([0.0, 2 / 3, 0.0, 1 / 3]))


def test_top_p_includes_the_token_that_crosses_top_p():
    """probs (.1, .5, .15, .25), top_p = .8: .5 + .25 = .75 < .8, so .15 joins (mass .9)."""
    logits = _logits([0.10, 0.50, 0.15, 0.25])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.15, 0.25]) / 0.9)


def test_tiny_top_p_keeps_at_least_the_top_token():
    """top_p smaller than the top token's mass still keeps that one token."""
    logits = _logits([0.10, 0.50, 0.15, 0.25])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_from_the_head_drops_what_the_full_sort_drops(top_p):
    """The CPU's top-p (rank only the 32 most likely tokens, sort the rows they do not cover)
    drops exactly the tokens the full sort drops: peaked rows, flat rows (which fall back), and
    rows with top-k's -inf, mixed in one [rows, positions, V] batch."""
    from specdec_core.sampling import _top_p_drop, _top_p_drop_from_head
    generator = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.05, 1.0, 4.0, 12.0]).repeat(6)[:, None, None]
    logits = torch.randn(24, 3, 2000, generator=generator) * scale
    logits[::5, :, 1000:] = float("-inf")
    head = 32
    probs = logits.softmax(-1).reshape(-1, 2000)
    covered = probs.topk(head, -1).values.sum(-1) >= top_p
    assert covered.any() and not covered.all()      # both routes are taken
    assert torch.equal(_top_p_drop_from_head(logits, top_p, head=head), _top_p_drop(logits, top_p))


def test_top_k_is_applied_before_top_p():
    """(.4, .3, .2, .1), top_k = 2 then top_p = .5: renormalised (4/7, 3/7) keeps only the first."""
    logits = _logits([0.4, 0.3, 0.2, 0.1])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    # top-p on the untruncated distribution would have kept two tokens (mass before .3 is .4 < .5)
    assert torch.equal(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_temperature_is_applied_before_top_p():
    """(.4, .3, .2, .1) at T = 0.5 is (16, 9, 4, 1)/30; top_p = .8 keeps the first two (.83)."""
    logits = _logits([0.4, 0.3, 0.2, 0.1])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5, top_p=0.8))
    # at T = 1 the same top_p would have kept three tokens (.4 + .3 = .7 < .8)
    torch.testing.assert_close(probs, torch.tensor([16 / 25, 9 / 25, 0.0, 0.0]))


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.6),
])
def test_probabilities_sum_to_one_and_keep_shape(params):
    """Every row of the [..., V] output is a distribution (>= 0, sums to 1), shape unchanged."""
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0)) * 3
    probs = logits_to_probs(logits, params)
    assert probs.shape == (3, 4, 50)
    assert bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4))


# ---------------------------------------------------------------------------------------------
# sample_from
# ---------------------------------------------------------------------------------------------

def test_sample_from_frequencies_match_probs():
    """Chi-square over 40000 draws from a fixed distribution with a zero entry."""
    probs = torch.tensor([0.05, 0.30, 0.0, 0.15, 0.40, 0.10])
    n = 40_000
    tokens = sample_from(probs.expand(n, 6), torch.Generator().manual_seed(0))
    assert tokens.shape == (n,) and tokens.dtype == torch.long
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[2] == 0
    support = probs > 0
    expected = probs[support].double() / probs[support].double().sum() * n
    pvalue = chisquare(counts[support].numpy(), expected.numpy()).pvalue
    assert pvalue > 1e-3


def test_sample_from_detects_a_wrong_distribution():
    """Power check of the chi-square above: draws from probs fail against a shifted distribution."""
    probs = torch.tensor([0.05, 0.30, 0.15, 0.40, 0.10])
    wrong = torch.tensor([0.05, 0.32, 0.15, 0.38, 0.10])
    n = 40_000
    counts = torch.bincount(sample_from(probs.expand(n, 5), torch.Generator().manual_seed(0)),
                            minlength=5).double()
    expected = wrong.double() / wrong.double().sum() * n
    assert chisquare(counts.numpy(), expected.numpy()).pvalue < 1e-6


def test_sample_from_never_picks_zero_probability_tokens():
    """Tokens with probability 0 are never drawn, even beside tiny non-zero masses."""
    probs = torch.tensor([[0.0, 1e-6, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.5, 0.0, 0.5, 0.0]])
    tokens = sample_from(probs.repeat(5000, 1), torch.Generator().manual_seed(1)).view(5000, 3)
    assert bool((tokens[:, 0] == 1).all())
    assert bool((tokens[:, 1] == 3).all())
    assert set(tokens[:, 2].tolist()) == {0, 2}


def test_sample_from_accepts_unnormalised_weights():
    """Weights (2, 6) are sampled as (.25, .75): same draws as the normalised distribution."""
    gen_a, gen_b = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    weights = torch.tensor([2.0, 6.0]).expand(20_000, 2)
    a = sample_from(weights, gen_a)
    b = sample_from(weights / 8.0, gen_b)
    assert torch.equal(a, b)
    share = a.double().mean().item()
    assert abs(share - 0.75) < 5 * math.sqrt(0.75 * 0.25 / 20_000)


def test_sample_from_keeps_leading_dimensions():
    """probs [2, 3, V] gives one index per row: shape [2, 3]."""
    probs = torch.full((2, 3, 7), 1 / 7)
    assert sample_from(probs, torch.Generator().manual_seed(0)).shape == (2, 3)
