"""Cost profiles moved between machines: `export_costs` / `import_costs` move a profile through a
JSON file (FILE_FORMAT), so costs measured on the serving GPU can plan for it from any machine.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...db.queries_costs import hardware_row
from ...db.store import Store
from ...timeutil import utcnow
from .cost_table import CostProfileError, CostTable, load_costs
from .costs import store_costs


FILE_FORMAT = "specdec-cost-profile/1"


def export_costs(hardware_profile: str, path: str | Path, store: Store,
                 run_id: str | None = None) -> dict:
    """Write the profile (newest run unless run_id) to a JSON file; returns what was written."""
    table = load_costs(hardware_profile, store, run_id)
    hardware = hardware_row(store, hardware_profile)
    document = {"format": FILE_FORMAT, "run_id": table.run_id,
                "hardware_profile": {"name": hardware_profile,
                                     "device": hardware["device"] if hardware else "unknown",
                                     "dtype": hardware["dtype"] if hardware else "unknown",
                                     "details": hardware["details"] if hardware else None},
                "exported_at": utcnow().isoformat(), "costs": table.rows(), "check": table.check}
    Path(path).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return document


def import_costs(path: str | Path, store: Store, name: str | None = None) -> dict:
    """Store a profile exported by export_costs (optionally under another name); idempotent."""
    try:
        document = json.loads(Path(path).read_text("utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CostProfileError(f"cost profile file {path}: cannot read JSON ({exc})") from exc
    if not isinstance(document, dict) or document.get("format") != FILE_FORMAT:
        raise CostProfileError(f"cost profile file {path}: not a {FILE_FORMAT} document (make it with "
                               "`specdec profile export`)")
    try:
        hardware = dict(document["hardware_profile"])
        if name:
            hardware["name"] = name
        table = CostTable.from_rows(hardware["name"], document["run_id"], document["costs"])
        check = document.get("check")
        if check is not None:
            if not isinstance(check, dict) or check.get("status") not in ("ok", "noisy", "unchecked"):
                raise ValueError(f"check must be an object with status ok, noisy or unchecked, got "
                                 f"{check!r}")
            table.check = dict(check)
    except (CostProfileError, KeyError, TypeError, ValueError) as exc:
        raise CostProfileError(f"cost profile file {path}: malformed ({type(exc).__name__}: {exc}); "
                               "make it with `specdec profile export`") from exc
    if not table.target_step or any(b not in table.verify for b in table.target_step):
        raise CostProfileError(f"cost profile file {path}: every batch size needs a target step and "
                               "verify costs")
    gaps = {b: sorted(v) for b, v in table.verify.items() if sorted(v) != list(range(1, max(v) + 1))}
    if gaps:
        raise CostProfileError(f"cost profile file {path}: verify costs must cover K = 1..k_max at "
                               f"every batch size; got {gaps}")
    store_costs(store, table.run_id, hardware, table)
    return {"hardware_profile": hardware, "run_id": table.run_id, "rows": len(table.rows())}
