"""The evaluation run's plots, logged to its MLflow run under `plots/`. Sized to be read where
MLflow shows them (an image about 900-1200 px wide in a 1280 px window): short titles (the run id
is a footnote), legends outside the data, fonts of 10 pt and up.

- conditional_acceptance.png: per domain, the planned drafter's conditional acceptance a_i at
  each draft position with its 95% interval (bootstrap over requests) as an error bar, and beside it the share of its rounds that drafted at all (the rates
  count only rounds that reached a position; E counts every round);
- predicted_speedup_vs_k.png: one panel per domain, predicted speedup (batch 1) against K for each
  drafter, its 95% interval as a band where the estimate has one, the `plan_min_speedup` threshold, the
  plain-decoding line and the chosen (drafter, K) marked (hollow: the best of a domain that is off);
- calibration.png: the cost model's calibration, predicted against measured speedup on the same
  requests, one marker per domain with the measurement's 95% interval as an error bar.

The figure builders take plain rows (dicts; the load check's: its records, tasks.db.load_records)
and return matplotlib Figures; `write_plots` saves them. matplotlib is imported inside them (about
1.4 s): only the plots pay it.
"""

from __future__ import annotations

from pathlib import Path

from ..db.load_records import DomainLoad

TITLE_FONT, TEXT_FONT, FOOT_FONT = 13, 11, 9
MARKERS = "osD^vP*Xh<>"


def _pyplot():
    # imported here: matplotlib costs ~1.4 s to import: only the plots pay it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _footnote(fig, run_id: str) -> None:
    """The run id in a strip added below everything the layout placed (titles, axes, legends):
    the constrained layout runs first, then is frozen, the figure grows by the strip and every
    element moves up by it (a layout rect does not move a figure legend, whose entries the
    footnote then overlapped)."""
    fig.canvas.draw()
    fig.set_layout_engine("none")
    width, height = fig.get_size_inches()
    strip = 0.32
    scale, shift = height / (height + strip), strip / (height + strip)
    for ax in fig.axes:
        box = ax.get_position()
        ax.set_position([box.x0, box.y0 * scale + shift, box.width, box.height * scale])
    for legend in fig.legends:
        legend.set_bbox_to_anchor((0, shift, 1, scale), transform=fig.transFigure)
    for text in fig.texts + ([fig._suptitle] if fig._suptitle is not None else []):
        x, y = text.get_position()
        text.set_position((x, y * scale + shift))
    fig.set_size_inches(width, height + strip)
    fig.text(0.005, 0.005, f"run {run_id}", fontsize=FOOT_FONT, color="dimgrey", ha="left",
             va="bottom")


def proposal_rate(row: dict) -> float | None:
    """Share of a drafter's rounds that drafted at least one token: 1 - the estimate's share of
    rounds of width 0 (None without it). E counts every round; the per-position rates only the
    rounds that reached a position, so a drafter that seldom proposes shows high rates and a low E."""
    share = row.get("draft_width_share")
    return None if not share else max(0.0, 1.0 - float(share[0]))


def acceptance_figure(rows: list[dict], chosen: dict[str, str | None], run_id: str,
                      planned_k: dict[str, int | None] | None = None):
    """Per-position conditional acceptance of each domain's planned drafter (at its planned K, or
    the largest K estimated) and, in a second panel, the share of its rounds that proposed at all.
    rows: acceptance_estimates rows; chosen: {domain: planned drafter label}; planned_k:
    {domain: planned K}."""
    plt = _pyplot()
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(11, 5.5), layout="constrained",
                                   gridspec_kw={"width_ratios": [3, 1.2]})
    names, rates_drafted, widest, intervals, without = [], [], 1, 0, []
    domains = sorted({r["domain"] for r in rows})
    for n, domain in enumerate(domains):
        best = [r for r in rows if r["domain"] == domain and r["drafter"] == chosen.get(domain)]
        if not best:
            continue
        at_k = [r for r in best if r["k"] == (planned_k or {}).get(domain)]
        row = at_k[0] if at_k else max(best, key=lambda r: r["k"])
        rates = row["conditional_acceptance"] or []
        drafted = proposal_rate(row)
        extra = "" if drafted is None else f", drafts in {100 * drafted:.0f}% of rounds"
        length = row.get("mean_accepted_length")
        extra += "" if length is None else f", E {length:.2f}"
        # domains side by side around each position: equal rates (K = 1 everywhere) stay apart
        offset = 0.08 * (n - (len(domains) - 1) / 2)
        widest = max(widest, len(rates))
        xs = [i + 1 + offset for i in range(len(rates))]
        line, = ax.plot(xs, rates, marker=MARKERS[n % len(MARKERS)],
                        label=f"{domain} ({row['drafter']}{extra})")
        spans = row.get("conditional_acceptance_ci") or []
        if len(spans) == len(rates) and rates:    # each point's 95% interval, in its colour
            intervals += 1
            lows, highs = [float(s[0]) for s in spans], [float(s[1]) for s in spans]
            ax.vlines(xs, lows, highs, color=line.get_color(), lw=1.4)
            for ends in (lows, highs):
                ax.hlines(ends, [x - 0.025 for x in xs], [x + 0.025 for x in xs],
                          color=line.get_color(), lw=1.4)
        else:
            without.append(domain)
        if drafted is not None:
            names.append(domain)
            rates_drafted.append(100 * drafted)
            bars.barh(domain, 100 * drafted, color=line.get_color())
    ax.set_xlim(0.5, widest + 0.5)          # one position is a point at 1, not an axis of 0.96-1.04
    ax.set_xticks(range(1, widest + 1))
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position i", fontsize=TEXT_FONT)
    ax.set_ylabel("conditional acceptance a_i" + (" (95% interval)" if intervals else ""),
                  fontsize=TEXT_FONT)
    if without:     # estimates stored before the intervals were (migration 0016), or none
        ax.text(0.01, 0.01, "no interval stored: " + ", ".join(without), transform=ax.transAxes,
                fontsize=FOOT_FONT, color="dimgrey", ha="left", va="bottom")
    ax.tick_params(labelsize=TEXT_FONT)
    ax.set_title("Per-position acceptance of the planned drafter", fontsize=TITLE_FONT)
    bars.set_xlim(0, 100)
    bars.invert_yaxis()
    bars.set_xlabel("% of rounds with a draft", fontsize=TEXT_FONT)
    bars.tick_params(labelsize=TEXT_FONT)
    bars.set_title("Rounds that drafted", fontsize=TITLE_FONT)
    for y, value in enumerate(rates_drafted):
        bars.text(min(value, 78) + 2, y, f"{value:.0f}%", va="center", fontsize=TEXT_FONT)
    if not names:
        bars.set_visible(False)
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="outside lower center", fontsize=TEXT_FONT, frameon=False)
    _footnote(fig, run_id)
    return fig


def speedup_figure(rows: list[dict], configs: dict[str, dict], min_speedup: float, run_id: str):
    """Predicted speedup against K per domain and drafter. configs: {domain: {"drafter", "k",
    "enabled"}} of the run's plan: the chosen (drafter, K) is marked."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    domains = sorted({r["domain"] for r in rows})
    drafters = sorted({r["drafter"] for r in rows})
    colours = {d: f"C{n % 10}" for n, d in enumerate(drafters)}
    columns = min(2, len(domains))
    grid = (len(domains) + columns - 1) // columns
    fig, axes = plt.subplots(grid, columns, figsize=(4.6 * columns + 0.4, 3.4 * grid + 1.2),
                             sharey=True, squeeze=False, layout="constrained")
    for ax in axes.flat[len(domains):]:
        ax.set_visible(False)
    for ax, domain in zip(axes.flat, domains):
        plan = configs.get(domain) or {}
        for drafter in drafters:
            points = sorted((r["k"], r["predicted_speedup"], r.get("predicted_speedup_lo"),
                             r.get("predicted_speedup_hi")) for r in rows
                            if r["domain"] == domain and r["drafter"] == drafter
                            and r["predicted_speedup"] is not None)
            if not points:
                continue
            ks = [p[0] for p in points]
            ax.plot(ks, [p[1] for p in points], marker=".", color=colours[drafter], label=drafter)
            band = [p for p in points if p[2] is not None and p[3] is not None]
            if band:
                ax.fill_between([p[0] for p in band], [p[2] for p in band], [p[3] for p in band],
                                color=colours[drafter], alpha=0.18, linewidth=0)
            if plan.get("drafter") == drafter and plan.get("k"):
                at = [p[1] for p in points if p[0] == plan["k"]]
                if at and plan.get("enabled"):
                    ax.plot([plan["k"]], at, marker="*", markersize=16, linestyle="none",
                            color="black", label="chosen K")
                elif at:        # off: the best candidate, not a choice
                    ax.plot([plan["k"]], at, marker="*", markersize=16, linestyle="none",
                            color="black", markerfacecolor="white", label="best K (off)")
        ax.axhline(1.0, color="grey", lw=0.9, label="plain decoding (1.0)")
        ax.axhline(min_speedup, color="tab:red", lw=1.2, ls="--", label=f"min_speedup {min_speedup:g}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=TEXT_FONT)
        state = (f"on, K={plan['k']}" if plan.get("enabled") and plan.get("k") else "off")
        ax.set_title(f"{domain}: {state}", fontsize=TEXT_FONT + 1)
        ax.set_xlabel("K (draft tokens per round)", fontsize=TEXT_FONT)
    for row in axes:
        row[0].set_ylabel("predicted speedup (batch 1)", fontsize=TEXT_FONT)
    handles, labels = [], []
    for ax in axes.flat[:len(domains)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if any(r.get("predicted_speedup_lo") is not None for r in rows):
        # one swatch for every drafter's band: neutral grey, each band has its drafter's colour
        handles.append(Patch(facecolor="grey", alpha=0.3, linewidth=0))
        labels.append("95% interval (in the drafter's colour)")
    fig.legend(handles, labels, loc="outside lower center", ncol=min(3, len(labels)),
               fontsize=TEXT_FONT, frameon=False)
    fig.suptitle("Predicted speedup vs K", fontsize=TITLE_FONT)
    _footnote(fig, run_id)
    return fig


def calibration_figure(live: list[dict], run_id: str):
    """Predicted (same requests) against measured speedup, one marker per domain with the
    measurement's 95% interval as an error bar (each rests on a few requests: the legend says how
    many); the diagonal is a perfect cost model. live: {"domain", "predicted", "measured", and
    optionally "lo", "hi", "requests"} rows."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5), layout="constrained")
    for n, row in enumerate(sorted(live, key=lambda r: r["domain"])):
        lo, hi = row.get("lo"), row.get("hi")
        yerr = None if lo is None or hi is None else [[max(0.0, row["measured"] - lo)],
                                                      [max(0.0, hi - row["measured"])]]
        count = row.get("requests")
        ax.errorbar([row["predicted"]], [row["measured"]], yerr=yerr, marker=MARKERS[n % len(MARKERS)],
                    markersize=9, linestyle="none", capsize=4,
                    label=row["domain"] + ("" if not count else f" ({count} requests)"))
    values = [v for r in live for v in (r["predicted"], r["measured"], r.get("lo"), r.get("hi"))
              if v is not None]
    low, high = min(values) * 0.9, max(values) * 1.1
    ax.plot([low, high], [low, high], color="grey", lw=0.9, label="measured = predicted")
    ax.set_xlabel("predicted speedup (same requests)", fontsize=TEXT_FONT)
    ax.set_ylabel("measured speedup (95% interval)", fontsize=TEXT_FONT)
    ax.tick_params(labelsize=TEXT_FONT)
    ax.set_title("Cost-model calibration", fontsize=TITLE_FONT)
    fig.legend(loc="outside right upper", fontsize=TEXT_FONT, frameon=False)
    _footnote(fig, run_id)
    return fig


def write_plots(run_id: str, estimates: list[dict], configs: dict[str, dict], live: list[dict],
                min_speedup: float, directory: Path) -> list[Path]:
    """Save the run's figures as PNG files in `directory` (none without estimates)."""
    if not estimates:
        return []
    plt = _pyplot()
    figures = [("conditional_acceptance.png",
                acceptance_figure(estimates, {d: c.get("drafter") for d, c in configs.items()}, run_id,
                                  {d: c.get("k") for d, c in configs.items()})),
               ("predicted_speedup_vs_k.png", speedup_figure(estimates, configs, min_speedup, run_id))]
    if live:
        figures.append(("calibration.png", calibration_figure(live, run_id)))
    paths = []
    for name, fig in figures:
        paths.append(directory / name)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def production_figure(points: list[dict], promises: dict[str, dict], events: list[dict], title: str):
    """Production E over time per deployment (one marker per scrape: 1 + accepted / drafts of its
    deltas), beside the promise's interval (a band from the lowest to the highest end over the
    deployment's domains) and the break-even E (dashed), with the drift alerts and rollbacks as
    vertical lines. points: {deployment, at, e}; promises: {deployment: {lo, hi, break_even}};
    events: {deployment, kind, at}."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 5.5), layout="constrained")
    names = sorted({p["deployment"] for p in points})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, name in enumerate(names):
        color = colors[n % len(colors)]
        mine = [p for p in points if p["deployment"] == name and p["e"] is not None]
        ax.plot([p["at"] for p in mine], [p["e"] for p in mine], marker=MARKERS[n % len(MARKERS)],
                color=color, label=f"{name}: production E")
        promise = promises.get(name) or {}
        if promise.get("lo") is not None and promise.get("hi") is not None and mine:
            ax.fill_between([mine[0]["at"], mine[-1]["at"]], promise["lo"], promise["hi"],
                            color=color, alpha=0.15, label=f"{name}: promised E (95% interval)")
        if promise.get("break_even") is not None:
            ax.axhline(promise["break_even"], color=color, linestyle="--", lw=1,
                       label=f"{name}: break-even E")
    for event in events:
        ax.axvline(event["at"], color="red" if event["kind"] != "alert" else "orange", lw=1,
                   linestyle=":", label=f"{event['kind']} ({event['deployment']})")
    ax.set_xlabel("scrape time (UTC)", fontsize=TEXT_FONT)
    ax.set_ylabel("E: tokens per verify round", fontsize=TEXT_FONT)
    ax.tick_params(labelsize=TEXT_FONT)
    ax.set_title(title, fontsize=TITLE_FONT)
    fig.autofmt_xdate()
    fig.legend(loc="outside right upper", fontsize=TEXT_FONT - 1, frameon=False)
    return fig


def load_speedup_figure(loads: dict[str, DomainLoad], min_speedup: float, run_id: str):
    """The load check (load_check_speedup.png): one panel per domain, the measured speedup on
    vLLM's OpenAI server against the number of concurrent requests with its 95% interval, the
    speedup vLLM's cost profile predicts at that batch size, the `plan_min_speedup` threshold and the
    plain-decoding line; levels that do not pay are hollow."""
    plt = _pyplot()
    domains = sorted(d for d, check in loads.items() if check.levels)
    columns = min(3, len(domains))
    rows = -(-len(domains) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns + 1, 3.6 * rows + 1),
                             layout="constrained", squeeze=False)
    for ax in axes.flat[len(domains):]:
        ax.set_visible(False)
    for ax, domain in zip(axes.flat, domains):
        levels = [level for level in loads[domain].levels if level.measured_speedup is not None]
        sizes = [level.concurrency for level in levels]
        measured = [level.measured_speedup for level in levels]
        errors = [[m - level.measured_speedup_lo for m, level in zip(measured, levels)],
                  [level.measured_speedup_hi - m for m, level in zip(measured, levels)]]
        ax.errorbar(sizes, measured, yerr=errors, marker="o", capsize=4, label="measured [95% CI]")
        for size, value, level in zip(sizes, measured, levels):
            if not level.pays:
                ax.plot([size], [value], marker="o", markersize=11, markerfacecolor="white",
                        color="tab:red", linestyle="none")
        predicted = [(level.concurrency, level.predicted_speedup) for level in loads[domain].levels
                     if level.predicted_speedup is not None]
        if predicted:
            ax.plot(*zip(*predicted), marker="s", linestyle="--", label="predicted (vLLM profile)")
        ax.axhline(min_speedup, color="tab:green", lw=0.9, linestyle=":", label=f"min_speedup {min_speedup:g}x")
        ax.axhline(1.0, color="grey", lw=0.9, label="plain decoding")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({level.concurrency for level in loads[domain].levels}) or [1])
        ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        ax.set_title(f"{domain} ({loads[domain].status})", fontsize=TEXT_FONT)
        ax.set_xlabel("concurrent requests", fontsize=TEXT_FONT)
        ax.set_ylabel("speedup", fontsize=TEXT_FONT)
        ax.tick_params(labelsize=TEXT_FONT)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(labels)),
               fontsize=TEXT_FONT, frameon=False)
    fig.suptitle("Speedup under load (vLLM OpenAI server)", fontsize=TITLE_FONT)
    _footnote(fig, run_id)
    return fig


def write_load_plot(run_id: str, loads: dict[str, DomainLoad], min_speedup: float,
                    directory: Path) -> list[Path]:
    """Save load_speedup_figure as load_check_speedup.png in `directory` (none without a level)."""
    if not any(check.levels for check in loads.values()):
        return []
    plt = _pyplot()
    fig = load_speedup_figure(loads, min_speedup, run_id)
    path = directory / "load_check_speedup.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
