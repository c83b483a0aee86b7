"""A larger held-out set for the EAGLE-3 heads: new prompts of every domain, answered by the target
at their logged sampling settings, that no head trains on and nothing chooses a head on.

    python benchmarks/eagle3_heldout.py [--per-domain 100] [--seed 5100]
                                        [--out benchmarks/data/eagle3_heldout.jsonl.gz]
    python benchmarks/eagle3_heldout.py --smoke --out DIR/heldout.jsonl.gz   # tiny random Llama

Why: the shipped traffic's held-out split (in_heldout("eagle3-bench", id, 0.2)) holds about 20
requests a domain, and a head's first-draft acceptance over 20 requests has a 95% interval of
+-0.02-0.05 -- as wide as the distance between the second H100 lease's chat head and its goal
(0.431 against 0.45). Scoring a head on more rows costs a GPU lease time it needs for training;
scoring it here, on the CPU, after the checkpoint comes back costs nothing of the lease.

The prompts come from scripts/make_sample_traffic.py's builders (another seed than the GPU run's
generated training prompts, reworded where a pool runs dry), none equal to a shipped prompt,
`--per-domain` a domain. The target answers them with SpecDecoder.generate_plain, fp32, as the
shipped traffic's responses were made. benchmarks/eagle3_gpu.py leaves these prompts out of the
prompts it generates to train on (--extra-heldout); benchmarks/eagle3_train.py scores its head on
them beside the shipped held-out rows (eagle3_gpu.extra_heldout_rows reads them). Rows keep the
shipped file's fields (id, domain, messages, sampling settings, max_tokens, prompt and response
token ids); a sidecar DIR/NAME.meta.json says how they were made.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eagle3_gpu as gpu  # noqa: E402

SEED = 5100            # the GPU run's generated prompts use --seed 51
REQUEST_FIELDS = [f for f in gpu.HELDOUT_FIELDS if not f.endswith("_token_ids")]


def balanced_requests(per_domain: int, taken: list[dict], encode, seed: int, max_new: int) -> list[dict]:
    """`per_domain` new requests of each domain (make_sample_traffic's builders, seed `seed`,
    reworded where a pool runs dry), none with the messages or prompt ids of a `taken` row."""
    domains = 6
    made = gpu.new_requests(per_domain * domains * 3, taken, encode, seed, max_new)
    kept, counts = [], Counter()
    for request in made:
        if counts[request["domain"]] < per_domain:
            counts[request["domain"]] += 1
            kept.append({**request, "id": request["id"].replace(f"gen{seed}-", f"heldout{seed}-")})
    if len(counts) < domains or min(counts.values()) < per_domain:
        raise ValueError(f"the builders gave too few new prompts for {per_domain} a domain ({dict(counts)}): "
                         "ask for fewer with --per-domain")
    return kept


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=gpu.EXTRA_HELDOUT)
    parser.add_argument("--per-domain", type=int, default=None, help="default 100 (smoke: 2)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--generate-seconds", type=float, default=3600.0,
                        help="a run stopped by it writes what it has (the mix kept)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama, 2 rows a domain")
    args = parser.parse_args(argv)
    args.per_domain = args.per_domain or (2 if args.smoke else 100)
    if args.smoke:
        args.max_new_tokens = min(args.max_new_tokens, 8)
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    args.device = torch.device(args.device)
    # what eagle3_gpu's loader and generator read
    gen_args = argparse.Namespace(smoke=args.smoke, seed=args.seed, device=args.device, gguf=None,
                                  dtype="float32", static_cache="auto", compile=False,
                                  batch_size=args.batch_size)
    started = time.perf_counter()
    target, _, encode, eos = gpu.load_target(gen_args)
    shipped = gpu.shipped_rows()
    requests = balanced_requests(args.per_domain, shipped, encode, args.seed, args.max_new_tokens)
    gpu.say(f"{len(requests)} new prompts, {args.per_domain} a domain; generating on {args.device}")
    by_id = {r["id"]: r for r in requests}
    answered = gpu.generate(target, requests, eos, gen_args, time.perf_counter() + args.generate_seconds)
    rows = [{**{f: by_id[a.request_id][f] for f in REQUEST_FIELDS},
             "prompt_token_ids": list(a.prompt_ids), "response_token_ids": list(a.response_ids)}
            for a in answered]
    rows.sort(key=lambda r: r["id"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out, "wt", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    counts = Counter(row["domain"] for row in rows)
    meta = {"command": " ".join(["python benchmarks/eagle3_heldout.py", *(sys.argv[1:] if argv is None else argv)]),
            "target": "tiny random Llama (smoke)" if args.smoke else gpu.VERIFIER, "dtype": "float32",
            "device": str(args.device), "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "seed": args.seed, "asked_per_domain": args.per_domain,
            "rows_by_domain": dict(sorted(counts.items())),
            "left_out": len(requests) - len(rows),    # under 2 response tokens, or past the budget
            "seconds": round(time.perf_counter() - started, 1)}
    args.out.with_name(args.out.name.split(".")[0] + ".meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    gpu.say(f"wrote {len(rows)} rows to {args.out} ({meta['rows_by_domain']}), {meta['seconds']} s")
    return rows


if __name__ == "__main__":
    main()
