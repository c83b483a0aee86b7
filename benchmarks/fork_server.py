"""The serving environment's processes, each of its own against forked from the fork server
(tasks/serving/forks.py), on a tiny random target; contenders interleaved, one machine, one run.

Per repeat and contender: a probe (`versions`), an engine replay (vllm_probe.py replay: one greedy
request of 24 tokens with vLLM's n-gram drafter at K 3, in-process engine, as the engine check
and the cost measurement start theirs) and, with --server, an OpenAI server started, asked once
and stopped. The fork server's own start (its imports) is timed once, before the repeats: it is
paid once per pipeline process and serving environment.

    python benchmarks/fork_server.py [--repeats 3] [--server] [--out benchmarks/results/fork_server.md]
    python benchmarks/fork_server.py --smoke        # one repeat, no server (tests)

Needs the serving environment (`make serving-env`, or SPECDEC_ENGINE_SERVING_PYTHON).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))
sys.path.insert(0, str(Path(__file__).resolve().parent))

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
CONTENDERS = ("own process", "forked")


def tiny_target(directory: Path) -> Path:
    """A random Llama vLLM has CPU kernels for (4 heads of 32), with a byte-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from random_model import build_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)
    build_tokenizer(config.vocab_size).save_pretrained(directory)
    return directory


def measure(target: Path, work: Path, settings, server: bool) -> dict:
    from tasks.serving import environment as serving_env
    from tasks.serving.server import VllmServer

    seconds = {}
    began = time.perf_counter()
    serving_env.probe("versions", {}, settings, timeout_s=300)
    seconds["probe"] = time.perf_counter() - began
    request = {"model": str(target), "speculative_config": NGRAM, "dtype": "float32",
               "requests": [{"id": "a", "prompt_ids": [1, 5, 6, 7, 5, 6, 7, 5, 6], "max_tokens": 24,
                             "temperature": 0.0}]}
    began = time.perf_counter()
    answer = serving_env.run_engine(request, work / "engine.log", 300, "benchmark", settings)
    seconds["engine replay"] = time.perf_counter() - began
    seconds["(its engine start)"] = answer["start_s"]
    tokens = answer["requests"]["a"]["token_ids"]
    if server:
        began = time.perf_counter()
        with VllmServer(str(target), None, work / "server.log", dtype="float32", settings=settings) as running:
            running.complete([1, 5, 6, 7], 8)
        seconds["server start, ask, stop"] = time.perf_counter() - began
    return {"seconds": seconds, "tokens": tokens}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.server = 1, False

    from tasks.serving import environment as serving_env
    from tasks.serving import forks
    from tasks.settings import load_settings

    settings = {"own process": load_settings(engine_fork_server=False),
                "forked": load_settings(engine_fork_server=True)}
    python = serving_env.serving_python(settings["forked"])
    with tempfile.TemporaryDirectory(prefix="fork-server-bench-") as tmp:
        work = Path(tmp)
        target = tiny_target(work / "target")
        began = time.perf_counter()
        warm = forks.launch(python, ["-c", "pass"], dict(os.environ))
        if warm is None:
            print("the fork server could not start (see the log above)", file=sys.stderr)
            return 1
        warm.wait(60)
        server_start = time.perf_counter() - began
        print(f"fork server start (its imports, once): {server_start:.1f} s", flush=True)
        rows: dict[str, dict[str, list[float]]] = {c: {} for c in CONTENDERS}
        answers = {}
        for repeat in range(args.repeats):
            order = CONTENDERS if repeat % 2 == 0 else CONTENDERS[::-1]
            for contender in order:
                done = measure(target, work, settings[contender], args.server)
                answers.setdefault(contender, done["tokens"])
                for what, value in done["seconds"].items():
                    rows[contender].setdefault(what, []).append(value)
                print(f"repeat {repeat + 1}, {contender}: " + ", ".join(
                    f"{k} {v:.1f} s" for k, v in done["seconds"].items()), flush=True)
    same = answers["own process"] == answers["forked"]
    lines = ["| step | own process, s (median) | forked, s (median) | own / forked |",
             "|---|---|---|---|"]
    for what in rows["forked"]:
        own, forked = (statistics.median(rows[c][what]) for c in CONTENDERS)
        lines.append(f"| {what} | {own:.2f} | {forked:.2f} | {own / forked:.2f}x |")
    report = "\n".join([
        f"fork server start (its imports, paid once per process and environment): {server_start:.1f} s",
        f"repeats: {args.repeats} (contenders interleaved, order alternating)", "",
        *lines, "", f"replayed tokens equal (own process vs forked): {same}"])
    print(report)
    if args.out:
        args.out.write_text(report + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
