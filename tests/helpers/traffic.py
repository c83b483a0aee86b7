"""Traffic: JSONL request rows and files, a tiny target's own traffic, the rows a database holds."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from .models import VOCAB


def request_row(index: int = 1, **overrides) -> dict:
    """One valid JSONL request; overrides replace fields (a value of None removes the field)."""
    row = {
        "id": f"req-{index:05d}",
        "timestamp": f"2025-11-{1 + index % 14:02d}T{index % 24:02d}:15:00Z",
        "domain": "qa",
        "messages": [{"role": "user", "content": f"What is the capital of country number {index}?"}],
        "response": f"The capital of country {index} is City {index}.",
        "temperature": 0.0 if index % 2 else 0.7,
        "top_p": 1.0 if index % 2 else 0.9,
        "model": "smollm2-135m-instruct",
        "target_fingerprint": "sha256:test",
        "prompt_token_ids": [1, 2, 3, index % 1000],
        "response_token_ids": [4, 5, 6],
    }
    for key, value in overrides.items():
        if value is None:
            row.pop(key, None)
        else:
            row[key] = value
    return row


def write_jsonl(path: Path, rows, compress: bool = False) -> Path:
    """Rows (dicts, or strings written as they are) one per line."""
    lines = "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def traffic_rows(target, per_domain: int = 10, foreign: int = 2) -> list[dict]:
    """Requests answered by `target` (its fingerprint), plus `foreign` from another target."""
    import torch

    from specdec_core import SamplingParams, SpecDecoder
    from specdec_core.validation import fingerprint_id, target_fingerprint

    fid = fingerprint_id(target_fingerprint(target))
    decoder = SpecDecoder(target, None)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for domain in ("json", "qa"):
        for i in range(per_domain + (foreign if domain == "qa" else 0)):
            if domain == "json":     # repetitive prompts: prompt lookup finds continuations
                chunk = torch.randint(3, VOCAB, (5,), generator=generator)
                prompt = torch.cat([chunk, torch.randint(3, VOCAB, (3,), generator=generator), chunk[:3]])
            else:
                prompt = torch.randint(3, VOCAB, (8,), generator=generator)
            sampling = SamplingParams() if i % 2 else SamplingParams(temperature=0.7, top_p=0.9)
            response = decoder.generate_plain(prompt[None], 12, sampling=sampling, seed=i).tokens[0]
            other = i >= per_domain
            rows.append({
                "id": f"{domain}-{i:03d}", "timestamp": f"2025-11-{1 + i % 9:02d}T10:00:00Z",
                "domain": domain, "prompt": "tokens " + " ".join(map(str, prompt.tolist())),
                "response": "tokens " + " ".join(map(str, response.tolist())),
                "temperature": sampling.temperature, "top_p": sampling.top_p, "model": "tiny",
                "target_fingerprint": "sha256:" + "0" * 32 if other else fid,
                "prompt_token_ids": prompt.tolist(), "response_token_ids": response.tolist()})
    return rows


def traffic(url) -> dict[str, dict]:
    """The stored traffic_requests rows by id."""
    from sqlalchemy import create_engine, select

    from tasks.db.models import TrafficRequest

    engine = create_engine(url)
    with engine.connect() as connection:
        rows = {row.id: dict(row._mapping) for row in connection.execute(select(TrafficRequest.__table__))}
    engine.dispose()
    return rows
