"""A load generator for vLLM's OpenAI server: requests streamed at a fixed concurrency.

`run_level` sends a list of requests (token-id prompts, each with its own sampling parameters,
`max_tokens` and seed) to one `VllmServer` through `/v1/completions` with streaming, at most
`concurrency` in flight at once (asyncio + httpx), and reads the server's vllm:spec_decode_*
counters from `/metrics` before and after (prometheus-client's parser, via
`server.spec_decode_counters`). Per request it records when each streamed chunk arrived and how
many tokens it carried, the time to the first token, the decode phase (first token to last) and
vLLM's own per-request speculative-decoding metrics (the final usage chunk's
`metrics.speculative_decoding`, sent with `stream_options.include_usage`).

Per level it also reads from /proc the CPU other processes took meanwhile (`other_cores`: the
machine's busy time less the server's process tree and this process, over the level's wall time),
so that a caller can tell a level a neighbour slowed.

A request that fails (HTTP error, an error chunk, a dropped connection) is recorded failed with its
error; a level that runs past its deadline is cut ("timeout"), its requests in flight cancelled.
Nothing here decides what a result means (tasks.steps.checks.load_check does).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import psutil

from .server import VllmServer


def request_body(model: str, item: dict) -> dict:
    """The /v1/completions body of one streamed request (item: id, prompt_ids, max_tokens,
    temperature, top_k, top_p, seed, and k: its own K on a server with K per request, 0 for none;
    absent or None: the server's schedule)."""
    body = {"model": model, "prompt": [int(t) for t in item["prompt_ids"]],
            "max_tokens": int(item["max_tokens"]), "temperature": float(item.get("temperature", 0.0)),
            "top_p": float(item.get("top_p", 1.0)), "ignore_eos": True, "return_token_ids": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if item.get("top_k"):
        body["top_k"] = int(item["top_k"])
    if item.get("seed") is not None:
        body["seed"] = int(item["seed"])
    if item.get("k") is not None:
        body["vllm_xargs"] = {"specdec_k": int(item["k"])}
    return body


def _chunk_event(result: dict, chunk: dict, began: float) -> None:
    """Fold one streamed chunk into a request's result."""
    if chunk.get("error"):
        raise RuntimeError(str(chunk["error"])[:300])
    for choice in chunk.get("choices") or []:
        tokens = choice.get("token_ids") or []
        if tokens:
            result["chunks"].append((time.perf_counter() - began, len(tokens)))
            result["token_ids"] += [int(t) for t in tokens]
    spec = (chunk.get("metrics") or {}).get("speculative_decoding")
    if spec is not None:
        result["spec"] = {"drafts": int(spec["num_spec_steps"]),
                          "draft_tokens": int(spec["num_draft_tokens"]),
                          "accepted_tokens": int(spec["num_accepted_draft_tokens"]),
                          "histogram": [int(h) for h in spec.get("acceptance_histogram") or []]}


async def stream_request(client: httpx.AsyncClient, url: str, model: str, item: dict) -> dict:
    """One streamed request. Output: {id, ok, error, token_ids, chunks [(seconds, tokens)], spec,
    ttft_s, decode_s, latency_s}."""
    result = {"id": str(item["id"]), "ok": False, "error": None, "token_ids": [], "chunks": [],
              "spec": None}
    began = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=request_body(model, item)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                _chunk_event(result, json.loads(data), began)
        result["ok"] = bool(result["token_ids"])
        if not result["ok"]:
            result["error"] = "the stream ended without a token"
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:500]
    result["latency_s"] = time.perf_counter() - began
    chunks = result["chunks"]
    result["ttft_s"] = chunks[0][0] if chunks else None
    result["decode_s"] = chunks[-1][0] - chunks[0][0] if len(chunks) > 1 else None
    return result


def inter_token_latencies(chunks: list) -> list[float]:
    """Per token after the first chunk: the gap since the previous chunk over the tokens it
    carried (a verify step that emits 3 tokens gives 3 gaps of a third)."""
    out = []
    for (before, _), (at, count) in zip(chunks, chunks[1:]):
        out += [(at - before) / count] * count
    return out


async def _level(server: VllmServer, items: list[dict], concurrency: int, timeout_s: float) -> dict:
    gate = asyncio.Semaphore(max(1, concurrency))
    limits = httpx.Limits(max_connections=max(1, concurrency), max_keepalive_connections=max(1, concurrency))
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        async def one(item):
            async with gate:
                return await stream_request(client, server.url, server.model_dir, item)
        tasks = [asyncio.create_task(one(item)) for item in items]
        began = time.perf_counter()
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        wall = time.perf_counter() - began
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    results = []
    for item, task in zip(items, tasks):
        if task in done and task.exception() is None:
            results.append(task.result())
        else:
            results.append({"id": str(item["id"]), "ok": False, "token_ids": [], "chunks": [],
                            "spec": None, "ttft_s": None, "decode_s": None, "latency_s": None,
                            "error": f"not finished within {timeout_s:.0f} s (load_check_timeout_s)"
                            if task not in done else repr(task.exception())[:500]})
    return {"requests": results, "wall_s": wall, "timed_out": bool(pending)}


def cpu_seconds(pid: int | None) -> tuple[float, float]:
    """(CPU seconds the machine has spent busy, CPU seconds of process `pid` with its children
    and of this process): their differences over a level give the CPU other processes took."""
    times = psutil.cpu_times()
    # guest time is inside user time on Linux; idle and iowait are not busy
    busy = sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))
    own = psutil.Process().cpu_times()
    ours = own.user + own.system
    try:
        root = psutil.Process(pid) if pid else None
        for process in ([root] + root.children(recursive=True)) if root else []:
            try:
                mine = process.cpu_times()
                ours += mine.user + mine.system
            except psutil.NoSuchProcess:
                continue
    except psutil.NoSuchProcess:
        pass
    return busy, ours


def run_level(server: VllmServer, items: list[dict], concurrency: int, timeout_s: float) -> dict:
    """Stream `items` through `server` at `concurrency` (see the module's docstring). Output:
    {requests: [per request], wall_s, timed_out, counters: /metrics deltas or None when the server
    could not be read after the level, alive: the server's process after the level, other_cores:
    the CPU other processes took meanwhile}."""
    pid = server.process.pid if server.process is not None else None
    before = _counters(server)
    cpu0 = cpu_seconds(pid)
    level = asyncio.run(_level(server, items, concurrency, timeout_s))
    cpu1 = cpu_seconds(pid)
    level["other_cores"] = round(max((cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1]), 0.0)
                                 / max(level["wall_s"], 1e-9), 3)
    after = _counters(server) if server.alive() else None
    level["alive"] = server.alive()
    level["counters"] = None if before is None or after is None else counter_delta(before, after)
    return level


def merge_levels(results: list[dict]) -> dict:
    """run_level outputs of several waves as one: requests in order, wall times and counter
    deltas summed (None where any wave's is)."""
    counters = [r["counters"] for r in results]
    total = None
    if counters and None not in counters:
        width = max(len(c["accepted_per_pos"]) for c in counters)
        total = {key: sum(c[key] for c in counters) for key in ("drafts", "draft_tokens", "accepted_tokens")}
        total["accepted_per_pos"] = [sum((c["accepted_per_pos"] + [0] * width)[i] for c in counters)
                                     for i in range(width)]
    return {"requests": [r for result in results for r in result["requests"]],
            "wall_s": sum(r["wall_s"] for r in results),
            "timed_out": any(r["timed_out"] for r in results),
            "alive": all(r["alive"] for r in results), "counters": total}


def _counters(server: VllmServer) -> dict | None:
    try:
        return server.metrics()
    except (httpx.HTTPError, ValueError):
        return None


def counter_delta(before: dict, after: dict) -> dict:
    """after - before of spec_decode_counters' output (positions padded)."""
    width = max(len(before["accepted_per_pos"]), len(after["accepted_per_pos"]))
    pad = [0] * width
    return {"drafts": after["drafts"] - before["drafts"],
            "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted_tokens": after["accepted_tokens"] - before["accepted_tokens"],
            "accepted_per_pos": [a - b for a, b in zip((after["accepted_per_pos"] + pad)[:width],
                                                       (before["accepted_per_pos"] + pad)[:width])]}
