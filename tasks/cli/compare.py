"""`specdec generate|compare` (parsers: tasks.cli.parsers.compare): one prompt decoded, and plain
decoding compared with each drafter on a prompt set: tokens/s, acceptance, speedup.

All contenders decode the same prompts one at a time (batch 1), interleaved prompt by prompt so
that drift of the machine's speed hits every contender alike.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass

from rich.table import Table
from tqdm.auto import tqdm

from specdec_core import SamplingParams, SpecDecoder, SpecStats, load_model
from specdec_core.drafters import Drafter
from specdec_core.factory import make_drafter
from specdec_core.profile import calibrate_verify_widths

from ..steps.drafters.candidates import candidate_label
from .console import emit, make_console
from .prompts import Prompt, PromptFileError, encode, load_prompts

log = logging.getLogger(__name__)
console = make_console()

PLAIN = "plain"


@dataclass
class CompareRow:
    contender: str
    domain: str
    stats: SpecStats
    speedup: float            # decode tokens/s over plain decoding's, same prompts

    def to_dict(self) -> dict:
        return {"contender": self.contender, "domain": self.domain,
                "decode_tokens_per_s": self.stats.decode_tokens_per_s,
                "acceptance_rate": self.stats.acceptance_rate,
                "mean_accepted_length": self.stats.mean_accepted_length,
                "speedup": self.speedup, "new_tokens": self.stats.new_tokens,
                "total_s": self.stats.total_s}


def compare(model, tokenizer, drafters: dict[str, Drafter | tuple[Drafter, int]],
            prompts: list[Prompt], k: int = 4, max_new_tokens: int = 64,
            sampling: SamplingParams | None = None, seed: int = 0, progress: bool = True,
            verify_widths: dict[int, int] | None = None) -> list[CompareRow]:
    """Rows per (contender, domain) and per contender over all prompts (domain "all").

    drafters: name -> drafter, or name -> (drafter, its own K); verify_widths: see SpecDecoder.
    """
    sampling = sampling or SamplingParams()
    decoders = {}
    for name, entry in drafters.items():
        drafter, drafter_k = entry if isinstance(entry, tuple) else (entry, k)
        decoders[name] = SpecDecoder(model, drafter, k=drafter_k, tokenizer=tokenizer,
                                     verify_widths=verify_widths)
    plain = SpecDecoder(model, None, k=k, tokenizer=tokenizer)
    per: dict[tuple[str, str], SpecStats] = {}
    device = next(model.parameters()).device
    contenders = [PLAIN, *decoders]
    bar = tqdm(total=len(prompts) * len(contenders), desc="compare", disable=not progress)
    for prompt in prompts:
        ids, mask = encode(tokenizer, [prompt.text], device=device)
        for name in contenders:
            decoder = plain if name == PLAIN else decoders[name]
            run = decoder.generate_plain if name == PLAIN else decoder.generate
            result = run(ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                         attention_mask=mask, eos_token_id=tokenizer.eos_token_id)
            for key in ((name, prompt.domain), (name, "all")):
                per[key] = per[key].merge(result.stats) if key in per else result.stats
            bar.update(1)
    bar.close()
    rows = []
    for (name, domain), stats in per.items():
        base = per[(PLAIN, domain)].decode_tokens_per_s
        rows.append(CompareRow(name, domain, stats,
                               stats.decode_tokens_per_s / base if base else 0.0))
    order = {name: i for i, name in enumerate(contenders)}
    domains = list(dict.fromkeys(p.domain for p in prompts)) + ["all"]
    rows.sort(key=lambda row: (domains.index(row.domain), order[row.contender]))
    return rows


def drafter_label(kind: str, params: dict) -> str:
    return candidate_label({"kind": kind, "params": params})


def _sampling(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def cmd_generate(args) -> int:
    model, tokenizer = load_model(args.model, device=args.device)
    drafter = None
    if args.drafter:
        kind, params = args.drafter
        drafter = make_drafter(kind, params, model, tokenizer)
    decoder = SpecDecoder(model, drafter, k=args.k, tokenizer=tokenizer)
    ids, mask = encode(tokenizer, [args.prompt], chat=not args.no_chat, device=model.device)
    run = decoder.generate if drafter is not None else decoder.generate_plain
    result = run(ids, max_new_tokens=args.max_new_tokens, sampling=_sampling(args), seed=args.seed,
                 attention_mask=mask, eos_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(result.tokens[0, : result.num_tokens[0]], skip_special_tokens=True)
    emit(text)
    stats = ("plain " if drafter is None else drafter_label(*args.drafter) + f" k={args.k} ") \
        + result.stats.summary()
    if args.stats_to_stderr:
        print(stats, file=sys.stderr)
    else:
        emit(stats)
    return 0


def cmd_compare(args) -> int:
    prompts = load_prompts(args.prompts)
    if args.domains:
        wanted = set(args.domains.split(","))
        prompts = [p for p in prompts if p.domain in wanted]
        if not prompts:
            raise PromptFileError(f"no prompt has a domain in {sorted(wanted)}")
    model, tokenizer = load_model(args.model, device=args.device)
    specs = args.drafter or [("prompt_lookup", {"k": 8}), ("layer_skip", {"num_layers": 8, "k": 2})]
    drafters = {}
    for kind, params in specs:
        params = dict(params)
        drafter_k = int(params.pop("k", args.k))
        drafters[drafter_label(kind, params) + f" k={drafter_k}"] = (
            make_drafter(kind, params, model, tokenizer), drafter_k)
    widths = None
    if not args.no_calibrate:
        widths = calibrate_verify_widths(model, max(k for _, k in drafters.values()) + 1)
    rows = compare(model, tokenizer, drafters, prompts, k=args.k,
                   max_new_tokens=args.max_new_tokens, sampling=_sampling(args), seed=args.seed,
                   verify_widths=widths)
    if args.format == "json":
        emit(json.dumps([row.to_dict() for row in rows], indent=2))
        return 0
    console.print(_compare_table(args.model, len(prompts), rows))
    return 0


def _compare_table(model: str, prompts: int, rows: list[CompareRow]) -> Table:
    table = Table(title=f"{model}: plain vs drafters, {prompts} prompts, batch 1, decode phase")
    for column in ("domain", "contender", "decode tok/s", "acceptance rate",
                   "mean accepted length", "speedup"):
        table.add_column(column, justify="left" if column in ("domain", "contender") else "right",
                         no_wrap=column == "contender")
    for row in rows:
        plain = row.contender == "plain"
        table.add_row(row.domain, row.contender, f"{row.stats.decode_tokens_per_s:.1f}",
                      "-" if plain else f"{row.stats.acceptance_rate:.3f}",
                      "-" if plain else f"{row.stats.mean_accepted_length:.2f}",
                      f"{row.speedup:.2f}x")
    return table
