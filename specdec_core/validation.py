"""Losslessness checks: speculative decoding must leave the target's output distribution unchanged.

1. greedy_check: speculative greedy output equals plain greedy output token for token; in fp32 a
   divergence is acceptable only where the target's top-2 logit margin at that step is < 1e-4
   (batched and single-token passes round differently). Every divergence is reported.
2. sampling_check: from one prompt, M identical rows decode with independent random streams.
   For each position j < L, among rows whose first j tokens equal the most frequent path, token j
   is tested against the target's exact p(. | prompt, path) with a G-test over the most likely
   tokens (expected count >= 5 each) plus a "rest" bin; tests are Bonferroni-corrected, so the
   false-alarm rate of a whole check is at most alpha. The chi-square approximation of G rejects
   too often at a few hundred rows (measured: up to 2x the nominal rate in the tail where the
   corrected threshold sits), so a p-value between threshold / 100 and 10 x threshold is recomputed
   by simulating G under the target's own distribution (`monte_carlo_p`, about 50 / threshold
   draws); the report says which method decided each test. A token the target gives probability 0 (e.g.
   outside top-p) fails at once. Rows decode as in a call of L + K tokens, so every round inside
   the first L positions drafts a full K (accepted drafts, corrections and bonus tokens all
   occur), and stop once they hold L tokens (`stop_after`): later rounds cannot change them.
3. target_fingerprint: an exact digest of the weights plus canary log-probabilities, compared
   within a tolerance (they differ across devices and dtypes).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .cache import shared_prompt_cache
from .decoder import SpecDecoder
from .drafters import Drafter
from .sampling import SamplingParams, logits_to_probs

NEAR_TIE_MARGIN = 1e-4


# ---------------------------------------------------------------------------------------------
# 1. greedy
@dataclass
class Divergence:
    row: int
    step: int
    margin: float          # target's top-2 logit margin at that step (on the plain path)
    acceptable: bool       # margin < NEAR_TIE_MARGIN


@dataclass
class GreedyReport:
    rows: int
    tokens: int
    exact_rows: int
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(d.acceptable for d in self.divergences)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "tokens": self.tokens, "exact_rows": self.exact_rows,
                "passed": self.passed, "divergences": [asdict(d) for d in self.divergences]}


@torch.inference_mode()
def greedy_check(target: torch.nn.Module, drafter: Drafter, k: int, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, max_new_tokens: int = 32,
                 eos_token_id: int | None = None, decoder_cls=SpecDecoder) -> GreedyReport:
    """Compare speculative and plain greedy decoding of the same batch, token for token."""
    decoder = decoder_cls(target, drafter, k=k)
    plain = decoder.generate_plain(input_ids, max_new_tokens, attention_mask=attention_mask,
                                   eos_token_id=eos_token_id)
    spec = decoder.generate(input_ids, max_new_tokens, attention_mask=attention_mask,
                            eos_token_id=eos_token_id)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    device = next(target.parameters()).device
    divergences = []
    for row in range(input_ids.shape[0]):
        n = max(plain.num_tokens[row], spec.num_tokens[row])
        diff = (plain.tokens[row, :n] != spec.tokens[row, :n]).nonzero()
        if diff.numel() == 0:
            continue
        step = int(diff[0])
        prefix = torch.cat([input_ids[row][attention_mask[row].bool()].to(device),
                            plain.tokens[row, :step].to(device)])
        top2 = target(prefix[None]).logits[0, -1].float().topk(2).values
        margin = float(top2[0] - top2[1])
        divergences.append(Divergence(row, step, margin, margin < NEAR_TIE_MARGIN))
    return GreedyReport(rows=input_ids.shape[0], tokens=sum(plain.num_tokens),
                        exact_rows=input_ids.shape[0] - len(divergences), divergences=divergences)


# ---------------------------------------------------------------------------------------------
# 2. sampling
def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): the regularised upper incomplete gamma."""
    if math.isinf(statistic):
        return 0.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(statistic / 2.0, dtype=torch.float64)))


def _bins(counts: Counter, probs: torch.Tensor, min_expected: float):
    """(observed, bin probabilities) over the likely tokens plus a "rest" bin; None when an
    observed token has probability 0 (G is infinite)."""
    total = sum(counts.values())
    probs = probs.double().cpu()
    if any(probs[token] <= 0 for token in counts):
        return None
    ranked, order = torch.sort(probs, descending=True)
    big = order[ranked * total >= min_expected].tolist()
    observed = [counts.get(t, 0) for t in big]
    shares = [float(probs[t]) for t in big]
    rest = 1.0 - sum(shares)
    if rest >= 1e-9:
        observed.append(total - sum(observed))
        shares.append(rest)
    elif total - sum(observed) > 0:
        return None
    return observed, shares


def _g(observed: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """G statistic over the last dimension (0 log 0 = 0)."""
    ratio = torch.where(observed > 0, observed / expected, torch.ones_like(observed))
    return 2.0 * (observed * ratio.log()).sum(-1)


def g_test(counts: Counter, probs: torch.Tensor, min_expected: float = 5.0):
    """(G statistic, degrees of freedom, bins) of observed token counts against probs [V].

    Bins: every token with expected count >= min_expected, plus one "rest" bin for the others.
    A token with probability 0 that was observed makes G infinite.
    """
    binned = _bins(counts, probs, min_expected)
    if binned is None:
        return math.inf, 1, 0
    observed, shares = binned
    total = sum(observed)
    statistic = float(_g(torch.tensor(observed, dtype=torch.float64),
                         torch.tensor(shares, dtype=torch.float64) * total))
    return statistic, max(len(observed) - 1, 1), len(observed)


def monte_carlo_p(counts: Counter, probs: torch.Tensor, statistic: float, draws: int,
                  seed: int = 0, min_expected: float = 5.0) -> float:
    """P(G >= statistic) when the same number of tokens is drawn from probs itself, estimated
    from `draws` simulated samples binned exactly like the observed one: (1 + hits) / (1 + draws),
    valid at any sample size. Bin counts are drawn as a chain of binomials (one draw per bin, not
    per token)."""
    binned = _bins(counts, probs, min_expected)
    if binned is None or not math.isfinite(statistic):
        return 0.0
    observed, shares = binned
    total = float(sum(observed))
    expected = torch.tensor(shares, dtype=torch.float64) * total
    generator = torch.Generator().manual_seed(seed)
    chunk = max(1, 2_000_000 // len(shares))
    hits, left = 0, draws
    while left > 0:
        size = min(chunk, left)
        simulated = torch.empty(size, len(shares), dtype=torch.float64)
        remaining = torch.full((size,), total, dtype=torch.float64)
        mass = 1.0
        for column, share in enumerate(shares[:-1]):
            chance = torch.full((size,), min(share / mass, 1.0) if mass > 0 else 0.0,
                                dtype=torch.float64)
            simulated[:, column] = torch.binomial(remaining, chance, generator=generator)
            remaining -= simulated[:, column]
            mass -= share
        simulated[:, -1] = remaining
        hits += int((_g(simulated, expected) >= statistic - 1e-9).sum())
        left -= size
    return (1 + hits) / (1 + draws)


@dataclass
class PositionTest:
    k: int
    sampling: dict
    position: int
    rows: int              # rows that followed the most frequent path up to this position
    bins: int
    statistic: float
    p_value: float
    threshold: float       # Bonferroni-corrected alpha
    passed: bool
    method: str = "chi2"   # how p_value was computed: "chi2" or "monte_carlo" (near the threshold)


@dataclass
class SamplingReport:
    alpha: float
    rows_per_test: int
    tests: list[PositionTest] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tests)

    @property
    def failures(self) -> list[PositionTest]:
        return [t for t in self.tests if not t.passed]

    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "rows_per_test": self.rows_per_test, "passed": self.passed,
                "tests": [asdict(t) for t in self.tests]}


MAX_SIMULATED_DRAWS = 2_000_000   # alpha down to about 1e-5 over 18 tests; below, chi-square decides

DEFAULT_VALIDATION_SAMPLING = (
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_p=0.9),
)


@torch.inference_mode()
def sampling_check(target: torch.nn.Module, drafter: Drafter, prompt_ids: torch.Tensor,
                   ks=(1, 2), samplings=DEFAULT_VALIDATION_SAMPLING, rows: int = 2000,
                   length: int = 3, alpha: float = 0.01, seed: int = 0, chunk: int = 500,
                   decoder_cls=SpecDecoder, verifier=None,
                   verify_round: Callable | None = None, share_prompt: bool = True) -> SamplingReport:
    """Distribution test of speculative sampling from one prompt (see the module docstring).
    share_prompt: the rows' common prompt cached once (cache.shared_prompt_cache; the same draws),
    False: copied per row, as a cache of distinct requests holds it."""
    device = next(target.parameters()).device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().to(device)
    configs = [(k, s) for k in ks for s in samplings]
    threshold = alpha / (len(configs) * length)
    report = SamplingReport(alpha=alpha, rows_per_test=rows)
    for index, (k, sampling) in enumerate(configs):
        options = {} if verify_round is None else {"verify_round": verify_round}
        decoder = decoder_cls(target, drafter, k=k, verifier=verifier, **options)
        outputs = []
        for start in range(0, rows, chunk):   # memory-bounded: rows decoded in chunks
            batch = min(chunk, rows - start)
            with shared_prompt_cache() if share_prompt else contextlib.nullcontext():
                result = decoder.generate(prompt.expand(batch, -1), length + k, sampling=sampling,
                                          seed=seed * 1000003 + index * 1009 + start,
                                          stop_after=length)
            outputs.append(result.tokens[:, :length].cpu())
        tokens = torch.cat(outputs)
        report.tests += position_tests(target, prompt, tokens, sampling, threshold, k=k,
                                       seed=seed * 31 + index * 7)
    return report


@torch.inference_mode()
def position_tests(target: torch.nn.Module, prompt_ids, tokens: torch.Tensor, sampling: SamplingParams,
                   threshold: float, k: int = 0, seed: int = 0) -> list[PositionTest]:
    """G-tests of sampled continuations against the target's exact next-token distributions.

    tokens [N, L]: N continuations of L tokens drawn, from whichever engine, after prompt_ids
    under `sampling`. For each position j, the rows whose first j tokens equal the most frequent
    path are tested against p(. | prompt, path) computed by `target` (teacher-forced), binned by
    g_test; near the threshold the p-value is simulated (monte_carlo_p). `k` labels the tests.
    """
    device = next(target.parameters()).device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().to(device)
    tokens = torch.as_tensor(tokens, dtype=torch.long).cpu()
    tests = []
    for position in range(tokens.shape[1]):
        if position == 0:
            path: tuple[int, ...] = ()
            followers = tokens
        else:
            path = Counter(map(tuple, tokens[:, :position].tolist())).most_common(1)[0][0]
            followers = tokens[(tokens[:, :position] == torch.tensor(path)).all(1)]
        context = torch.cat([prompt, torch.tensor(path, dtype=torch.long, device=device)])
        probs = logits_to_probs(target(context[None]).logits[0, -1], sampling)
        counts = Counter(followers[:, position].tolist())
        statistic, dof, bins = g_test(counts, probs)
        p_value, method = chi2_sf(statistic, dof), "chi2"
        draws = math.ceil(50 / threshold)
        if threshold / 100 <= p_value < 10 * threshold and draws <= MAX_SIMULATED_DRAWS:
            p_value, method = monte_carlo_p(counts, probs, statistic, draws=draws,
                                            seed=seed + position), "monte_carlo"
        tests.append(PositionTest(
            k=k, sampling=sampling.to_dict(), position=position, rows=len(followers), bins=bins,
            statistic=statistic, p_value=p_value, threshold=threshold,
            passed=p_value >= threshold, method=method))
    return tests


# ---------------------------------------------------------------------------------------------
# 3. fingerprint
CANARY_LENGTH = 16
CANARY_COUNT = 4


def _canaries(vocab: int) -> torch.Tensor:
    """Fixed pseudo-random token sequences [CANARY_COUNT, CANARY_LENGTH], independent of torch's RNG."""
    values, state = [], 2654435761
    for _ in range(CANARY_COUNT * CANARY_LENGTH):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        values.append((state >> 33) % vocab)
    return torch.tensor(values, dtype=torch.long).view(CANARY_COUNT, CANARY_LENGTH)


@torch.inference_mode()
def target_fingerprint(model: torch.nn.Module) -> dict:
    """{weights_sha256, canary_logprobs, dtype, device}: digest over every named parameter and buffer
    (names, shapes, dtypes, bytes), plus teacher-forced log-probabilities of fixed canary sequences."""
    digest = hashlib.sha256()
    seen = set()
    for name, tensor in sorted(list(model.state_dict().items())):
        if tensor.data_ptr() in seen and tensor.numel():   # tied weights count once
            digest.update(f"{name}=tied".encode())
            continue
        seen.add(tensor.data_ptr())
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    canaries = _canaries(vocab).to(device)
    logprobs = model(canaries).logits.float().log_softmax(-1)[:, :-1]
    picked = logprobs.gather(-1, canaries[:, 1:, None]).squeeze(-1)
    return {"weights_sha256": digest.hexdigest(),
            "canary_logprobs": [round(v, 6) for v in picked.flatten().tolist()],
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "device": device.type}


def compare_fingerprints(expected: dict, actual: dict, tolerance: float | None = None) -> dict:
    """{same_weights, canary_max_abs_diff, tolerance, same_model}.

    Same digest: the same weights. Otherwise the canary log-probabilities decide, within a
    tolerance that depends on the dtypes (1e-3 in fp32, 0.1 when either side is 16-bit).
    """
    same_weights = expected.get("weights_sha256") == actual.get("weights_sha256")
    a, b = expected.get("canary_logprobs", []), actual.get("canary_logprobs", [])
    diff = max((abs(x - y) for x, y in zip(a, b)), default=math.inf) if len(a) == len(b) else math.inf
    if tolerance is None:
        sixteen = {"bfloat16", "float16"} & {expected.get("dtype"), actual.get("dtype")}
        tolerance = 0.1 if sixteen else 1e-3
    return {"same_weights": same_weights, "canary_max_abs_diff": diff, "tolerance": tolerance,
            "same_model": same_weights or diff <= tolerance}


def fingerprint_id(fingerprint: dict) -> str:
    """The short form stored with traffic rows, runs and configs: "sha256:" + 32 hex digits of the
    weights digest. Equal ids mean equal weights; the canaries are compared separately."""
    return "sha256:" + fingerprint["weights_sha256"][:32]
