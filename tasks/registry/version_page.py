"""The registered version's page in MLflow: what a reviewer decides from.

A config version's description is Markdown in sections, its first line "Promote only with
`specdec config promote N`": warnings (a champion moved outside specdec, a noisy profile, domains
vetoed or on although their live check fell short, the low-acceptance alert), the per-domain table
(on or off and why, E with the proposal rate, predicted with its interval, the live check,
validation and whose test it is), what changed against the champion, the gates (a preview at
registration, the real result once `specdec config promote` ran them), and one "Current champion"
line that is written again on every version with an alias, and on the one that lost it, whenever
specdec moves the champion. Its tables are HTML with padding (html_table): MLflow draws Markdown
tables without it, and adjacent cells ran together.

It also tells a champion that passed specdec's gates from one moved by hand (MLflow's "Promote"
button or alias pencil): the latest champion move in specdec's `promotions` table must be a
`promote` or `rollback` of exactly that version.
"""

from __future__ import annotations

import logging
import re
from html import escape, unescape

from sqlalchemy import select

from ..db.engine import ensure_ready
from ..db.models import Promotion
from ..masking import mask_text, mask_url
from ..timeutil import utcnow

log = logging.getLogger(__name__)

CHAMPION_LINE = "**Current champion:**"
GATES_HEADING = "### Gates"
PRODUCTION_HEADING = "### Production"


def html_table(headers: list[str], rows: list[list[str]]) -> str:
    """A table MLflow's page renders legibly: HTML (the description is Markdown, whose tables MLflow
    draws without cell padding, so adjacent cells run together) with borders and padding. Cells
    are HTML already (`cell()` escapes text); one line per row, no blank line (Markdown would end
    the HTML block there)."""
    head = "".join(f'<th style="text-align: left">{escape(h)}</th>' for h in headers)
    body = "\n".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return (f'<table border="1" cellpadding="6" style="border-collapse: collapse">\n<tr>{head}</tr>\n'
            f"{body}\n</table>")


def cell(text, bold: bool = False) -> str:
    """One table cell's text, escaped for HTML (bold when asked)."""
    text = escape("-" if text is None else str(text))
    return f"<b>{text}</b>" if bold else text


def description_text(description: str) -> str:
    """The page for a terminal (`specdec config show`): each HTML table row as `| cell | cell |`,
    tags dropped and entities decoded; the Markdown around the tables as it is."""
    def row(match: re.Match) -> str:
        cells = re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", match.group(1), re.DOTALL)
        return "| " + " | ".join(unescape(re.sub(r"<[^>]+>", "", c)) for c in cells) + " |"

    text = re.sub(r"<tr>(.*?)</tr>", row, description or "", flags=re.DOTALL)
    return re.sub(r"</?table[^>]*>\n?", "", text)


GATE_RESULTS = {"pass": "pass", "fail": "FAIL", "unsure": "UNSURE", "not enforced": "not enforced"}


def gate_result(gate: dict) -> str:
    """pass | fail | unsure (passes, but its evidence is noise: the figure says why) | not enforced
    (reported, never failing: the setting that enforces it is off)."""
    return gate.get("result") or ("pass" if gate["passed"] else "fail")


def gates_markdown(gates: list[dict], title: str) -> str:
    rows = [[cell(g["name"]), cell(GATE_RESULTS[gate_result(g)], bold=gate_result(g) != "pass"),
             cell(g["figure"])] for g in gates]
    return f"{GATES_HEADING} ({title})\n\n" + html_table(["gate", "result", "figure"], rows)


def gate_counts(gates: list[dict]) -> str:
    """The gates counted by result, naming those that did not pass: `5 passed, 1 unsure
    (live_check)`."""
    order = ("pass", "fail", "unsure", "not enforced")
    words = {"pass": "passed", "fail": "FAILED", "unsure": "unsure", "not enforced": "not enforced"}
    parts = []
    for result in order:
        names = [g["name"] for g in gates if gate_result(g) == result]
        if names:
            parts.append(f"{len(names)} {words[result]}" + ("" if result == "pass" else f" ({', '.join(names)})"))
    return ", ".join(parts) or "no gates"


def gates_summary(gates: list[dict]) -> str:
    """The gates in one line: `validation pass, live_check UNSURE, ...`."""
    return ", ".join(f"{g['name']} {GATE_RESULTS[gate_result(g)]}" for g in gates)


def version_url(tracking_uri: str, name: str, version: str) -> str:
    """Where the version's page is: the tracking server's URL of it, or (a local store, opened
    with `mlflow ui`) the page's path under the UI's address."""
    path = f"#/models/{name}/versions/{version}"
    if tracking_uri.startswith(("http://", "https://")):
        return mask_url(tracking_uri.rstrip("/")) + "/" + path
    return f"{path} of the MLflow UI on {mask_url(tracking_uri)}"


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


def production_markdown(rows: list[dict], events: list[dict], title: str, plot: str | None) -> str:
    """The version page's Production section (tasks.steps.monitor.publish): per deployment and
    domain, promised E with its interval, scraped E (the deployment's) and per-request E (the
    domain's), and the monitor's alerts and rollbacks."""
    def e(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    table = html_table(["deployment", "domain", "promised E [95%]", "break-even", "drafts",
                        "scraped E", "per-request E"],
                       [[cell(r["deployment"]), cell(r["domain"]),
                         cell(f"{e(r['promise_e'])} [{e(r['promise_lo'])}, {e(r['promise_hi'])}]"),
                         cell(e(r["break_even"])), cell(r["drafts"]), cell(e(r["scraped_e"])),
                         cell(e(r["request_e"]))] for r in rows])
    lines = [f"{PRODUCTION_HEADING}", "", title, "", table, ""]
    lines += [f"- **{ev['kind']}** {ev['at']:%Y-%m-%d %H:%M} UTC: {escape(ev['reason'] or '')}"
              for ev in events]
    if plot:
        lines += ["", f"Production E over time: the run's `{plot}` artifact."]
    return "\n".join(lines) + "\n"


def write_production(mlflow_client, name: str, version: str, body: str) -> None:
    """Replace the version page's Production section with `body`."""
    detail = mlflow_client.get_model_version(name, version)
    mlflow_client.update_model_version(name, version, description=replace_section(
        detail.description or "", PRODUCTION_HEADING, body))


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
