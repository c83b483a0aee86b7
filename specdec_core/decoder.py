"""SpecDecoder: speculative decoding of a target model with a drafter, K draft tokens a round.

It checks the inputs, picks the KV cache kind (dynamic, or static with CUDA graphs) and runs the
one decode loop of loop.py, where the whole decode path reads top to bottom.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import cpu_kernels as kernels
from .cache import dynamic_session
from .drafters import Drafter
from .errors import InvalidDecodeInput
from .fused_projections import fuse_projections as fuse_projections_of, fused_projections
from .loop import decode
from .records import GenerateResult
from .sampling import SamplingParams
from . import static_cache
from .static_cache import StaticCachePool, resolve_compile, static_by_default
from .verify import Verifier, rejection_sample, relaxed_verify, verify_round

VERIFIERS: dict[str, Verifier] = {"exact": rejection_sample, "relaxed": relaxed_verify}


def prepare_for_decoding(model: torch.nn.Module, cpu_kernels: bool | str = "auto",
                         fuse_projections: bool | str = "auto") -> dict:
    """Put `model` in place on the forward path SpecDecoder runs it on (see its cpu_kernels and
    fuse_projections options): fused projections first, where chosen (the CPU kernels then pack
    the plain nn.Linear modules left), then the CPU kernels. Returns what the CPU kernels applied
    ({packed_linear, gqa_attention}). A cost measurement calls it too, so that it times the
    forwards decoding will run, not the model as it was loaded."""
    none = {"packed_linear": 0, "gqa_attention": False}
    weight = next(model.parameters(), None)
    if weight is None:
        return none
    if fuse_projections is True or (fuse_projections == "auto" and weight.device.type == "cuda"):
        fuse_projections_of(model)
    return none if cpu_kernels is False else kernels.prepare(model)


class SpecDecoder:
    """Speculative decoding of `target_model` with `drafter`, k draft tokens per round.

    verifier: "exact" (rejection sampling; the default), "relaxed" (LOSSY, for comparison) or a
    callable with rejection_sample's signature. Greedy decoding (temperature 0) accepts while the
    draft equals the target's argmax unless a verifier is given explicitly.
    verify_round: the round's verification (verify.verify_round, or a callable with its
    signature: faults.py swaps in broken ones to show that validation catches them).
    verify_widths: optional {needed width: width to run}, from profile.calibrate_verify_widths.
    On some hardware a verify pass over more tokens is cheaper than over fewer (CPU matmul kernels
    pick different paths by row count); the extra positions are filler after the drafts, so the
    causal target's logits for the real positions are unchanged, and the cache rollback drops them.
    static_cache: the KV cache kind behind the loop. "auto" (the default): static caches
    (static_cache.py: preallocated, fixed shapes, CUDA graphs) on CUDA when the models allow it,
    dynamic ones (cache.py) otherwise; True forces static caches (also on CPU), False dynamic
    ones. Both give the same greedy tokens.
    cuda_graphs: "auto" captures the static caches' draft steps and verify passes as CUDA graphs
    on CUDA; False runs them eagerly; True off CUDA replays them by running them again on the same
    static buffers (a stand-in that tests the graph plumbing on CPU).
    phase_timing: synchronise around the draft and verify phases to fill stats.draft_s/verify_s
    (on by default; benchmarks turn it off, and they stay 0).
    compile: run the static caches' decode-width forwards through torch.compile (inductor), one
    compiled body per width, inside the engine's graphs. "auto": on CUDA (where it pays); False
    never; True also on a CPU (inductor's C++ backend). Static caches only. `engine()` says what
    was chosen; cost profiles record it.
    cpu_kernels: "auto" (the default) uses cpu_kernels.py's packed linear weights and grouped-query
    attention for the narrow forwards of a float32 model on a CPU (the target's and the drafter's
    own models; same numbers up to float32 rounding, a verify pass about a sixth cheaper there);
    False leaves the models as they are. It changes the models in place, for every later user.
    fuse_projections: each decoder layer's query, key and value projections multiplied as one
    matrix, and the MLP's gate and up (fused_projections.py: the same parameters and state dict,
    a few wider kernels instead of many narrow ones). "auto": on CUDA, where a small weight's
    kernel runs far below the memory bandwidth; True also on a CPU (where it measured no gain,
    and takes those projections off the CPU kernels' packed weights: 0.74x on plain decoding,
    benchmarks/results/fused_projections_cpu.md); False does not fuse (a model
    fused before stays fused). In place, for every later user, like cpu_kernels (the target's
    and the drafter's own models).
    """

    def __init__(self, target_model: torch.nn.Module, drafter: Drafter | None, k: int = 4,
                 tokenizer=None, verifier: str | Verifier | None = None,
                 verify_widths: dict[int, int] | None = None, static_cache: bool | str = "auto",
                 cuda_graphs: bool | str = "auto", phase_timing: bool = True,
                 verify_round: Callable = verify_round, compile: bool | str = "auto",
                 cpu_kernels: bool | str = "auto", fuse_projections: bool | str = "auto"):
        if not isinstance(k, int) or k < 1:
            raise InvalidDecodeInput(f"k={k!r}: the number of draft tokens per round must be an "
                                     "integer >= 1 (use generate_plain for no speculation)")
        self.target = target_model
        self.drafter = drafter
        self.k = k
        self.tokenizer = tokenizer
        if isinstance(verifier, str):
            if verifier not in VERIFIERS:
                raise InvalidDecodeInput(f"verifier={verifier!r}: choose one of {sorted(VERIFIERS)}")
            verifier = VERIFIERS[verifier]
        self.verifier = verifier
        self.verify_round = verify_round
        self.verify_widths = {int(n): int(w) for n, w in (verify_widths or {}).items() if int(w) >= int(n)}
        if drafter is not None:
            drafter.check_compatible(target_model, tokenizer)
        for name, value in (("static_cache", static_cache), ("cuda_graphs", cuda_graphs),
                            ("compile", compile), ("cpu_kernels", cpu_kernels),
                            ("fuse_projections", fuse_projections)):
            if value not in ("auto", True, False):
                raise InvalidDecodeInput(f"{name}={value!r}: use 'auto', True or False")
        self.static_cache = static_cache
        self.cuda_graphs = cuda_graphs
        self.compile = compile
        self.phase_timing = phase_timing
        self._static_pool = None
        self._static: bool | None = None          # uses_static_cache(), decided on first use
        # the target first: a drafter's model may share its layers (layer skip)
        self._cpu_kernels = prepare_for_decoding(target_model, cpu_kernels, fuse_projections)
        for model in (drafter.cached_models() if drafter is not None else ()):
            prepare_for_decoding(model, cpu_kernels, fuse_projections)

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    def uses_static_cache(self) -> bool:
        """Whether generate runs on static caches (see static_cache)."""
        if self._static is None:
            if self.static_cache == "auto":
                models = [self.target] + list(self.drafter.cached_models() if self.drafter else ())
                self._static = all(static_by_default(m) for m in models)
            else:
                self._static = bool(self.static_cache)
        return self._static

    @property
    def static_pool(self) -> StaticCachePool:
        """The static caches (and CUDA graphs), kept across generate calls and shared
        by every SpecDecoder of this target model (captured once, whatever the drafter or K)."""
        if self._static_pool is None:
            self._static_pool = StaticCachePool.of(self.target, *self._static_options())
        return self._static_pool

    def _static_options(self) -> tuple[bool, bool | str]:
        """(cuda_graphs, compile) of the static caches; compile "auto" where chosen by default
        (the caches then fall back to eager forwards if compiling fails)."""
        graphs = self.cuda_graphs is True or (self.cuda_graphs == "auto" and self.device.type == "cuda")
        return graphs, resolve_compile(self.compile, self.target)

    def engine(self) -> dict:
        """The engine options as resolved on this device: {static_cache, cuda_graphs, compile,
        cpu_kernels, fused_projections} (graphs and compile apply to static caches only;
        cpu_kernels: the target's packed linear layers and grouped-query attention, see
        cpu_kernels.py; fused_projections: the target's decoder layers whose attention and MLP
        projections are fused, see fused_projections.py)."""
        static = self.uses_static_cache()
        graphs, compiled = self._static_options()
        return {"static_cache": static, "cuda_graphs": static and graphs,
                "compile": static and bool(compiled), "cpu_kernels": dict(self._cpu_kernels),
                "fused_projections": fused_projections(self.target)}

    def engine_state(self) -> dict:
        """What the engine holds now (for tests and diagnostics): engine() and, on static caches,
        every cache in this target's pool -- {role, batch, length, width (host write column),
        device_positions (every layer's and the cache's own: equal to width between calls),
        compactions, compiled, forward_graphs (captured (width, logits_to_keep))} -- with, for the
        target's caches, the captured round shapes {source, drafted, run_width, parts}, the
        rounds run eagerly because their shape was not captured yet (warm-ups) and the captures
        made (one per part of a shape), both counted over the cache's life."""
        state = {**self.engine(), "caches": [], "compiled": dict(static_cache.COMPILES)}
        if not self.uses_static_cache():
            return state
        for role, cache in self.static_pool.caches():
            entry = {"role": role, **cache.state()}
            if cache.loop is not None:
                graphs = cache.loop.graphs
                entry["round_graphs"] = [
                    {"source": key[0], "drafted": key[1], "run_width": key[2], "parts": parts}
                    for key, parts in graphs.shapes().items()]
                entry["eager_rounds"] = graphs.counts["eager_rounds"]
                entry["captures"] = graphs.counts["captures"]
            state["caches"].append(entry)
        return state

    def generate(self, input_ids, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
                 seed: int = 0, attention_mask=None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None, stop_after: int | None = None) -> GenerateResult:
        """Speculative decoding; see docs/design.md ("Public contracts") for the arguments and result.

        stop_after: a row stops once it holds at least this many tokens, while every round drafts
        as it would in a call of max_new_tokens (a test of the first positions that must see full
        K-token rounds decodes no further than it needs).
        """
        if self.drafter is None:
            raise InvalidDecodeInput("this SpecDecoder has no drafter: pass one, or call generate_plain")
        return self._run(self.drafter, self.k, input_ids, max_new_tokens, sampling, seed,
                         attention_mask, eos_token_id, pad_token_id, stop_after)

    def generate_plain(self, input_ids, max_new_tokens: int = 64,
                       sampling: SamplingParams | None = None, seed: int = 0, attention_mask=None,
                       eos_token_id: int | None = None, pad_token_id: int | None = None) -> GenerateResult:
        """Plain decoding (one target step per token) with the same signature and result type."""
        return self._run(None, 0, input_ids, max_new_tokens, sampling, seed, attention_mask,
                         eos_token_id, pad_token_id)

    # ------------------------------------------------------------------------------------------
    def _check_inputs(self, input_ids, attention_mask, max_new_tokens):
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.as_tensor(input_ids, dtype=torch.long)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.shape[0] == 0:
            raise InvalidDecodeInput(f"input_ids of shape {tuple(input_ids.shape)}: expected [B, T] "
                                     "with B >= 1 (token ids of left-padded prompts)")
        if input_ids.shape[1] == 0:
            raise InvalidDecodeInput("empty prompt (input_ids has 0 tokens): give at least one token, "
                                     "e.g. the tokenizer's BOS token")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        elif tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise InvalidDecodeInput(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids "
                                     f"shape {tuple(input_ids.shape)}")
        attention_mask = attention_mask.long()
        empty_rows = (attention_mask.sum(1) == 0).nonzero().flatten().tolist()
        if empty_rows:
            raise InvalidDecodeInput(f"empty prompt in rows {empty_rows} (attention_mask all 0): give "
                                     "every row at least one token")
        if bool((attention_mask[:, -1] == 0).any()):
            raise InvalidDecodeInput("prompts must be left-padded (the last column of attention_mask "
                                     "must be 1): use tokenizer.padding_side = 'left'")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidDecodeInput(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1")
        return input_ids.long(), attention_mask

    @torch.inference_mode()
    def _run(self, drafter: Drafter | None, k: int, input_ids, max_new_tokens, sampling, seed,
             attention_mask, eos_token_id, pad_token_id, stop_after=None) -> GenerateResult:
        device = self.device
        input_ids, attention_mask = self._check_inputs(input_ids, attention_mask, max_new_tokens)
        if stop_after is not None and (not isinstance(stop_after, int) or stop_after < 1):
            raise InvalidDecodeInput(f"stop_after={stop_after!r}: must be an integer >= 1 (or None: "
                                     "rows decode to max_new_tokens)")
        if pad_token_id is None:
            pad_token_id = eos_token_id if eos_token_id is not None else 0
        session = self.static_pool.session if self.uses_static_cache() else dynamic_session
        return decode(self.target, drafter, k, input_ids.to(device), attention_mask.to(device),
                      max_new_tokens, sampling or SamplingParams(), seed, eos_token_id,
                      pad_token_id, session, verify=self.verify_round, verifier=self.verifier,
                      verify_widths=self.verify_widths, phase_timing=self.phase_timing,
                      stop_after=stop_after)
