"""Draft heads (specdec_core.head): exact greedy decoding on both cache kinds, the sampling
distribution test with a reduced vocabulary, the start-dependent offline estimate against live
rounds, files, training resume, and candidates per target fingerprint.

The "near-oracle" head: on a one-layer target, a head whose fuse passes the token embedding
through (weights [0 | I]) and whose layer is the target's own layer computes what the target
computes one position later (RoPE scores depend on relative positions only), missing only the
first token of the context -- so its drafts are mostly, not always, accepted, also when it feeds
on its own outputs. That exercises every path of the catch-up (0..K accepted) without training.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

from specdec_core import SamplingParams, SpecDecoder, TokenizerMismatch
from specdec_core.estimate import LoggedRequest, estimate_acceptance
from specdec_core.head import DraftHead, HeadDrafter, HeadFileError
from specdec_core.validation import sampling_check

from .helpers.models import VOCAB, chain_pass_checks, tiny_llama

REDUCED = torch.tensor([t for t in range(VOCAB) if t % 7 != 3])      # 83 of 97 tokens


def near_oracle(target, vocab_ids=None, noise: float = 0.0) -> DraftHead:
    head = DraftHead(target, vocab_ids=vocab_ids, init_layer=-1)
    hidden = target.config.hidden_size
    with torch.no_grad():
        head.fuse.weight.copy_(torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], 1))
        if noise:
            generator = torch.Generator().manual_seed(3)
            for _, param in head.own_named_parameters():
                param.add_(torch.randn(param.shape, generator=generator) * noise * param.std())
    return head.eval()


@pytest.fixture(scope="module")
def one_layer():
    return tiny_llama(layers=1, seed=3)


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (4, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0          # left padding
    mask[3, :5] = 0
    return ids, mask


@pytest.mark.parametrize("engine", ["dynamic", "static", "graphs"])
@pytest.mark.parametrize("reduced", [False, True], ids=["full", "reduced"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_equals_plain(one_layer, prompts, engine, reduced, k):
    # "graphs": rounds after the first are captured (the CPU stand-in with a CUDA graph's
    # semantics), the target's hidden states handed over by the tap inside the capture
    head = near_oracle(one_layer, REDUCED if reduced else None, noise=0.3)
    ids, mask = prompts
    decoder = SpecDecoder(one_layer, HeadDrafter(head), k=k, static_cache=engine != "dynamic",
                          cuda_graphs=engine == "graphs")
    plain = decoder.generate_plain(ids, 24, attention_mask=mask)
    general = SpecDecoder(one_layer, HeadDrafter(head), k=k, static_cache=False).generate(
        ids, 24, attention_mask=mask)
    for _ in range(2 if engine == "graphs" else 1):          # the second call replays
        spec = decoder.generate(ids, 24, attention_mask=mask)
        assert torch.equal(spec.tokens, plain.tokens)
        assert 0 < spec.stats.accepted < spec.stats.drafted  # accepted and rejected drafts occurred
        # the same drafts on every engine: fixed-width catch-up holes change nothing
        assert (spec.stats.rounds, spec.stats.accepted) == (general.stats.rounds, general.stats.accepted)
    if engine == "graphs":
        caches = [c for c in decoder.engine_state()["caches"] if c["role"] == "target"]
        assert any(graph["source"] == "device" for graph in caches[0]["round_graphs"])


def test_near_oracle_accepts_most_drafts(one_layer, prompts):
    ids, mask = prompts
    result = SpecDecoder(one_layer, HeadDrafter(near_oracle(one_layer)), k=4).generate(
        ids, 24, attention_mask=mask)
    assert result.stats.accepted / result.stats.drafted > 0.5


def test_reduced_head_never_proposes_outside_its_vocabulary(one_layer, prompts):
    head = near_oracle(one_layer, REDUCED, noise=0.3)
    drafter = HeadDrafter(head)
    ids, mask = prompts
    seen = []
    original = drafter.propose

    def spy(*args, **kwargs):
        proposal = original(*args, **kwargs)
        seen.append(proposal)
        return proposal

    drafter.propose = spy
    SpecDecoder(one_layer, drafter, k=3).generate(ids, 16, attention_mask=mask,
                                                 sampling=SamplingParams(temperature=1.0), seed=2)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[REDUCED] = False
    assert seen and all(p.probs is not None for p in seen)
    assert all(float(p.probs[..., outside].abs().max()) == 0.0 for p in seen)
    assert all(not bool(outside[p.tokens].any()) for p in seen)


def test_sampling_distribution_with_a_reduced_head(one_layer):
    # q is zero outside the head's vocabulary: the residual distribution must restore p there
    head = near_oracle(one_layer, REDUCED, noise=0.3)
    prompt = torch.tensor([5, 17, 33, 8, 61, 17, 33])
    report = sampling_check(one_layer, HeadDrafter(head), prompt, ks=(1, 3), rows=1500, seed=4,
                            chunk=1500)
    assert report.passed, [t for t in report.tests if not t.passed]


def test_sampling_distribution_with_a_head_in_captured_rounds(one_layer):
    head = near_oracle(one_layer, REDUCED, noise=0.3)
    prompt = torch.tensor([5, 17, 33, 8, 61, 17, 33])
    captured = functools.partial(SpecDecoder, static_cache=True, cuda_graphs=True)
    report = sampling_check(one_layer, HeadDrafter(head), prompt, ks=(3,), rows=1500, seed=5,
                            chunk=500, decoder_cls=captured)
    assert report.passed, [t for t in report.tests if not t.passed]


@pytest.mark.parametrize("reduced", [False, True], ids=["full", "reduced"])
def test_greedy_estimate_equals_live_rounds(one_layer, reduced):
    head = near_oracle(one_layer, REDUCED if reduced else None, noise=0.3)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, VOCAB, (6, 7), generator=generator)
    plain = SpecDecoder(one_layer, None).generate_plain(prompts, 20)
    requests = [LoggedRequest(f"r{i}", prompts[i].tolist(), plain.tokens[i].tolist(),
                              SamplingParams(), "json") for i in range(6)]
    for k in (1, 3, 5):
        estimate = estimate_acceptance(one_layer, HeadDrafter(head), requests, [k], progress=False,
                                       n_boot=100)["json"][k]
        for request, totals in zip(requests, estimate.per_request):
            live = SpecDecoder(one_layer, HeadDrafter(head), k=k).generate(
                torch.tensor([request.prompt_ids]), len(request.response_ids))
            assert live.tokens[0].tolist() == list(request.response_ids)
            assert totals.rounds == live.stats.rounds, (k, request.request_id)
            assert totals.accepted.sum() == live.stats.accepted, (k, request.request_id)


def test_save_load_round_trip_and_bad_files(one_layer, tmp_path):
    head = near_oracle(one_layer, REDUCED, noise=0.3)
    head.save(tmp_path / "head")
    loaded = DraftHead.load(tmp_path / "head", one_layer)
    assert loaded.vocab_size == len(REDUCED) and torch.equal(loaded.vocab_ids, head.vocab_ids)
    for name, param in head.own_named_parameters():
        assert torch.equal(param, dict(loaded.own_named_parameters())[name]), name
    # corrupted weights: a clear error naming the directory
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "head_config.json").write_text((tmp_path / "head" / "head_config.json").read_text())
    (tmp_path / "bad" / "head.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HeadFileError, match="bad"):
        DraftHead.load(tmp_path / "bad", one_layer)
    # a target of another vocabulary
    with pytest.raises(TokenizerMismatch, match="train a head for this target"):
        DraftHead.load(tmp_path / "head", tiny_llama(vocab=64, layers=1, seed=3))


def test_training_resume_equals_uninterrupted(one_layer, tmp_path):
    from specdec_core.train import TrainConfig, train_head

    generator = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, VOCAB, (24, 6), generator=generator)
    out = SpecDecoder(one_layer, None).generate_plain(prompts, 10)
    requests = [LoggedRequest(f"r{i}", prompts[i].tolist(), out.tokens[i].tolist(), SamplingParams(),
                              "qa") for i in range(24)]
    train, heldout = requests[:18], requests[18:]
    config = TrainConfig(steps=6, eval_every=3, k_max=2, warmup_steps=1, lr=1e-3, batch_size=4)
    costs = (0.1, [1.2, 1.3])
    whole = train_head(DraftHead(one_layer, REDUCED), one_layer, train, heldout, config,
                       tmp_path / "whole", costs=costs, progress=False)
    interrupted_head = DraftHead(one_layer, REDUCED)
    first = train_head(interrupted_head, one_layer, train, heldout, config, tmp_path / "cut",
                       costs=costs, progress=False, stop_after=3)
    assert first.step == 3
    resumed = train_head(DraftHead(one_layer, REDUCED), one_layer, train, heldout, config,
                         tmp_path / "cut", costs=costs, progress=False)
    assert resumed.step == 6
    assert [h["step"] for h in resumed.history] == [h["step"] for h in whole.history] == [0, 3, 6]
    for a, b in zip(resumed.history, whole.history):
        assert a["heldout_kl"] == pytest.approx(b["heldout_kl"], rel=1e-5)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5, nan_ok=True) \
            if a["train_loss"] is not None else b["train_loss"] is None


def test_training_past_its_deadline_stops_with_the_head_evaluated_saved_and_resumable(one_layer, tmp_path):
    """optimise(deadline=...): the step that ends past the deadline is the last, evaluated and
    saved as an eval_every step is (a run under a time limit keeps its best checkpoint), and a
    later call without a deadline resumes from there to config.steps."""
    from specdec_core.train import TrainConfig, _HeadTrainee, optimise

    generator = torch.Generator().manual_seed(4)
    prompts = torch.randint(3, VOCAB, (12, 6), generator=generator)
    out = SpecDecoder(one_layer, None).generate_plain(prompts, 8)
    requests = [LoggedRequest(f"r{i}", prompts[i].tolist(), out.tokens[i].tolist(), SamplingParams(),
                              "qa") for i in range(12)]
    config = TrainConfig(steps=50, eval_every=50, k_max=2, warmup_steps=1, lr=1e-3, batch_size=4)

    def trainee():
        return _HeadTrainee(DraftHead(one_layer, REDUCED), one_layer, requests[:9], requests[9:],
                            config, (0.1, [1.2, 1.3]), 0.1)

    cut = optimise(trainee(), 9, config, tmp_path, progress=False, deadline=time.perf_counter())
    assert cut.step == 1
    assert [point["step"] for point in cut.history] == [0, 1]
    assert torch.load(tmp_path / "last" / "state.pt", weights_only=False)["step"] == 1
    resumed = optimise(trainee(), 9, config, tmp_path, progress=False)
    assert resumed.step == 50
    assert [point["step"] for point in resumed.history] == [0, 1, 50]


@torch.no_grad()
def test_chain_training_pass_computes_what_the_live_chain_computes(one_layer):
    """The unrolled training pass (head_chain_passes): chain step w at position j must see what a
    live round that started after position j - w sees -- the teacher-forced head positions up to
    there, then its own earlier steps -- and so give the same logits."""
    assert chain_pass_checks(near_oracle(one_layer, noise=0.3), one_layer) > 20


def test_head_builds_when_the_targets_pad_id_lies_outside_its_vocabulary():
    """A real target's pad id (SmolLM2: 2, others far higher) may not be a row of a small reduced
    head, nor of the 1-row stub a full head's body carries: the head never embeds by id."""
    target = tiny_llama(layers=1, seed=4)
    target.config.pad_token_id = 90
    for ids in (torch.arange(8), None):
        head = DraftHead(target, vocab_ids=ids).eval()
        logits, _ = head(torch.randn(1, 3, target.config.hidden_size), torch.tensor([[5, 6, 7]]))
        assert logits.shape[-1] == (8 if ids is not None else VOCAB)


@pytest.fixture(scope="module")
def packed_trainee(one_layer):
    """A head trainee over requests of 5 to 16 tokens (max_length 12 cuts the longest), prepared."""
    from specdec_core.train import TrainConfig, _HeadTrainee

    generator = torch.Generator().manual_seed(5)
    requests = []
    for i in range(10):
        prompt, response = 2 + i % 5, 3 + (7 * i) % 9
        ids = torch.randint(3, VOCAB, (prompt + response,), generator=generator).tolist()
        requests.append(LoggedRequest(f"r{i}", ids[:prompt], ids[prompt:], SamplingParams(), "qa"))
    config = TrainConfig(steps=1, eval_every=1, k_max=2, batch_size=4, max_length=12)
    trainee = _HeadTrainee(DraftHead(one_layer, REDUCED), one_layer, requests, requests[:2], config,
                           (0.1, [1.2, 1.3]), unroll=2)
    trainee.prepare(config, False)
    return trainee, requests, config


def test_a_training_batch_is_gathered_as_the_rows_padded_one_by_one(packed_trainee, one_layer):
    from specdec_core.head import target_features

    trainee, requests, config = packed_trainee
    cache = trainee.cache
    assert len(cache) == len(requests) and cache.used == cache.capacity
    for i in (0, 4, 7):                     # the rows as appended: the request's last max_length tokens
        ids, features, values, index = cache[i]
        row = (requests[i].prompt_ids + requests[i].response_ids)[-config.max_length:]
        assert ids.tolist() == row and len(values) == len(index) == len(row) - 1
        with torch.no_grad():
            expected, _ = target_features(one_layer, torch.tensor([row]), head=trainee.module)
        torch.testing.assert_close(features, expected[0])
    for picks in ([3], [1, 8, 2], [9, 0, 5, 5, 6]):
        # against the padded batch the rows make one at a time
        for got, want in zip(cache.batch(picks, "cpu"), cache.batch_rowwise(picks, "cpu")):
            assert got.dtype == want.dtype and torch.equal(got, want), picks
    # and the row-at-a-time batch is the rows' own slices, padded
    feats, nxt, truth, mask, values, index = cache.batch_rowwise([1, 0], "cpu")
    ids, features, top_values, top_index = cache[0]
    n = len(ids) - 1
    assert mask[1].tolist() == [True] * n + [False] * (mask.shape[1] - n)
    assert torch.equal(nxt[1, :n], ids[1:]) and torch.equal(feats[1, :n], features[:-1])
    assert torch.equal(truth[1, :n], features[1:]) and not truth[1, n:].any()
    assert torch.equal(values[1, :n - 1], top_values[:n - 1]) and values[1, n - 1:].isinf().all()
    assert torch.equal(index[1, :n - 1], top_index[:n - 1].clamp(min=0)) and not index[1, n - 1:].any()


def test_a_training_step_runs_the_same_operations_at_every_batch_size(packed_trainee):
    """A step's tensor operations (on a GPU: launches and host time) must not grow with the batch:
    building the batch a row at a time took about 30 per row."""
    from torch.profiler import ProfilerActivity, profile

    trainee, _, _ = packed_trainee

    def operations(step, picks) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(picks)
        trainee.module.zero_grad(set_to_none=True)
        return sum(1 for event in prof.events() if event.cpu_parent is None)

    def train_step(picks):
        trainee.loss(picks).backward()

    # every batch here has rows of several lengths (the attention masks take the same path)
    small, large = [0, 1], [0, 2, 3, 4, 7, 8, 9, 5]
    operations(train_step, small)                   # first-call set-up is not a step's
    assert operations(train_step, small) == operations(train_step, large)
    gather = functools.partial(trainee.cache.batch, device="cpu")
    assert operations(gather, [3]) == operations(gather, small) == operations(gather, large)
    # the count sees a batch built a row at a time: 6 rows more, over 100 operations more
    trainee.rowwise = True
    try:
        assert operations(train_step, large) > operations(train_step, small) + 100
    finally:
        trainee.rowwise = False


def host_reads(run) -> list[str]:
    """The ATen calls of run() that read device values on the host (graphs.reads_host): on a GPU,
    each one makes the host wait for the device, and a CUDA graph capture fails on it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from specdec_core.graphs import reads_host

    seen = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if reads_host(func, args):
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Reads():
        run()
    return seen


def test_a_training_step_never_reads_the_device_on_the_host(packed_trainee):
    """The head's loss and its backward: masked sums, the chain's masks built here -- no boolean
    indexing (a nonzero() inside the kernel) and no transformers padding check (a host read)."""
    trainee, _, _ = packed_trainee
    eager = trainee.graphs
    trainee.graphs = False
    try:
        assert host_reads(lambda: trainee.loss([0, 2, 3, 7]).backward()) == []
        assert host_reads(lambda: trainee.cache.batch([1, 5], "cpu", width=11)) == []
    finally:
        trainee.graphs = eager
        trainee.module.zero_grad(set_to_none=True)
    # the check sees what the loss used to do
    values, where = torch.randn(2, 3), torch.tensor([[True, False, True], [False, True, True]])
    assert host_reads(lambda: values[where]) == ["aten.index.Tensor"]


def reference_loss(trainee, batch) -> torch.Tensor:
    """The head loss computed on the scored positions alone, picked out by boolean indexing (the
    definition batch_loss's masked sums must equal)."""
    from specdec_core.train import head_chain_passes

    feats, nxt, truth, mask, values, index = batch
    head = trainee.module
    scored = mask.clone()
    scored[torch.arange(len(mask)), mask.sum(1) - 1] = False       # a row's last position
    total = 0.0
    for w, (logits, g) in enumerate(head_chain_passes(head, feats, nxt, mask, trainee.unroll)):
        started = (torch.arange(mask.shape[1]) >= w)[None]
        where, fmask = scored & started, mask & started
        p = values[where].softmax(-1)
        log_q = logits.float()[where].log_softmax(-1).gather(-1, index[where])
        total = total + (p * (p.clamp_min(1e-30).log() - log_q)).sum(-1).mean()
        if trainee.feature_weight and head.feature_regression:
            norm = head.body.model.norm
            total = total + trainee.feature_weight * torch.nn.functional.smooth_l1_loss(
                norm(g)[fmask].float(), norm(truth)[fmask].float())
    return total / trainee.unroll


def test_the_masked_loss_is_the_loss_of_the_scored_positions_at_any_padded_width(packed_trainee):
    trainee, _, _ = packed_trainee
    params = trainee.parameters()

    def value_and_grads(loss):
        grads = torch.autograd.grad(loss, params)
        return loss.detach(), grads

    picks = [1, 8, 2, 6]
    want = value_and_grads(reference_loss(trainee, trainee.cache.batch(picks, "cpu")))
    for width in (None, max(trainee.cache.lengths) - 1, 20):        # the picks' own, the rows', wider
        got = value_and_grads(trainee.batch_loss(*trainee.cache.batch(picks, "cpu", width=width)))
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        for a, b in zip(got[1], want[1]):        # within float error of the gradients' scale
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4 * float(b.abs().max()))
    with pytest.raises(ValueError, match="width 3 cannot hold rows of"):
        trainee.cache.batch(picks, "cpu", width=3)


def test_a_graphed_training_step_trains_as_the_eager_step(one_layer, tmp_path):
    """graphs=True (torch.cuda.make_graphed_callables on CUDA; here graphs.RecordedModule, which
    reruns the recorded operators on the same tensors and fails on a host read): the same losses,
    held-out scores and weights as the eager step; a loss that cannot be captured trains eagerly
    with the capture's error kept."""
    from specdec_core.graphs import RecordedModule
    from specdec_core.train import TrainConfig, _HeadTrainee, optimise

    generator = torch.Generator().manual_seed(6)
    prompts = torch.randint(3, VOCAB, (14, 5), generator=generator)
    out = SpecDecoder(one_layer, None).generate_plain(prompts, 7)
    requests = [LoggedRequest(f"r{i}", prompts[i, :2 + i % 4].tolist(), out.tokens[i, : 3 + i % 5].tolist(),
                              SamplingParams(), "qa") for i in range(14)]
    config = TrainConfig(steps=8, eval_every=4, k_max=2, warmup_steps=2, lr=3e-3, batch_size=4)

    def train(graphs: bool, trainee_type=_HeadTrainee, name=""):
        trainee = trainee_type(DraftHead(one_layer, REDUCED), one_layer, requests[:11], requests[11:],
                               config, (0.1, [1.2, 1.3]), 0.1, unroll=2, graphs=graphs)
        result = optimise(trainee, 11, config, tmp_path / f"{graphs}{name}", progress=False)
        return trainee, result

    eager, eager_result = train(False)
    graphed, graphed_result = train(True)
    assert graphed.graph_error is None and list(graphed.graphed) == [4]
    assert isinstance(graphed.graphed[4], RecordedModule) and eager.graphed == {}
    assert [h["step"] for h in graphed_result.history] == [0, 4, 8]
    for a, b in zip(graphed_result.history, eager_result.history):
        assert a["heldout_kl"] == pytest.approx(b["heldout_kl"], rel=1e-4)
        assert (a["train_loss"] is None) == (b["train_loss"] is None)
        if a["train_loss"] is not None:
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
    moved = 0
    for (name, a), (_, b) in zip(graphed.module.own_named_parameters(), eager.module.own_named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=name)
        moved += not torch.equal(a, DraftHead(one_layer, REDUCED).state_dict()[name])
    assert moved > 0                                       # the steps trained something

    class Indexing(_HeadTrainee):
        """The loss as it was: boolean indexing (a host read inside the step)."""
        def batch_loss(self, feats, nxt, truth, mask, values, index):
            return reference_loss(self, (feats, nxt, truth, mask, values, index))

    fallback, result = train(True, Indexing, "indexing")
    assert result.step == config.steps and fallback.graphed == {} and fallback.graphs is False
    assert "reads the device on the host" in fallback.graph_error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graphed_training_step_on_cuda_captures_and_trains_as_the_eager_step(tmp_path):
    """On CUDA, graphs=True is torch.cuda.make_graphed_callables under bf16 autocast: the capture
    succeeds and the losses follow the eager step's (bf16 kernels may differ a little)."""
    from specdec_core.graphs import RecordedModule
    from specdec_core.train import TrainConfig, _HeadTrainee, optimise

    target = tiny_llama(layers=1, seed=3).cuda()
    generator = torch.Generator().manual_seed(6)
    prompts = torch.randint(3, VOCAB, (14, 5), generator=generator)
    out = SpecDecoder(target, None).generate_plain(prompts.cuda(), 7)
    requests = [LoggedRequest(f"r{i}", prompts[i].tolist(), out.tokens[i].tolist(), SamplingParams(), "qa")
                for i in range(14)]
    config = TrainConfig(steps=6, eval_every=3, k_max=2, warmup_steps=1, lr=3e-3, batch_size=4)
    results = {}
    for graphs in (False, True):
        trainee = _HeadTrainee(DraftHead(target, REDUCED.cuda()), target, requests[:11], requests[11:],
                               config, (0.1, [1.2, 1.3]), 0.1, unroll=2, graphs=graphs)
        results[graphs] = optimise(trainee, 11, config, tmp_path / str(graphs), progress=False)
        if graphs:
            assert trainee.graph_error is None and not isinstance(trainee.graphed[4], RecordedModule)
    for a, b in zip(results[True].history, results[False].history):
        if a["train_loss"] is not None:
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=2e-2)
