"""GPU decoding benchmark: a ~1B Llama-shaped target with random weights, ours vs transformers.

Models of real architectures and sizes are built here with RANDOM weights (nothing is downloaded):
the target has the shape of Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, vocabulary 128256, tied embeddings, rope_theta 500000) in bf16 on the GPU; the
"unrelated" draft is a 2-layer, hidden-512 Llama of the same vocabulary. Every figure is greedy.

  1. plain decoding tokens/s at batch 1: ours (SpecDecoder.generate_plain, static cache) vs
     transformers generate (static cache, torch.compile when --compile) vs the memory-bandwidth
     limit (measured device copy bandwidth / weight bytes read per token);
  2. the cost of a verify pass over K + 1 tokens relative to one decoding step, K in 1, 2, 4, 6, 8;
  3. end-to-end speedup over our plain decoding with ControlledAcceptance (alpha x K grid), next to
     the planner's prediction E(K) / (c_round + v(K)) from the measured costs;
  4. ours vs transformers assisted generation (assistant_model, K tokens per round, constant
     schedule, no confidence threshold) with draft = the target itself and the unrelated draft;
  5. speedup of ours with ControlledAcceptance (alpha 0.8) over our plain decoding at batch sizes
     1, 4, 16, 64.

Random weights give nearly flat logits, whose greedy ties flip between kernels in bf16 (scaling the
LM head does not help: argmax is scale-invariant and bf16 errors are relative). sharpen_greedy()
therefore gives the target a deterministic greedy continuation with large margins without changing
its shape or cost: every speculative run's tokens are compared with plain greedy tokens, and the
mismatching rows are reported.

Timing: every contender is warmed up first (graph capture and compilation happen there), then the
contenders are interleaved repeat by repeat; CUDA is synchronised before every clock read; medians.
Progress goes to stderr. The Markdown goes to stdout and to benchmarks/results/gpu_decode.md.

    python benchmarks/gpu_decode.py [--quick] [--no-compile] [--json raw.json]
    python benchmarks/gpu_decode.py --smoke        # tiny fp32 models on the CPU, for tests
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import inspect
import json
import math
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

from specdec_core import DraftModel, SamplingParams, SpecDecoder
from specdec_core.records import DecodeState
from specdec_core.planner import expected_tokens_per_round, optimal_k, predicted_speedup
from specdec_core.synthetic import ControlledAcceptance

RESULTS = Path(__file__).parent / "results" / "gpu_decode.md"
SMOKE_RESULTS = Path(__file__).parent / "results" / "gpu_decode_smoke.md"

# Llama-3.2-1B's shape (rope scaling left out: it changes no cost at these lengths)
TARGET_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                 rope_theta=500000.0, max_position_embeddings=4096, tie_word_embeddings=True)
DRAFT_SMALL = dict(vocab_size=128256, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                   rope_theta=500000.0, max_position_embeddings=4096, tie_word_embeddings=True)
# the embedded default's architecture (SmolLM2-135M), for runs on a CPU
TARGET_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                   rope_theta=100000.0, max_position_embeddings=2048, tie_word_embeddings=True)
TARGET_SHAPES = {"llama-3.2-1b": TARGET_1B, "smollm2-135m": TARGET_135M}
TARGET_SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=512, tie_word_embeddings=True)
DRAFT_SMOKE = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                   max_position_embeddings=512, tie_word_embeddings=True)

SEED_REFERENCE = {"alpha": 0.8, "draft_verify_ratio": 0.07, "speedup": 2.8}
WITHIN = 0.15          # "within 15% of the planner"
BANDWIDTH_GOAL = 0.60  # "plain decoding >= 60% of the bandwidth limit"
ENGINE_OPTIONS = ("static_cache", "cuda_graphs", "phase_timing", "compile", "fuse_projections")
PAD = 0

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[gpu_decode {time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------
# settings
class Setup(NamedTuple):
    """What one run measures and how (from the command line)."""

    device: torch.device
    dtype: torch.dtype
    smoke: bool
    compile: bool
    repeats: int
    prompt_len: int
    new_tokens: dict[int, int]      # batch size -> max_new_tokens
    batches: tuple[int, ...]
    alphas: tuple[float, ...]
    ks: tuple[int, ...]
    assist_k: int
    batch_alpha: float
    target_shape: dict
    draft_shape: dict
    cost_repeats: int
    copy_bytes: int
    engine: dict                    # SpecDecoder options (static_cache, cuda_graphs, phase_timing, compile)
    seed: int = 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny fp32 models on the CPU, 2 alphas, K 1-2, batch 1-2 (for tests)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer tokens and repeats (a first look in a few minutes)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"Markdown output (default {RESULTS}; --smoke: {SMOKE_RESULTS})")
    parser.add_argument("--json", type=Path, default=None, help="also dump the raw numbers here")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="default: bfloat16 on cuda, float32 on cpu and in --smoke")
    parser.add_argument("--compile", dest="compile", action="store_true", default=None,
                        help="let transformers torch.compile its forward (static cache; CUDA only); "
                             "default on cuda, off in --smoke")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="at batch 1 (default 128; --quick 64; --smoke 16); larger batches get "
                             "half of it from batch 16 on")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats per contender (default 3; --quick 2; --smoke 1)")
    parser.add_argument("--static-cache", default="auto", choices=["auto", "on", "off"],
                        help="SpecDecoder static_cache (auto: static on CUDA)")
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(TARGET_SHAPES),
                        help="the target's architecture (random weights); smollm2-135m suits a CPU")
    parser.add_argument("--batches", default=None,
                        help="comma-separated batch sizes for item 5 (default 1,4,16,64)")
    parser.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                        help="SpecDecoder cuda_graphs (auto: on with the static cache on CUDA)")
    parser.add_argument("--engine-compile", default="auto", choices=["auto", "on", "off"],
                        help="SpecDecoder compile: its static-cache forwards through torch.compile "
                             "(auto: on CUDA)")
    parser.add_argument("--items", default=None,
                        help="comma-separated items to run (default all: 1,2,3,4,5; item 3 needs 2)")
    return parser.parse_args(argv)


def make_setup(args: argparse.Namespace) -> Setup:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke
                                          else "cpu"))
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" and not args.smoke else "float32")
    # transformers compiles generate's forward on CUDA only (without a private flag)
    compile_on = device.type == "cuda" and (args.compile if args.compile is not None else not args.smoke)
    tri = {"auto": "auto", "on": True, "off": False}
    engine = {"static_cache": tri[args.static_cache], "cuda_graphs": tri[args.cuda_graphs],
              "phase_timing": False, "compile": tri[args.engine_compile]}
    if args.smoke:
        new = args.max_new_tokens or 16
        return Setup(device=device, dtype=getattr(torch, dtype_name), smoke=True, compile=compile_on,
                      repeats=args.repeats or 1, prompt_len=8, new_tokens={1: new, 2: new},
                      batches=(1, 2), alphas=(0.5, 0.85), ks=(1, 2), assist_k=2, batch_alpha=0.8,
                      target_shape=TARGET_SMOKE, draft_shape=DRAFT_SMOKE, cost_repeats=2,
                      copy_bytes=16 << 20, engine=engine)
    new = args.max_new_tokens or (64 if args.quick else 128)
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else (1, 4, 16, 64)
    if 1 not in batches:
        batches = (1, *batches)          # items 1-4 run at batch 1
    return Setup(device=device, dtype=getattr(torch, dtype_name), smoke=False, compile=compile_on,
                 repeats=args.repeats or (2 if args.quick else 3), prompt_len=32,
                 new_tokens={b: (new if b < 16 else max(new // 2, 8)) for b in batches},
                 batches=batches, alphas=(0.5, 0.7, 0.85, 0.95), ks=(1, 2, 4, 6, 8),
                 assist_k=4, batch_alpha=0.8, target_shape=TARGET_SHAPES[args.shape],
                 draft_shape=dict(DRAFT_SMALL, vocab_size=TARGET_SHAPES[args.shape]["vocab_size"]),
                 cost_repeats=10 if args.quick else 20,
                 copy_bytes=(1 << 30) if device.type == "cuda" else (256 << 20), engine=engine)


# ------------------------------------------------------------------------------------------------
# models
def build_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A random-weight Llama built directly on the device in its dtype (no fp32 copy on the host)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**shape, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


@torch.no_grad()
def sharpen_greedy(model: torch.nn.Module, embed_std: float = 8.0, gain: float = 2.0,
                   self_score: float = 40.0, seed: int = 0) -> int:
    """Give a random Llama a greedy continuation with large margins; returns how many token ids
    (0 .. n-1) prompts may use.

    The token embeddings (tied to the LM head) live on the first d_kv = kv_heads x head_dim
    coordinates, in orbits of d_kv tokens: token (b, s) is a random vector u_b rolled by s, so
    rolling an embedding by one coordinate gives the next token of its orbit, pi(x). They are
    large (std embed_std), so the residual stream is dominated by the current token's embedding and
    the random layers add little. Layer 0's attention is set to attend to the current position
    (q = k, a large self score) and to add gain * roll(e_x, 1) = gain * e_pi(x) (v = identity on
    those coordinates, o = the roll). The LM head then prefers pi(x) over x (score gain vs 1) and over
    every other token by many standard deviations, so the model walks its orbit: x, pi(x),
    pi(pi(x)), ... -- not a constant, different per prompt, and far from any bf16 near-tie. Shapes,
    parameter count and every kernel are unchanged, so are the costs.
    """
    config = model.config
    hidden = config.hidden_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    group = heads // kv_heads
    d_kv = kv_heads * head_dim
    embed = model.get_input_embeddings().weight
    vocab = embed.shape[0]
    if d_kv > hidden or vocab < d_kv:
        raise ValueError(f"sharpen_greedy needs kv_heads x head_dim ({d_kv}) <= hidden ({hidden}) "
                         f"and <= vocab ({vocab})")
    device, dtype = embed.device, embed.dtype
    orbits = vocab // d_kv
    generator = torch.Generator().manual_seed(seed)
    base = (torch.randn(orbits + 1, d_kv, generator=generator) * embed_std).to(device)
    cols = torch.arange(d_kv, device=device)
    embed.zero_()
    chunk = 8192
    for start in range(0, vocab, chunk):
        rows = torch.arange(start, min(start + chunk, vocab), device=device)
        orbit, step = rows // d_kv, rows % d_kv
        embed[start:start + rows.numel(), :d_kv] = base[orbit[:, None],
                                                        (cols[None, :] - step[:, None]) % d_kv].to(dtype)
    head = model.get_output_embeddings().weight
    if head.data_ptr() != embed.data_ptr():
        head.copy_(embed)

    layer = model.model.layers[0]
    layer.input_layernorm.weight.fill_(1.0)
    attn = layer.self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
        proj.weight.zero_()
        if getattr(proj, "bias", None) is not None:
            proj.bias.zero_()
    # the normalised input has its energy on the d_kv coordinates: mean square hidden / d_kv there;
    # a self score of q.k / sqrt(head_dim) = a^2 head_dim (hidden / d_kv) / sqrt(head_dim)
    a = math.sqrt(self_score * d_kv / (hidden * math.sqrt(head_dim)))
    eye = torch.eye(head_dim, device=device, dtype=dtype)
    for h in range(heads):
        g = h // group
        attn.q_proj.weight[h * head_dim:(h + 1) * head_dim, g * head_dim:(g + 1) * head_dim] = a * eye
    attn.k_proj.weight[:, :d_kv] = a * torch.eye(d_kv, device=device, dtype=dtype)
    attn.v_proj.weight[:, :d_kv] = torch.eye(d_kv, device=device, dtype=dtype)
    # the first query head of each KV group writes gain * rms(e) * roll(normalised input, 1)
    i = torch.arange(d_kv, device=device)
    source_col = (i // head_dim) * group * head_dim + i % head_dim
    rms_embed = embed_std * math.sqrt(d_kv / hidden)
    attn.o_proj.weight[(i + 1) % d_kv, source_col] = gain * rms_embed
    return orbits * d_kv


@torch.no_grad()
def greedy_margins(model: torch.nn.Module, prompts: torch.Tensor, tokens: torch.Tensor) -> dict:
    """Top-1 minus top-2 logit over the greedy continuation (min and median over positions), as a
    fraction of the top-1 logit (compare with bf16's relative precision, 2^-8 = 0.004) and in
    standard deviations of the logits, from one forward pass over prompt + continuation; also
    whether that pass's argmax is the continuation everywhere."""
    ids = torch.cat([prompts, tokens[:, :-1]], 1).to(next(model.parameters()).device)
    logits = model(input_ids=ids).logits[:, prompts.shape[1] - 1:].float()
    top = logits.topk(2, dim=-1)
    gap = top.values[..., 0] - top.values[..., 1]
    relative = gap / top.values[..., 0].abs().clamp(min=1e-12)
    in_std = gap / logits.std(-1).clamp(min=1e-12)
    return {"relative_min": float(relative.min()), "relative_median": float(relative.median()),
            "std_min": float(in_std.min()), "std_median": float(in_std.median()),
            "argmax_is_continuation": bool((top.indices[..., 0] == tokens.to(ids.device)).all())}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters, each tensor once (tied embeddings count once)."""
    seen, total = set(), 0
    for _, param in model.named_parameters(remove_duplicate=False):
        if param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        total += param.numel() * param.element_size()
    return total


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5, inner: int = 10) -> float:
    """Bytes per second of a large device-to-device copy: (bytes read + bytes written) / time."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(inner):
            dst.copy_(src)
        sync(device)
        times.append((time.perf_counter() - start) / inner)
    del src, dst
    return 2 * nbytes / statistics.median(times)


# ------------------------------------------------------------------------------------------------
# the engine (one place that knows its optional keyword arguments)
def engine_options_supported() -> set[str]:
    return set(inspect.signature(SpecDecoder.__init__).parameters) & set(ENGINE_OPTIONS)


def make_decoder(target: torch.nn.Module, drafter, k: int = 4, **options) -> SpecDecoder:
    """SpecDecoder with the engine options (static_cache, cuda_graphs, phase_timing, compile) this version of
    specdec_core accepts; the others are left out (and listed in the report's header)."""
    supported = engine_options_supported()
    return SpecDecoder(target, drafter, k=k, **{n: v for n, v in options.items() if n in supported})


def forward_costs(model: torch.nn.Module, widths, context_len: int, repeats: int,
                  engine: dict) -> tuple[dict, str]:
    """{width: median seconds of one cached target pass over width new tokens}, and its source.
    engine: the decoders' options; the passes run as theirs do (graphs, compile)."""
    from specdec_core.profile import measure_forward_costs
    source = "specdec_core.profile.measure_forward_costs (static cache)"
    costs = measure_forward_costs(model, list(widths), context_len=context_len, batch_size=1,
                                  repeats=repeats, static=True, cuda_graphs=engine["cuda_graphs"],
                                  compile=engine["compile"],
                                  fuse_projections=engine.get("fuse_projections", "auto"))
    return {int(w): float(s) for w, s in costs.items()}, source


def decode_seconds(result, wall: float) -> float:
    """Decode-phase seconds of one of our runs (the whole call when no prefill time was taken)."""
    stats = result.stats
    return stats.decode_s if stats.prefill_s > 0 and stats.decode_s > 0 else wall


def measured_alpha(stats) -> tuple[float, int]:
    """(pooled conditional acceptance = accepted / reached over draft positions, reached)."""
    reached = sum(stats.reached_at_position)
    return (sum(stats.accepted_at_position) / reached if reached else 0.0), reached


def mismatched_rows(tokens: torch.Tensor, reference: torch.Tensor) -> int:
    return int((tokens.cpu() != reference.cpu()).any(1).sum())


# ------------------------------------------------------------------------------------------------
# timing
def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def interleave(contenders: dict[str, Callable[[], Any]], repeats: int, device: torch.device,
               label: str, warmup: int = 1) -> dict[str, list[tuple[float, Any]]]:
    """Warm every contender up, then run each once per repeat (order alternating between repeats)."""
    for name, fn in contenders.items():
        seconds = sum(timed(fn, device)[0] for _ in range(warmup))
        log(f"{label}: warm-up {name} {seconds:.2f}s")
    samples: dict[str, list] = {name: [] for name in contenders}
    names = list(contenders)
    for repeat in range(repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        start = time.perf_counter()
        for name in order:
            samples[name].append(timed(contenders[name], device))
        log(f"{label}: repeat {repeat + 1}/{repeats} ({len(names)} contenders, "
            f"{time.perf_counter() - start:.1f}s)")
    return samples


def median(values) -> float:
    return float(statistics.median(values))


def hf_generate(model, ids: torch.Tensor, new: int, **extra) -> torch.Tensor:
    """transformers greedy generate, never stopping early; returns the new tokens [B, new]."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         do_sample=False, pad_token_id=PAD, eos_token_id=None, **extra)
    return out[:, ids.shape[1]:]


@contextmanager
def hf_assisted_rounds():
    """Counts of transformers' assisted rounds while inside: {rounds, candidates, matches} (None
    when this transformers version has no AssistedCandidateGenerator.update_candidate_strategy)."""
    try:
        from transformers.generation.candidate_generator import AssistedCandidateGenerator
        original = AssistedCandidateGenerator.update_candidate_strategy
    except (ImportError, AttributeError):
        yield None
        return
    record = {"rounds": 0, "candidates": 0, "matches": 0}

    def counting(self, input_ids, scores, num_matches):
        # called once per round with the target's logits over candidates + 1 positions
        record["rounds"] += 1
        record["candidates"] += int(scores.shape[1]) - 1
        record["matches"] += int(num_matches)
        return original(self, input_ids, scores, num_matches)

    AssistedCandidateGenerator.update_candidate_strategy = counting
    try:
        yield record
    finally:
        AssistedCandidateGenerator.update_candidate_strategy = original


def configure_assistant(draft: torch.nn.Module, k: int) -> None:
    """K draft tokens every round: constant schedule, no confidence-based early stop."""
    config = draft.generation_config
    config.num_assistant_tokens = k
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0


# ------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, setup: Setup):
        self.s = setup
        self.device = setup.device
        t0 = time.perf_counter()
        self.target = build_model(setup.target_shape, setup.device, setup.dtype, seed=setup.seed)
        self.usable_vocab = sharpen_greedy(self.target, seed=setup.seed)
        self.draft = build_model(setup.draft_shape, setup.device, setup.dtype, seed=setup.seed + 1)
        # transformers' contenders run the models as a user loads them: copies made before the
        # engine fuses the originals' projections in place (fused_projections.py)
        fusing = "fuse_projections" in engine_options_supported()
        self.hf_target = copy.deepcopy(self.target) if fusing else self.target
        self.hf_draft = copy.deepcopy(self.draft) if fusing else self.draft
        sync(self.device)
        self.build_s = time.perf_counter() - t0
        log(f"models built in {self.build_s:.1f}s: target {human(param_count(self.target))} "
            f"params, draft {human(param_count(self.draft))} params, {setup.dtype}, {setup.device}")
        self.references: dict[int, torch.Tensor] = {}   # batch -> plain greedy tokens

    def prompts(self, batch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 + batch)
        ids = torch.randint(0, self.usable_vocab, (batch, self.s.prompt_len), generator=generator)
        return ids.to(self.device)

    def decoder(self, drafter, k: int = 1) -> SpecDecoder:
        return make_decoder(self.target, drafter, k=k, **self.s.engine)

    def reference(self, batch: int) -> torch.Tensor:
        if batch not in self.references:
            new = self.s.new_tokens[batch]
            self.references[batch] = self.decoder(None).generate_plain(self.prompts(batch), new).tokens
        return self.references[batch]

    # -- 1 -------------------------------------------------------------------------------------
    def plain_vs_hf(self) -> dict:
        s, target = self.s, self.hf_target
        ids, new = self.prompts(1), s.new_tokens[1]
        plain = self.decoder(None)
        hf_extra = {"cache_implementation": "static", "disable_compile": not s.compile}
        compiled, compile_error, compile_s = s.compile, None, 0.0
        if s.compile:  # compile (and capture) once outside the timing; fall back to eager on failure
            log("item 1: transformers static cache + torch.compile warm-up (compiles the forward)")
            try:
                compile_s = sum(timed(lambda: hf_generate(target, ids, new, **hf_extra),
                                      self.device)[0] for _ in range(2))
            except Exception as error:  # noqa: BLE001 -- any compile failure: report and go on
                compiled, compile_error = False, f"{type(error).__name__}: {str(error)[:200]}"
                hf_extra["disable_compile"] = True
                log(f"item 1: torch.compile failed ({compile_error}); transformers runs eager")
        contenders = {
            "ours": lambda: plain.generate_plain(ids, new),
            "hf": lambda: hf_generate(target, ids, new, **hf_extra),
            "hf_prefill": lambda: hf_generate(target, ids, 1, **hf_extra),
        }
        samples = interleave(contenders, s.repeats, self.device, "item 1 plain decoding",
                             warmup=2 if compiled else 1)
        ours_wall = median(t for t, _ in samples["ours"])
        ours_decode = median(decode_seconds(r, t) for t, r in samples["ours"])
        hf_wall = median(t for t, _ in samples["hf"])
        hf_prefill = median(t for t, _ in samples["hf_prefill"])
        ours_tokens = samples["ours"][-1][1].tokens
        self.references[1] = ours_tokens
        hf_tokens = samples["hf"][-1][1]
        bandwidth = copy_bandwidth(self.device, s.copy_bytes)
        wbytes = weight_bytes(target)
        limit = bandwidth / wbytes
        ours_tps = (new - 1) / ours_decode
        hf_tps = (new - 1) / max(hf_wall - hf_prefill, 1e-9)
        margins = greedy_margins(target, ids, ours_tokens)
        result = {
            "max_new_tokens": new, "prompt_len": s.prompt_len,
            "copy_bandwidth_bytes_per_s": bandwidth, "weight_bytes": wbytes,
            "limit_tokens_per_s": limit,
            "ours": {"tokens_per_s": new / ours_wall, "decode_tokens_per_s": ours_tps,
                     "pct_of_limit": 100 * ours_tps / limit, "wall_s": ours_wall,
                     "decode_s": ours_decode},
            "hf": {"tokens_per_s": new / hf_wall, "decode_tokens_per_s": hf_tps,
                   "pct_of_limit": 100 * hf_tps / limit, "wall_s": hf_wall,
                   "prefill_call_s": hf_prefill, "compiled": compiled,
                   "compile_warmup_s": compile_s, "compile_error": compile_error,
                   "mismatched_rows_vs_ours": mismatched_rows(hf_tokens, ours_tokens)},
            "greedy_margin": margins,
        }
        log(f"item 1: ours {ours_tps:.1f} tok/s, transformers {hf_tps:.1f} tok/s, "
            f"limit {limit:.1f} tok/s")
        return result

    # -- 2 -------------------------------------------------------------------------------------
    def verify_costs(self) -> dict:
        s = self.s
        widths = range(1, max(s.ks) + 2)
        context = s.prompt_len + s.new_tokens[1] // 2
        log(f"item 2: forward costs of widths {list(widths)} at context {context}")
        costs, source = forward_costs(self.target, widths, context, s.cost_repeats, s.engine)
        step = costs[1]
        return {"source": source, "context_len": context, "step_s": step,
                "forward_s": {str(w): c for w, c in costs.items()},
                "verify_s": {str(k): costs[k + 1] for k in s.ks},
                "verify_ratio": {str(k): costs[k + 1] / step for k in s.ks}}

    # -- 3 -------------------------------------------------------------------------------------
    def propose_seconds(self, reference: torch.Tensor, k: int, calls: int) -> float:
        """Seconds of one ControlledAcceptance proposal of k tokens (a few small kernels)."""
        batch, new = reference.shape
        drafter = ControlledAcceptance(reference, 0.8, seed=7)
        drafter.check_compatible(self.target)
        ids = self.prompts(batch)
        state = DecodeState(prompt_ids=ids, prompt_mask=torch.ones_like(ids),
                            prompt_len=torch.full((batch,), ids.shape[1], device=self.device),
                            out=torch.zeros(batch, new + k + 1, dtype=torch.long, device=self.device),
                            n_out=torch.full((batch,), new // 2, device=self.device),
                            prompt_has_padding=False)
        drafter.start(state)
        num_draft = torch.full((batch,), k, device=self.device)
        greedy = SamplingParams()
        for _ in range(3):
            drafter.propose(state, k, num_draft, greedy, None)
        times = []
        for _ in range(3):
            seconds, _ = timed(lambda: [drafter.propose(state, k, num_draft, greedy, None)
                                        for _ in range(calls)], self.device)
            times.append(seconds / calls)
        return median(times)

    def controlled_grid(self, costs: dict) -> dict:
        s = self.s
        ids, new = self.prompts(1), s.new_tokens[1]
        reference = self.reference(1)
        step = costs["step_s"]
        draft_s = {k: self.propose_seconds(reference, k, 50 if s.smoke else 200) for k in s.ks}
        c_round = {k: draft_s[k] / step for k in s.ks}
        v = {k: costs["verify_ratio"][str(k)] for k in s.ks}
        plain = self.decoder(None)
        contenders: dict[str, Callable] = {"plain": lambda: plain.generate_plain(ids, new)}
        for alpha in s.alphas:
            for k in s.ks:
                dec = self.decoder(ControlledAcceptance(reference, alpha, seed=11), k=k)
                contenders[f"a{alpha}_k{k}"] = (lambda d=dec: d.generate(ids, new))
        samples = interleave(contenders, s.repeats, self.device, "item 3 alpha x K grid")
        plain_decode = median(decode_seconds(r, t) for t, r in samples["plain"])
        plain_wall = median(t for t, _ in samples["plain"])
        rows = []
        for alpha in s.alphas:
            for k in s.ks:
                runs = samples[f"a{alpha}_k{k}"]
                stats = runs[-1][1].stats
                alpha_hat, reached = measured_alpha(stats)
                spec_decode = median(decode_seconds(r, t) for t, r in runs)
                speedup = plain_decode / spec_decode
                predicted = expected_tokens_per_round(alpha, k) / (c_round[k] + v[k])
                rows.append({
                    "alpha": alpha, "k": k, "measured_alpha": alpha_hat, "reached": reached,
                    "acceptance_rate": stats.acceptance_rate,
                    "tokens_per_round": stats.mean_accepted_length,
                    "speedup": speedup,
                    "speedup_end_to_end": plain_wall / median(t for t, _ in runs),
                    "predicted": predicted,
                    "predicted_at_measured_tokens_per_round":
                        stats.mean_accepted_length / (c_round[k] + v[k]),
                    "ratio": speedup / predicted,
                    "within": abs(speedup / predicted - 1) <= WITHIN,
                    "mismatched_rows": max(mismatched_rows(r.tokens, reference) for _, r in runs)})
        seed_k, seed_speedup = optimal_k(SEED_REFERENCE["alpha"], SEED_REFERENCE["draft_verify_ratio"])
        ours_best = max(((k, expected_tokens_per_round(SEED_REFERENCE["alpha"], k) / (c_round[k] + v[k]))
                         for k in s.ks), key=lambda kv: kv[1])
        nearest = min(s.alphas, key=lambda a: abs(a - s.batch_alpha))
        best_k = max((row for row in rows if row["alpha"] == nearest), key=lambda r: r["speedup"])["k"]
        return {
            "plain_decode_s": plain_decode, "plain_wall_s": plain_wall, "max_new_tokens": new,
            "draft_round_s": {str(k): draft_s[k] for k in s.ks},
            "c_round": {str(k): c_round[k] for k in s.ks},
            "draft_verify_ratio": {str(k): c_round[k] / v[k] for k in s.ks},
            "grid": rows,
            "seed_reference": {
                **SEED_REFERENCE, "planner_best_k": seed_k, "planner_speedup": seed_speedup,
                "planner_speedup_at_k4": predicted_speedup(SEED_REFERENCE["alpha"], 4,
                                                           SEED_REFERENCE["draft_verify_ratio"]),
                "ours_best_k": ours_best[0], "ours_predicted": ours_best[1],
                "ours_draft_verify_ratio": c_round[ours_best[0]] / v[ours_best[0]]},
            "best_k": best_k, "best_k_alpha": nearest,
        }

    # -- 4 -------------------------------------------------------------------------------------
    def assisted(self) -> dict:
        s = self.s
        ids, new, k = self.prompts(1), s.new_tokens[1], s.assist_k
        reference = self.reference(1)
        rows = []
        for label, draft, hf_draft in (("draft = target (all accepted)", self.target, self.hf_target),
                                       ("unrelated small draft", self.draft, self.hf_draft)):
            configure_assistant(hf_draft, k)
            ours = self.decoder(DraftModel(draft), k=k)
            contenders = {
                "ours": lambda d=ours: d.generate(ids, new),
                "hf": lambda d=hf_draft: hf_generate(self.hf_target, ids, new, assistant_model=d),
            }
            samples = interleave(contenders, s.repeats, self.device, f"item 4 {label}")
            with hf_assisted_rounds() as hf_rounds:     # one more, untimed run: count its rounds
                contenders["hf"]()
            stats = samples["ours"][-1][1].stats
            alpha_hat, _ = measured_alpha(stats)
            ours_wall = median(t for t, _ in samples["ours"])
            hf_wall = median(t for t, _ in samples["hf"])
            rows.append({
                "draft": label, "k": k,
                "ours_tokens_per_s": new / ours_wall, "hf_tokens_per_s": new / hf_wall,
                "ratio": hf_wall / ours_wall,
                "ours_decode_tokens_per_s": (new - 1) / median(decode_seconds(r, t)
                                                               for t, r in samples["ours"]),
                "acceptance_rate": stats.acceptance_rate, "measured_alpha": alpha_hat,
                "tokens_per_round": stats.mean_accepted_length,
                "hf_rounds": hf_rounds,
                "hf_acceptance_rate": (hf_rounds["matches"] / hf_rounds["candidates"]
                                       if hf_rounds and hf_rounds["candidates"] else None),
                "hf_tokens_per_round": ((hf_rounds["matches"] + hf_rounds["rounds"])
                                        / hf_rounds["rounds"]
                                        if hf_rounds and hf_rounds["rounds"] else None),
                "ours_mismatched_rows": max(mismatched_rows(r.tokens, reference)
                                            for _, r in samples["ours"]),
                "hf_mismatched_rows": max(mismatched_rows(t, reference) for _, t in samples["hf"])})
        return {"max_new_tokens": new, "rows": rows}

    # -- 5 -------------------------------------------------------------------------------------
    def batch_sizes(self, best_k: int | None) -> dict:
        """best_k: item 3's best measured K (None when item 3 failed: K = 4 only)."""
        s = self.s
        base_k = 4 if 4 in s.ks else max(s.ks)
        ks = sorted({base_k, best_k or base_k})
        rows = []
        for batch in s.batches:
            ids, new = self.prompts(batch), s.new_tokens[batch]
            reference = self.reference(batch)
            plain = self.decoder(None)
            contenders: dict[str, Callable] = {"plain": lambda: plain.generate_plain(ids, new)}
            for k in ks:
                dec = self.decoder(ControlledAcceptance(reference, s.batch_alpha, seed=13), k=k)
                contenders[f"k{k}"] = (lambda d=dec: d.generate(ids, new))
            samples = interleave(contenders, s.repeats, self.device, f"item 5 batch {batch}")
            plain_decode = median(decode_seconds(r, t) for t, r in samples["plain"])
            for k in ks:
                runs = samples[f"k{k}"]
                stats = runs[-1][1].stats
                alpha_hat, _ = measured_alpha(stats)
                spec_decode = median(decode_seconds(r, t) for t, r in runs)
                rows.append({
                    "batch": batch, "k": k, "alpha": s.batch_alpha, "max_new_tokens": new,
                    "plain_tokens_per_s": batch * (new - 1) / plain_decode,
                    "spec_tokens_per_s": batch * (new - 1) / spec_decode,
                    "speedup": plain_decode / spec_decode, "measured_alpha": alpha_hat,
                    "tokens_per_round": stats.mean_accepted_length,
                    "mismatched_rows": max(mismatched_rows(r.tokens, reference) for _, r in runs)})
        stops = {}
        for k in ks:
            losing = [row["batch"] for row in rows if row["k"] == k and row["speedup"] < 1]
            stops[str(k)] = min(losing) if losing else None
        source = (f"the best measured K in item 3 at the alpha nearest {s.batch_alpha}" if best_k
                  else "the default (item 3 gave no best K)")
        return {"ks": ks, "alpha": s.batch_alpha, "best_k": best_k or base_k,
                "best_k_source": source, "rows": rows, "stops_paying_at_batch": stops}


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# report
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def human(count: float, unit: str = "") -> str:
    """1.236B, 65.4M, 51.2k (of params, or of bytes with unit 'B')."""
    for scale, suffix, digits in ((1e9, "G" if unit else "B", 3), (1e6, "M", 1), (1e3, "k", 1)):
        if count >= scale:
            return f"{count / scale:.{digits}f}{suffix}{unit}"
    return f"{count:.0f}{unit}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def must_show(raw: dict) -> list[dict]:
    """The three claims, each met / not met with its figure (not measured: met is None)."""
    rows = []
    plain = measured(raw, "item1")
    claim = f"plain decoding >= {BANDWIDTH_GOAL:.0%} of the bandwidth limit at batch 1"
    if plain:
        rows.append({"claim": claim, "met": plain["ours"]["pct_of_limit"] >= 100 * BANDWIDTH_GOAL,
                     "figure": f"ours {plain['ours']['pct_of_limit']:.1f}% "
                               f"({plain['ours']['decode_tokens_per_s']:.1f} of "
                               f"{plain['limit_tokens_per_s']:.1f} tok/s); transformers "
                               f"{plain['hf']['pct_of_limit']:.1f}%"})
    else:
        rows.append({"claim": claim, "met": None, "figure": "not measured"})
    grid = measured(raw, "item3")
    claim = f"end-to-end speedup within {WITHIN:.0%} of the planner across the alpha/K grid"
    if grid:
        worst = max(grid["grid"], key=lambda r: abs(r["ratio"] - 1))
        within = sum(r["within"] for r in grid["grid"])
        rows.append({"claim": claim, "met": within == len(grid["grid"]),
                     "figure": f"{within}/{len(grid['grid'])} within; worst measured/predicted "
                               f"{worst['ratio']:.2f} (alpha {worst['alpha']}, K {worst['k']})"})
    else:
        rows.append({"claim": claim, "met": None, "figure": "not measured"})
    assisted = measured(raw, "item4")
    claim = "less overhead than transformers assisted generation at both extremes"
    if assisted:
        rows.append({"claim": claim, "met": all(r["ratio"] > 1 for r in assisted["rows"]),
                     "figure": "; ".join(f"{r['draft']}: ours/transformers {r['ratio']:.2f}x"
                                         for r in assisted["rows"])})
    else:
        rows.append({"claim": claim, "met": None, "figure": "not measured"})
    return rows


def measured(raw: dict, key: str) -> dict | None:
    """An item's numbers, or None when it failed or was not reached."""
    item = raw.get(key)
    return item if item and "error" not in item else None


def render_header(meta: dict) -> list[str]:
    missing = meta["engine_options_missing"]
    line = (
        f"{meta['utc']} UTC; device {meta['device_name']}; dtype {meta['dtype']}; torch "
        f"{meta['torch']}; transformers {meta['transformers']}; target {meta['target']} "
        f"({human(meta['target_params'])} params, random weights, sharpened greedy); draft "
        f"{meta['draft']} ({human(meta['draft_params'])} params, random weights); prompts of "
        f"{meta['prompt_len']} random tokens; greedy; medians of {meta['repeats']} interleaved "
        f"repeats after warm-up. Engine options: {meta['engine_options']}"
        + (f" (not accepted by this specdec_core, left out: {', '.join(missing)})" if missing else "")
        + f". Models built in {meta['build_s']:.1f}s; "
        + (f"whole run {meta['run_s']:.1f}s." if meta.get("finished")
           else f"run time so far {meta['run_s']:.1f}s (unfinished).")
        + (" SMOKE RUN: tiny models, timings meaningless." if meta["smoke"] else ""))
    return [f"# GPU decoding benchmark: {meta['device_name']}", "", line, ""]


def render_item1(s1: dict, raw: dict) -> list[str]:
    hf_label = ("transformers generate, static cache + torch.compile (its automatic compile: "
                "CompileConfig defaults, mode reduce-overhead)" if s1["hf"]["compiled"]
                else "transformers generate, static cache (no compile)")
    margin = s1["greedy_margin"]
    return [table(
        ["contender", "tokens/s (end to end)", "decode tokens/s", "% of bandwidth limit"],
        [["ours: SpecDecoder.generate_plain", f"{s1['ours']['tokens_per_s']:.1f}",
          f"{s1['ours']['decode_tokens_per_s']:.1f}", f"{s1['ours']['pct_of_limit']:.1f}%"],
         [hf_label, f"{s1['hf']['tokens_per_s']:.1f}", f"{s1['hf']['decode_tokens_per_s']:.1f}",
          f"{s1['hf']['pct_of_limit']:.1f}%"],
         ["bandwidth limit", "", f"{s1['limit_tokens_per_s']:.1f}", "100%"]]), "",
        f"{s1['max_new_tokens']} new tokens. Limit = measured copy bandwidth "
        f"{s1['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (bytes read + written by a device copy) / "
        f"{human(s1['weight_bytes'], 'B')} of weights read per token (each tensor once; the tied "
        "embedding once; the KV cache, a few MB here, left out). Decode tokens/s: tokens after the "
        "first per second after the prefill (ours: its own prefill timing; transformers: wall time "
        "of max_new_tokens minus that of max_new_tokens=1). "
        f"transformers tokens differing from ours: {s1['hf']['mismatched_rows_vs_ours']} row(s). "
        "Greedy margin (top-1 minus top-2 logit) over the continuation: min "
        f"{margin['relative_min']:.3f}, median {margin['relative_median']:.3f} of the top-1 logit "
        f"(bf16 resolves 0.004); min {margin['std_min']:.1f} logit standard deviations."
        + (f" torch.compile warm-up {s1['hf']['compile_warmup_s']:.1f}s."
           if s1["hf"]["compiled"] else "")
        + (f" torch.compile failed: {s1['hf']['compile_error']}." if s1["hf"]["compile_error"] else "")]


def render_item2(s2: dict, raw: dict) -> list[str]:
    return [table(["K", "tokens in the pass", "ms", "verify(K) / step"],
                  [[k, int(k) + 1, f"{sec * 1e3:.3f}", f"{s2['verify_ratio'][k]:.3f}"]
                   for k, sec in s2["verify_s"].items()]), "",
            f"One step (a cached pass over 1 token) = {s2['step_s'] * 1e3:.3f} ms at context "
            f"{s2['context_len']}, from {s2['source']}."]


def render_item3(s3: dict, raw: dict) -> list[str]:
    ratios = ", ".join(f"K={k}: {r:.3f}" for k, r in s3["draft_verify_ratio"].items())
    ref = s3["seed_reference"]
    s5 = measured(raw, "item5")
    at_08 = [r for r in s5["rows"] if r["batch"] == 1] if s5 else []
    return [
        table(["alpha", "K", "measured acceptance", "tokens/round", "measured speedup", "predicted",
               "measured / predicted", f"within {WITHIN:.0%}?", "predicted at measured tokens/round",
               "speedup incl. prefill", "mismatched rows"],
              [[r["alpha"], r["k"], f"{r['measured_alpha']:.3f}", f"{r['tokens_per_round']:.2f}",
                f"{r['speedup']:.2f}x", f"{r['predicted']:.2f}x", f"{r['ratio']:.2f}",
                "yes" if r["within"] else "no", f"{r['predicted_at_measured_tokens_per_round']:.2f}x",
                f"{r['speedup_end_to_end']:.2f}x", r["mismatched_rows"]] for r in s3["grid"]]), "",
        "Measured speedup = our plain decode-phase time / the speculative one over whole generate "
        f"calls (same prompt, same {s3['max_new_tokens']} tokens; the prefill, which the planner "
        "does not model, is left out; with it: the 'incl. prefill' column). Predicted = "
        "E(alpha, K) / (c_round + v(K)) with v(K) from item 2 and c_round = one "
        "ControlledAcceptance proposal / one step, measured: "
        + ", ".join(f"K={k}: {c:.3f} ({s3['draft_round_s'][k] * 1e6:.0f} us)"
                    for k, c in s3["c_round"].items())
        + f". Measured draft/verify cost ratio c_round / v(K): {ratios}. Measured acceptance = "
        "accepted / reached draft positions (the conditional rate, comparable to alpha).", "",
        table(["", "alpha", "draft/verify cost ratio", "best K", "speedup"],
              [["seeds' reference (planner, v(K) = 1)", ref["alpha"], ref["draft_verify_ratio"],
                ref["planner_best_k"],
                f"{ref['planner_speedup']:.2f}x (quoted: about {ref['speedup']}x)"],
               ["ours, planner with our measured costs", ref["alpha"],
                f"{ref['ours_draft_verify_ratio']:.3f}", ref["ours_best_k"],
                f"{ref['ours_predicted']:.2f}x"]]
              + [[f"ours, measured (item 5, batch 1, K={r['k']})", r["alpha"], "", r["k"],
                  f"{r['speedup']:.2f}x"] for r in at_08])]


def render_item4(s4: dict, raw: dict) -> list[str]:
    return [
        table(["draft", "K", "ours tokens/s", "transformers tokens/s", "ours / transformers",
               "acceptance ours / transformers", "tokens/round ours / transformers",
               "mismatched rows ours / transformers"],
              [[r["draft"], r["k"], f"{r['ours_tokens_per_s']:.1f}", f"{r['hf_tokens_per_s']:.1f}",
                f"{r['ratio']:.2f}x",
                f"{r['acceptance_rate']:.3f} / {fmt(r['hf_acceptance_rate'], '.3f')}",
                f"{r['tokens_per_round']:.2f} / {fmt(r['hf_tokens_per_round'], '.2f')}",
                f"{r['ours_mismatched_rows']} / {r['hf_mismatched_rows']}"] for r in s4["rows"]]),
        "",
        f"End to end, {s4['max_new_tokens']} new tokens. Ours: SpecDecoder(target, "
        "DraftModel(draft), k=K). transformers: generate(assistant_model=draft, do_sample=False) "
        "with the draft's generation_config num_assistant_tokens=K, "
        "num_assistant_tokens_schedule='constant', assistant_confidence_threshold=0 (K drafts "
        "every round), its default (dynamic) cache (assisted generation does not take the static "
        "one). Acceptance = accepted / drafted tokens; transformers' from its rounds (counted in "
        "one more, untimed run; its first token comes from a round, ours from the prefill)."]


def render_item5(s5: dict, raw: dict) -> list[str]:
    stops = []
    for k, batch in s5["stops_paying_at_batch"].items():
        stops.append(f"K={k}: speculation stops paying (speedup < 1) at batch {batch}" if batch
                     else f"K={k}: speculation pays at every batch size measured")
    return [
        table(["batch", "K", "new tokens", "plain tokens/s", "speculative tokens/s", "speedup",
               "measured acceptance", "tokens/round", "mismatched rows"],
              [[r["batch"], r["k"], r["max_new_tokens"], f"{r['plain_tokens_per_s']:.1f}",
                f"{r['spec_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                f"{r['measured_alpha']:.3f}", f"{r['tokens_per_round']:.2f}", r["mismatched_rows"]]
               for r in s5["rows"]]), "",
        f"ControlledAcceptance alpha {s5['alpha']}; decode-phase tokens/s over all rows. "
        + "; ".join(stops) + f". K={s5['best_k']} is {s5['best_k_source']}."]


SECTIONS = (
    ("item1", "1. Plain decoding at batch 1 vs transformers and the bandwidth limit", render_item1),
    ("item2", "2. verify(K) cost relative to one decoding step", render_item2),
    ("item3", "3. End-to-end speedup with controlled acceptance vs the planner (batch 1)",
     render_item3),
    ("item4", "4. Overhead against transformers assisted generation (batch 1)", render_item4),
    ("item5", "5. Speedup over plain decoding by batch size", render_item5),
)


def render(raw: dict) -> str:
    out = render_header(raw["meta"])
    for key, title, section in SECTIONS:
        out += [f"## {title}", ""]
        item = raw.get(key)
        if item is None:
            out.append("_Not measured: the run stopped before this item._")
        elif "error" in item:
            out.append(f"**Failed:** `{item['error']}` (traceback on stderr).")
        else:
            out += section(item, raw)
        out.append("")
    out += ["## Must show", ""]
    out.append(table(["claim", "status", "figure"],
                     [[m["claim"], {True: "met", False: "not met", None: "not measured"}[m["met"]],
                       m["figure"]] for m in raw["must_show"]]))
    out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the raw numbers (what --json writes). After every item the
    Markdown (and the JSON) are rewritten, so a run cut short still leaves what it measured."""
    args = parse_args(argv)
    setup = make_setup(args)
    transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    utc = dt.datetime.now(dt.timezone.utc)
    log(f"device {device_name(setup.device)}, dtype {setup.dtype}, compile {setup.compile}, "
        f"repeats {setup.repeats}, new tokens {setup.new_tokens}")
    bench = Bench(setup)
    supported = engine_options_supported()
    raw: dict[str, Any] = {"meta": {
        "utc": f"{utc:%Y-%m-%d %H:%M}", "device_name": device_name(setup.device),
        "device": str(setup.device), "dtype": str(setup.dtype).replace("torch.", ""),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "smoke": setup.smoke, "compile": setup.compile, "repeats": setup.repeats,
        "prompt_len": setup.prompt_len, "new_tokens": {str(b): n for b, n in setup.new_tokens.items()},
        "target": shape_label(setup.target_shape), "draft": shape_label(setup.draft_shape),
        "target_params": param_count(bench.target), "draft_params": param_count(bench.draft),
        "engine_options": ", ".join(f"{k}={v!r}" for k, v in setup.engine.items() if k in supported)
                          or "none",
        "engine_options_missing": [k for k in setup.engine if k not in supported],
        "build_s": bench.build_s, "run_s": 0.0}}
    out = args.out or (SMOKE_RESULTS if setup.smoke else RESULTS)

    def write(finished: bool = False) -> str:
        raw["meta"]["run_s"] = time.perf_counter() - started
        raw["meta"]["finished"] = finished
        raw["must_show"] = must_show(raw)
        text = render(raw)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(raw, indent=2))
        return text

    steps = (
        ("item1", bench.plain_vs_hf),
        ("item2", bench.verify_costs),
        ("item3", lambda: bench.controlled_grid(raw["item2"])),
        ("item4", bench.assisted),
        ("item5", lambda: bench.batch_sizes(
            measured(raw, "item3")["best_k"] if measured(raw, "item3") else None)),
    )
    chosen = None if args.items is None else {f"item{i.strip()}" for i in args.items.split(",")}
    for key, step in steps:
        if chosen is not None and key not in chosen:
            continue
        try:
            raw[key] = step()
        except Exception as error:  # noqa: BLE001 -- report it and measure the other items
            log(f"{key} failed: {type(error).__name__}: {error}")
            traceback.print_exc(file=sys.stderr)
            raw[key] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        write()
    text = write(finished=True)
    print(text)
    log(f"done in {time.perf_counter() - started:.1f}s; wrote {out}"
        + (f" and {args.json}" if args.json else ""))
    return raw


def shape_label(shape: dict) -> str:
    return (f"Llama {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
            f"{shape['num_attention_heads']} heads / {shape['num_key_value_heads']} KV, "
            f"intermediate {shape['intermediate_size']}, vocab {shape['vocab_size']}, "
            f"{'tied' if shape['tie_word_embeddings'] else 'untied'} embeddings")


if __name__ == "__main__":
    main()
