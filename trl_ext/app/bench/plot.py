"""The bench's figure, `bench.png`: one panel per section (error bars = interquartile range of the per-round
ratios); a panel whose section has nothing to draw says why in one line instead of standing empty."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: One colour per meaning, the same in every panel.
COLOURS = {"stock": "#7f7f7f", "trl_ext": "#d62728", "auto": "#ff7f0e", "bound": "#1f77b4", "flag": "#9467bd"}


#: The section each panel draws, in panel order, and the name its one-line note gives it.
PANELS = {
    "padding_free": "padding_free",
    "precompute": "precompute",
    "sync_metrics": "sync_metrics",
    "generation": "ZeRO-3 generation",
    "token_budget": "token_budget",
    "fused_logprobs": "fused_logprobs",
}


def panel_note(report: dict[str, Any], name: str) -> str:
    """The one line a panel shows when its section has nothing to draw: not run (not among `--only`, or the bench
    stopped first), skipped (what it needs, e.g. DeepSpeed), failed (the error, in full on the table's row), or run
    without rows."""
    what = PANELS.get(name, name)
    section = report["sections"].get(name)
    if section is None:
        why = "not among --only" if report.get("complete", True) else "the bench stopped before it"
        return f"{what}: not run ({why})"
    if "skipped" in section:
        # The reason up to its install hint ("needs DeepSpeed, which is not installed"); the table has all of it.
        return f"{what}: not run ({section['skipped'].split(' (')[0]})"
    if "error" in section:
        error = section["error"].splitlines()[0] if section["error"].strip() else "no message"
        return f"{what}: FAILED ({error[:60]}{'...' if len(error) > 60 else ''}; see the table)"
    return f"{what}: no rows (the run measured nothing to draw)"


def plot(report: dict[str, Any], path: Path) -> None:
    """`bench.png`: one panel per section, error bars = interquartile range of the per-round ratios."""
    import matplotlib.pyplot as plt

    fig = figure(report)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(report: dict[str, Any]) -> Any:
    """The figure of `bench.png` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    sections = report["sections"]
    fig, grid = plt.subplots(2, 3, figsize=(18, 9.6))
    axes = list(grid.flat)

    def ratio_bar(ax, x: float, r: dict[str, Any], colour: str, label: str) -> None:
        err = [[r["median"] - r["q1"]], [r["q3"] - r["median"]]]
        ax.bar(x, r["median"], color=colour, label=label, width=0.6)
        ax.errorbar(x, r["median"], yerr=err, fmt="none", ecolor="black", capsize=5, label=None)
        ax.plot([x] * len(r["ratios"]), r["ratios"], ".", color="black", alpha=0.4)
        if r["flags"]:
            note, offset = "!! " + r["flags"][0].split(":")[0], dict(xytext=(0, 6), textcoords="offset points")
            ax.annotate(note, (x, r["q3"]), ha="center", va="bottom", color=COLOURS["flag"], fontsize=8, **offset)

    # 1. padding-free: speed-up with its bound as a line, and the per-batch losses of both sides.
    ax = axes[0]
    pf = sections.get("padding_free", {})
    if "speedup" in pf:
        ax.axhline(1.0, color=COLOURS["stock"], linestyle=":", label="stock TRL = 1")
        ratio_bar(ax, 0, pf["speedup"], COLOURS["trl_ext"], "trl-ext padding_free (median, IQR)")
        ax.axhline(
            pf["bound"], color=COLOURS["bound"], linestyle="--", label=f"bound (padded/real work) = {pf['bound']:.2f}x"
        )
        ax.set_xticks([0], [f"DPO step, {pf['padding_fraction']:.0%} padding"])
        inset = ax.inset_axes([0.62, 0.08, 0.35, 0.35])
        steps = range(1, len(pf["stock"]["loss"]) + 1)
        inset.plot(steps, pf["stock"]["loss"], "o-", color=COLOURS["stock"], linewidth=3)
        inset.plot(steps, pf["trl_ext"]["loss"], "x--", color=COLOURS["trl_ext"])
        inset.set_title("loss per batch (overlap)", fontsize=7)
        inset.xaxis.set_major_locator(MaxNLocator(integer=True))
        inset.tick_params(labelsize=6)
        inset.set_xlabel("batch", fontsize=6)
    ax.set_title("padding-free DPO step (higher is better)")
    ax.set_ylabel("speed-up vs stock TRL")

    # 2. precompute: same batch size and "auto".
    ax = axes[1]
    pc = sections.get("precompute", {})
    if "speedup" in pc:
        ax.axhline(1.0, color=COLOURS["stock"], linestyle=":", label="stock TRL = 1")
        ratio_bar(ax, 0, pc["speedup"], COLOURS["trl_ext"], "trl-ext, same batch size")
        ratio_bar(ax, 1, pc["speedup_auto"], COLOURS["auto"], 'trl-ext, "auto"')
        ax.set_xticks([0, 1], [f"batch {pc['batch_size']}", "auto"])
    ax.set_title("reference precompute (higher is better)")
    ax.set_ylabel("speed-up vs stock TRL")

    # 3. collectives per optimizer step (exact counts) and the step-time ratio's spread in the label.
    ax = axes[2]
    co = sections.get("sync_metrics", {})
    if "stock" in co:
        counts = [co[side]["collectives_per_step"] for side in ("stock", "trl_ext")]
        for x, side, label in ((0, "stock", "stock TRL"), (1, "trl_ext", "trl-ext sync_metrics")):
            ax.bar(x, counts[x], color=COLOURS[side], label=label, width=0.6)
        ax.errorbar([0, 1], counts, yerr=[0, 0], fmt="none", ecolor="black", capsize=5)  # exact counts: zero error
        r = co["step_time_ratio"]
        ax.set_xticks(
            [0, 1], ["stock", f"sync_metrics\n(step time {r['median']:.2f}x, IQR {r['q1']:.2f}-{r['q3']:.2f})"]
        )
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("collectives per optimizer step, 2 processes (exact)")
    ax.set_ylabel("collectives / step (lower is better)")

    # 4. ZeRO-3 generation: peak parameter memory per rank, relative to TRL's gather.
    ax = axes[3]
    ge = sections.get("generation", {})
    if ge.get("modes"):
        names = [m["mode"] for m in ge["modes"]]
        values = [m["peak_vs_gather"] for m in ge["modes"]]
        seen: set[str] = set()
        for x, (name, value) in enumerate(zip(names, values, strict=True)):
            kind = "stock" if name.startswith("trl") else "trl_ext"
            label = {"stock": "stock TRL", "trl_ext": "trl-ext"}[kind] if kind not in seen else "_nolegend_"
            seen.add(kind)
            ax.bar(x, value, color=COLOURS[kind], width=0.6, label=label)
        ax.errorbar(range(len(names)), values, yerr=[0] * len(names), fmt="none", ecolor="black", capsize=5)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_title("ZeRO-3 generation, peak params/rank (exact)")
    ax.set_ylabel("vs TRL gather (lower is better)")

    # 5 and 6. token_budget against padding_free, fused_logprobs against stock: speed-up and peak memory ratio.
    for ax, name, baseline in ((axes[4], "token_budget", "padding_free"), (axes[5], "fused_logprobs", "stock TRL")):
        section = sections.get(name, {})
        if "speedup" in section:
            ax.axhline(1.0, color=COLOURS["stock"], linestyle=":", label=f"{baseline} = 1")
            ratio_bar(ax, 0, section["speedup"], COLOURS["trl_ext"], f"trl-ext {name} speed-up (median, IQR)")
            memory = section["memory"]["ratio"]
            if memory is not None:
                ax.bar(1, memory, color=COLOURS["auto"], width=0.6, label="peak memory ratio (median)")
            ax.set_xticks([0, 1], ["step time: speed-up", "peak memory: ratio"])
        ax.set_title(f"{name} vs {baseline}")
        ax.set_ylabel(f"vs {baseline}")
    for ax, name in zip(axes, PANELS, strict=True):
        if not ax.has_data():  # never an empty panel: one line that says why there is nothing to draw
            ax.text(0.5, 0.5, panel_note(report, name), ha="center", va="center", transform=ax.transAxes, fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_ylabel("")
            continue
        handles, labels = ax.get_legend_handles_labels()
        top = ax.dataLim.y1 if handles else 1.0
        # Headroom above the bars, their error bars and flag notes for the legend (one text line per entry), so that
        # the legend never covers what is plotted.
        ax.set_ylim(0, max(top, 1e-9) * (1.3 + 0.1 * len(handles)))
        if handles:
            ax.legend(fontsize=7, loc="upper left")
    load = report.get("load_average", {})
    fig.suptitle(
        f"trl-ext bench — trl {report['trl']}, {report['model']}; error bars: interquartile range of per-round "
        "ratios; "
        f"load average {load.get('start', '?')} -> {load.get('end', '?')} on {os.cpu_count()} cores",
        fontsize=9,
    )
    fig.tight_layout()
    return fig
