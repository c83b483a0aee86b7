"""The serving-environment probe's answer to a replay (tasks/serving/scripts/vllm_probe.py replay,
run by tasks.serving.environment.run_engine) as typed records on the main environment's side:
each replayed request as vLLM served it (ServedRequest), and one engine's answer summed over its
starts (ReplayAnswer). The probe prints JSON with string keys; it is read once, by from_probe,
where the engine check receives it (tasks.steps.checks.engine_replay.serve_replay), and the
probe's output format is left as it is."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from .scripts.vllm_probe import PLAIN     # the id prefix of a request's K 0 twin


@dataclass(frozen=True, kw_only=True)
class ServedRequest:
    """One replayed request as vLLM served it (the probe's _served_one): its tokens, wall and
    decode-phase seconds (vLLM's own timestamps), drafted and accepted tokens per verify step
    (None without vLLM's per-request metrics), the CPU other processes and the engine took
    meanwhile (cores), whether that made it contended, whether its step was slowed past its K's
    fastest, and how many times it was served (a contended K 0 twin is served again)."""

    token_ids: list[int]
    seconds: float | None = None
    decode_s: float | None = None
    drafted: list[int] | None = None
    accepted: list[int] | None = None
    other_cores: float | None = None
    own_cores: float | None = None
    contended: bool | None = None
    slowed: bool | None = None
    served: int | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_probe(cls, row: dict) -> ServedRequest:
        """The request from the probe's JSON (a key it lacks keeps its default)."""
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})


def _add_counters(total: dict | None, more: dict) -> dict:
    """vLLM's spec_decode counters of two engines summed (per position, the shorter padded)."""
    if total is None:
        return dict(more)
    width = max(len(total["accepted_per_pos"]), len(more["accepted_per_pos"]))

    def padded(values):
        return list(values) + [0] * (width - len(values))
    return {"drafts": total["drafts"] + more["drafts"],
            "draft_tokens": total["draft_tokens"] + more["draft_tokens"],
            "accepted_tokens": total["accepted_tokens"] + more["accepted_tokens"],
            "accepted_per_pos": [a + b for a, b in zip(padded(total["accepted_per_pos"]),
                                                       padded(more["accepted_per_pos"]))]}


@dataclass(frozen=True, kw_only=True)
class ReplayAnswer:
    """One engine's replay, over the engines started for it (a request that kills an engine is
    recorded and a fresh one serves the rest): vLLM's version, the first engine's start seconds
    and mends, the engines started (None: none was tried), the requests served by id (K 0
    twins under PLAIN + id), vLLM's counters summed, the requests engines died on ({request,
    error}), those left unserved, the pairs the budget left out, vLLM's refusal of the config,
    and why the replay failed as a whole ((status, reason): died, timeout, unresolved)."""

    vllm: str | None = None
    start_s: float | None = None
    mends: list[str] = field(default_factory=list)
    starts: int | None = None
    requests: dict[str, ServedRequest] = field(default_factory=dict)
    counters: dict | None = None
    died: list[dict] = field(default_factory=list)
    unserved: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    refused: str | None = None
    failed: tuple[str, str] | None = None

    @classmethod
    def from_probe(cls, answer: dict) -> ReplayAnswer:
        """One engine's answer from the probe's JSON (its died: one {request, error} or None)."""
        return cls(vllm=answer.get("vllm"), start_s=answer.get("start_s"), mends=answer.get("mends") or [],
                   requests={key: ServedRequest.from_probe(row) for key, row in (answer.get("requests") or {}).items()},
                   counters=answer.get("counters"), died=[answer["died"]] if answer.get("died") else [],
                   left_out=list(answer.get("left_out") or []), refused=answer.get("refused"))

    def then(self, answer: ReplayAnswer) -> ReplayAnswer:
        """This replay followed by the next engine's `answer`: its start counted, its requests,
        pairs left out, counters and death added (vLLM's version, start and mends: the first
        engine's)."""
        first = not self.starts
        return replace(self, starts=(self.starts or 0) + 1, requests={**self.requests, **answer.requests},
                       vllm=answer.vllm if first else self.vllm, start_s=answer.start_s if first else self.start_s,
                       mends=answer.mends if first else self.mends, left_out=self.left_out + answer.left_out,
                       counters=_add_counters(self.counters, answer.counters) if answer.counters else self.counters,
                       died=self.died + answer.died)

    def without_plain(self) -> tuple[ReplayAnswer, dict[str, ServedRequest]]:
        """The answer without its K 0 twins, and the twins by their request's id."""
        plain = {key[len(PLAIN):]: row for key, row in self.requests.items() if key.startswith(PLAIN)}
        return replace(self, requests={key: row for key, row in self.requests.items()
                                       if not key.startswith(PLAIN)}), plain
