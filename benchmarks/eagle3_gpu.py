"""EAGLE-3 heads for the embedded default trained where the GPU is: generate the target's own
responses to 20k+ requests, train heads on nested subsets (1k, 5k, all), score each on the
shipped traffic's held-out requests -- one run, under time budgets (issue 51, item 4).

    python benchmarks/eagle3_gpu.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --out DIR
        [--requests 24000] [--generate-seconds 120] [--sizes 1000,5000,all] [--train-seconds 40]
        [--steps 800] [--costs measure|assume]
        [--device cuda] [--dtype float32] [--batch-size 256] [--train-batch 48|auto]
    python benchmarks/eagle3_gpu.py --smoke --out DIR      # a tiny random Llama on the CPU (tests)

Phases, each in its own try (a failure is logged with its traceback and the run goes on to write
what it has; DIR/curve.json is rewritten after every phase):
1. load: the target from the GGUF file (specdec_core.models.load_model), fp32 by default (the
   shipped traffic's responses were produced in fp32).
2. prompts: the shipped traffic (tasks/data/sample_traffic.jsonl.gz) split by request as
   benchmarks/eagle3_train.py does (in_heldout("eagle3-bench", id, 0.2)); the held-out 20% is
   only scored. New requests come from scripts/make_sample_traffic.py's builders (another seed,
   reworded where a pool runs dry), with its mix of greedy and sampled settings and max_tokens;
   none equals a shipped prompt, nor one of --extra-heldout (benchmarks/eagle3_heldout.py's
   larger held-out set, scored on a CPU after the run by eagle3_train.py --head).
3. generate: the target answers them with SpecDecoder.generate_plain (static caches on CUDA),
   batches sharing one setting, until --generate-seconds runs out (the requests are scheduled so
   that what is done at any moment keeps the domain and sampling mix).
4. train: one Eagle3Head per size on the first N training requests (shipped training rows and
   generated ones, shuffled once: the subsets are nested), the recipe of eagle3_train.py (draft
   vocabulary of the subset's response tokens, unroll 3, max length 160, lr 1e-3), the target
   passes batched, steps chosen so that the head fits --train-seconds (or --steps for every
   size: a curve over data at the same compute, cut to what fits --train-seconds where it does
   not); optimisation stops at the budget's end whatever the plan, with the head evaluated and
   saved there. The training curve is scored on --curve-requests validation requests taken in
   turn from each domain of the training pool and trained on by no head -- not on the held-out
   rows the heads are reported on, whose score would then be the best of several looks -- at the
   start, the end, and in between where that takes at most a tenth of the steps' time (the best
   point's head is kept: a long run on few rows may overfit). A step is also timed at twice
   --train-batch (rows per second by batch); with --train-batch auto also at four times, and the
   batch that pays trains, at a learning rate scaled by the square root of the batch's growth
   (--lr-scaling).
5. score: estimate_acceptance on every held-out shipped request: first-draft acceptance (K=1)
   with its bootstrap 95% interval over requests, and the acceptance length at K=1..5 per
   domain.
Output: DIR/head-<size>/ (speculators format), DIR/curve.json, DIR/curve.md; a short summary is
printed last on stdout. Imports only specdec_core, torch, transformers, numpy and the standard
library (no database, no MLflow, no network).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import make_sample_traffic as traffic  # noqa: E402
from specdec_core import SamplingParams, SpecDecoder, load_model  # noqa: E402
from specdec_core.drafters import output_size  # noqa: E402
from specdec_core.eagle3 import Eagle3Head  # noqa: E402
from specdec_core.estimate import (LoggedRequest, bootstrap_ratio, estimate_acceptance,  # noqa: E402
                                   in_heldout, split_off)
from specdec_core.head import HeadDrafter, target_features  # noqa: E402
from specdec_core.train import (PackedRows, TrainConfig, _HeadTrainee, autocast,  # noqa: E402
                                head_vocabulary, measure_head_step, measured_costs, optimise)

SPLIT_KEY, HELDOUT_FRACTION = "eagle3-bench", 0.2
EXTRA_HELDOUT = REPO / "benchmarks/data/eagle3_heldout.jsonl.gz"     # eagle3_heldout.py's rows
HELDOUT_FIELDS = ("id", "domain", "messages", "temperature", "top_k", "top_p", "max_tokens",
                  "prompt_token_ids", "response_token_ids")
VERIFIER = "smollm2-135m-instruct"
GOALS = {"json": 0.6, "code": 0.6}      # held-out first-draft acceptance; 0.45 for the others
OTHER_GOAL = 0.45
K_MAX = 5
SMOKE_SHAPE = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
STARTED = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="the target's GGUF file (transformers' GGUF "
                        "loader; the `gguf` package must be installed), or a transformers directory "
                        "of it (default: the embedded default, fetched into $SPECDEC_HOME when not "
                        "there)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--requests", type=int, default=None,
                        help="training requests in all: shipped training rows + generated (24000)")
    parser.add_argument("--generate-seconds", type=float, default=None, help="default 120")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="cap on a request's max_tokens (the traffic's are 48 or 64)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="generation batch (256 on CUDA, 16 on a CPU)")
    parser.add_argument("--static-cache", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--compile", action="store_true", help="torch.compile the static caches' "
                        "forwards (off: compiling per shape would eat the budget)")
    parser.add_argument("--sizes", default=None, help="training requests per head (1000,5000,all)")
    parser.add_argument("--train-seconds", type=float, default=None,
                        help="per head: target passes + optimisation (default 40)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per head, the same for every size (a learning curve "
                             "over data at fixed compute) where they fit --train-seconds, fewer "
                             "where they do not; default: as many as --train-seconds leaves")
    parser.add_argument("--costs", default="measure", choices=("measure", "assume"),
                        help="the head's step and verify(K) costs that pick each head's K: "
                             "measured here (compiling the head's step: ~80 s on a fresh H100) or "
                             "assumed (0.05 of a step, verify(K) 1 + 0.01 K)")
    parser.add_argument("--train-batch", default=None,
                        help="rows per training step: 48 on CUDA, 8 on a CPU; auto: that batch, "
                             "twice and four times it timed before training, the largest that "
                             "buys at least 1.5x the rows per second of the one below it trains")
    parser.add_argument("--train-graphs", default="auto", choices=("auto", "on", "off"),
                        help="the training step's forward and backward captured as graphs "
                             "(make_graphed_callables; a CPU stand-in elsewhere); auto: both "
                             "timed before training, the faster one trains")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--unroll", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="AdamW's learning rate at --train-batch's rows (48 on CUDA, 8 on a CPU)")
    parser.add_argument("--lr-scaling", default="sqrt", choices=("sqrt", "none"),
                        help="where --train-batch auto trains a larger batch: the learning rate "
                             "times the square root of the batch's growth (the square-root rule "
                             "for Adam, Malladi et al. 2022), or unchanged")
    parser.add_argument("--max-length", type=int, default=160)
    parser.add_argument("--curve-requests", type=int, default=30,
                        help="validation requests scored at the training curve's points, which "
                             "choose the head kept: taken in turn from each domain of the training "
                             "pool and trained on by no head (the held-out rows are only reported)")
    parser.add_argument("--save-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="dtype of the saved heads' weights (bfloat16: half the size)")
    parser.add_argument("--heldout-per-domain", type=int, default=0,
                        help="score only the first N held-out requests of each domain (0: all; "
                             "for a quick check on a CPU)")
    parser.add_argument("--extra-heldout", default=None,
                        help="a held-out file of benchmarks/eagle3_heldout.py whose prompts are left "
                             "out of the generated ones (scored after the run, on a CPU, by "
                             "eagle3_train.py --head); default: the shipped one when it is there, "
                             "none for no file")
    parser.add_argument("--seed", type=int, default=51)
    parser.add_argument("--save-generated", action="store_true",
                        help="also write DIR/generated.jsonl.gz (token ids of the generated rows)")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random Llama on the CPU, ~40 new prompts, tiny budgets")
    args = parser.parse_args(argv)
    smoke = args.smoke
    defaults = {"requests": (64, 24000), "generate_seconds": (15.0, 120.0),
                "sizes": ("16,all", "1000,5000,all"), "train_seconds": (4.0, 40.0)}
    for name, (small, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if smoke else full)
    if smoke:
        args.device = args.device or "cpu"
        args.max_new_tokens = min(args.max_new_tokens, 8)
        args.vocab = min(args.vocab, 512)
        args.curve_requests = min(args.curve_requests, 6)     # one a domain
        args.max_length = min(args.max_length, 64)
        args.heldout_per_domain = args.heldout_per_domain or 1
    args.extra_heldout = args.extra_heldout or default_extra_heldout()
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = args.device.type == "cuda"
    args.batch_size = args.batch_size or (256 if cuda else 16)
    args.train_batch_auto = args.train_batch == "auto"
    if args.train_batch in (None, "auto"):
        args.train_batch = 48 if cuda else 8
    else:
        try:
            args.train_batch = int(args.train_batch)
        except ValueError:
            parser.error(f"--train-batch {args.train_batch!r}: a number of rows, or auto")
    return args


# ------------------------------------------------------------------------------------------------
# phase 1: the target
class ByteTokenizer:
    """The smoke run's tokenizer: a chat rendered as text, one id per byte (no files needed)."""

    eos_token_id = 2

    def encode_chats(self, chats: list[list[dict]]) -> list[list[int]]:
        texts = ["".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
                 for messages in chats]
        return [[3 + b for b in text.encode("utf-8")] for text in texts]


def smoke_target(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SMOKE_SHAPE, tie_word_embeddings=True, pad_token_id=None,
                         bos_token_id=None, eos_token_id=ByteTokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval(), ByteTokenizer()


def load_target(args):
    """(model, tokenizer, encode([messages, ...]) -> [prompt ids, ...], eos id)."""
    if args.smoke:
        model, tokenizer = smoke_target(args.seed)
        model = model.to(args.device)
        return model, tokenizer, tokenizer.encode_chats, tokenizer.eos_token_id
    model, tokenizer = load_model(args.gguf or VERIFIER, device=args.device,
                                  dtype=getattr(torch, args.dtype))

    def encode(chats: list[list[dict]]) -> list[list[int]]:    # as make_sample_traffic.py does
        texts = [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                 for messages in chats]
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    return model, tokenizer, encode, tokenizer.eos_token_id


# ------------------------------------------------------------------------------------------------
# phase 2: prompts
def shipped_rows() -> list[dict]:
    with gzip.open(REPO / "tasks/data/sample_traffic.jsonl.gz", "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def default_extra_heldout() -> str:
    """The shipped extra held-out file where it is there, else "none"."""
    return str(EXTRA_HELDOUT) if EXTRA_HELDOUT.exists() else "none"


def extra_heldout_rows(path) -> list[dict]:
    """The rows of a held-out file made by benchmarks/eagle3_heldout.py; [] for "none". A missing
    file or a row without the shipped file's fields is an error naming the command that makes it."""
    if path is None or str(path) == "none":
        return []
    path = Path(path)
    remake = f"make it with `python benchmarks/eagle3_heldout.py --out {path}`, or pass none"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such held-out file; {remake}")
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    for number, row in enumerate(rows, 1):
        missing = [f for f in HELDOUT_FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}, row {number}: no {', '.join(missing)}; {remake}")
    return rows


def logged(row: dict, response_ids=None) -> LoggedRequest:
    return LoggedRequest(row["id"], list(row["prompt_token_ids"]),
                         list(row["response_token_ids"] if response_ids is None else response_ids),
                         SamplingParams(temperature=float(row["temperature"]),
                                        top_k=int(row["top_k"] or 0), top_p=float(row["top_p"] or 1.0)),
                         row["domain"])


def split_shipped(rows: list[dict], smoke: bool, heldout_per_domain: int = 0) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of the shipped traffic, by eagle3_train.py's rule; the smoke
    run keeps 4 training rows a domain; heldout_per_domain > 0 keeps that many held-out rows."""
    rows = [r for r in rows if len(r["response_token_ids"]) >= 2]
    heldout = [r for r in rows if in_heldout(SPLIT_KEY, r["id"], HELDOUT_FRACTION)]
    train = [r for r in rows if not in_heldout(SPLIT_KEY, r["id"], HELDOUT_FRACTION)]
    if smoke:
        train = per_domain(train, 4)
    if heldout_per_domain > 0:
        heldout = per_domain(heldout, heldout_per_domain)
    return train, heldout


def per_domain(rows: list[dict], n: int) -> list[dict]:
    kept, counts = [], {}
    for row in rows:
        if counts.get(row["domain"], 0) < n:
            counts[row["domain"]] = counts.get(row["domain"], 0) + 1
            kept.append(row)
    return kept


def new_requests(count: int, taken: list[dict], encode, seed: int, max_new: int) -> list[dict]:
    """`count` new requests from make_sample_traffic's builders (seed `seed`, reworded where a
    pool runs dry), with their prompt ids; none has the messages or prompt ids of a `taken` row
    (the shipped requests, the extra held-out ones)."""
    if count <= 0:
        return []
    domains = 6
    made = traffic.build_requests(math.ceil(count * 1.05 / domains) + 1, seed=seed, vary=True)
    taken_messages = {json.dumps(r["messages"]) for r in taken}
    taken_ids = {tuple(r["prompt_token_ids"]) for r in taken}
    random.Random(seed).shuffle(made)
    made = [r for r in made if json.dumps(r["messages"]) not in taken_messages][:count + 64]
    encoded = encode([r["messages"] for r in made])
    kept = []
    for request, ids in zip(made, encoded):
        if tuple(ids) in taken_ids:
            continue
        request = {**request, "id": f"gen{seed}-{request['id']}", "prompt_token_ids": ids,
                   "max_tokens": min(int(request["max_tokens"]), max_new)}
        kept.append(request)
        if len(kept) == count:
            break
    return kept


# ------------------------------------------------------------------------------------------------
# phase 3: generation
def schedule(requests: list[dict], batch_size: int, seed: int) -> list[list[dict]]:
    """Batches sharing one sampling setting and max_tokens, in an order that keeps each group's
    share of what is done (a run stopped early keeps the mix); similar lengths batched together."""
    groups: dict[tuple, list[dict]] = {}
    for r in requests:
        groups.setdefault((r["temperature"], r["top_k"], r["top_p"], r["max_tokens"]), []).append(r)
    rng = random.Random(seed)
    queues = []
    for rows in groups.values():
        rng.shuffle(rows)
        batches = []
        window = 8 * batch_size
        for start in range(0, len(rows), window):
            chunk = sorted(rows[start:start + window], key=lambda r: len(r["prompt_token_ids"]))
            parts = [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
            rng.shuffle(parts)
            batches += parts
        queues.append({"size": len(rows), "done": 0, "batches": batches})
    order = []
    while any(q["batches"] for q in queues):
        queue = min((q for q in queues if q["batches"]), key=lambda q: q["done"] / q["size"])
        batch = queue["batches"].pop(0)
        queue["done"] += len(batch)
        order.append(batch)
    return order


def generate(target, requests: list[dict], eos: int | None, args, deadline: float) -> list[LoggedRequest]:
    """The target's responses, batch by batch, until the deadline."""
    static = {"auto": "auto", "on": True, "off": False}[args.static_cache]
    decoder = SpecDecoder(target, None, static_cache=static, compile=args.compile, phase_timing=False)
    if decoder.uses_static_cache():
        decoder.static_pool.max_caches = 3       # each holds batch x length of KV on the device
    say(f"generating up to {len(requests)} responses, engine {decoder.engine()}")
    done, tokens, batches = [], 0, schedule(requests, args.batch_size, args.seed)
    started = time.perf_counter()
    for number, batch in enumerate(batches):
        if time.perf_counter() >= deadline:
            say(f"generation budget spent after {number} of {len(batches)} batches")
            break
        width = max(len(r["prompt_token_ids"]) for r in batch)
        # on static caches a short batch is filled up with copies of its last row (their
        # responses are dropped): every batch then has one shape, and no new cache and graph
        # is made for it
        rows = batch + [batch[-1]] * (args.batch_size - len(batch) if decoder.uses_static_cache() else 0)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, request in enumerate(rows):
            prompt = request["prompt_token_ids"]
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        first = batch[0]
        sampling = SamplingParams(temperature=first["temperature"], top_k=first["top_k"],
                                  top_p=first["top_p"])
        seed = int(hashlib.sha256(first["id"].encode()).hexdigest()[:8], 16)
        result = decoder.generate_plain(ids.to(args.device), max_new_tokens=first["max_tokens"],
                                        sampling=sampling, seed=seed,
                                        attention_mask=mask.to(args.device), eos_token_id=eos)
        produced = result.tokens.cpu()
        for row, request in enumerate(batch):
            response = produced[row, :int(result.num_tokens[row])].tolist()
            tokens += len(response)
            if len(response) >= 2:
                done.append(logged(request, response))
        if number % 10 == 0 or number == len(batches) - 1:
            spent = time.perf_counter() - started
            say(f"  batch {number + 1}/{len(batches)}: {len(done)} responses, {tokens} tokens, "
                f"{tokens / max(spent, 1e-9):.0f} tokens/s")
    if decoder.uses_static_cache():
        decoder.static_pool._caches.clear()
    del decoder
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    return done


# ------------------------------------------------------------------------------------------------
# phase 4: heads
class BatchedHeadTrainee(_HeadTrainee):
    """specdec_core.train's head trainee with its target passes batched (right-padded rows: a
    causal model's outputs at a row's own positions do not see the padding after them) and
    bounded by a deadline: the rows passed by then are the ones trained on."""

    def __init__(self, *args, pass_batch: int = 32, deadline: float = math.inf, **kwargs):
        super().__init__(*args, **kwargs)
        self.pass_batch, self.deadline = pass_batch, deadline

    @torch.no_grad()
    def prepare(self, config, progress) -> None:
        if self.cache:
            return
        head = self.module
        device = next(head.parameters()).device
        self.topk = min(self.topk, head.vocab_size)
        inside = torch.ones(head.full_vocab, dtype=torch.bool, device=device)
        if head.reduced:
            inside[:] = False
            inside[head.vocab_ids.to(device)] = True
        local = torch.full((head.full_vocab,), -1, dtype=torch.long, device=device)
        local[inside] = torch.arange(int(inside.sum()), device=device)
        keep = "cpu" if device.type == "cpu" else device
        rows = [(list(r.prompt_ids) + list(r.response_ids))[-config.max_length:] for r in self.train]
        self.cache = PackedRows(sum(len(row) for row in rows), keep)     # the rows' own slots
        # similar lengths batched together, within windows of the (shuffled) rows: rows cut off
        # by the deadline are then a random share, not the longest ones (code, summaries)
        window = 16 * self.pass_batch
        order = [i for start in range(0, len(rows), window)
                 for i in sorted(range(start, min(start + window, len(rows))), key=lambda i: len(rows[i]))]
        kept = []
        for start in range(0, len(order), self.pass_batch):
            if time.perf_counter() >= self.deadline:
                break
            picks = order[start:start + self.pass_batch]
            width = max(len(rows[i]) for i in picks)
            ids = torch.zeros(len(picks), width, dtype=torch.long, device=device)
            for b, i in enumerate(picks):
                ids[b, :len(rows[i])] = torch.tensor(rows[i], device=device)
            features, logits = target_features(self.target, ids, head=head)
            logp = logits[:, 1:].float().log_softmax(-1)          # predicts x_{j+2}, as prepare
            del logits
            logp[:, :, ~inside] = float("-inf")
            values, index = logp.topk(self.topk, -1)
            del logp
            index = local[index]
            for b, i in enumerate(picks):
                n = len(rows[i])
                self.cache.append(ids[b, :n], features[b, :n].float(), values[b, :n - 1],
                                  index[b, :n - 1])
                kept.append(i)
        self.train = [self.train[i] for i in kept]


def time_steps(trainee, batch: int, repeats: int = 3) -> float:
    """Seconds of one optimisation step (loss + backward), measured on the trainee's rows (the
    first, which may capture the step's graphs, left out)."""
    device = next(trainee.module.parameters()).device
    params = trainee.parameters()
    times = []
    trainee.module.train()
    for _ in range(repeats + 1):
        picks = random.sample(range(len(trainee.cache)), min(batch, len(trainee.cache)))
        start = time.perf_counter()
        with autocast(device):
            loss = trainee.loss(picks)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    for param in params:
        param.grad = None
    trainee.module.eval()
    return sorted(times[1:])[len(times[1:]) // 2] * 1.15      # + the optimizer step


def choose_step(trainee, mode: str, batch: int, entry: dict) -> float:
    """Set the trainee's step eager or graphed (`mode` on/off, or auto: both timed, the faster);
    returns its seconds. entry gets step_s_by_mode, train_graphs and any capture error (a
    capture that fails leaves the step eager)."""
    timings = {}
    if mode != "on":
        trainee.graphs = False
        timings["eager"] = time_steps(trainee, batch)
    if mode != "off":
        trainee.graphs = True
        seconds = time_steps(trainee, batch)
        if trainee.graph_error is None:
            timings["graphs"] = seconds
        else:
            entry["graph_error"] = trainee.graph_error[:2000]
            timings.setdefault("eager", seconds)
    chosen = min(timings, key=timings.get)
    trainee.graphs = chosen == "graphs"
    if not trainee.graphs:
        trainee.graphed.clear()
    entry.update(step_s_by_mode={name: round(t, 4) for name, t in timings.items()}, train_graphs=chosen)
    return timings[chosen]


CURVE_SHARE = 0.1          # of a head's optimisation time, at most, for curve points in between
CURVE_BETWEEN = 4          # curve points between the start and the end, at most
BATCH_GAIN = 1.5           # --train-batch auto: rows per second a doubled batch must buy


def planned_steps(asked: int | None, left_s: float, step_s: float, eval_s: float) -> int:
    """Training steps for a head with left_s seconds of its budget left: as many as fit after its
    curve points (the start and the end with a margin; those in between take at most CURVE_SHARE
    of the steps' time, see curve_every), at least 4; with `asked` (--steps) at most that many --
    the same for every size while they fit, fewer where the budget ends first (a run that
    outlives the device step's limit brings back no head at all)."""
    fit = max(4, int((left_s - 2.2 * eval_s) / (step_s * (1 + CURVE_SHARE))))
    return min(asked, fit) if asked else fit


def curve_every(steps: int, step_s: float, eval_s: float) -> int:
    """eval_every for a head of `steps` steps: the held-out curve is scored at the start, at the
    end, and in between as often as keeps that scoring within CURVE_SHARE of the steps' time (at
    most CURVE_BETWEEN times). A long run on few rows may overfit before its schedule ends; the
    best checkpoint is kept from these points. A short one (800 steps of 45 ms against a 4.5 s
    point) is scored only at the start and the end."""
    between = min(CURVE_BETWEEN, int(CURVE_SHARE * steps * step_s / max(eval_s, 1e-9)))
    return max(1, math.ceil(steps / (between + 1)))


def scaled_lr(lr: float, batch: int, base_batch: int, rule: str) -> float:
    """The learning rate for `batch` rows a step where `lr` was set for `base_batch`: Adam's
    square-root rule (the gradient's noise falls with the square root of the batch), or none."""
    return lr * math.sqrt(batch / base_batch) if rule == "sqrt" else lr


def choose_batch(step_s_by_batch: dict[int, float], gain: float = BATCH_GAIN) -> int:
    """The training batch among those timed: from the smallest up, a batch twice as large is
    taken while its step buys at least `gain` times the rows per second (its step costs at most
    2 / gain of the smaller one's: a step bound by launches, not by arithmetic). Under a fixed
    time budget such a batch trains as many steps on about twice the rows each; where the step
    cost grows with the batch, the smaller batch takes as many rows in more steps, which trains
    at least as well at one learning rate."""
    sizes = sorted(step_s_by_batch)
    chosen = sizes[0]
    for larger in sizes[1:]:
        if larger / step_s_by_batch[larger] >= gain * chosen / step_s_by_batch[chosen]:
            chosen = larger
        else:
            break
    return chosen


def train_one(target, rows: list[LoggedRequest], curve_rows, costs, args, entry: dict,
              work: Path) -> tuple[Eagle3Head, int]:
    """One head on `rows` within args.train_seconds; fills `entry` as it goes."""
    started = time.perf_counter()
    budget = args.train_seconds
    vocab = head_vocabulary(rows, args.vocab, output_size(target), responses_only=True)
    head = Eagle3Head(target, vocab)
    config = TrainConfig(steps=1, eval_every=1, k_max=K_MAX, warmup_steps=20, lr=args.lr,
                         batch_size=args.train_batch, max_length=args.max_length)
    trainee = BatchedHeadTrainee(head, target, rows, curve_rows, config, costs, unroll=args.unroll,
                                 pass_batch=64 if args.device.type == "cuda" else 4,
                                 deadline=started + 0.45 * budget)
    trainee.prepare(config, False)
    entry.update(draft_vocab=len(vocab), rows_passed=len(trainee.cache),
                 curve_requests=[r.request_id for r in trainee.heldout],
                 passes_s=round(time.perf_counter() - started, 2))
    if not trainee.cache:
        raise RuntimeError("no training row was passed through the target within the budget")
    step_s = choose_step(trainee, args.train_graphs, args.train_batch, entry)
    # the step at larger batches (the mode chosen): whether a larger batch buys rows per second (a
    # launch-bound step costs about the same at each); with --train-batch auto the batch trained
    by_batch = {args.train_batch: step_s}
    for factor in ((2, 4) if args.train_batch_auto else (2,)):
        if factor * args.train_batch <= len(trainee.cache):       # a batch is at most every row
            by_batch[factor * args.train_batch] = time_steps(trainee, factor * args.train_batch)
    batch = choose_batch(by_batch) if args.train_batch_auto else args.train_batch
    for size in by_batch:
        if size != batch:
            trainee.graphed.pop(size, None)               # its captured step's memory
    step_s = by_batch[batch]
    config.batch_size = batch
    config.lr = scaled_lr(args.lr, batch, args.train_batch, args.lr_scaling)
    entry.update(step_s_by_batch={str(b): round(s, 4) for b, s in by_batch.items()}, train_batch=batch,
                 lr=config.lr)
    eval_started = time.perf_counter()
    trainee.evaluate()
    eval_s = time.perf_counter() - eval_started
    left = budget - (time.perf_counter() - started)
    steps = planned_steps(args.steps, left, step_s, eval_s)
    config.steps = steps
    config.warmup_steps = min(20, max(1, steps // 10))
    config.eval_every = steps if args.smoke else curve_every(steps, step_s, eval_s)
    entry.update(step_s=round(step_s, 4), eval_s=round(eval_s, 2), steps=steps,
                 **({"steps_asked": args.steps} if args.steps else {}))
    say(f"  {len(trainee.cache)} rows passed in {entry['passes_s']} s; step {step_s * 1e3:.1f} ms "
        f"({', '.join(f'{m} {1e3 * t:.1f}' for m, t in entry['step_s_by_mode'].items())}), "
        f"curve point {eval_s:.1f} s: {steps} steps"
        + (f" ({args.steps} asked; what fits --train-seconds {budget:g})" if args.steps and steps < args.steps else ""))
    opt_started = time.perf_counter()
    # the net under the plan: a step estimate that was low still ends inside the budget, with the
    # head evaluated and saved where it stopped (the device step's limit would keep nothing)
    result = optimise(trainee, len(trainee.cache), config, work, progress=False, desc="eagle3 head",
                      deadline=started + budget - eval_s)
    entry.update(optimise_s=round(time.perf_counter() - opt_started, 2), best_step=result.best["step"],
                 best_k=result.best["k"], history=jsonable(result.history), steps_done=result.step,
                 epochs=round(result.step * batch / len(trainee.cache), 2))
    if result.best_dir:
        head = Eagle3Head.load(result.best_dir, target)
    entry["train_s"] = round(time.perf_counter() - started, 2)
    return head, int(result.best["k"] or 3)


def score(target, head, heldout: list[LoggedRequest]) -> dict:
    """{domain: {requests, acceptance_k1, acceptance_k1_ci95, length_by_k}} on the held-out
    shipped requests; the interval is a bootstrap over requests (about 20 a domain here)."""
    return score_sets(target, head, {"heldout": heldout})["heldout"]


def score_sets(target, head, sets: dict[str, list[LoggedRequest]]) -> dict[str, dict]:
    """score() of each named set of rows, and of them all together ("all", where there are two
    sets or more), from one pass of the head over every row."""
    names = [name for name, rows in sets.items() if rows]
    rows = [r for name in names for r in sets[name] if len(r.response_ids) >= 2]
    labels = [name for name in names for r in sets[name] if len(r.response_ids) >= 2]
    out: dict[str, dict] = {name: {} for name in sets}
    if len(names) > 1:
        out["all"] = {}
    if not rows:
        return out
    ks = list(range(1, K_MAX + 1))
    estimates = estimate_acceptance(target, HeadDrafter(head), rows, ks, progress=False, n_boot=200)
    for domain, by_k in sorted(estimates.items()):
        # estimate_acceptance keeps each domain's rows in the order given
        domain_labels = [label for label, r in zip(labels, rows) if r.domain == domain]
        for name in out:
            picks = [i for i, label in enumerate(domain_labels) if name in ("all", label)]
            if picks:
                out[name][domain] = summarise({k: [by_k[k].per_request[i] for i in picks] for k in ks})
    return out


def summarise(totals_by_k: dict[int, list]) -> dict:
    """{requests, acceptance_k1 (accepted / reached at the first draft), its bootstrap 95% interval
    over requests, length_by_k} from per-request round totals at each K."""
    first = totals_by_k[1]
    accepted = [float(t.accepted[0]) for t in first]
    reached = [float(t.reached[0]) for t in first]
    return {"requests": len(first),
            "acceptance_k1": sum(accepted) / sum(reached) if sum(reached) > 0 else 0.0,
            "acceptance_k1_ci95": [round(v, 4) for v in bootstrap_ratio(accepted, reached)],
            "length_by_k": {str(k): round(sum(t.tokens for t in totals) / max(sum(t.rounds for t in totals), 1e-12), 4)
                            for k, totals in sorted(totals_by_k.items())}}


# ------------------------------------------------------------------------------------------------
# output
def jsonable(value):
    """`value` with tuples as lists, tensors and numpy numbers as Python numbers."""
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)))


def goal(domain: str) -> float:
    return GOALS.get(domain, OTHER_GOAL)


def markdown(curve: dict) -> str:
    heads = [h for h in curve["heads"] if h.get("heldout")]
    domains = sorted({d for h in heads for d in h["heldout"]})
    lines = ["# EAGLE-3 heads trained where the GPU is: held-out first-draft acceptance", "",
             f"{curve['meta']['device']}, {curve['meta']['dtype']}, torch {curve['meta']['torch']}, "
             f"transformers {curve['meta']['transformers']}"
             + (" -- SMOKE RUN: a tiny random model, figures meaningless" if curve["meta"]["smoke"] else ""),
             "", f"Held-out: {curve['counts'].get('heldout', 0)} shipped requests (split by request, "
             f"in_heldout({SPLIT_KEY!r}, id, {HELDOUT_FRACTION})), never trained on and not chosen "
             f"on. Training: {curve['counts'].get('shipped_train', 0)} shipped + "
             f"{curve['counts'].get('generated', 0)} generated requests "
             f"(generation {curve['phases'].get('generate_s', 0)} s), less "
             f"{curve['counts'].get('validation', 0)} validation requests (each domain in turn) "
             "that score the training curve and choose the head kept. Cells: held-out first-draft "
             "acceptance (K = 1) and its bootstrap 95% interval over requests.", ""]
    if curve["counts"].get("extra_heldout"):
        lines[-1:-1] = [f"A further {curve['counts']['extra_heldout']} held-out requests "
                        f"({curve['meta']['args'].get('extra_heldout')}, benchmarks/eagle3_heldout.py) "
                        f"were left out of the generated prompts "
                        f"({curve['counts'].get('new_prompts_equal_to_extra_heldout', 0)} equal to one); "
                        "they are scored on a CPU once the heads are back: "
                        "`python benchmarks/eagle3_train.py --head DIR/head-SIZE`.", ""]
    if not heads:
        return "\n".join(lines + ["No head was scored (see errors in curve.json).", ""])
    lines += ["| training requests | passed through the target (trained on) | steps | epochs (batch) | "
              + " | ".join(domains) + " |", "|---|---|---|---|" + "---|" * len(domains)]
    for h in heads:
        steps = h.get("steps_done", h.get("steps", "?"))
        if h.get("steps_asked") and steps != h["steps_asked"]:
            steps = f"{steps} of {h['steps_asked']} asked"
        lines.append(f"| {h['requests']} | {h.get('rows_passed', '?')} | {steps} | "
                     f"{h.get('epochs', '?')} ({h.get('train_batch', '?')}) | "
                     + " | ".join(with_interval(h["heldout"][d]) if d in h["heldout"] else "-"
                                  for d in domains) + " |")
    lines += ["| goal | | | | " + " | ".join(f">= {goal(d)}" for d in domains) + " |", "",
              f"Acceptance length (tokens per round) at K=1..{K_MAX}, largest head:", ""]
    last = heads[-1]
    for d in domains:
        lengths = ", ".join(f"{v:.2f}" for v in last["heldout"][d]["length_by_k"].values())
        lines.append(f"- {d}: {lengths}")
    timed = [h for h in heads if h.get("step_s_by_batch")]
    if timed:
        lines += ["", "A training step (loss + backward, optimizer step estimated) by batch, largest head: "
                  + ", ".join(f"batch {b}: {1e3 * s:.1f} ms ({int(b) / s:.0f} rows/s)"
                              for b, s in timed[-1]["step_s_by_batch"].items())
                  + f"; trained at batch {timed[-1].get('train_batch', '?')}"
                  + (" (--train-batch auto)" if curve["meta"]["args"].get("train_batch_auto") == "True" else "")]
    modes = [h for h in heads if h.get("step_s_by_mode")]
    if modes:
        by_mode = modes[-1]["step_s_by_mode"]
        lines += ["", f"The step at batch {curve['meta']['args'].get('train_batch', '?')}, largest head: "
                  + ", ".join(f"{name} {1e3 * t:.1f} ms" for name, t in by_mode.items())
                  + (f" (eager / graphs {by_mode['eager'] / by_mode['graphs']:.2f}x)"
                     if {"eager", "graphs"} <= set(by_mode) else "")
                  + f"; trained {modes[-1]['train_graphs']}"
                  + (f"; the capture failed: {modes[-1]['graph_error'][:200]}" if modes[-1].get("graph_error") else "")]
    lines += ["", f"Goal (held-out first-draft acceptance >= 0.6 for json and code, >= "
              f"{OTHER_GOAL} elsewhere), largest head ({last['requests']} requests):", ""]
    for d in domains:
        lines.append(f"- {d}: {verdict(d, last['heldout'][d])}")
    return "\n".join(lines) + "\n"


def with_interval(scored: dict) -> str:
    low, high = scored.get("acceptance_k1_ci95") or (None, None)
    return f"{scored['acceptance_k1']:.3f}" + (f" ({low:.2f}-{high:.2f})" if low is not None else "")


def verdict(domain: str, scored: dict) -> str:
    """The goal line of one domain: met or not by the point estimate, and whether the held-out
    requests settle it (the 95% interval on one side of the goal) or not."""
    value, target = scored["acceptance_k1"], goal(domain)
    line = f"{value:.3f} vs {target}: {'met' if value >= target else 'not met'}"
    if not scored.get("acceptance_k1_ci95"):
        return line
    if scored["requests"] < 2:
        return line + f" ({scored['requests']} request: no interval)"
    low, high = scored["acceptance_k1_ci95"]
    settled = low >= target or high < target
    return line + (f" (95% interval {low:.3f}-{high:.3f} over {scored['requests']} requests: "
                   + ("settled)" if settled else "spans the goal, not settled)"))


def write(curve: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.json").write_text(json.dumps(jsonable(curve), indent=1))
    (out / "curve.md").write_text(markdown(curve))


def summary(curve: dict) -> str:
    lines = [f"eagle3_gpu: {curve['counts'].get('generated', 0)} generated + "
             f"{curve['counts'].get('shipped_train', 0)} shipped training requests; "
             f"phases {curve['phases']}; errors {len(curve['errors'])}"]
    for h in curve["heads"]:
        scored = h.get("heldout") or {}
        lines.append(f"  head {h['size']} ({h['requests']} requests, {h.get('rows_passed', '?')} passed, "
                     f"{h.get('steps_done', h.get('steps', '?'))} steps): "
                     + (", ".join(f"{d} {v['acceptance_k1']:.3f}{'' if v['acceptance_k1'] >= goal(d) else '*'}"
                                  for d, v in scored.items()) or "not scored"))
    lines.append("  (* below the goal: 0.6 json/code, 0.45 elsewhere)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
def phase(curve: dict, name: str, out: Path, work, *args):
    """work(*args), timed, its failure logged (traceback on stderr, the error in curve.json);
    curve.json and curve.md rewritten after it."""
    started = time.perf_counter()
    say(f"phase {name}")
    try:
        return work(*args)
    except Exception as exc:                 # noqa: BLE001 - one shot on the device: keep going
        traceback.print_exc(file=sys.stderr)
        curve["errors"].append({"phase": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        return None
    finally:
        curve["phases"][f"{name}_s"] = round(time.perf_counter() - started, 2)
        try:
            write(curve, out)
        except Exception:                     # noqa: BLE001
            traceback.print_exc(file=sys.stderr)


def sizes_of(text: str, pool: int) -> list[tuple[str, int]]:
    sizes = []
    for part in text.split(","):
        part = part.strip()
        n = pool if part == "all" else min(int(part), pool)
        if n > 0 and n not in [s for _, s in sizes]:
            sizes.append((part, n))
    return sizes


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    import transformers

    out = args.out
    curve = {"meta": {"device": (torch.cuda.get_device_name(args.device) if args.device.type == "cuda"
                                 else f"cpu ({platform.processor() or platform.machine()})"),
                      "dtype": args.dtype if not args.smoke else "float32", "torch": torch.__version__,
                      "transformers": transformers.__version__, "smoke": args.smoke,
                      "args": {k: str(v) for k, v in vars(args).items()}},
             "phases": {}, "counts": {}, "sizes": [], "heads": [], "errors": []}
    state: dict = {}
    loaded = phase(curve, "load", out, load_target, args)
    if loaded is None:
        print(summary(curve))
        return curve
    target, _, encode, eos = loaded

    def prompts():
        train_rows, heldout_rows = split_shipped(shipped_rows(), args.smoke, args.heldout_per_domain)
        state["heldout"] = [logged(r) for r in heldout_rows]
        state["shipped_train"] = [logged(r) for r in train_rows]
        wanted = args.requests - len(train_rows)
        # the larger held-out set scored after the run (eagle3_heldout.py) is never generated for
        # training either
        extra = extra_heldout_rows(args.extra_heldout)
        state["requests"] = new_requests(wanted, shipped_rows() + extra, encode, args.seed,
                                         args.max_new_tokens)
        held = {tuple(r.prompt_ids) for r in state["heldout"]}
        clash = sum(tuple(r["prompt_token_ids"]) in held for r in state["requests"])
        extra_messages = {json.dumps(r["messages"]) for r in extra}
        extra_clash = sum(json.dumps(r["messages"]) in extra_messages for r in state["requests"])
        curve["counts"].update(shipped_train=len(train_rows), heldout=len(heldout_rows),
                               new_prompts=len(state["requests"]), new_prompts_equal_to_heldout=clash,
                               extra_heldout=len(extra), new_prompts_equal_to_extra_heldout=extra_clash)

    phase(curve, "prompts", out, prompts)
    state.setdefault("shipped_train", [])
    state.setdefault("requests", [])

    def generation():
        deadline = time.perf_counter() + args.generate_seconds
        state["generated"] = generate(target, state["requests"], eos, args, deadline)
        by_domain: dict[str, int] = {}
        for r in state["generated"]:
            by_domain[r.domain] = by_domain.get(r.domain, 0) + 1
        curve["counts"].update(generated=len(state["generated"]), generated_by_domain=by_domain)
        if args.save_generated:
            with gzip.open(out / "generated.jsonl.gz", "wt", encoding="utf-8") as handle:
                for r in state["generated"]:
                    handle.write(json.dumps({"id": r.request_id, "domain": r.domain,
                                             "temperature": r.sampling.temperature,
                                             "top_k": r.sampling.top_k, "top_p": r.sampling.top_p,
                                             "prompt_token_ids": list(r.prompt_ids),
                                             "response_token_ids": list(r.response_ids)}) + "\n")

    phase(curve, "generate", out, generation)
    pool = state["shipped_train"] + state.get("generated", [])
    random.Random(args.seed).shuffle(pool)
    # the curve's rows, which choose the head kept: from the pool, never trained on, and
    # not the held-out rows reported (chosen on, those would report the best of several looks)
    pool, validation = split_off(pool, args.curve_requests)
    state["pool"] = pool
    curve["counts"].update(training_pool=len(pool), validation=len(validation))
    heldout = state.get("heldout", [])
    if heldout and pool:
        train_heads(target, pool, validation, heldout, args, curve)
    print(summary(curve))
    curve["train_requests"] = pool          # returned for the tests, not written
    curve["validation_requests"] = validation
    curve["heldout_requests"] = heldout
    return curve


def train_heads(target, pool, curve_rows, heldout, args, curve) -> None:
    out = args.out
    costs = None
    if args.costs == "measure":
        costs = phase(curve, "costs", out, lambda: (
            measure_head_step(Eagle3Head(target, torch.arange(min(args.vocab, output_size(target)))),
                              target),
            measured_costs(target, None, K_MAX)[1]))
    if costs is None:      # assumed, or the measurement failed
        costs = (0.05, [1.0 + 0.01 * k for k in range(K_MAX)])
        curve["costs_assumed"] = True
    curve["costs"] = {"head_step": costs[0], "verify": costs[1]}
    for label, n in sizes_of(args.sizes, len(pool)):
        curve["sizes"].append(n)
        entry = {"size": label, "requests": n}
        curve["heads"].append(entry)
        trained = phase(curve, f"train_{label}", out, train_and_save, target, pool[:n], curve_rows,
                        costs, args, entry)
        if trained is not None:
            phase(curve, f"score_{label}", out, lambda head=trained: entry.update(
                heldout=score(target, head, heldout)))
        if args.device.type == "cuda":
            torch.cuda.empty_cache()


def train_and_save(target, rows, curve_rows, costs, args, entry) -> Eagle3Head:
    with tempfile.TemporaryDirectory(prefix="eagle3-gpu-") as work:
        head, k = train_one(target, rows, curve_rows, costs, args, entry, Path(work))
    directory = args.out / f"head-{entry['size']}"
    head.save(directory, k=k, verifier=VERIFIER, meta={"training_requests": entry["requests"],
                                                       "rows_passed": entry.get("rows_passed")})
    if args.save_dtype != "float32":
        cast_weights(directory / "model.safetensors", getattr(torch, args.save_dtype))
    entry["dir"] = directory.name
    entry["checkpoint_mb"] = round(sum(f.stat().st_size for f in directory.iterdir()) / 2 ** 20, 1)
    return head


def cast_weights(path: Path, dtype: torch.dtype) -> None:
    """Rewrite a safetensors file with its floating-point tensors in `dtype` (index maps kept)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    save_file({name: (t.to(dtype) if t.is_floating_point() else t) for name, t in state.items()},
              str(path), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
