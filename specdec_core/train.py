"""Training a draft on the traffic it will serve: distillation from the target's logged responses.

- init_draft_from_target: a small causal LM of the target's architecture (fewer layers, optionally
  a smaller hidden size) whose embeddings, output head and final norm start from the target's
  (projected onto the top singular directions of the embedding when the hidden size is smaller);
  with the target's hidden size its layers start as the target's first layers (LayerSkip's
  starting point, which training then turns into a real draft).
- train_draft: AdamW with warm-up and a cosine schedule, gradient clipping, fp32 on CPU and bf16
  autocast on CUDA, safetensors checkpoints and resume. Loss on response positions only: KL from
  the target's top-k distribution when teacher_topk > 0 (one batched target pass, cached), else
  cross-entropy on the logged tokens (the target's own samples).
- Model selection by what serving needs: every `eval_every` steps the held-out requests are scored
  with the offline acceptance estimator, and the checkpoint with the best predicted speedup
  (optimal K on measured costs) is kept, not the one with the lowest loss; among checkpoints that
  predict the same speedup (e.g. none pays yet on this hardware), the one with the higher
  expected tokens per round.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_model
from tqdm.auto import tqdm

from .cache import SequenceCache
from .drafters import DraftModel, output_size
from .errors import TokenizerMismatch
from .estimate import LoggedRequest, estimate_acceptance
from .graphs import graphed_module
from .head import HeadDrafter, HiddenTap, target_features
from .planner import optimal_k
from .train_config import TrainConfig   # defined torch-free there; specdec_core.train.TrainConfig as before

log = logging.getLogger(__name__)


def init_draft_from_target(target: torch.nn.Module, num_layers: int = 2, hidden_size: int | None = None,
                           num_heads: int | None = None, intermediate_size: int | None = None,
                           seed: int = 0) -> torch.nn.Module:
    """A draft of the target's architecture with num_layers layers, initialised from the target."""
    torch.manual_seed(seed)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:num_layers]
    same_width = hidden_size is None or hidden_size == target.config.hidden_size
    if not same_width:
        heads = num_heads or max(1, hidden_size // getattr(target.config, "head_dim", 64))
        config.hidden_size = hidden_size
        config.num_attention_heads = heads
        config.num_key_value_heads = max(1, min(getattr(config, "num_key_value_heads", heads), heads))
        while heads % config.num_key_value_heads:
            config.num_key_value_heads -= 1
        config.head_dim = hidden_size // heads
        config.intermediate_size = intermediate_size or 4 * hidden_size
    elif intermediate_size is not None:
        config.intermediate_size = intermediate_size
    draft = type(target)(config).to(next(target.parameters()).device)
    with torch.no_grad():
        source_embed = target.get_input_embeddings().weight.float()
        if same_width:
            draft.get_input_embeddings().weight.copy_(source_embed)
            state = target.state_dict()
            own = draft.state_dict()
            for name, tensor in own.items():   # first layers + final norm + head: the target's
                if name in state and state[name].shape == tensor.shape and "embed_tokens" not in name:
                    tensor.copy_(state[name])
        else:   # project onto the embedding's top singular directions
            _, _, vh = torch.linalg.svd(source_embed - source_embed.mean(0), full_matrices=False)
            projection = vh[:hidden_size].T                     # [H_target, H_draft]
            draft.get_input_embeddings().weight.copy_(source_embed @ projection)
            head = target.get_output_embeddings().weight.float()
            draft_head = draft.get_output_embeddings()
            if draft_head.weight.data_ptr() != draft.get_input_embeddings().weight.data_ptr():
                draft_head.weight.copy_(head @ projection)
    return draft.eval()


@dataclass
class TrainResult:
    step: int
    best_step: int
    best: dict                        # the kept checkpoint's scores on the rows that chose it
    history: list[dict] = field(default_factory=list)
    best_dir: str | None = None
    # the kept checkpoint scored once on rows that neither trained nor chose it (optimise's
    # `report`); None where none were given. `best` is the best of several looks at its rows, so
    # it reads higher than one look would
    report: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _check_vocab(draft, target) -> None:
    if output_size(draft) != output_size(target):
        raise TokenizerMismatch(f"draft vocab {output_size(draft)} != target vocab {output_size(target)} "
                                "(model output sizes): train a draft with the target's tokenizer")


def _batch(requests: list[LoggedRequest], max_length: int, device):
    """Right-padded ids [B, T], attention mask, and the response mask (positions predicting a
    response token), keeping the last max_length tokens of each row."""
    rows = [(list(r.prompt_ids) + list(r.response_ids))[-max_length:] for r in requests]
    response_len = [min(len(r.response_ids), len(row)) for r, row in zip(requests, rows)]
    width = max(len(row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    target_mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        # logits at position t predict token t + 1: response tokens sit at len-response_len..len-1
        target_mask[i, len(row) - response_len[i] - 1: len(row) - 1] = True
    return ids.to(device), mask.to(device), target_mask.to(device)


def _teacher_topk(target, requests, k, max_length, batch_size, device, progress):
    """Per request: (log-probs [L, k], indices [L, k]) of the target at its response positions."""
    cache = []
    with torch.inference_mode():
        for start in tqdm(range(0, len(requests), batch_size), desc="teacher top-k", disable=not progress):
            chunk = requests[start: start + batch_size]
            ids, mask, target_mask = _batch(chunk, max_length, device)
            logp = target(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
            for i in range(len(chunk)):
                values, index = logp[i][target_mask[i]].topk(k, dim=-1)
                cache.append((values.cpu(), index.cpu()))
    return cache


def _loss(draft, ids, mask, target_mask, teacher=None):
    logits = draft(input_ids=ids, attention_mask=mask).logits.float()
    picked = logits[target_mask]                                   # [N, V] response positions
    if teacher is None:
        labels = ids[:, 1:][target_mask[:, :-1]]
        return F.cross_entropy(picked, labels)
    values, index = teacher                                        # [N, k] each
    p = values.to(picked.device).exp()
    p = p / p.sum(-1, keepdim=True)
    log_q = picked.log_softmax(-1).gather(-1, index.to(picked.device))
    return (p * (p.clamp_min(1e-30).log() - log_q)).sum(-1).mean()


@torch.inference_mode()
def heldout_kl(draft, target, requests, max_length: int = 512, batch_size: int = 8) -> float:
    """Mean KL(p_target || q_draft) over the held-out requests' response positions (full vocab)."""
    device = next(draft.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(requests), batch_size):
        ids, mask, target_mask = _batch(requests[start: start + batch_size], max_length, device)
        log_p = target(input_ids=ids, attention_mask=mask).logits.float()[target_mask].log_softmax(-1)
        log_q = draft(input_ids=ids, attention_mask=mask).logits.float()[target_mask].log_softmax(-1)
        total += float((log_p.exp() * (log_p - log_q)).sum())
        count += int(target_mask.sum())
    return total / max(count, 1)


def evaluate_draft(draft, target, heldout: list[LoggedRequest], k_max: int, draft_cost_ratio: float,
                   verify_cost_ratios: list[float] | None) -> dict:
    """evaluate_drafter for a draft model."""
    return evaluate_drafter(DraftModel(draft), target, heldout, k_max, draft_cost_ratio,
                            verify_cost_ratios)


def evaluate_drafter(drafter, target, heldout: list[LoggedRequest], k_max: int,
                     draft_cost_ratio: float, verify_cost_ratios: list[float] | None) -> dict:
    """Held-out acceptance (offline estimator) and the predicted speedup at the best K, pooled and
    per domain: {"k", "predicted_speedup", "expected_tokens_per_round", "conditional_acceptance",
    "domains": {domain: {...}}}."""
    pooled = [LoggedRequest(r.request_id, r.prompt_ids, r.response_ids, r.sampling, "all")
              for r in heldout]
    ks = list(range(1, k_max + 1))
    out = {}
    for name, requests in [("all", pooled), *[(d, [r for r in heldout if r.domain == d])
                                              for d in sorted({r.domain for r in heldout})]]:
        estimates = estimate_acceptance(target, drafter, requests, ks, progress=False, n_boot=200)
        estimates = next(iter(estimates.values()))
        rates = estimates[k_max].conditional_acceptance
        k, speedup = optimal_k(rates, draft_cost_ratio, k_max, verify_cost_ratios)
        best = estimates[max(k, 1)]
        out[name] = {"k": k, "predicted_speedup": speedup,
                     "expected_tokens_per_round": best.expected_tokens_per_round,
                     "acceptance_rate": best.acceptance_rate, "conditional_acceptance": rates,
                     "requests": best.requests}
    result = dict(out.pop("all"))
    result["domains"] = out
    return result


def _save(draft, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    draft.config.save_pretrained(directory)
    save_model(draft, str(directory / "model.safetensors"))


class Trainee:
    """What the shared optimisation loop (optimise) trains: a draft model or a draft head."""

    module: torch.nn.Module

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def prepare(self, config: "TrainConfig", progress: bool) -> None:
        """Once per call, before any step (teacher passes, caches)."""

    def loss(self, picks: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self) -> dict:
        """Held-out scores: evaluate_drafter's dict plus "heldout_kl"."""
        raise NotImplementedError

    def score(self, rows: list[LoggedRequest]) -> dict:
        """evaluate() on other rows than those it scores at the curve's points (`heldout`)."""
        kept, self.heldout = self.heldout, rows
        try:
            return self.evaluate()
        finally:
            self.heldout = kept

    def save(self, directory: Path) -> None:
        raise NotImplementedError

    def load(self, directory: Path) -> None:
        raise NotImplementedError


def measured_costs(target, draft_step: torch.nn.Module | None, k_max: int) -> tuple[float, list[float]]:
    """(draft step / target step, [verify(K) / target step]) measured here at batch 1; draft_step:
    a model whose one-token forward is the draft step (None: a drafter without one)."""
    from .profile import measure_forward_costs

    target_costs = measure_forward_costs(target, range(1, k_max + 2), context_len=128, repeats=3)
    step_cost = target_costs[1]
    draft_cost = (measure_forward_costs(draft_step, [1], context_len=128, repeats=3)[1]
                  if draft_step is not None else 0.0)
    return (draft_cost / step_cost,
            [max(target_costs[k + 1] / step_cost, 1.0) for k in range(1, k_max + 1)])


class _DraftTrainee(Trainee):
    def __init__(self, draft, target, train, heldout, config, costs):
        self.module, self.target, self.train, self.heldout = draft, target, train, heldout
        self.config, self.costs, self.teacher = config, costs, None
        self.device = next(draft.parameters()).device

    def prepare(self, config, progress) -> None:
        if config.teacher_topk > 0:
            self.teacher = _teacher_topk(self.target, self.train, config.teacher_topk,
                                         config.max_length, config.batch_size, self.device, progress)

    def loss(self, picks):
        ids, mask, target_mask = _batch([self.train[i] for i in picks], self.config.max_length,
                                        self.device)
        teacher = None
        if self.teacher is not None:
            teacher = (torch.cat([self.teacher[i][0] for i in picks]),
                       torch.cat([self.teacher[i][1] for i in picks]))
        return _loss(self.module, ids, mask, target_mask, teacher)

    def evaluate(self):
        scores = evaluate_draft(self.module, self.target, self.heldout, self.config.k_max, *self.costs)
        scores["heldout_kl"] = heldout_kl(self.module, self.target, self.heldout,
                                          self.config.max_length, self.config.batch_size)
        return scores

    def save(self, directory):
        _save(self.module, directory)

    def load(self, directory):
        load_model(self.module, str(directory / "model.safetensors"))


def train_draft(draft: torch.nn.Module, target: torch.nn.Module, train: list[LoggedRequest],
                heldout: list[LoggedRequest], config: TrainConfig, checkpoint_dir: str | Path,
                costs: tuple[float, list[float] | None] | None = None, progress: bool = True,
                stop_after: int | None = None, report: list[LoggedRequest] | None = None) -> TrainResult:
    """Train `draft` in place; checkpoints under checkpoint_dir/{last,best}; resumes from last.

    heldout: the rows scored at the curve's points, which choose the checkpoint kept; report:
    rows the kept checkpoint is scored on once at the end (TrainResult.report).
    costs: (draft step / target step, [verify(K) / target step]) for the predicted speedup;
    measured here at batch 1 when None. stop_after: stop after this many steps of this call
    (simulates an interruption in tests; the schedule still spans config.steps).
    """
    _check_vocab(draft, target)
    if not train or not heldout:
        raise ValueError(f"need training and held-out requests (got {len(train)} and {len(heldout)})")
    costs = costs or measured_costs(target, draft, config.k_max)
    trainee = _DraftTrainee(draft, target, train, heldout, config, costs)
    return optimise(trainee, len(train), config, checkpoint_dir, progress=progress,
                    stop_after=stop_after, desc="draft training", report=report)


def autocast(device: torch.device):
    """The training step's autocast: bf16 on CUDA, with its weight-cast cache off (a graphed step,
    torch.cuda.make_graphed_callables, refuses the cache; a forward casts each weight once
    anyway), none elsewhere (fp32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
    return torch.autocast("cpu", enabled=False)


def lr_factor(config: TrainConfig, step: int) -> float:
    """The learning-rate factor at `step`: linear warm-up, then cosine decay to 0 at config.steps."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _resume(trainee: Trainee, last: Path, optimizer, scheduler, config: TrainConfig,
            desc: str) -> tuple[int, list, dict]:
    """(step, history, best) from the checkpoint in `last` -- weights, optimizer, schedule and
    random states restored -- or a fresh start, seeded."""
    if not (last / "state.pt").exists():
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        return 0, [], {"predicted_speedup": -1.0, "step": -1}
    trainee.load(last)
    state = torch.load(last / "state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    random.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
    log.info("resumed %s at step %d from %s", desc, state["step"], last)
    return state["step"], state["history"], state["best"]


def optimise(trainee: Trainee, n_train: int, config: TrainConfig, checkpoint_dir: str | Path,
             progress: bool = True, stop_after: int | None = None,
             desc: str = "training", deadline: float | None = None,
             report: list[LoggedRequest] | None = None) -> TrainResult:
    """The optimisation loop every trained drafter shares: AdamW, warm-up + cosine, clipping,
    held-out evaluation every eval_every steps with the best checkpoint kept by predicted speedup,
    and resume from checkpoint_dir/last (same result as an uninterrupted run).

    deadline (a time.perf_counter() value): the first step that ends past it is the last one; it
    is evaluated and saved as a step at eval_every would be (the result's `step` says how far it
    got), so a run under a time limit keeps its best checkpoint instead of being killed without
    one. The schedule is still config.steps': plan the steps to fit, the deadline is the net.

    report: rows the kept checkpoint is scored on once, after the loop (TrainResult.report); the
    module is left with the weights it ended with."""
    device = next(trainee.module.parameters()).device
    checkpoint_dir = Path(checkpoint_dir)
    last, best_dir = checkpoint_dir / "last", checkpoint_dir / "best"
    parameters = trainee.parameters()
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, config))
    step, history, best = _resume(trainee, last, optimizer, scheduler, config, desc)
    trainee.prepare(config, progress)

    def evaluate(at_step: int, train_loss: float | None) -> None:
        nonlocal best
        trainee.module.eval()
        scores = trainee.evaluate()
        record = {"step": at_step, "train_loss": train_loss, **scores}
        history.append(record)
        # by predicted speedup; where nothing pays yet (every K "off": 1.0), by acceptance
        key = (scores["predicted_speedup"], scores["expected_tokens_per_round"])
        if key > (best["predicted_speedup"], best.get("expected_tokens_per_round", 0.0)):
            best = {"step": at_step, **{k: v for k, v in record.items() if k != "step"}}
            trainee.save(best_dir)
        log.info("%s step %d: held-out KL %.4f, E %.3f at K=%d, predicted %.3fx", desc, at_step,
                 scores["heldout_kl"], scores["expected_tokens_per_round"], scores["k"],
                 scores["predicted_speedup"])
        trainee.module.train()

    if step == 0:
        evaluate(0, None)
    trainee.module.train()
    order = list(range(n_train))
    bar = tqdm(total=config.steps, initial=step, desc=desc, disable=not progress)
    # the losses are summed on the device and read at the curve points: reading one a step would
    # make the host wait for the device every step (the next step's launches then start late)
    loss_sum, n_losses = torch.zeros((), dtype=torch.float64, device=device), 0
    started = step
    while step < config.steps and (stop_after is None or step - started < stop_after):
        picks = random.sample(order, min(config.batch_size, len(order)))
        with autocast(device):
            loss = trainee.loss(picks)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        step += 1
        loss_sum += loss.detach()
        n_losses += 1
        bar.update(1)
        if not bar.disable and step % 10 == 0:
            bar.set_postfix(loss=f"{float(loss):.3f}")
        out_of_time = deadline is not None and time.perf_counter() >= deadline
        if step % config.eval_every == 0 or step == config.steps or out_of_time:
            evaluate(step, float(loss_sum) / n_losses)
            loss_sum.zero_()
            n_losses = 0
            _save_last(trainee, last, optimizer, scheduler, step, history, best, config)
        if out_of_time and step < config.steps:
            log.warning("%s: stopped at its deadline after step %d of %d", desc, step, config.steps)
            break
    bar.close()
    trainee.module.eval()
    (checkpoint_dir / "history.json").write_text(json.dumps(history, indent=1))
    scored = _score_kept(trainee, parameters, best_dir, best, report, desc) if report else None
    return TrainResult(step=step, best_step=best["step"], best=best, history=history,
                       best_dir=str(best_dir) if best_dir.exists() else None, report=scored)


def _save_last(trainee: Trainee, last: Path, optimizer, scheduler, step: int, history: list,
               best: dict, config: TrainConfig) -> None:
    """The resumable checkpoint: the weights and what _resume reads back."""
    trainee.save(last)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step, "history": history, "best": best, "config": asdict(config),
                "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()},
               last / "state.pt")


def _score_kept(trainee: Trainee, parameters: list, best_dir: Path, best: dict,
                report: list[LoggedRequest], desc: str) -> dict | None:
    """The kept checkpoint scored on `report`; the module is left with the weights it ended with."""
    if not best_dir.exists():
        return None
    ended = [param.detach().clone() for param in parameters]     # what training changes
    trainee.load(best_dir)
    scored = {"step": best["step"], **trainee.score(report)}
    with torch.no_grad():
        for param, value in zip(parameters, ended):
            param.copy_(value)
    log.info("%s: the kept checkpoint (step %d) on %d rows it was not chosen on: E %.3f at "
             "K=%d, predicted %.3fx", desc, best["step"], len(report),
             scored["expected_tokens_per_round"], scored["k"], scored["predicted_speedup"])
    return scored


# ---------------------------------------------------------------------------------------------
# draft heads (head.py): trained on cached target passes, with the same loop
def head_vocabulary(requests: list[LoggedRequest], size: int, full_vocab: int,
                    responses_only: bool = False) -> torch.Tensor:
    """The `size` most frequent token ids of the requests (prompts and responses; with
    responses_only, of the responses alone: what a draft proposes), ascending."""
    counts = torch.zeros(full_vocab, dtype=torch.long)
    for request in requests:
        ids = torch.tensor((([] if responses_only else list(request.prompt_ids))
                            + list(request.response_ids)), dtype=torch.long)
        counts += torch.bincount(ids, minlength=full_vocab)[:full_vocab]
    size = min(size, full_vocab)
    return counts.topk(size).indices.sort().values


def chain_attention_mask(passes: int, width: int, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask [B, 1, L, L], L = passes x width, for training a head's draft chain in one
    forward (a "training-time test"). Row (w, j) is chain step w at position j: a round that
    started after teacher-forced position s = j - w. It sees the teacher-forced keys (pass 0) at
    positions <= s and its own chain's earlier steps (pass v at s + v, 1 <= v <= w), exactly what
    the head's cache holds when it drafts step w live. valid [B, width]: keys that exist."""
    device = valid.device
    step = torch.arange(passes, device=device).repeat_interleave(width)     # pass of each slot
    pos = torch.arange(width, device=device).repeat(passes)                 # position of each slot
    qw, qj = step[:, None], pos[:, None]
    kv, ki = step[None], pos[None]
    allowed = ((kv == 0) & (ki <= qj - qw)) | ((kv >= 1) & (kv <= qw) & (ki == qj - qw + kv))
    allowed = allowed[None] & valid.bool().repeat(1, passes)[:, None, :]
    allowed |= torch.eye(len(step), dtype=torch.bool, device=device)[None]  # no empty rows
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def head_chain_passes(head, feats: torch.Tensor, next_tokens: torch.Tensor, valid: torch.Tensor,
                      steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits [B, T, N], outputs g [B, T, H]) of chain steps 0..steps-1 of a head over teacher
    features [B, T, H]: step 0 is the teacher-forced pass; at step w, position j feeds on the
    head's own step-(w-1) output at j - 1 (what a live round that started after j - w drafts).
    Step w runs as one forward over all steps so far, under chain_attention_mask."""
    out = []
    width = feats.shape[1]
    embeds = [head.inputs(feats, next_tokens)]
    positions = torch.arange(width, device=feats.device)
    g = None                                   # the previous step's outputs
    for w in range(steps):
        if w:
            embeds.append(head.chained(torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], 1), next_tokens))
        # step 0's mask too is built here: transformers' own, from a padding mask, asks the host
        # whether the padding is all ones (a device read each step)
        with HiddenTap(head.body.model.norm) as tap:
            step = head.body(inputs_embeds=torch.cat(embeds, 1),
                             attention_mask=chain_attention_mask(w + 1, width, valid, embeds[0].dtype),
                             position_ids=positions.repeat(w + 1)[None].expand(len(feats), -1),
                             use_cache=False, logits_to_keep=width)
            g = tap.value[:, -width:]
        out.append((step.logits, g))
    return out


class PackedRows:
    """A head trainee's cached target passes, one row per training request, in flat buffers: the
    rows' tokens [T], target features [T, F] and the target's top-k log-probabilities and local
    indices [T, k] (row r's slots start at starts[r]; its last slot has no next distribution: -inf
    values). Buffers are made at the first append, `capacity` slots, on `device`, features in the
    dtype they come in; `self[r]` gives row r's views (ids, features, values, index) as appended.

    `batch` gathers a padded training batch in a fixed number of tensor operations whatever the
    batch size (a row at a time took about 30 per row: on a GPU, launches and host time per step
    that grew with the batch)."""

    def __init__(self, capacity: int, device="cpu"):
        self.capacity, self.device = capacity, torch.device(device)
        self.used = 0
        self.starts: list[int] = []
        self.lengths: list[int] = []          # on the host: a batch's width needs no device read
        self.ids = self.features = self.values = self.index = None
        self._where: tuple[torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        start = self.starts[row]
        end = start + self.lengths[row]
        return (self.ids[start:end], self.features[start:end], self.values[start:end - 1],
                self.index[start:end - 1])

    def append(self, ids: torch.Tensor, features: torch.Tensor, values: torch.Tensor,
               index: torch.Tensor) -> None:
        """One row: ids [n], features [n, F], values and index [n - 1, k]."""
        n = len(ids)
        if self.used + n > self.capacity:
            raise ValueError(f"a row of {n} tokens does not fit: {self.used} of {self.capacity} "
                             "slots used (capacity: the training rows' tokens, each cut to max_length)")
        if self.ids is None:
            slots, k = self.capacity, values.shape[-1]
            self.ids = torch.zeros(slots, dtype=torch.long, device=self.device)
            self.features = torch.zeros(slots, features.shape[-1], dtype=features.dtype, device=self.device)
            self.values = torch.full((slots, k), float("-inf"), dtype=values.dtype, device=self.device)
            self.index = torch.zeros(slots, k, dtype=torch.long, device=self.device)
        start = self.used
        self.ids[start:start + n] = ids
        self.features[start:start + n] = features
        self.values[start:start + n - 1] = values
        self.index[start:start + n - 1] = index
        self.starts.append(start)
        self.lengths.append(n)
        self.used += n
        self._where = None

    def batch(self, picks: list[int], device, width: int | None = None) -> tuple[torch.Tensor, ...]:
        """(features [B, W, F] float32, next tokens [B, W], target features at the next position
        [B, W, F], mask [B, W], top-k values [B, W, k], top-k local indices [B, W, k]) of rows
        `picks`, W = the longest pick's length - 1 or `width` (at least that: the same shapes for
        every batch, as a graphed step needs); past a row's end: zeros, -inf values, index 0, mask
        False. On `device`; the host never waits for the device here."""
        if self._where is None:
            self._where = (torch.tensor(self.starts, dtype=torch.long, device=self.device),
                           torch.tensor(self.lengths, dtype=torch.long, device=self.device))
        starts, lengths = self._where
        rows = torch.tensor(picks, dtype=torch.long)
        if self.device.type == "cuda":     # a pageable copy would wait for the device's queue
            rows = rows.pin_memory().to(self.device, non_blocking=True)
        start, n = starts[rows], lengths[rows] - 1               # n: positions with a next token
        longest = max(self.lengths[i] for i in picks) - 1
        if width is not None and width < longest:
            raise ValueError(f"a batch of width {width} cannot hold rows of {longest + 1} tokens")
        width = longest if width is None else width
        pos = torch.arange(width, device=self.device)
        mask = pos < n[:, None]
        scored = (pos < (n - 1)[:, None])[..., None]              # and a next distribution
        at = (start[:, None] + pos).clamp_(max=max(self.used - 2, 0))
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        feats = torch.where(mask[..., None], self.features[at].float(), zero)
        truth = torch.where(mask[..., None], self.features[at + 1].float(), zero)
        nxt = torch.where(mask, self.ids[at + 1], 0)
        values = torch.where(scored, self.values[at].float(), float("-inf"))
        index = torch.where(scored, self.index[at].clamp(min=0), 0)
        return tuple(t.to(device) for t in (feats, nxt, truth, mask, values, index))

    def batch_rowwise(self, picks: list[int], device) -> tuple[torch.Tensor, ...]:
        """What `batch` returns, built a row at a time (about 30 tensor operations per row): the
        reference `batch` is tested and benchmarked against."""
        rows = [self[i] for i in picks]
        width = max(len(r[0]) for r in rows) - 1
        k = self.values.shape[-1]
        feats = torch.zeros(len(rows), width, self.features.shape[-1], device=device)
        nxt = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
        truth = torch.zeros_like(feats)
        values = torch.full((len(rows), width, k), float("-inf"), device=device)
        index = torch.zeros(len(rows), width, k, dtype=torch.long, device=device)
        for b, (ids, f, v, i) in enumerate(rows):
            n = len(ids) - 1
            feats[b, :n] = f[:-1].to(device)
            nxt[b, :n] = ids[1:].to(device)
            truth[b, :n] = f[1:].to(device)
            mask[b, :n] = True
            values[b, : n - 1] = v[: n - 1].to(device)
            index[b, : n - 1] = i[: n - 1].clamp(min=0).to(device)
        return feats, nxt, truth, mask, values, index


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of `values` where `mask` is set (0 where it is nowhere), without indexing by the
    mask (whose result's size the host would have to read)."""
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp_min(1)


class _BatchLoss(torch.nn.Module):
    """A head trainee's batch_loss as a module over the head (what graphed_module captures: its
    parameters are the head's)."""

    def __init__(self, trainee: "_HeadTrainee"):
        super().__init__()
        self.head = trainee.module
        self.batch_loss = trainee.batch_loss

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        return self.batch_loss(*batch)


def packed_capacity(requests: list[LoggedRequest], max_length: int) -> int:
    """Slots PackedRows needs for these requests' rows (prompt + response, cut to max_length)."""
    return sum(min(len(r.prompt_ids) + len(r.response_ids), max_length) for r in requests)


class _HeadTrainee(Trainee):
    """Loss at every position j of prompt + response: KL(p_target(. | x_<=j+1) || q_head,j), with p
    restricted to the head's vocabulary and renormalised (the mass outside it cannot be drafted),
    plus `feature_weight` x the smooth-L1 distance of the normed head output to the target's
    normed hidden state at j + 1 (EAGLE's feature regression).

    unroll > 1 also trains the chain as it runs live: step w of a round feeds on the head's own
    output of step w - 1, not on the target's feature (chain_attention_mask); the loss is the mean
    over the steps. Without it, a head drafts well at step 1 and decays fast after."""

    def __init__(self, head, target, train, heldout, config, costs, feature_weight: float = 0.1,
                 teacher_topk: int = 64, unroll: int = 1, graphs: bool | None = None):
        self.module, self.target, self.train, self.heldout = head, target, train, heldout
        self.config, self.costs = config, costs
        self.feature_weight, self.topk, self.unroll = feature_weight, teacher_topk, max(1, unroll)
        self.cache = PackedRows(0)
        self.rowwise = False        # build batches a row at a time (benchmarks/head_step.py compares)
        # graphs: the step's forward and backward captured (graphs.graphed_module), batches at one
        # width; None: on CUDA. A capture that fails leaves the step eager, its error kept here.
        self.graphs = graphs
        self.graph_error: str | None = None
        self.graphed: dict[int, object] = {}      # batch size -> its captured step

    def parameters(self):
        return [p for _, p in self.module.own_named_parameters()]

    def prepare(self, config, progress) -> None:
        if self.cache:
            return
        head = self.module
        self.topk = min(self.topk, head.vocab_size)     # a small draft vocabulary: all of it
        inside = torch.ones(head.full_vocab, dtype=torch.bool)
        if head.reduced:
            inside[:] = False
            inside[head.vocab_ids.cpu()] = True
        local = torch.full((head.full_vocab,), -1, dtype=torch.long)
        local[inside] = torch.arange(int(inside.sum()))
        device = next(head.parameters()).device
        self.cache = PackedRows(packed_capacity(self.train, config.max_length))
        for request in tqdm(self.train, desc="target passes", disable=not progress):
            ids = torch.tensor((list(request.prompt_ids) + list(request.response_ids))[-config.max_length:],
                               device=device)
            features, logits = target_features(self.target, ids[None], head=head)
            logp = logits[0, 1:].float().log_softmax(-1).cpu()        # predicts x_{j+2}
            logp[:, ~inside] = float("-inf")
            values, index = logp.topk(self.topk, -1)
            self.cache.append(ids, features[0], values, local[index])

    def uses_graphs(self) -> bool:
        if self.graphs is None:
            self.graphs = next(self.module.parameters()).device.type == "cuda"
        return bool(self.graphs) and not self.rowwise

    def loss(self, picks):
        device = next(self.module.parameters()).device
        if self.rowwise:
            return self.batch_loss(*self.cache.batch_rowwise(picks, device))
        if not self.uses_graphs():
            return self.batch_loss(*self.cache.batch(picks, device))
        batch = self.cache.batch(picks, device, width=max(self.cache.lengths) - 1)
        graphed = self.graphed.get(len(picks))
        if graphed is None:
            try:
                graphed = self.graphed[len(picks)] = graphed_module(_BatchLoss(self), batch)
            except Exception as exc:       # noqa: BLE001 -- the eager step still trains
                self.graphs, self.graph_error = False, f"{type(exc).__name__}: {exc}"
                log.warning("head training: the step's capture failed, training eagerly: %s",
                            self.graph_error)
                return self.batch_loss(*batch)
        return graphed(*batch)

    def batch_loss(self, feats, nxt, truth, mask, values, index) -> torch.Tensor:
        """The loss of a gathered batch (PackedRows.batch), in tensor operations whose shapes do not
        depend on the values: masked sums, no boolean indexing, nothing read back to the host --
        a graphed step can capture it, and an eager one never waits for the device."""
        head = self.module
        width = feats.shape[1]
        # a position is scored where the target's next distribution is there (not a row's last)
        scored = values[..., 0] > float("-inf")
        p = torch.where(scored[..., None], values, 0.0).softmax(-1)
        log_p = p.clamp_min(1e-30).log()
        norm = head.body.model.norm
        positions = torch.arange(width, device=feats.device)
        total = 0.0
        for w, (logits, g) in enumerate(head_chain_passes(head, feats, nxt, mask, self.unroll)):
            started = (positions >= w)[None]                                  # round start s >= 0
            log_q = logits.float().log_softmax(-1).gather(-1, index)
            total = total + masked_mean((p * (log_p - log_q)).sum(-1), scored & started)
            if self.feature_weight and head.feature_regression:
                distance = F.smooth_l1_loss(norm(g).float(), norm(truth).float(), reduction="none")
                total = total + self.feature_weight * masked_mean(distance.mean(-1), mask & started)
        return total / self.unroll

    def evaluate(self):
        scores = evaluate_drafter(HeadDrafter(self.module), self.target, self.heldout,
                                  self.config.k_max, *self.costs)
        scores["heldout_kl"] = head_heldout_kl(self.module, self.target, self.heldout,
                                               self.config.max_length)
        return scores

    def save(self, directory):
        self.module.save(directory)

    def load(self, directory):
        saved = dict(type(self.module).load(directory, self.target).own_named_parameters())
        with torch.no_grad():
            for name, param in self.module.own_named_parameters():
                param.copy_(saved[name])


@torch.inference_mode()
def head_heldout_kl(head, target, requests: list[LoggedRequest], max_length: int = 512) -> float:
    """Mean KL(p_target || q_head) over the held-out responses' positions (full vocabulary; a
    reduced head's mass outside its ids counts through q's smoothing floor of 1e-30)."""
    total, count = 0.0, 0
    device = next(head.parameters()).device
    for request in requests:
        ids = torch.tensor((list(request.prompt_ids) + list(request.response_ids))[-max_length:],
                           device=device)
        n_resp = min(len(request.response_ids), len(ids) - 2)
        features, logits = target_features(target, ids[None], head=head)
        head_logits, _ = head(features[:, :-1], ids[None, 1:])
        log_p = logits[0, 1:].float().log_softmax(-1)[-n_resp - 1: -1]
        q = head.full_logits(head_logits[0].float()).softmax(-1)[-n_resp - 1: -1]
        total += float((log_p.exp() * (log_p - q.clamp_min(1e-30).log())).sum())
        count += n_resp
    return total / max(count, 1)


def train_head(head, target: torch.nn.Module, train: list[LoggedRequest],
               heldout: list[LoggedRequest], config: TrainConfig, checkpoint_dir: str | Path,
               costs: tuple[float, list[float] | None] | None = None, progress: bool = True,
               stop_after: int | None = None, feature_weight: float = 0.1,
               unroll: int = 1, graphs: bool | None = None,
               report: list[LoggedRequest] | None = None) -> TrainResult:
    """Train a DraftHead in place with the shared loop (optimise); its held-out score is the
    start-dependent offline estimate (head.head_round_rates). costs: as train_draft's, the draft
    step being one head step; measured here when None. unroll: draft steps trained as a chain on
    the head's own features (_HeadTrainee). graphs: the step's forward and backward captured
    (None: on CUDA; a capture that fails trains eagerly, with a warning). heldout and report:
    as train_draft's."""
    if not train or not heldout:
        raise ValueError(f"need training and held-out requests (got {len(train)} and {len(heldout)})")
    if costs is None:
        costs = measured_costs(target, None, config.k_max)
        costs = (measure_head_step(head, target), costs[1])
    trainee = _HeadTrainee(head, target, train, heldout, config, costs, feature_weight, unroll=unroll,
                           graphs=graphs)
    return optimise(trainee, len(train), config, checkpoint_dir, progress=progress,
                    stop_after=stop_after, desc="head training", report=report)


def measure_head_step(head, target, context_len: int = 128, repeats: int = 5) -> float:
    """One draft step of the head (a one-position pass on its cache: fuse, layer, norm, output
    head) / one target step, both measured here at batch 1."""

    from .profile import measure_forward_costs

    device = next(target.parameters()).device
    cache = SequenceCache(head.body)
    times = []
    with torch.inference_mode():
        feats = torch.randn(1, context_len, head.feature_size, device=device)
        tokens = torch.randint(0, head.full_vocab, (1, context_len), device=device)
        cache.forward(tokens, inputs_embeds=head.inputs(feats, tokens))
        keep = torch.full((1,), context_len, device=device)
        for _ in range(repeats + 1):
            start = time.perf_counter()
            logits = cache.forward(tokens[:, :1], logits_to_keep=1,
                                   inputs_embeds=head.inputs(feats[:, :1], tokens[:, :1]))
            head.full_logits(logits[:, -1]).argmax(-1).tolist()
            times.append(time.perf_counter() - start)
            cache.rollback_to(keep)
    step = measure_forward_costs(target, [1], context_len=context_len, repeats=repeats)[1]
    return float(sorted(times[1:])[len(times[1:]) // 2]) / step
