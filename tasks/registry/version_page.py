"""The registered version's page in MLflow: what a reviewer decides from.

A config version's description is Markdown in sections: the per-domain table (on or off and why,
predicted with its interval, measured, validation), what changed against the champion, the gates
(a preview at registration, the real result once `specdec config promote` ran them), and one
"Current champion" line that is written again on every version with an alias, and on the one that
lost it, whenever specdec moves the champion.

It also tells a champion that passed specdec's gates from one moved by hand (MLflow's "Promote"
button or alias pencil): the latest champion move in specdec's `promotions` table must be a
`promote` or `rollback` of exactly that version.
"""

from __future__ import annotations

import logging
import re

from sqlalchemy import select

from ..db.engine import ensure_ready
from ..db.models import Promotion
from ..masking import mask_text
from ..timeutil import utcnow

log = logging.getLogger(__name__)

CHAMPION_LINE = "**Current champion:**"
GATES_HEADING = "### Gates"


def gates_markdown(gates: list[dict], title: str) -> str:
    lines = [f"{GATES_HEADING} ({title})", "", "| gate | result | figure |", "|---|---|---|"]
    lines += [f"| {g['name']} | {'pass' if g['passed'] else '**FAIL**'} | {g['figure'].replace('|', '/')} |"
              for g in gates]
    return "\n".join(lines)


def champion_line(version: str | None, how: str) -> str:
    now = utcnow().strftime("%Y-%m-%d %H:%M UTC")
    if version is None:
        return f"{CHAMPION_LINE} none yet ({now})."
    return f"{CHAMPION_LINE} version {version} ({how}, {now})."


def replace_section(description: str, heading: str, body: str) -> str:
    """description with the section that starts with `heading` (up to the next '### ' heading or
    the champion line) replaced by `body`, or `body` added before the champion line."""
    text = description or ""
    pattern = re.compile(rf"^{re.escape(heading)}.*?(?=^### |^{re.escape(CHAMPION_LINE)}|\Z)",
                         re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        return pattern.sub(lambda _: body.rstrip() + "\n\n", text, count=1)
    head, sep, tail = text.partition(CHAMPION_LINE)
    return head.rstrip() + "\n\n" + body.rstrip() + "\n\n" + (sep + tail if sep else "")


def with_champion_line(description: str, line: str) -> str:
    kept = [row for row in (description or "").rstrip().splitlines() if not row.startswith(CHAMPION_LINE)]
    return "\n".join(kept).rstrip() + "\n\n" + line + "\n"


def write_gates(mlflow_client, name: str, version: str, gates: list[dict], title: str) -> None:
    detail = mlflow_client.get_model_version(name, version)
    mlflow_client.update_model_version(name, version, description=replace_section(
        detail.description or "", GATES_HEADING, gates_markdown(gates, title)))


def refresh_champion_lines(mlflow_client, name: str, champion: str | None, how: str,
                           also: tuple[str | None, ...] = ()) -> None:
    """Write the current champion line on every version that carries an alias, and on `also`
    (e.g. the version that just lost the champion). Best effort: a failure is logged."""
    try:
        model = mlflow_client.get_registered_model(name)
        versions = {str(v) for v in (model.aliases or {}).values()} | {str(v) for v in also if v}
        line = champion_line(champion, how)
        for version in sorted(versions, key=int):
            detail = mlflow_client.get_model_version(name, version)
            mlflow_client.update_model_version(name, version, description=with_champion_line(
                detail.description or "", line))
    except Exception as exc:     # the page is documentation; the alias move already happened
        log.warning("%s: champion line not refreshed (%s)", name, mask_text(str(exc)))


def champion_audit(db_url: str, name: str, champion: str | None) -> dict:
    """{"champion", "gated", "detail"}: whether the champion alias was last moved by specdec onto
    this version (a promote or rollback row), i.e. through the gates or a recorded rollback."""
    if champion is None:
        return {"champion": None, "gated": True, "detail": "no champion"}
    engine = ensure_ready(db_url)
    with engine.connect() as connection:
        last = connection.execute(
            select(Promotion.config_version, Promotion.action, Promotion.forced, Promotion.created_at)
            .where((Promotion.config_name == name) & (Promotion.alias == "champion")
                   & Promotion.action.in_(("promote", "rollback")))
            .order_by(Promotion.id.desc()).limit(1)).first()
    if last is not None and str(last.config_version) == str(champion):
        how = "forced past failed gates" if last.forced else (
            "passed the gates" if last.action == "promote" else "restored by rollback")
        return {"champion": champion, "gated": True,
                "detail": f"version {champion} {how} ({last.action}, {last.created_at:%Y-%m-%d %H:%M} UTC)"}
    seen = "no specdec promotion at all" if last is None else \
        f"specdec last moved it to version {last.config_version} ({last.action})"
    return {"champion": champion, "gated": False,
            "detail": f"champion version {champion} was moved outside specdec ({seen}): it never "
                      "passed the gates. Promote with `specdec config promote N` (gates + audit "
                      "row), or roll back"}
