"""An EAGLE-3 head for the embedded default, served by vLLM: its accepted lengths against our
estimate on the same held-out requests, and vLLM's tokens/s with the head against plain.

    python benchmarks/eagle3_vllm.py HEAD_DIR [--domains json,code] [--requests 12] [--k 3]
                                     [--extra-heldout FILE|none]
                                     [--out benchmarks/results/eagle3_vllm.md]

HEAD_DIR: a checkpoint in the speculators format (benchmarks/eagle3_train.py --save writes one, the
GPU run's heads are in it). The requests are held-out rows, never trained on: per domain the
shipped traffic's held-out rows of eagle3_train.py's split, then the extra held-out file's
(benchmarks/eagle3_heldout.py; default: the shipped one), the first --requests of them. It runs the
product's engine check (tasks.steps.checks.engine_check) on a run whose domains are set on with the head
at K, so the figures are the ones the pipeline gates on: vLLM's own per-request counts, E = 1 +
accepted / drafting steps on both sides, greedy requests compared request by request, and the
tokens/s of one engine with the head and one without, requests one at a time, on this CPU. Needs
the serving environment (`make serving-env`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import eagle3_gpu  # noqa: E402
from eagle3_train import shipped_requests  # noqa: E402
from vs_vllm import report  # noqa: E402
from specdec_core import load_model  # noqa: E402
from specdec_core.validation import fingerprint_id, target_fingerprint  # noqa: E402
from tasks.db import upgrade  # noqa: E402
from tasks.db.engine import ensure_ready  # noqa: E402
from tasks.db.models import DomainConfig, EvalRun  # noqa: E402
from tasks.db.store import Store  # noqa: E402
from tasks.settings import load_settings  # noqa: E402
from tasks.steps.drafters.candidates import build_drafters, candidate_label, parse_candidate  # noqa: E402
from specdec_core.estimate import in_heldout  # noqa: E402
from tasks.steps.estimate.acceptance import mean_accepted_length  # noqa: E402
from tasks.steps.checks.engine_check import engine_check  # noqa: E402
from tasks.steps.checks.engine_compare import inside_output  # noqa: E402
from tasks.timeutil import utcnow  # noqa: E402

TARGET = "smollm2-135m-instruct"


def split_e(rows: list[dict], greedy: bool) -> str:
    """E = 1 + accepted / drafting steps on the greedy (or the sampled) requests, vLLM (the drafts
    inside its output, as the engine check counts them) / estimate."""
    rows = [r for r in rows if r["greedy"] == greedy and r["estimate_steps"] is not None]
    engine = mean_accepted_length(sum(inside_output(r, "engine_accepted") for r in rows), sum(r["engine_steps"] for r in rows))
    estimate = mean_accepted_length(sum(r["estimate_accepted"] for r in rows), sum(r["estimate_steps"] for r in rows))
    if engine is None or estimate is None:
        return "-"
    return f"{engine:.2f} / {estimate:.2f} ({len(rows)})"


def own_count_e(rows: list[dict]) -> str:
    """E on vLLM's own count (its counters' definition): drafts its last steps accepted past
    max_tokens included."""
    e = mean_accepted_length(sum(r["engine_accepted"] for r in rows), sum(r["engine_steps"] for r in rows))
    return "-" if e is None else f"{e:.3f}"


def heldout_by_domain(domains: list[str], extra_path) -> tuple[dict[str, list], set[str]]:
    """Per domain its held-out requests: the shipped traffic's held-out rows (eagle3_train.py's
    split), then the extra held-out file's rows of that domain ("none": no file), each in the
    order it is stored; and the ids of the extra file's requests. A domain with no held-out
    request is an error naming the domains there are."""
    extra = [eagle3_gpu.logged(row) for row in eagle3_gpu.extra_heldout_rows(extra_path)]
    heldout = [r for r in shipped_requests() if in_heldout("eagle3-bench", r.request_id, 0.2)] + extra
    by_domain = {d: [r for r in heldout if r.domain == d] for d in domains}
    empty = [d for d, requests in by_domain.items() if not requests]
    if empty:
        known = sorted({r.domain for r in heldout})
        raise SystemExit(f"--domains {','.join(empty)}: no held-out request; the domains are "
                         f"{', '.join(known)}")
    return by_domain, {r.request_id for r in extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("head_dir")
    parser.add_argument("--domains", default="json,code")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--extra-heldout", default=None,
                        help="more held-out rows (benchmarks/eagle3_heldout.py's file), served after "
                             "the shipped held-out ones where --requests asks for more; default: the "
                             "shipped file when it is there, none for no file")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.extra_heldout = args.extra_heldout or eagle3_gpu.default_extra_heldout()
    domains = args.domains.split(",")
    by_domain, extra_ids = heldout_by_domain(domains, args.extra_heldout)
    served = {d: [r.request_id in extra_ids for r in by_domain[d][:args.requests]] for d in domains}
    model, tokenizer = load_model(TARGET, device="cpu")
    candidate = f"eagle3:model={Path(args.head_dir).resolve()}"
    spec = parse_candidate(candidate)
    drafters = {d: build_drafters([candidate], model, tokenizer, None) for d in domains}
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'specdec.db'}"
        upgrade(url)
        now = utcnow()
        with ensure_ready(url).begin() as connection:
            connection.execute(EvalRun.__table__.insert().values(
                run_id="eagle3-vllm", created_at=now, updated_at=now, status="evaluated",
                target_id=TARGET, target_fingerprint=fingerprint_id(target_fingerprint(model)),
                hardware_profile="cpu"))
            for domain in domains:
                connection.execute(DomainConfig.__table__.insert().values(
                    run_id="eagle3-vllm", domain=domain, enabled=True, drafter=candidate_label(spec),
                    k=args.k, status="ok", drafter_spec=spec, mean_accepted_length=1.0,
                    samples=len(by_domain[domain]), reason="set on for this benchmark", created_at=now))
        result = engine_check("eagle3-vllm", TARGET, model, drafters, by_domain, Store.open(url),
                              settings=load_settings(engine_check_requests=args.requests,
                                                     live_max_new_tokens=args.max_new_tokens,
                                                     engine_check_tolerance=1.0))
    if result.get("skipped"):
        sys.exit(result["skipped"])
    lines = [f"# EAGLE-3 head on vLLM's CPU build: {TARGET}, K = {args.k}", "",
             f"`python benchmarks/eagle3_vllm.py {args.head_dir} --domains {args.domains} "
             f"--requests {args.requests} --k {args.k}"
             + ("" if args.extra_heldout == eagle3_gpu.default_extra_heldout()
                else f" --extra-heldout {args.extra_heldout}") + "`", "",
             "Requests a domain: its shipped held-out rows first, then the extra held-out file's; "
             "served here (shipped + extra): " + ", ".join(
                 f"{d} {len(served[d]) - sum(served[d])} + {sum(served[d])}" for d in domains) + ".", "",
             "E vLLM: the drafts accepted inside its outputs, as the engine check counts them; "
             "on vLLM's own count (its counters') beside it, which adds those its last steps "
             "accepted past max_tokens.", "",
             "| domain | requests | greedy equal / checked | E vLLM | E vLLM, own count | E estimate (95% CI) | vLLM / estimate | "
             "E greedy rows vLLM / est. | E sampled rows vLLM / est. | "
             "per-position vLLM | per-position estimate | plain tok/s | head tok/s | head / plain | "
             "sampling test on vLLM |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for domain, row in result["domains"].items():
        ci = (row.get("estimate_e_lo"), row.get("estimate_e_hi"))
        ratio = (row["engine_e"] / row["estimate_e"]) if row.get("engine_e") and row.get("estimate_e") else None
        plain, spec_tps = row.get("plain_tokens_per_s"), row.get("spec_tokens_per_s")
        lines.append(
            f"| {domain} | {len(row.get('per_request') or [])} | {row.get('greedy_equal')} / "
            f"{row.get('greedy_checked')} | {row.get('engine_e') or 0:.3f} | "
            f"{own_count_e(row.get('per_request') or [])} | {row.get('estimate_e') or 0:.3f} "
            f"({(ci[0] or 0):.3f}-{(ci[1] or 0):.3f}) | {ratio or 0:.3f} | "
            + " | ".join(split_e(row.get("per_request") or [], greedy) for greedy in (True, False)) + " | "
            + ", ".join(f"{x:.2f}" for x in row.get("engine_rates") or []) + " | "
            + ", ".join(f"{x:.2f}" for x in row.get("estimate_rates") or [])
            + f" | {plain or 0:.1f} | {spec_tps or 0:.1f} | "
            + (f"{spec_tps / plain:.2f}" if plain and spec_tps else "-") + " | "
            + sampling_cell(result["sampling"].get(domain)) + " |")
        if row.get("status") != "ok":
            lines.append(f"|  | status {row.get('status')}: {row.get('reason')} |")
    report(lines, args.out)


def sampling_cell(test: dict | None) -> str:
    """The engine check's sampling test on vLLM's OpenAI server for one domain (the config served
    with the plain server as control; EngineSamplingResult.to_dict()), as a table cell."""
    if not test:
        return "not run (the replay failed, or engine sampling is off)"
    shared = f" (the test of {test['shared_from']}, shared)" if test.get("shared_from") else ""
    if not test.get("passed"):
        return f"{str(test.get('status') or 'failed').upper()}: {test.get('reason')}{shared}"
    return (f"passed: {test.get('positions')} G-tests of {test.get('rows')} rows, smallest p "
            f"{test.get('min_p') or 0:.3g}{shared}")


if __name__ == "__main__":
    main()
