"""One promotion gate's outcome as a typed record (Gate), for the gates (tasks.registry.promotion,
run_view.engine_gate) and their readers (the version page, the audit rows, the CLI, the pipeline).

Its JSON (Gate.to_json: {name, passed, figure} and `result` where the gate set one) is what the
promotions table's gates, the results of register_config and promote (Airflow's XCom) and the CLI
carry; Gate.from_json reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gate:
    """name: the gate (validation, live_check, ...); passed: whether it lets the version be
    promoted; figure: what it measured, in words; result: where a gate can be unsure, not
    enforced, not checked or not run, that word (None: pass or fail by `passed`)."""

    name: str
    passed: bool
    figure: str
    result: str | None = None

    @property
    def outcome(self) -> str:
        """pass | fail | unsure (passes, but its evidence is noise: the figure says why) | not
        enforced (reported, never failing: the setting that enforces it is off) | not checked (never
        failing: the check could not run, e.g. no serving engine; the figure says why) | not run
        (never failing: it had nothing to check, e.g. no domain on or no champion; the figure says
        why)."""
        return self.result or ("pass" if self.passed else "fail")

    def to_json(self) -> dict:
        """{name, passed, result?, figure}: the stored and returned shape of a gate."""
        out = {"name": self.name, "passed": self.passed}
        if self.result is not None:
            out["result"] = self.result
        return {**out, "figure": self.figure}

    @classmethod
    def from_json(cls, data: dict) -> Gate:
        """A gate read back from its JSON (to_json)."""
        return cls(name=data["name"], passed=bool(data["passed"]), figure=data["figure"],
                   result=data.get("result"))


def gates_json(gates: list[Gate]) -> list[dict]:
    """The gates as JSON (Gate.to_json), in order."""
    return [gate.to_json() for gate in gates]


def gates_of(rows: list[dict]) -> list[Gate]:
    """The gates of their JSON (a result of register_config or promote, an audit row's gates)."""
    return [Gate.from_json(row) for row in rows]
