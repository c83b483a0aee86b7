"""The serving-environment probe's answer to time-paired (tasks/serving/scripts/vllm_probe.py
time_paired, run by tasks.serving.environment.run_engine) as typed records on the main
environment's side: each timed batch (PairedTiming) and one engine's answer (PairedAnswer). The
probe prints JSON and is left as it is; the answer is read once, by from_json, where the vLLM cost
profile receives it (tasks.steps.costs.engine_costs._time_engines). to_json gives the probe's
JSON back key for key, in its order: what the profile's check stores as each engine's timings,
and what the probe's own pairing functions (clean_pairs, pooled_spread: they read dicts, in the
serving environment too) are handed."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True, kw_only=True)
class PairedTiming:
    """One timed batch (the probe's _batch_row, with its pair): its batch size, sampling and K,
    the round (repeat) it was timed in, its wall and decode-phase seconds (None without vLLM's
    timestamps), the most decode steps of any of its requests, its tokens, the CPU other
    processes took meanwhile (cores) and whether that made it contended, its decode tokens,
    drafted and accepted tokens, and the pair it was timed in (None: an earlier probe's row,
    paired by repeat; to_json then has no "pair", as the row had none). Fields in the order of
    the probe's keys; those the profile reads are required, as they were as dict keys."""

    batch_size: int
    sampling: str
    k: int
    repeat: int
    wall_s: float | None = None
    decode_s: float | None
    steps: int
    tokens: int | None = None
    other_cores: float | None = None
    contended: bool
    decode_tokens: int | None = None
    drafted: int
    accepted: int | None = None
    pair: int | None = None

    @property
    def pair_key(self) -> int:
        """The pair it was timed in (the probe's _pair_key: its repeat without one)."""
        return self.repeat if self.pair is None else self.pair

    @property
    def step_s(self) -> float:
        """Seconds per decode step."""
        return self.decode_s / self.steps

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.pair is None:       # an earlier probe's row: paired by repeat, as it was
            del out["pair"]
        return out

    @classmethod
    def from_json(cls, row: dict) -> PairedTiming:
        """The batch from the probe's JSON (a key it lacks keeps its default)."""
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})


@dataclass(frozen=True, kw_only=True)
class PairedAnswer:
    """One engine's time-paired answer: vLLM's version, the engine's start in seconds, vLLM's
    refusal of the config (None: started), the CPU sampler mends made, its timed batches, whether
    the engine serves each request the K it asks (the specdec plugin), why the rounds stopped
    (budget, max_repeats, settled, settled_contended) and the seconds they took. Fields in the
    order of the probe's keys."""

    vllm: str | None = None
    start_s: float | None = None
    refused: str | None = None
    mends: list[str] = field(default_factory=list)
    timings: list[PairedTiming] = field(default_factory=list)
    k_per_request: bool | None = None
    stopped: str | None = None
    seconds: float | None = None

    @property
    def repeats(self) -> int:
        """The rounds timed."""
        return 1 + max((t.repeat for t in self.timings), default=-1)

    @property
    def contended_pairs(self) -> int:
        """The pairs with a batch timed while other processes took CPU."""
        return len({t.pair_key for t in self.timings if t.contended})

    def groups(self) -> dict[tuple[int, str], list[int]]:
        """{(batch size, sampling): the Ks timed}, in the order first timed."""
        out: dict = {}
        for t in self.timings:
            out.setdefault((t.batch_size, t.sampling), set()).add(t.k)
        return {group: sorted(ks) for group, ks in out.items()}

    def timings_json(self) -> list[dict]:
        """The timed batches as the probe wrote them (what the profile stores, and what the
        probe's functions read)."""
        return [t.to_json() for t in self.timings]

    def to_json(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "timings": self.timings_json()}

    @classmethod
    def from_json(cls, answer: dict) -> PairedAnswer:
        """The answer from the probe's JSON (a key it lacks keeps its default)."""
        known = {f.name: answer[f.name] for f in fields(cls) if f.name in answer}
        timings = [PairedTiming.from_json(row) for row in answer.get("timings") or []]
        return cls(**{**known, "timings": timings})
