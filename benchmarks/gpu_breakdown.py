"""Where a decoding step's and a speculative round's time goes, with torch.profiler.

Eight configurations of the engine on one random-weight target (the shapes, model builder and
sharpened greedy continuation of gpu_decode.py), batch 1, greedy, static caches, the decoder
layers' projections fused (fused_projections.py) except where named:

  plain_eager    SpecDecoder.generate_plain, CUDA graphs off
  plain_graphs   SpecDecoder.generate_plain, CUDA graphs on
  plain_unfused  the same on a copy of the target whose projections are not fused
  plain_compiled SpecDecoder.generate_plain, CUDA graphs on, torch.compile on whatever
                 --engine-compile says (the engine's default on CUDA, where the bandwidth goal is
                 set): the kernels of the compiled step, and the bodies and seconds it compiled
  plain_tuned    the same with inductor's coordinate descent tuning (TUNED_OPTIONS, what
                 SPECDEC_INDUCTOR_OPTIONS=coordinate_descent_tuning=1 sets: Triton block sizes
                 tuned per kernel; gpt-fast's setting), the lever left for the bandwidth goal
  spec_k4        SpecDecoder.generate with ControlledAcceptance (alpha 0.8), K = 4, graphs on
  spec_k6        the same with K = 6
  spec_k8        the same with K = 8

Each is warmed up twice (graph capture happens there; --warmup 1 as gpu_decode.py does), timed once
wall-clock (synchronised), with the round graphs captured and the rounds run eagerly inside the
timed call counted (both 0 once every round shape was captured in the warm-up), then run once more
under torch.profiler (CPU activity, plus CUDA when available). Every figure is given
per step (plain: per decoding step) or per round (speculative), dividing the whole generate call
by result.stats.rounds; the prefill is part of the call, so it is spread over the steps.

What is counted (host-side events only inside the profiled call's record_function range, so the
synchronisation after it is left out; device-side events all, since the profiled session holds
nothing else):
  device busy    sum of the durations of device-side work (kernels, memcpy, memset: Kineto's
                 activity types; not the range annotations and sync waits it also puts on the
                 device's timeline); one stream here, so no overlap is double-counted
  kernels        device-side work events with a duration > 0 (memcpy and memset included)
  eager launches cudaLaunchKernel, cudaLaunchKernelExC, cuLaunchKernel, cuLaunchKernelEx calls
  graph launches cudaGraphLaunch calls
  host syncs     cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize calls (a copy
                 to pageable host memory blocks too; those show under DtoH copies)
  DtoH copies    device-side memcpy events with "DtoH" in the name (cudaMemcpyAsync calls of any
                 direction are in the JSON as memcpy_calls)
  aten ops       top-level aten:: operators on the host (not those called by other aten ops)
Device-side figures are None ("n/a") when CUDA is not profiled (CPU runs). The top-10 tables list
kernels by device time on CUDA, host operators by self CPU time on the CPU. Runtime call names may
carry a CUPTI version suffix (_v7000); it is stripped before matching. Kernel durations inside CUDA
graphs are as CUPTI reports them; the counts are exact.

Every speculative run's tokens are compared with plain greedy tokens (mismatching rows reported).
Progress goes to stderr; the Markdown to stdout and --out; the raw numbers to --json.

    python benchmarks/gpu_breakdown.py [--shape llama-3.2-1b] [--new 64] [--json raw.json]
    python benchmarks/gpu_breakdown.py --smoke      # tiny fp32 model on the CPU, for tests
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import re
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_decode as gd  # noqa: E402  -- shapes, model builder, decoder factory, report helpers

from specdec_core import static_cache  # noqa: E402
from specdec_core.synthetic import ControlledAcceptance  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "gpu_breakdown.md"
ALPHA = 0.8
TOP = 10
RUN_RANGE = "gpu_breakdown::run"

EAGER_LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
GRAPH_LAUNCHES = {"cudaGraphLaunch"}
HOST_SYNCS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}
MEMCPY_CALLS = {"cudaMemcpyAsync", "cudaMemcpy"}
DEVICE_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}
DEVICE_WAITS = re.compile(r"Sync$|Wait Event")       # device-timeline waits, older torch only

# name, label, speculative K (None: plain), CUDA graphs, projections fused (fused_projections.py),
# compile (None: as --engine-compile says; True: on whatever it says)
CONFIGS = (
    ("plain_eager", "plain, CUDA graphs off", None, False, True, None),
    ("plain_graphs", "plain, CUDA graphs on", None, True, True, None),
    ("plain_unfused", "plain, CUDA graphs on, projections unfused (q/k/v and gate/up apart)", None, True, False, None),
    ("plain_compiled", "plain, CUDA graphs on, torch.compile on", None, True, True, True),
    ("spec_k4", f"speculative K=4 (alpha {ALPHA}), graphs on", 4, True, True, None),
    ("spec_k6", f"speculative K=6 (alpha {ALPHA}), graphs on", 6, True, True, None),
    ("spec_k8", f"speculative K=8 (alpha {ALPHA}), graphs on", 8, True, True, None),
    # last: a step cut short by its time limit in this one's longer compile keeps the others
    ("plain_tuned", "plain, CUDA graphs on, torch.compile on, coordinate descent tuning", None, True,
     True, True),
)
# inductor's options per configuration (static_cache.COMPILE_OPTIONS while it runs; the others
# compile with what SPECDEC_INDUCTOR_OPTIONS says, by default inductor's defaults)
TUNED_OPTIONS = {"plain_tuned": {"coordinate_descent_tuning": True}}
# per-step figures: (JSON key, Markdown header, total it comes from, scale)
PER_STEP = (
    ("wall_ms", "wall ms", None, None),
    ("device_busy_ms", "device busy ms", "device_busy_us", 1e-3),
    ("kernels", "kernels", "kernels", 1),
    ("eager_launches", "eager launches", "eager_launches", 1),
    ("graph_launches", "graph launches", "graph_launches", 1),
    ("host_syncs", "host syncs", "host_syncs", 1),
    ("dtoh_copies", "DtoH copies", "dtoh_copies", 1),
    ("aten_ops", "aten ops", "aten_ops", 1),
)
SUMMARY_HEADER = (["configuration", "unit", "rounds", "tokens/round"]
                  + [header for _, header, _, _ in PER_STEP]
                  + ["busy % of wall", "captures, eager rounds (timed call)",
                     "compiled bodies, s (warm-up)", "mismatched rows"])

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[gpu_breakdown {time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(gd.TARGET_SHAPES),
                        help="the target's architecture (random weights)")
    parser.add_argument("--new", type=int, default=None,
                        help="new tokens per generate call (default 64; --smoke 16)")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny fp32 test model on the CPU, few tokens (for tests)")
    parser.add_argument("--device", default=None, help="default: cuda if available (and not "
                                                       "--smoke), else cpu")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"Markdown (default {RESULTS})")
    parser.add_argument("--json", type=Path, default=None, help="also dump the raw numbers here")
    parser.add_argument("--warmup", type=int, default=2,
                        help="warm-up calls before the timed one (gpu_decode.py makes 1: a round "
                             "shape met first in the timed call is captured there)")
    parser.add_argument("--engine-compile", default="auto", choices=["auto", "on", "off"],
                        help="SpecDecoder compile (auto: on CUDA)")
    parser.add_argument("--backend", default=None,
                        help="torch.compile's backend for compiled configurations (default inductor; "
                             "--smoke: eager, the same bodies traced with no code generated)")
    parser.add_argument("--configs", default=None,
                        help="comma-separated names of CONFIGS to run (default: all)")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# counting
def base_name(name: str) -> str:
    """A runtime call's name without a CUPTI version suffix (cudaLaunchKernel_v7000)."""
    return re.sub(r"_v\d+$", "", name)


def is_device_event(event) -> bool:
    """Device-side work: a kernel, memcpy or memset (not a range annotation or a sync wait that the
    profiler also draws on the device's timeline)."""
    kind = getattr(event, "activity_type", None)      # Kineto's activity type (newer torch)
    if kind:
        return kind in DEVICE_WORK
    return (event.device_type != DeviceType.CPU and not getattr(event, "is_user_annotation", False)
            and event.name != RUN_RANGE and not DEVICE_WAITS.search(event.name))


def is_host_event(event) -> bool:
    return event.device_type == DeviceType.CPU and event.name != RUN_RANGE


def duration_us(event) -> float:
    return float(event.time_range.end - event.time_range.start)


def nested_in_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def count_events(events, window: tuple[float, float], device_profiled: bool) -> dict:
    """Totals of one profiled call. events: FunctionEvents (name, device_type, time_range,
    self_cpu_time_total, cpu_parent); window: the call's host time range (us). Device-side totals
    (and the CUDA runtime counts) are None when device_profiled is False."""
    start, end = window
    host = [e for e in events if is_host_event(e)
            and e.time_range.start >= start and e.time_range.end <= end]
    device = [e for e in events if is_device_event(e)]
    calls = defaultdict(int)
    for event in host:
        calls[base_name(event.name)] += 1
    totals: dict[str, Any] = {
        "aten_ops": sum(1 for e in host if e.name.startswith("aten::") and not nested_in_aten(e)),
        "host_events": len(host),
        "host_self_us": float(sum(e.self_cpu_time_total for e in host)),
    }
    if device_profiled:
        busy = [e for e in device if duration_us(e) > 0]
        totals.update({
            "device_busy_us": float(sum(duration_us(e) for e in busy)),
            "kernels": len(busy),
            "eager_launches": sum(calls[n] for n in EAGER_LAUNCHES),
            "graph_launches": sum(calls[n] for n in GRAPH_LAUNCHES),
            "host_syncs": sum(calls[n] for n in HOST_SYNCS),
            "dtoh_copies": sum(1 for e in device if "DtoH" in e.name),
            "memcpy_calls": sum(calls[n] for n in MEMCPY_CALLS),
        })
    else:
        totals.update(dict.fromkeys(("device_busy_us", "kernels", "eager_launches", "graph_launches",
                                     "host_syncs", "dtoh_copies", "memcpy_calls")))
    return totals


def top_entries(events, window: tuple[float, float], device_profiled: bool, n: int = TOP) -> list[dict]:
    """The n device-side events (by name) with the most device time; on the CPU the n host
    operators with the most self CPU time. Each: name, calls, us (total), pct (of the total)."""
    start, end = window
    if device_profiled:
        chosen = [(e.name, duration_us(e)) for e in events if is_device_event(e)]
    else:
        chosen = [(e.name, float(e.self_cpu_time_total)) for e in events
                  if is_host_event(e) and e.time_range.start >= start and e.time_range.end <= end]
    calls, spent = defaultdict(int), defaultdict(float)
    for name, us in chosen:
        calls[name] += 1
        spent[name] += us
    total = sum(spent.values()) or 1.0
    ranked = sorted(spent, key=lambda name: -spent[name])[:n]
    return [{"name": name, "calls": calls[name], "us": spent[name], "pct": 100 * spent[name] / total}
            for name in ranked]


def per_step(totals: dict, wall_s: float, wall_rounds: int, profiled_rounds: int) -> dict:
    """The PER_STEP figures: the timed call's wall over its rounds, the profiled call's totals over
    its rounds (the same number: both calls decode the same tokens), and busy % of wall."""
    out = {"wall_ms": 1e3 * wall_s / wall_rounds}
    for key, _, source, scale in PER_STEP[1:]:
        value = totals[source]
        out[key] = None if value is None else value * scale / profiled_rounds
    out["busy_pct"] = (None if out["device_busy_ms"] is None
                       else 100 * out["device_busy_ms"] / out["wall_ms"])
    return out


# ------------------------------------------------------------------------------------------------
# measuring
def profiled_call(fn, device: torch.device) -> tuple[Any, list, tuple[float, float], float]:
    """(result, events, the call's host window in us, wall seconds under the profiler)."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    gd.sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        with record_function(RUN_RANGE):
            result = fn()
        gd.sync(device)
        wall = time.perf_counter() - start
    events = list(prof.events())
    return result, events, call_window(events), wall


def call_window(events) -> tuple[float, float]:
    """The profiled call's host time range (us): its record_function range on the host (with CUDA
    profiled the range also appears on the device's timeline, as a GPU user annotation)."""
    ranges = [e for e in events if e.name == RUN_RANGE and e.device_type == DeviceType.CPU]
    if len(ranges) != 1:
        raise RuntimeError(f"expected one host {RUN_RANGE} range in the profile, found {len(ranges)}")
    return ranges[0].time_range.start, ranges[0].time_range.end


def graph_counts(decoder) -> tuple[int, int] | None:
    """(captures, eager rounds) of the target cache's round graphs so far (None: not reported).
    An engine that does not count its captures reports its captured parts (the same until a shape
    is evicted)."""
    for cache in decoder.engine_state().get("caches", []):
        if cache.get("role") == "target" and "eager_rounds" in cache:
            captures = cache.get("captures")
            if captures is None:
                captures = sum(len(shape["parts"]) for shape in cache["round_graphs"])
            return captures, cache["eager_rounds"]
    return None


def measure_config(name: str, label: str, k: int | None, graphs: bool, target, ids, new: int,
                   reference: torch.Tensor, device: torch.device, warmup: int = 2,
                   compile: bool | str = "auto", fused: bool = True) -> dict:
    drafter = None if k is None else ControlledAcceptance(reference, ALPHA, seed=11)
    decoder = gd.make_decoder(target, drafter, k=k or 1, static_cache=True, cuda_graphs=graphs,
                              phase_timing=False, compile=compile, fuse_projections=fused)
    run = (lambda: decoder.generate_plain(ids, new)) if k is None else (lambda: decoder.generate(ids, new))
    compiled_before = dict(static_cache.COMPILES)
    for i in range(warmup):
        seconds, _ = gd.timed(run, device)
        log(f"{name}: warm-up {i + 1} {seconds:.3f}s")
    compiled = {key: static_cache.COMPILES[key] - compiled_before[key] for key in compiled_before}
    before = graph_counts(decoder)
    wall, timed_result = gd.timed(run, device)
    after = graph_counts(decoder)
    in_timed = None if before is None or after is None else [a - b for a, b in zip(after, before)]
    result, events, window, profiled_wall = profiled_call(run, device)
    device_profiled = device.type == "cuda"
    rounds = max(int(timed_result.stats.rounds), 1)
    profiled_rounds = max(int(result.stats.rounds), 1)
    totals = count_events(events, window, device_profiled)
    top = top_entries(events, window, device_profiled)
    record = {
        "name": name, "label": label, "mode": "plain" if k is None else "speculative", "k": k,
        "cuda_graphs": graphs, "alpha": None if k is None else ALPHA, "new_tokens": new,
        "compiled": bool(decoder.engine().get("compile")),
        # bodies torch.compile made in the warm-up calls and the seconds of the calls that made them
        "compiled_bodies": compiled["bodies"], "compile_s": compiled["seconds"],
        "fused_projections": decoder.engine().get("fused_projections"),
        "unit": "step" if k is None else "round",
        "rounds": rounds, "profiled_rounds": profiled_rounds,
        "tokens_per_round": float(timed_result.stats.mean_accepted_length),
        "wall_s": wall, "profiled_wall_s": profiled_wall,
        "totals": totals,
        "per_round": per_step(totals, wall, rounds, profiled_rounds),
        "profiled_wall_ms_per_round": 1e3 * profiled_wall / profiled_rounds,
        "warmup_calls": warmup,
        "timed_captures": None if in_timed is None else in_timed[0],
        "timed_eager_rounds": None if in_timed is None else in_timed[1],
        "top_kind": "kernels by device time" if device_profiled else "host operators by self CPU time",
        "top": [dict(entry, calls_per_round=entry["calls"] / profiled_rounds,
                     us_per_round=entry["us"] / profiled_rounds) for entry in top],
        "mismatched_rows": max(gd.mismatched_rows(r.tokens, reference)
                               for r in (timed_result, result)),
    }
    per = record["per_round"]
    log(f"{name}: {rounds} {record['unit']}s, {per['wall_ms']:.3f} ms per {record['unit']}, "
        f"kernels {fmt(per['kernels'], '.1f')}, eager launches {fmt(per['eager_launches'], '.1f')}, "
        f"graph launches {fmt(per['graph_launches'], '.1f')}, captures / eager rounds in the timed "
        f"call {record['timed_captures']} / {record['timed_eager_rounds']}, mismatched rows "
        f"{record['mismatched_rows']}")
    return record


# ------------------------------------------------------------------------------------------------
# report
def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def cell(text: str, width: int = 100) -> str:
    """A Markdown table cell: no pipes, no newlines, at most width characters."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def summary_row(record: dict) -> list:
    if "error" in record:
        return [record["name"], "failed", "", ""] + [""] * len(PER_STEP) + ["", "", "", ""]
    per = record["per_round"]
    figures = [fmt(per["wall_ms"], ".3f"), fmt(per["device_busy_ms"], ".3f")]
    figures += [fmt(per[key], ".1f") for key, _, _, _ in PER_STEP[2:]]
    return ([record["name"], record["unit"], record["rounds"], f"{record['tokens_per_round']:.2f}"]
            + figures + [fmt(per["busy_pct"], ".0f"),
                         f"{fmt(record.get('timed_captures'), 'd')}, "
                         f"{fmt(record.get('timed_eager_rounds'), 'd')}",
                         (f"{record['compiled_bodies']}, {record['compile_s']:.1f}"
                          + "".join(f"; {key}={value}" for key, value in
                                    (record.get("inductor_options") or {}).items())
                          if record.get("compiled") else "not compiled"),
                         record["mismatched_rows"]])


def render(raw: dict) -> str:
    meta = raw["meta"]
    out = [f"# Where decoding time goes: {meta['device_name']}", "",
           f"{meta['utc']} UTC; torch {meta['torch']}; transformers {meta['transformers']}; dtype "
           f"{meta['dtype']}; target {meta['target']} ({gd.human(meta['target_params'])} params, "
           f"random weights, sharpened greedy); batch 1, prompt of {meta['prompt_len']} tokens, "
           f"{meta['new_tokens']} new tokens, greedy, static caches; ControlledAcceptance alpha "
           f"{ALPHA}. Profiled: {meta['activities']}. Warm-up calls per configuration: "
           f"{meta.get('warmup_calls', 2)}; engine compile: {meta.get('engine_compile', 'auto')} "
           f"(plain_compiled, plain_tuned: on), backend {meta.get('compile_backend', 'inductor')}."
           + (" SMOKE RUN: tiny model, timings meaningless." if meta["smoke"] else ""), "",
           "## Summary (per step for plain decoding, per round for speculative decoding)", "",
           gd.table(SUMMARY_HEADER, [summary_row(r) for r in raw["configs"]]), "",
           "Wall: the unprofiled, synchronised call / its rounds (the prefill spread over them). "
           "The other figures come from one more call under the profiler. Device busy: the sum of "
           "device-side event durations; kernels: device-side events (memcpy and memset included); "
           "eager launches: cudaLaunchKernel(ExC) / cuLaunchKernel(Ex) calls; graph launches: "
           "cudaGraphLaunch calls; host syncs: cudaStream/Device/EventSynchronize calls; DtoH "
           "copies: device-to-host memcpy events; aten ops: top-level aten operators on the host. "
           "n/a: not measurable without CUDA. Compiled bodies: with the inductor options it was "
           "compiled with, where any. Mismatched rows: tokens differing from plain greedy "
           "decoding (must be 0).", ""]
    for record in raw["configs"]:
        out += [f"## {record['name']}: {record['label']}", ""]
        if "error" in record:
            out += [f"**Failed:** `{record['error']}` (traceback on stderr).", ""]
            continue
        totals = record["totals"]
        out += [f"Top {TOP} {record['top_kind']}, per {record['unit']} "
                f"({record['profiled_rounds']} {record['unit']}s profiled; the profiled call took "
                f"{record['profiled_wall_ms_per_round']:.3f} ms per {record['unit']}, "
                f"{totals['host_events']} host events; cudaMemcpyAsync calls: "
                f"{fmt(totals['memcpy_calls'], 'd')}).", "",
                gd.table(["name", "calls", "us", "% of total"],
                         [[cell(e["name"]), f"{e['calls_per_round']:.2f}", f"{e['us_per_round']:.1f}",
                           f"{e['pct']:.1f}"] for e in record["top"]]), ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    """Measure the configurations; returns the raw numbers (what --json writes). The report is
    rewritten after every configuration, so a run cut short keeps what it measured."""
    args = parse_args(argv)
    chosen = None if args.configs is None else set(args.configs.split(","))
    unknown = sorted((chosen or set()) - {config[0] for config in CONFIGS})
    if unknown:
        raise SystemExit(f"gpu_breakdown: --configs {args.configs!r}: no configuration named "
                         f"{', '.join(unknown)}; use some of {', '.join(c[0] for c in CONFIGS)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke
                                          else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" and not args.smoke else torch.float32
    shape = gd.TARGET_SMOKE if args.smoke else gd.TARGET_SHAPES[args.shape]
    new = args.new or (16 if args.smoke else 64)
    prompt_len = 8 if args.smoke else 32
    transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    log(f"device {gd.device_name(device)}, {dtype}, shape {'smoke' if args.smoke else args.shape}, "
        f"{new} new tokens")
    target = gd.build_model(shape, device, dtype, seed=0)
    usable = gd.sharpen_greedy(target, seed=0)
    generator = torch.Generator().manual_seed(1001)
    ids = torch.randint(0, usable, (1, prompt_len), generator=generator).to(device)
    # the unfused contender's own copy, made before a decoder fuses the target in place (an
    # engine without fused projections has none: its configurations are all unfused)
    fusing = "fuse_projections" in gd.engine_options_supported()
    unfused = copy.deepcopy(target) if fusing else None
    # eager (compile "auto" would compile a body of its own on CUDA, 20-30 s of the step's limit)
    reference = gd.make_decoder(target, None, k=1, static_cache=True, cuda_graphs=False,
                                phase_timing=False, compile=False,
                                fuse_projections=True).generate_plain(ids, new).tokens
    utc = dt.datetime.now(dt.timezone.utc)
    raw: dict[str, Any] = {"meta": {
        "utc": f"{utc:%Y-%m-%d %H:%M}", "device": str(device), "device_name": gd.device_name(device),
        "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
        "transformers": transformers.__version__, "smoke": args.smoke,
        "shape": "smoke" if args.smoke else args.shape, "target": gd.shape_label(shape),
        "target_params": gd.param_count(target), "prompt_len": prompt_len, "new_tokens": new,
        "alpha": ALPHA, "activities": "CPU + CUDA" if device.type == "cuda" else "CPU only",
        "warmup_calls": args.warmup, "engine_compile": args.engine_compile},
        "configs": []}

    def write() -> str:
        raw["meta"]["run_s"] = time.perf_counter() - started
        text = render(raw)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(raw, indent=2))
        return text

    engine_compile = {"on": True, "off": False}.get(args.engine_compile, "auto")
    # the compiled configurations' backend, for this run only (a test calls main in its process)
    saved_backend, saved_options = static_cache.COMPILE_BACKEND, static_cache.COMPILE_OPTIONS
    static_cache.COMPILE_BACKEND = args.backend or ("eager" if args.smoke else "inductor")
    raw["meta"]["compile_backend"] = static_cache.COMPILE_BACKEND
    try:
        for name, label, k, graphs, fused, compile_on in CONFIGS:
            if chosen is not None and name not in chosen:
                continue
            if not fused and unfused is None:
                log(f"{name}: skipped (this engine has no fused projections to turn off)")
                continue
            static_cache.COMPILE_OPTIONS = TUNED_OPTIONS.get(name, saved_options)
            if name in TUNED_OPTIONS:
                # torch.compile keeps compiled bodies per function, and a body the earlier
                # configurations compiled (plain_compiled's; spec_k*'s where compile is on) can
                # serve a call made with other options: dropped, so these options compile their own
                torch._dynamo.reset()
            try:
                options = dict(static_cache.compile_options())
                record = measure_config(name, label, k, graphs, target if fused else unfused, ids,
                                        new, reference, device, warmup=args.warmup,
                                        compile=True if compile_on else engine_compile, fused=fused)
                record["inductor_options"] = options if record["compiled"] else None
            except Exception as error:  # noqa: BLE001 -- report it and measure the others
                log(f"{name} failed: {type(error).__name__}: {error}")
                traceback.print_exc(file=sys.stderr)
                record = {"name": name, "label": label,
                          "error": f"{type(error).__name__}: {str(error)[:300]}"}
            raw["configs"].append(record)
            write()
    finally:
        static_cache.COMPILE_BACKEND, static_cache.COMPILE_OPTIONS = saved_backend, saved_options
    text = write()
    print(text)
    log(f"done in {time.perf_counter() - started:.1f}s; wrote {args.out}"
        + (f" and {args.json}" if args.json else ""))
    return raw


if __name__ == "__main__":
    main()
