"""The static-cache fast path (specdec_core/static_cache.py) against the general path, on CPU and -- where a
GPU is present -- on CUDA with captured graphs (those variants are skipped on CPU machines).

Greedy outputs must be identical token for token; sampling must keep the target's distribution
(the same G-test the validation step runs); the acceptance-controlled drafter must accept at the
rate it was given.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode

from specdec_core import (DraftModel, InvalidDecodeInput, LayerSkip, PromptLookup, SamplingParams,
                          SpecDecoder, profile, static_cache)
from specdec_core.cache import SequenceCache
from specdec_core.errors import UnsupportedArchitecture
from specdec_core.faults import off_by_one_bonus
from specdec_core.graphs import replaying
from specdec_core.synthetic import ControlledAcceptance
from specdec_core.validation import sampling_check
from specdec_core.verify import relaxed_verify

from .helpers.models import PROMPT, VOCAB, left_padded_batch, repetitive_prompt
from .helpers.scripts import load_script

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"))]
MAX_NEW = 24


@pytest.fixture(scope="module", params=DEVICES)
def pair(request, target, draft):
    """(device, target, draft): the session's tiny fp32 models, copied to the device."""
    if request.param == "cpu":
        return "cpu", target, draft
    return "cuda", copy.deepcopy(target).to("cuda"), copy.deepcopy(draft).to("cuda")


def make_drafter(name, target, draft, reference=None):
    return {
        "plain": lambda: None,
        "prompt_lookup": lambda: PromptLookup(max_ngram=3, min_ngram=1),
        "layer_skip": lambda: LayerSkip(target, num_layers=2),
        "draft_model": lambda: DraftModel(draft),
        "draft_is_target": lambda: DraftModel(target),
        "controlled": lambda: ControlledAcceptance(reference, 0.7, seed=2),
    }[name]()


def decode(target, drafter, k, ids, mask, static, eos=None, sampling=None, seed=0, **kwargs):
    decoder = SpecDecoder(target, drafter, k=k, static_cache=static, **kwargs)
    run = decoder.generate if drafter is not None else decoder.generate_plain
    return run(ids, MAX_NEW, attention_mask=mask, eos_token_id=eos, sampling=sampling, seed=seed)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("name", ["plain", "prompt_lookup", "layer_skip", "draft_model",
                                  "draft_is_target", "controlled"])
def test_greedy_fast_path_equals_general_path(pair, name, k):
    # same tokens, same counts and the same rounds / acceptance, single prompt and a left-padded
    # batch whose rows finish at different times (EOS on and off)
    device, target, draft = pair
    for ids, mask in ((repetitive_prompt(), None), left_padded_batch()):
        ids = ids.to(device)
        mask = None if mask is None else mask.to(device)
        reference = decode(target, None, k, ids, mask, static=False).tokens
        for eos in (None, 5):
            drafter = make_drafter(name, target, draft, reference)
            general = decode(target, drafter, k, ids, mask, static=False, eos=eos)
            drafter = make_drafter(name, target, draft, reference)
            fast_run = decode(target, drafter, k, ids, mask, static=True, eos=eos)
            assert torch.equal(fast_run.tokens, general.tokens), (name, k, eos)
            assert fast_run.num_tokens == general.num_tokens
            if name != "controlled":  # its random stream is drawn per round, K at a time
                assert (fast_run.stats.rounds, fast_run.stats.accepted, fast_run.stats.emitted) == (
                    general.stats.rounds, general.stats.accepted, general.stats.emitted)
            assert fast_run.stats.emitted == sum(fast_run.num_tokens) - ids.shape[0]


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("name", ["plain", "prompt_lookup", "layer_skip", "draft_model", "controlled"])
def test_graph_plumbing_keeps_outputs(target, draft, name, k):
    # cuda_graphs=True off CUDA: every draft step and verify pass goes through static input
    # buffers and one reused output per width (a replay reruns the body), as with CUDA graphs
    ids, mask = left_padded_batch()
    reference = decode(target, None, k, ids, mask, static=False).tokens
    for eos in (None, 5):
        general = decode(target, make_drafter(name, target, draft, reference), k, ids, mask,
                         static=False, eos=eos)
        decoder = SpecDecoder(target, make_drafter(name, target, draft, reference), k=k,
                              static_cache=True, cuda_graphs=True)
        run = decoder.generate if name != "plain" else decoder.generate_plain
        replayed = run(ids, MAX_NEW, attention_mask=mask, eos_token_id=eos)
        assert torch.equal(replayed.tokens, general.tokens), (name, k, eos)
        assert replayed.num_tokens == general.num_tokens
    for cache in decoder.engine_state()["caches"]:
        # captures ran the body without the host following: the device write positions must
        # still equal the host's (else writes drift towards the end of the cache)
        assert cache["device_positions"] == [cache["width"]] * len(cache["device_positions"])
    # whole rounds were captured (with the target's cache): plain steps, or rounds of k drafts
    # whose drafting is part of the capture for device-side drafters
    shapes = {(g["source"], g["drafted"], g["run_width"]): g["parts"]
              for g in target_cache(decoder)["round_graphs"]}
    if name == "plain":
        assert shapes[(None, 0, 1)] == ["accept"]
    elif name == "prompt_lookup":
        assert any(source == "host" for source, _, _ in shapes), shapes
    else:
        assert shapes[("device", k, k + 1)] == ["accept", "draft"]


def test_recorded_graph_replays_what_it_recorded_as_a_cuda_graph_would():
    # the CPU stand-in for captured rounds: Python runs once, later replays rerun the recorded
    # operators on the same tensors -- a value read from Python after the recording is stale
    # (as under CUDA), and a tensor the body handed out is updated in place
    from specdec_core.graphs import RecordedGraph

    counter, settings = torch.zeros(3), {"scale": 2.0}
    graph = RecordedGraph()
    graph.record(lambda: counter.add_(1).mul(settings["scale"]), torch.device("cpu"))
    graph.replay()
    out = graph.out
    assert out.tolist() == [2.0] * 3
    settings["scale"] = 10.0
    graph.replay()
    assert graph.out is out and out.tolist() == [4.0] * 3 and counter.tolist() == [2.0] * 3


def test_recorded_graph_refuses_a_host_read_inside_the_body():
    from specdec_core.graphs import RecordedGraph

    counter = torch.ones(2)
    graph = RecordedGraph()
    graph.record(lambda: counter * int(counter.sum()), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="reads the device on the host"):
        graph.replay()


def test_recorded_graph_draws_only_from_registered_generators():
    # a CUDA capture fails on a generator the graph does not hold ("Attempt to increase offset
    # for a CUDA generator not in capture mode"); the stand-in fails alike, and replays draw anew
    from specdec_core.graphs import RecordedGraph

    own, stray = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    graph = RecordedGraph()
    graph.record(lambda: torch.rand(4, generator=stray), torch.device("cpu"), (own,))
    with pytest.raises(RuntimeError, match="generator not registered with the graph"):
        graph.replay()
    graph = RecordedGraph()
    graph.record(lambda: torch.rand(4, generator=own), torch.device("cpu"), (own,))
    graph.replay()
    first = graph.out.clone()
    graph.replay()
    assert not torch.equal(first, graph.out)


def target_cache(decoder):
    """engine_state() of the decoder's one target cache (with its captured rounds)."""
    caches = [cache for cache in decoder.engine_state()["caches"] if cache["role"] == "target"]
    assert len(caches) == 1
    return caches[0]


@pytest.mark.parametrize("name", ["plain", "prompt_lookup", "draft_model", "controlled"])
def test_captured_rounds_replay_in_later_calls(target, draft, name):
    # rounds captured in one call replay in the next, on other prompts: every buffer they touch
    # persists with the cache, and each call resets it -- outputs equal the general path's
    ids, mask = left_padded_batch()
    other = torch.flip(ids, dims=[1]) % (VOCAB - 3) + 3        # other prompts, same padding
    other_mask = torch.ones_like(mask)
    reference = decode(target, None, 4, ids, mask, static=False).tokens
    decoder = SpecDecoder(target, make_drafter(name, target, draft, reference), k=4,
                          static_cache=True, cuda_graphs=True)
    run = decoder.generate if name != "plain" else decoder.generate_plain
    calls = [(ids, mask), (other, other_mask)] * 3
    shapes_after = []
    for prompt, prompt_mask in calls:
        general = decode(target, make_drafter(name, target, draft, reference), 4, prompt, prompt_mask,
                         static=False)
        replayed = run(prompt, MAX_NEW, attention_mask=prompt_mask)
        assert torch.equal(replayed.tokens, general.tokens), name
        if name != "controlled":  # its random stream is drawn per round, K at a time
            assert (replayed.stats.rounds, replayed.stats.accepted) == (general.stats.rounds,
                                                                       general.stats.accepted)
        cache = target_cache(decoder)
        shapes_after.append((len(cache["round_graphs"]), cache["eager_rounds"]))
    # a shape runs eagerly once, then is captured: by the third call of each prompt set every
    # round replays -- nothing new captured, no eager round
    assert shapes_after[5] == shapes_after[4] == shapes_after[3], shapes_after
    assert shapes_after[0][0] >= 1


class HostOps(TorchDispatchMode):
    """Counts the operators run outside graph replays: what a CUDA machine launches eagerly."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not replaying():
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_captured_round_costs_the_same_at_k_8_as_at_k_4(target):
    # Several decoders (alpha x K) share the target's cache, interleaved as a benchmark runs them.
    # After one warm-up call each, a later call captures nothing and runs no round eagerly at any
    # K -- a draft narrower than K near the end of a call used to be a shape of its own, captured
    # in the timed calls, more of them the larger K -- and the work outside the replays is the same
    # per round at K 8 as at K 4 (a round is two replays and a fixed host part).
    target = copy.deepcopy(target)          # a pool of its own (the session's model keeps others)
    ids = repetitive_prompt()
    new = 40
    reference = SpecDecoder(target, None, static_cache=True, cuda_graphs=True).generate_plain(ids, new).tokens
    decoders = {(alpha, k): SpecDecoder(target, ControlledAcceptance(reference, alpha, seed=11), k=k,
                                        static_cache=True, cuda_graphs=True)
                for alpha in (0.6, 0.8, 0.95) for k in (4, 8)}
    for decoder in decoders.values():
        decoder.generate(ids, new)
    per_round = {}     # K -> [(rounds, operators outside replays)] of the warmed-up calls
    for (alpha, k), decoder in decoders.items():
        before = target_cache(decoder)
        with HostOps() as ops:
            result = decoder.generate(ids, new)
        after = target_cache(decoder)
        assert torch.equal(result.tokens, reference)
        assert (after["captures"], after["eager_rounds"]) == (before["captures"], before["eager_rounds"]), (
            f"alpha {alpha}, K {k}: {after['captures'] - before['captures']} captures and "
            f"{after['eager_rounds'] - before['eager_rounds']} eager rounds in a warmed-up call")
        per_round.setdefault(k, []).append((result.stats.rounds, ops.count))
    shapes = target_cache(next(iter(decoders.values())))["round_graphs"]
    # one shape per decoder (K drafts), plus the target step alone that every decoder shares
    assert len(shapes) == len(decoders) + 1, shapes
    # the operators outside the replays: a fixed part per call and per round, the same at any K
    (r1, n1), (r2, n2) = sorted(per_round[4])[:2]
    per_round_ops = (n2 - n1) / (r2 - r1)
    fixed = n1 - per_round_ops * r1
    assert all(ops == fixed + per_round_ops * rounds for points in per_round.values()
               for rounds, ops in points), per_round


def test_one_compiled_body_serves_every_verify_width(target, draft, monkeypatch):
    # compile on: after decoders of K 1 and 2 (a step, and verify passes of widths 2 and 3), those
    # of K 3..8 (widths up to 9) compile nothing more -- the verify width is a dynamic dimension,
    # not one body per width (torch.compile's tracing with its "eager" backend: the same bodies as
    # inductor's, without generating code; no CPU kernels and no graph stand-in, whose dispatch
    # hooks would split the traced body)
    monkeypatch.setattr(static_cache, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    ids, mask = left_padded_batch()
    reference = decode(target, None, 1, ids, mask, static=False).tokens
    bodies = []
    for ks in ((1, 2), range(3, 9)):
        for k in ks:
            decoder = SpecDecoder(target, DraftModel(draft), k=k, static_cache=True,
                                  cuda_graphs=False, compile=True, cpu_kernels=False)
            result = decoder.generate(ids, MAX_NEW, attention_mask=mask)
            assert torch.equal(result.tokens, reference), k
        bodies.append(decoder.engine_state()["compiled"]["bodies"])
    assert decoder.engine()["compile"] is True
    assert bodies[0] > 0 and bodies[1] == bodies[0], bodies


def test_a_cost_measurement_and_a_decode_share_their_compiled_bodies(monkeypatch):
    # compile on: a cost measurement's cache (made outside a decode, its random tokens made
    # outside inference mode, a step keeping every logit) and a decode's cache (made inside
    # inference mode, a step keeping its last logit) run the same compiled bodies. They did not:
    # tensors' dispatch keys and logits_to_keep are guarded, and `profile measure` on an H100
    # compiled a body again for each (4.6-8.7 s each, after 31 s and 46 s for the first two).
    # A fresh model, its linears untouched by other tests (the CPU kernels change their class).
    from specdec_core.profile import measure_forward_costs

    from .helpers.models import tiny_llama

    monkeypatch.setattr(static_cache, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    model = tiny_llama(seed=3)
    measure_forward_costs(model, [1, 3], context_len=64, repeats=1, static=True, cuda_graphs=False,
                          compile=True, cpu_kernels=False)
    measured = static_cache.COMPILES["bodies"]
    decoder = SpecDecoder(model, PromptLookup(), k=2, static_cache=True, cuda_graphs=False,
                          compile=True, cpu_kernels=False)
    decoder.generate(repetitive_prompt(), 12)
    assert decoder.engine()["compile"] is True
    assert static_cache.COMPILES["bodies"] == measured, (measured, static_cache.COMPILES)


def test_captured_sampling_rounds_are_reseeded_per_call(target, draft):
    # a captured round draws from the loop's generator, re-seeded by each call: the same seed
    # gives the same tokens on replays, another seed other tokens (on CUDA the generator is
    # registered with the graph; here the replay reruns the draws)
    ids, mask = left_padded_batch()
    decoder = SpecDecoder(target, DraftModel(draft), k=3, static_cache=True, cuda_graphs=True)
    warm = SamplingParams(temperature=1.0)
    runs = [decoder.generate(ids, MAX_NEW, attention_mask=mask, sampling=warm, seed=seed).tokens
            for seed in (11, 11, 12, 11)]
    assert len(target_cache(decoder)["round_graphs"]) >= 1
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[3])
    assert not torch.equal(runs[0], runs[2])


def test_fast_path_writes_rows_that_stopped_early_as_padding(pair):
    device, target, draft = pair
    ids, mask = (t.to(device) for t in left_padded_batch())
    result = decode(target, DraftModel(draft), 3, ids, mask, static=True, eos=5)
    for row, n in enumerate(result.num_tokens):
        if n < MAX_NEW:
            assert int(result.tokens[row, n - 1]) == 5
            assert (result.tokens[row, n:] == 5).all()  # pad defaults to EOS


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_compaction_keeps_outputs_when_the_cache_is_tight(target, draft, monkeypatch, graphs):
    # rows of a batch accept different numbers of drafts, so the write position outruns every
    # row's length; with caches sized to the minimum, the valid columns must be compacted -- and
    # the output must not change
    monkeypatch.setattr(static_cache, "LENGTH_BUCKET", 1)
    ids, mask = left_padded_batch()
    reference = decode(target, None, 5, ids, mask, static=False).tokens
    drafter = ControlledAcceptance(reference, 0.6, seed=1)
    decoder = SpecDecoder(target, drafter, k=5, static_cache=True, cuda_graphs=graphs)

    def compactions():   # the pool is shared by every decoder of this target
        return sum(cache["compactions"] for cache in decoder.engine_state()["caches"])

    before = compactions()
    result = decoder.generate(ids, MAX_NEW, attention_mask=mask)
    assert torch.equal(result.tokens, reference)
    assert compactions() > before


def test_static_cache_logits_equal_the_dynamic_cache(target):
    # one sequence of appends with holes and rollbacks, both caches side by side
    torch.manual_seed(0)
    ids, mask = left_padded_batch()
    dynamic, static = SequenceCache(target), static_cache.StaticSequenceCache(target, 3, 64)
    with torch.inference_mode():
        steps = [(ids, mask.bool()), (torch.randint(3, VOCAB, (3, 4)), None),
                 (torch.randint(3, VOCAB, (3, 1)), torch.tensor([[True], [False], [True]]))]
        keeps = [None, torch.tensor([10, 13, 15]), None]
        for (tokens, valid), keep in zip(steps, keeps):
            a = dynamic.forward(tokens, valid)
            b = static.forward(tokens, valid)
            rows = torch.ones(tokens.shape, dtype=torch.bool) if valid is None else valid
            torch.testing.assert_close(b[rows], a[rows], rtol=1e-4, atol=1e-4)
            if keep is not None:
                dynamic.rollback_to(keep)
                static.rollback_to(keep)
                assert torch.equal(static.count, dynamic.count)


def test_controlled_acceptance_accepts_at_alpha_and_keeps_greedy_output(target):
    # the drafter proposes the target's own next token with probability alpha: its conditional
    # acceptance is alpha at every position (binomial bounds), and the output is the target's
    ids, _ = left_padded_batch()
    ids = ids.repeat(4, 1)                                  # 12 rows
    reference = decode(target, None, 4, ids, None, static=False).tokens
    for alpha in (0.0, 0.5, 0.9, 1.0):
        drafter = ControlledAcceptance(reference, alpha, seed=7)
        result = decode(target, drafter, 4, ids, None, static=True)
        assert torch.equal(result.tokens, reference)
        stats = result.stats
        reached, accepted = stats.reached_at_position[0], stats.accepted_at_position[0]
        rate = accepted / reached
        spread = 4 * (alpha * (1 - alpha) / reached) ** 0.5 + 1e-9
        assert abs(rate - alpha) <= spread, (alpha, rate, reached)
        if alpha == 1.0:
            assert stats.accepted == stats.drafted
        if alpha == 0.0:
            assert stats.accepted == 0


def test_controlled_acceptance_rejects_sampling_and_bad_alpha(target):
    reference = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(InvalidDecodeInput, match="alpha"):
        ControlledAcceptance(reference, 1.5)
    decoder = SpecDecoder(target, ControlledAcceptance(reference, 0.5), k=2)
    with pytest.raises(InvalidDecodeInput, match="greedy"):
        decoder.generate(repetitive_prompt(), 4, sampling=SamplingParams(temperature=1.0))


def test_phase_timing_off_keeps_tokens_and_skips_phase_clocks(target, draft):
    ids = repetitive_prompt()
    timed = decode(target, DraftModel(draft), 3, ids, None, static=True)
    untimed = decode(target, DraftModel(draft), 3, ids, None, static=True, phase_timing=False)
    assert torch.equal(timed.tokens, untimed.tokens)
    assert timed.stats.verify_s > 0 and untimed.stats.verify_s == 0 and untimed.stats.draft_s == 0
    assert untimed.stats.total_s > 0


def test_static_cache_refuses_sliding_window_models_and_auto_falls_back():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           sliding_window=4)
    model = MistralForCausalLM(config).eval()
    with pytest.raises(UnsupportedArchitecture, match="static_cache=False"):
        SpecDecoder(model, PromptLookup(), k=2, static_cache=True).generate(repetitive_prompt(), 4)
    auto = SpecDecoder(model, PromptLookup(), k=2)
    assert not auto.uses_static_cache()
    assert auto.generate(repetitive_prompt(), 4).num_tokens == [4]
    with pytest.raises(InvalidDecodeInput, match="static_cache"):
        SpecDecoder(model, PromptLookup(), k=2, static_cache="yes")


def test_auto_decodes_on_static_caches_on_cuda_and_dynamic_ones_on_cpu(pair):
    # "auto" picks the kind by device (the CPU default follows benchmarks/cache_kinds_cpu.py),
    # and generate really runs on it: a static decode leaves a cache in the model's pool
    device, target, _ = pair
    model = copy.deepcopy(target)
    decoder = SpecDecoder(model, PromptLookup(), k=2)
    decoder.generate(repetitive_prompt().to(device), 4)
    on_cuda = device == "cuda"
    assert decoder.uses_static_cache() is on_cuda
    # the decoder's own pool: on CUDA its key holds compile="auto" as well (failed on an H100 when
    # this looked up the pool of cuda_graphs=True, compile=False: another pool, empty)
    assert len(decoder.static_pool.caches()) == int(on_cuda)


def test_the_pool_keeps_the_most_recently_used_caches(target, monkeypatch):
    monkeypatch.setattr(static_cache.StaticCachePool, "max_caches", 2)
    pool = static_cache.StaticCachePool(cuda_graphs=False)
    first = pool.get(target, 1, 10)
    pool.get(target, 2, 10)
    assert pool.get(target, 1, 10) is first          # reused, and now the most recent
    pool.get(target, 3, 10)                          # evicts batch 2, not batch 1
    assert [cache.batch for _, cache in pool.caches()] == [1, 3]


def test_decoders_of_one_target_share_their_static_caches(target, draft):
    # captured graphs are per cache: a second decoder (another drafter, another K) reuses them
    ids = repetitive_prompt()
    first = SpecDecoder(target, DraftModel(draft), k=3, static_cache=True)
    first.generate(ids, 8)
    second = SpecDecoder(target, PromptLookup(), k=5, static_cache=True)
    assert second.static_pool is first.static_pool
    caches = first.static_pool.caches()
    second.generate(ids, 8)
    kept = second.static_pool.caches()
    assert all(any(cache is other for _, other in kept) for _, cache in caches)


def test_forward_costs_on_the_static_cache(pair):
    device, target, _ = pair
    costs = profile.measure_forward_costs(target, [1, 2, 5], context_len=32, repeats=2,
                                          static=True)
    assert set(costs) == {1, 2, 5} and all(seconds > 0 for seconds in costs.values())


# --- sampling: the target's distribution is kept ------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_fast_path_sampling_keeps_the_target_distribution(spread_target, spread_draft, device):
    # on the device: the batched rejection sampler through the fast path, G-test per position
    spread, perturbed = (copy.deepcopy(m).to(device) for m in (spread_target, spread_draft))
    static = functools.partial(SpecDecoder, static_cache=True)
    report = sampling_check(spread, DraftModel(perturbed), PROMPT, rows=3000, seed=1,
                            decoder_cls=static)
    assert report.passed, [t for t in report.tests if not t.passed]


def test_graph_plumbing_sampling_keeps_the_target_distribution(spread_target, spread_draft):
    spread, perturbed = spread_target, spread_draft
    replayed = functools.partial(SpecDecoder, static_cache=True, cuda_graphs=True)
    report = sampling_check(spread, DraftModel(perturbed), PROMPT, rows=3000, seed=2,
                            decoder_cls=replayed)
    assert report.passed, [t for t in report.tests if not t.passed]


@pytest.mark.parametrize("verifier", [relaxed_verify, off_by_one_bonus], ids=["relaxed", "off_by_one"])
def test_fast_path_sampling_check_still_catches_broken_verifiers(spread_target, spread_draft,
                                                                verifier):
    spread, perturbed = spread_target, spread_draft
    static = functools.partial(SpecDecoder, static_cache=True)
    report = sampling_check(spread, DraftModel(perturbed), PROMPT, rows=3000, seed=1,
                            decoder_cls=static, verifier=verifier)
    assert not report.passed


# --- host-device synchronisation ------------------------------------------------------------------
HOST_READS = ("__bool__", "__int__", "__index__", "__float__", "item", "tolist", "cpu", "numpy",
              "nonzero")


def count_host_reads():
    """Counts calls of the Tensor methods that read a device tensor on the host (each one a
    synchronisation on CUDA; on CPU they are counted all the same): round_ops' counter."""
    return load_script("benchmarks/round_ops.py", "round_ops").host_reads(HOST_READS)


@pytest.mark.parametrize("name,sampling", [("plain", SamplingParams()),
                                           ("draft_model", SamplingParams(temperature=1.0)),
                                           ("draft_model", SamplingParams()),
                                           ("controlled", SamplingParams())])
def test_fast_path_reads_the_device_once_per_round(target, draft, name, sampling):
    # inside the loop the fast path reads one tensor per round (the emitted counts; none in plain
    # decoding without EOS); everything else it reads is per call, so it does not grow with the
    # number of tokens. The general path reads several times per round (the counter sees them).
    ids, mask = left_padded_batch()
    reference = decode(target, None, 3, ids, mask, static=False).tokens
    reads = {}
    for static in (True, False):
        for new in (8, 20):
            decoder = SpecDecoder(target, make_drafter(name, target, draft, reference), k=3,
                                  static_cache=static)
            run = decoder.generate if name != "plain" else decoder.generate_plain
            with count_host_reads() as counts:
                result = run(ids, new, attention_mask=mask, sampling=sampling)
            rounds = max(row.rounds for row in result.row_stats)
            reads[static, new] = (dict(counts), rounds)
    for new in (8, 20):
        counts, rounds = reads[True, new]
        per_round = counts.get("cpu", 0)
        assert per_round == (rounds if name != "plain" else 0), (counts, rounds)
        assert counts.get("numpy", 0) == per_round
    fixed = [{key: value for key, value in reads[True, new][0].items() if key not in ("cpu", "numpy")}
             for new in (8, 20)]
    assert fixed[0] == fixed[1]
    general = [sum(reads[False, new][0].values()) for new in (8, 20)]
    assert general[1] > general[0] + 10


# --- the fast path on CUDA: what a first GPU run found (issue 18), reproduced on CPU ----------------
def test_a_model_stays_copyable_and_picklable_after_a_static_cache_decode(target):
    import gc
    import pickle
    import weakref

    model = copy.deepcopy(target)
    ids = repetitive_prompt()
    decoder = SpecDecoder(model, DraftModel(copy.deepcopy(target)), k=3, static_cache=True)
    first = decoder.generate(ids, 8)
    copied = copy.deepcopy(model)                    # the CUDA tests' fixture does exactly this
    restored = pickle.loads(pickle.dumps(model))
    for other in (copied, restored):
        again = SpecDecoder(other, PromptLookup(), k=3, static_cache=True).generate(ids, 8)
        assert torch.equal(again.tokens, first.tokens)
    # the pool (and its caches) still goes away with its model
    pool = weakref.ref(decoder.static_pool)
    gone = weakref.ref(model)
    del decoder, model
    gc.collect()
    assert gone() is None and pool() is None


@pytest.fixture
def counters_as_on_cuda(monkeypatch):
    """On CUDA the StaticCache's write counters are moved to the device during the first forward,
    which runs under torch.inference_mode(): they become inference tensors (and the profile's
    rollback, outside inference mode, crashed on them). Building the StaticCache under inference
    mode gives the same tensors on CPU."""
    built = static_cache.StaticCache

    def under_inference_mode(*args, **kwargs):
        with torch.inference_mode():
            return built(*args, **kwargs)

    monkeypatch.setattr(static_cache, "StaticCache", under_inference_mode)


def test_profile_timing_with_cache_counters_created_under_inference_mode(target, counters_as_on_cuda):
    for graphs in (False, True):
        costs = profile.measure_forward_costs(target, [1, 2], context_len=16, repeats=2,
                                              static=True, cuda_graphs=graphs)
        assert set(costs) == {1, 2} and all(seconds > 0 for seconds in costs.values())


def test_step_costs_on_the_path_cuda_takes_by_default(target, counters_as_on_cuda):
    # on CUDA, measure_step_costs times static caches with replayed graphs (profile measure's
    # path there); static=True, cuda_graphs=True takes that branch on CPU
    drafters = {"layer_skip": LayerSkip(target, num_layers=2), "lookup": PromptLookup()}
    costs = profile.measure_step_costs(target, drafters, k_max=3, context_len=16, repeats=2,
                                       static=True, cuda_graphs=True)
    assert set(costs["verify"]) == {1, 2, 3} and costs["target_step"] > 0
    assert set(costs["draft_step"]) == {"layer_skip", "lookup"}
    assert all(seconds > 0 for seconds in costs["draft_step"].values())


# --- compiled forwards (torch.compile inside the engine's graphs) ---------------------------------
def test_compiled_forwards_keep_greedy_outputs(target, draft):
    # compile=True on a CPU: inductor's C++ backend compiles each decode width once; rounds
    # captured around the compiled bodies emit exactly the general path's tokens
    from torch._dynamo.utils import counters as dynamo_counters

    ids, mask = left_padded_batch()
    for name in ("plain", "prompt_lookup", "draft_model"):
        general = decode(target, make_drafter(name, target, draft), 2, ids, mask, static=False, eos=5)
        decoder = SpecDecoder(target, make_drafter(name, target, draft), k=2, static_cache=True,
                              cuda_graphs=True, compile=True)
        assert {**decoder.engine(), "cpu_kernels": None, "fused_projections": None} == {
            "static_cache": True, "cuda_graphs": True, "compile": True, "cpu_kernels": None,
            "fused_projections": None}
        run = decoder.generate if name != "plain" else decoder.generate_plain
        compiles = []
        for _ in range(2):                       # the second call replays captured rounds
            compiled = run(ids, MAX_NEW, attention_mask=mask, eos_token_id=5)
            assert torch.equal(compiled.tokens, general.tokens), name
            assert compiled.num_tokens == general.num_tokens
            compiles.append(dynamo_counters["stats"]["unique_graphs"])
        assert compiles[1] == compiles[0]        # compiled once per width: no recompiles later
        assert all(cache["compiled"] for cache in decoder.engine_state()["caches"])
    # "auto" compiles on CUDA only; the CPU default path has no static caches at all
    linears = sum(1 for m in target.modules() if isinstance(m, torch.nn.Linear))
    fused = len(target.model.layers) if CUDA else 0
    assert SpecDecoder(target, None).engine() == {
        "static_cache": CUDA, "cuda_graphs": CUDA, "compile": CUDA,
        "cpu_kernels": {"packed_linear": 0 if CUDA else linears, "gqa_attention": not CUDA},
        "fused_projections": {"attention": fused, "mlp": fused}}


def test_compiled_sampling_keeps_the_target_distribution(spread_target, spread_draft):
    compiled = functools.partial(SpecDecoder, static_cache=True, cuda_graphs=True, compile=True)
    report = sampling_check(spread_target, DraftModel(spread_draft), PROMPT, ks=(2,), rows=3000,
                            seed=3, decoder_cls=compiled)
    assert report.passed, [t for t in report.tests if not t.passed]


def test_compile_auto_falls_back_to_eager_forwards_when_compiling_fails(target, monkeypatch, caplog):
    # compile="auto" (on by default on CUDA) must not cost a run when the compiler fails on some
    # setup: the cache warns and runs eagerly; compile=True surfaces the failure
    def broken(cache, options=()):
        def fails(*args):
            raise RuntimeError("inductor: no compiler for this setup")
        return fails

    monkeypatch.setattr(static_cache, "compiled_body", broken)
    monkeypatch.setattr(static_cache, "compile_by_default", lambda model: True)
    ids = repetitive_prompt()
    expected = SpecDecoder(target, None, static_cache=False).generate_plain(ids, 8).tokens
    model = copy.deepcopy(target)            # its own cache pool
    with caplog.at_level("WARNING", logger="specdec_core.static_cache"):
        auto = SpecDecoder(model, None, static_cache=True, cuda_graphs=True)
        assert auto.engine()["compile"] is True
        assert torch.equal(auto.generate_plain(ids, 8).tokens, expected)
    assert "running it eagerly" in caplog.text
    forced = SpecDecoder(copy.deepcopy(target), None, static_cache=True, compile=True)
    with pytest.raises(RuntimeError, match="no compiler"):
        forced.generate_plain(ids, 8)
