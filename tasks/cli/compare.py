"""Compare plain decoding with each drafter on a prompt set: tokens/s, acceptance, speedup.

All contenders decode the same prompts one at a time (batch 1), interleaved prompt by prompt so
that drift of the machine's speed hits every contender alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tqdm.auto import tqdm

from specdec_core import SamplingParams, SpecDecoder, SpecStats
from specdec_core.drafters import Drafter

from .prompts import Prompt, encode

log = logging.getLogger(__name__)

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
