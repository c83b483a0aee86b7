"""The registered version's page in MLflow: what a reviewer decides from.

A config version's description is Markdown in sections, its first line "Promote only with
`specdec config promote N`": warnings (a champion moved outside specdec, a noisy profile, domains
vetoed or on although their live check fell short, the low-acceptance alert), the per-domain table
(on or off and why, E with the proposal rate, predicted with its interval, the live check,
validation and whose test it is), what changed against the champion, the gates (a preview at
registration, the real result once `specdec config promote` ran them), and one "Current champion"
line that is written again on every version with an alias, and on the one that lost it, whenever
specdec moves the champion. Its tables are Markdown (tasks.registry.run_view renders them, the
same for the page, `reports/domains.md` and the terminal). The first line says how to promote
the version; once it is the champion, it says so instead (status_line).

It also tells a champion that passed specdec's gates from one moved by hand (MLflow's "Promote"
button or alias pencil): the latest champion move in specdec's `promotions` table must be a
`promote` or `rollback` of exactly that version.
"""

from __future__ import annotations

import logging
import re
import shlex

from ..db.queries_promotions import last_champion_move
from ..db.store import Store
from ..masking import mask_text, mask_url
from ..timeutil import utcnow
from .gate import Gate
from .run_config import changes_markdown, turns_nothing_on, validation_text
from .load_results import load_markdown
from .run_view import (RunView, alert_markdown, below_bar_markdown, domains_markdown, engine_markdown,
                       engine_state, load_not_run, markdown_table)

log = logging.getLogger(__name__)

CHAMPION_LINE = "**Current champion:**"
GATES_HEADING = "### Gates"
PRODUCTION_HEADING = "### Production"


def description_text(description: str) -> str:
    """The page for a terminal (`specdec config show`): the Markdown as it is (its tables are
    Markdown, run_view.markdown_table), the escaped "|" inside cells written plainly."""
    return (description or "").replace("\\|", "/")


GATE_RESULTS = {"pass": "pass", "fail": "FAIL", "unsure": "UNSURE", "not enforced": "not enforced",
                "not checked": "NOT CHECKED", "not run": "not run"}


def gates_markdown(gates: list[Gate], title: str) -> str:
    rows = [[g.name, GATE_RESULTS[g.outcome] if g.outcome == "pass"
             else f"**{GATE_RESULTS[g.outcome]}**", g.figure] for g in gates]
    return f"{GATES_HEADING} ({title})\n\n" + markdown_table(["gate", "result", "figure"], rows)


def gate_counts(gates: list[Gate]) -> str:
    """The gates counted by result, naming those that did not pass: `5 passed, 1 unsure
    (live_check)`."""
    order = ("pass", "fail", "unsure", "not enforced", "not checked", "not run")
    words = {"pass": "passed", "fail": "FAILED", "unsure": "unsure", "not enforced": "not enforced",
             "not checked": "not checked", "not run": "not run"}
    parts = []
    for result in order:
        names = [g.name for g in gates if g.outcome == result]
        if names:
            parts.append(f"{len(names)} {words[result]}" + ("" if result == "pass" else f" ({', '.join(names)})"))
    return ", ".join(parts) or "no gates"


def gates_summary(gates: list[Gate]) -> str:
    """The gates in one line: `validation pass, live_check UNSURE, ...`."""
    return ", ".join(f"{g.name} {GATE_RESULTS[g.outcome]}" for g in gates)


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


def target_option(target: str | None) -> str:
    """` --target ID` (shell-quoted where it needs it), or "" without a target: the commands a
    page gives name its registered model, which `specdec config` finds by target (without
    --target it takes the settings' default target's model, another model's version N)."""
    return "" if not target else f" --target {shlex.quote(target)}"


def page_target(description: str) -> str | None:
    """The target id a version page names ("target `ID` (fingerprint)", version_page_markdown)."""
    found = re.search(r"^target `([^`]+)` \(", description or "", re.MULTILINE)
    return found.group(1) if found else None


def status_line(version: str, champion: str | None, replaced: str | None = None,
                target: str | None = None) -> str:
    """The page's first paragraph: how to promote this version, or (it is the champion) that it
    is, and how to undo that: `specdec config rollback` restores `replaced`, the champion it
    replaced (per the promotions table); with none, there is nothing to roll back to. Plain text,
    no Markdown marks: MLflow's versions list previews a description's first characters raw.
    The commands carry --target (target_option)."""
    option = target_option(target)
    if champion is not None and str(champion) == str(version):
        undo = (f"specdec config rollback{option} restores version {replaced}, the champion it "
                "replaced (with an audit row)" if replaced else
                "It replaced no earlier champion: specdec config rollback has nothing to roll back "
                f"to (promote another version with specdec config promote N{option} instead)")
        return (f"This version ({version}) is the champion. {undo}; MLflow's alias pencil would "
                "move champion past the gates and the audit row.")
    return (f"Promote only with specdec config promote {version}{option} (it checks the gates "
            "below and writes the audit row); MLflow's alias pencil moves champion past both, and "
            "its \"Promote model\" button does not move champion at all (it copies the "
            "version into another registered model): do not use either. How: see Promoting "
            "this version below.")


PROMOTING_HEADING = "### Promoting this version"


def promoting_markdown(version: str, target: str | None) -> str:
    """The page's "Promoting this version" section: MLflow's UI has no action that promotes
    through specdec's gates (no button can be added to it), so the page says where the command
    runs and what each of MLflow's own controls would do instead."""
    option = target_option(target)
    return (f"{PROMOTING_HEADING}\n\n"
            "MLflow's UI has no action that promotes through specdec's gates; a reviewer promotes "
            "from a shell:\n\n"
            f"- `specdec config promote {version}{option}` checks the gates again against the "
            "champion of that moment, moves the `champion` alias (compare-and-set), writes the "
            "audit row and rewrites the first line of this page and the champion's;\n"
            "- it runs where specdec reaches this MLflow and specdec's database "
            "(`MLFLOW_TRACKING_URI`, `SPECDEC_DATABASE_URL`; the defaults are the local demo's "
            "files). In the Compose deployment: `docker compose exec airflow-scheduler specdec "
            f"config promote {version}{option}`;\n"
            "- `--expected-champion N` refuses the promotion if the champion is no longer N (the "
            "one whose gates you reviewed); `specdec config rollback` undoes a promotion;\n"
            "- MLflow's alias pencil moves `champion` past the gates and writes no audit row "
            "(specdec flags such a champion: `specdec config show champion`, the next "
            "registration's page, `specdec report ungated_champions`); its \"Promote model\" "
            "button copies the version into another registered model and moves nothing.")


STATUS_PREFIXES = ("Promote only with specdec config promote", "This version (",
                   "**Promote only with `specdec config promote", "**This version (")    # older pages


def with_champion_line(description: str, line: str, version: str | None = None,
                       champion: str | None = None, replaced: str | None = None) -> str:
    """description with `line` as its champion line and, given the page's version, its first
    paragraph (status_line) saying whether that version is the champion (and which one it
    replaced)."""
    kept = [row for row in (description or "").rstrip().splitlines() if not row.startswith(CHAMPION_LINE)]
    if version is not None and kept and kept[0].startswith(STATUS_PREFIXES):
        kept[0] = status_line(version, champion, replaced, page_target(description))
    return "\n".join(kept).rstrip() + "\n\n" + line + "\n"


def production_markdown(rows: list[dict], events: list[dict], title: str, plot: str | None) -> str:
    """The version page's Production section (tasks.steps.monitor.drift.publish): per deployment and
    domain, promised E with its interval, scraped E (the deployment's) and per-request E (the
    domain's), and the monitor's alerts and rollbacks."""
    def e(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    table = markdown_table(["deployment", "domain", "promised E [95%]", "break-even", "drafts",
                            "scraped E", "per-request E"],
                           [[r["deployment"], r["domain"],
                             f"{e(r['promise_e'])} [{e(r['promise_lo'])}, {e(r['promise_hi'])}]",
                             e(r["break_even"]), r["drafts"], e(r["scraped_e"]), e(r["request_e"])]
                            for r in rows])
    lines = [f"{PRODUCTION_HEADING}", "", title, "", table, ""]
    lines += [f"- **{ev['kind']}** {ev['at']:%Y-%m-%d %H:%M} UTC: {ev['reason'] or ''}"
              for ev in events]
    if plot:
        lines += ["", f"Production E over time: the run's `{plot}` artifact."]
    return "\n".join(lines) + "\n"


def write_production(mlflow_client, name: str, version: str, body: str) -> None:
    """Replace the version page's Production section with `body`."""
    detail = mlflow_client.get_model_version(name, version)
    mlflow_client.update_model_version(name, version, description=replace_section(
        detail.description or "", PRODUCTION_HEADING, body))


def write_gates(mlflow_client, name: str, version: str, gates: list[Gate], title: str) -> None:
    detail = mlflow_client.get_model_version(name, version)
    mlflow_client.update_model_version(name, version, description=replace_section(
        detail.description or "", GATES_HEADING, gates_markdown(gates, title)))


def refresh_champion_lines(mlflow_client, name: str, champion: str | None, how: str,
                           also: tuple[str | None, ...] = (), replaced: str | None = None) -> None:
    """Write the current champion line on every version that carries an alias, and on `also`
    (e.g. the version that just lost the champion); replaced: the champion the champion replaced
    (its page says what a rollback restores). Best effort: a failure is logged."""
    try:
        model = mlflow_client.get_registered_model(name)
        versions = {str(v) for v in (model.aliases or {}).values()} | {str(v) for v in also if v}
        line = champion_line(champion, how)
        for version in sorted(versions, key=int):
            detail = mlflow_client.get_model_version(name, version)
            mlflow_client.update_model_version(name, version, description=with_champion_line(
                detail.description or "", line, version, champion, replaced))
    except Exception as exc:     # the page is documentation; the alias move already happened
        log.warning("%s: champion line not refreshed (%s)", name, mask_text(str(exc)))


def champion_audit(store: Store, name: str, champion: str | None) -> dict:
    """{"champion", "gated", "detail"}: whether the champion alias was last moved by specdec onto
    this version (a promote or rollback row), i.e. through the gates or a recorded rollback."""
    return champion_audit_of(champion, None if champion is None else last_champion_move(store, name))


def champion_audit_of(champion: str | None, last) -> dict:
    """champion_audit from the champion's version and the newest champion move read already
    (queries_promotions.last_champion_move; None: specdec never moved it), without the store."""
    if champion is None:
        return {"champion": None, "gated": True, "detail": "no champion"}
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


def nothing_on_markdown(view: RunView, champion) -> str:
    """The note of a version that turns no domain on ("" otherwise): served, it is plain decoding;
    whether it changes anything against the champion; what automatic promotion does with it."""
    if not turns_nothing_on(view.config):
        return ""
    on_before = [] if champion is None else champion.domains_on
    change = ("there is no champion to compare with" if champion is None else
              "against the champion it changes nothing (its domains are off too)" if not on_before
              else f"against the champion it turns off {', '.join(on_before)}")
    return (f"**This version turns no domain on**: served, every domain decodes plain (no "
            f"speculation); {change}. The DAG's automatic promotion (Param promote) skips such a "
            "version; `specdec config promote N` promotes it when that is meant.\n\n")


def _notes_markdown(view: RunView, audit: dict, champion=None) -> str:
    """The page's warnings, before the table: a champion moved outside specdec, a noisy profile,
    vetoes, domains turned off on vLLM, live checks that show a problem, the low-acceptance alert,
    the engine check not run."""
    config, check = view.config, view.profile
    text = "" if audit["gated"] else f"**WARNING: {audit['detail']}.**\n\n"
    text += nothing_on_markdown(view, champion)
    if check is not None and check["status"] == "noisy":
        text += (f"**Cost profile too noisy**: {'; '.join(check.get('reasons') or [])}. No domain "
                 "was turned on from it that the champion has off.\n\n")
    vetoes = [f"- **{n}**: {s.reason}" for n, s in sorted(config.domains.items())
              if s.reason and s.reason.startswith("live check:")]
    if vetoes:
        text += "**Vetoed by the live check** (planned on, measured too slow; off):\n\n" + "\n".join(vetoes) + "\n\n"
    held = [f"- **{n}**: {s.reason}" for n, s in sorted(config.domains.items())
            if s.reason and s.reason.startswith("engine check:")]
    if held:
        text += ("**Turned off by the engine check** (planned on; on vLLM it refused, died or "
                 "accepted less than estimated):\n\n" + "\n".join(held) + "\n\n")
    under_load = [f"- **{n}**: {s.reason}" for n, s in sorted(config.domains.items())
                  if s.reason and s.reason.startswith("load check:")]
    if under_load:
        text += ("**Turned off or cut by the load check** (on vLLM's OpenAI server under concurrent "
                 "requests):\n\n" + "\n".join(under_load) + "\n\n")
    text += below_bar_markdown(view) + alert_markdown(view)
    if not view.engine_rows and config.domains_on:
        text += f"**{engine_state(view)}** (see \"On vLLM\" below and the engine_check gate).\n\n"
    return text


def plots_note(view: RunView) -> str:
    """Which promised plot is not drawn and why ("" when every one is): calibration.png needs a
    domain measured live on this engine."""
    if any(d.live for d in view.domains):
        return ""
    return (" (no `calibration.png`: no domain was measured live on this engine, e.g. a run "
            "planned on vLLM's costs, whose live check is the engine check)")


def version_page_markdown(view: RunView, version: str, gates: list[Gate], audit: dict,
                          champion, champion_version: str | None) -> str:
    """The registered version's page (its description), from the run's view."""
    config, check = view.config, view.profile
    return (status_line(version, champion_version, target=config.target.id) + "\n\n"
            f"## specdec config of run {view.run_id}\n\n{_notes_markdown(view, audit, champion)}target "
            f"`{config.target.id}` ({config.target.fingerprint}), hardware profile "
            f"`{config.hardware_profile}`{'' if check is None else ' (' + check['status'] + ')'}, "
            f"validation **{validation_text(config)}**\n\n"
            f"{domains_markdown(view)}\n\n"
            f"### On vLLM (engine check)\n\n{engine_markdown(view)}\n\n"
            f"### Under load on vLLM (load check; plot `plots/load_check_speedup.png`)\n\n"
            f"{load_markdown(view.loads, load_not_run(view))}\n\n"
            f"### What changed\n\n{changes_markdown(config, champion, champion_version)}\n\n"
            + gates_markdown(gates, f"preview at registration against champion "
                                    f"{champion_version or 'none'}; `specdec config promote` "
                                    "checks them again") + "\n\n"
            + promoting_markdown(version, config.target.id) + "\n\n"
            f"Plots: the run's `plots/` artifacts{plots_note(view)}. Validation details: `reports/validation.json`; "
            "data quality: `reports/data_quality.html` (every expectation and its result; Great "
            "Expectations' Data Docs attached under `reports/data_docs/`); this table alone: "
            "`reports/domains.md`.\n\n"
            + champion_line(champion_version, "as of this registration"))
