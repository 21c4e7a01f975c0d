"""The bench's report: the table (plain text, with each flag on its own line, and Markdown), the headline ratios and
the figure, `bench.png` (one panel per section; error bars: the interquartile range of the per-round ratios; a panel
whose section has nothing to draw says why in one line instead of standing empty).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from .plugin_sections import BUDGET_RTOL, FUSED_RTOL
from .sections import REF_LOGP_RTOL, SECTIONS
from .stats import NO_CLEAR_DIFFERENCE, ratio_text


def _times_text(ratio: float, baseline: str) -> str:
    """A time ratio `this / baseline` from single measurements: a direction only beyond `NO_CLEAR_DIFFERENCE` (one
    run has no spread to tell a few percent from noise)."""
    if ratio > 1 + NO_CLEAR_DIFFERENCE:
        return f"{ratio:.2f}x {baseline}'s (slower)"
    if ratio < 1 - NO_CLEAR_DIFFERENCE:
        return f"{ratio:.2f}x {baseline}'s (faster)"
    return f"{ratio:.2f}x {baseline}'s (no clear difference)"


Row = tuple[str, str, str, str, list[str]]


def _ran(section: dict[str, Any] | None) -> bool:
    return bool(section) and not {"error", "skipped"} & set(section or ())


def _timed(
    measure: str,
    section: dict[str, Any],
    key: str,
    text: str,
    ratio: str = "speedup",
    base: str = "stock",
    digits=3,
    named="",
) -> Row:
    """A timing row: the median seconds `key` of the baseline (`named`: its name before the number) and of trl-ext,
    `text` on the ratio, and the flags of the ratio `ratio`."""
    seconds = [f"{statistics.median(section[side][key]):.{digits}f}" for side in (base, "trl_ext")]
    return (measure, named + seconds[0], seconds[1], text, section[ratio]["flags"])


def _peaks(measure: str, section: dict[str, Any], base: str, named: str = "") -> Row:
    """A peak memory row: the median peaks of the baseline and of trl-ext, and the memory verdict."""
    stock, ext = _peak(section[base]["peak_mb"]), _peak(section["trl_ext"]["peak_mb"])
    return (measure, named + stock, ext, section["memory"]["text"], section["memory"]["flags"])


def _agree(measure: str, section: dict[str, Any], keys: tuple[str, ...], digits: str, tolerance: str) -> Row:
    """A row of agreement verdicts: each one's largest difference, their texts (the last followed by `tolerance`)."""
    verdicts = [section[key] for key in keys]
    values = ", ".join(f"{v['max_abs_diff']:{digits}}" for v in verdicts)
    text = "; ".join(v["text"] for v in verdicts) + tolerance
    return (measure, "", values, text, [flag for v in verdicts for flag in v["flags"]])


def _rows(report: dict[str, Any]) -> list[Row]:
    """The table's rows: `(measure, stock TRL, trl-ext, ratio or verdict, flags)`."""
    rows: list[Row] = []
    sections = report["sections"]
    pf = sections.get("padding_free")
    if _ran(pf):
        bound = (
            f"{ratio_text(pf['speedup'])}; bound {pf['bound']:.2f}x ({pf['padding_fraction']:.0%} padding: "
            f"tokens {pf['token_bound']:.2f}x, attention {pf['attention_bound']:.2f}x; "
            f"{pf['fraction_of_bound']:.0%} of bound)"
        )
        rows.append(_timed(f"DPO step fwd+bwd, {pf['batches']} batches, padding_free (s)", pf, "pass_seconds", bound))
        rows.append(_agree("same step: max |loss diff| per batch (fp32)", pf, ("losses",), ".2e", ""))
    pc = sections.get("precompute")
    if _ran(pc):
        cpu = pc.get("clock") == "cpu"  # process CPU time (recorded runs before it: wall time)
        unit = "CPU s" if cpu else "s"
        wall = f"; wall time {pc['wall_speedup']:.2f}x (shared machine: for reference)" if cpu else ""
        measure = f"ref precompute, {pc['pairs']} pairs, batch {pc['batch_size']} ({unit})"
        rows.append(_timed(measure, pc, "seconds", ratio_text(pc["speedup"]) + wall, digits=2))
        auto = ratio_text(pc["speedup_auto"]) + _auto_choice(pc["trl_ext_auto"].get("batch_tokens"))
        seconds = f"{statistics.median(pc['trl_ext_auto']['seconds']):.2f}"
        rows.append((f'ref precompute, "auto" ({unit})', "", seconds, auto, pc["speedup_auto"]["flags"]))
        largest = f": {REF_LOGP_RTOL:.0e} of the largest |logp|, {pc['max_abs_ref_logp']:.0f}"
        rows.append(_agree("max |ref logp diff| (fp32)", pc, ("values",), ".2e", largest))
    co = sections.get("sync_metrics")
    if _ran(co):
        per_step = [f"{co[side]['collectives_per_step']:.1f}" for side in ("stock", "trl_ext")]
        verdict = co["collectives"]
        rows.append(("collectives / optimizer step, 2 processes", *per_step, verdict["text"], verdict["flags"]))
        ratio = ratio_text(co["step_time_ratio"])
        rows.append(_timed("2-process step time, sync_metrics (s)", co, "step_seconds", ratio, "step_time_ratio"))
    ge = sections.get("generation")
    if ge and "modes" in ge and not ge["modes"]:
        # Never an empty ZeRO-3 part: one row that says so (and is flagged: the run should have measured every mode).
        text = "no rows: the 2-process ZeRO-3 run reported no modes"
        rows.append(("ZeRO-3 generation: nothing measured", "", "", text, [text]))
    elif ge and "modes" in ge:
        repeats = ge.get("repeats", 1)
        runs = "one run" if repeats == 1 else f"best of {repeats} runs"
        for index, mode in enumerate(ge["modes"]):
            text = f"the baseline ({runs})"
            if index:
                text = (
                    f"memory {mode['peak_vs_gather']:.2f}x TRL gather's (counted bytes); time "
                    f"{_times_text(mode['time_vs_gather'], 'TRL gather')} ({runs})"
                )
            peak = f"{max(mode['peak_bytes_per_rank']) / 2**20:.1f} MiB/rank"
            flags = [] if mode["same_tokens"] else ["TOKENS DIFFER from TRL gather's"]
            rows.append((f"ZeRO-3 generation, 2 ranks: {mode['mode']}", "", peak, text, flags))
        rows.append(("ZeRO-3 generation: greedy tokens", "", "", ge["tokens"]["text"], []))
    tb = sections.get("token_budget")
    if _ran(tb):
        counts = tb["micro_batches_per_step"]
        measure = (
            f"DPO train(), {tb['pairs_per_step']} pairs/step: padding_free {tb['pair_batch']} pairs/micro-batch "
            f"vs token_budget={tb['token_bound']} (s)"
        )
        versus = f"{ratio_text(tb['speedup'])} (vs padding_free)"
        rows.append(_timed(measure, tb, "train_seconds", versus, base="padding_free", named="padding_free: "))
        measure = "token_budget: peak RSS growth of train(), vs padding_free"
        rows.append(_peaks(measure, tb, "padding_free", "padding_free: "))
        rows.append(
            (
                "token_budget: micro-batches per step; largest micro-batch (tokens)",
                f"padding_free: {counts['padding_free']}",
                f"{', '.join(str(c) for c in counts['token_budget'])}",
                tb["bound"]["text"],
                tb["bound"]["flags"],
            )
        )
        measure = "token_budget vs stock, one SGD step: loss, metrics (rel.), gradient (fp32)"
        rows.append(_agree(measure, tb, ("metrics", "gradient"), ".1e", f": {BUDGET_RTOL:.0e} of the largest |grad|"))
    fl = sections.get("fused_logprobs")
    if _ran(fl):
        measure = (
            f"Online DPO step without generation, vocab {fl['vocab']}, {fl['completions']} completions "
            f"<= {fl['completion_width']} tokens, fused_logprobs (s)"
        )
        rows.append(_timed(measure, fl, "step_seconds", ratio_text(fl["speedup"])))
        rows.append(_peaks("fused_logprobs: peak RSS growth of the step", fl, "stock"))
        measure = "fused_logprobs vs stock: log-probs, loss and metrics (rel.), gradient (fp32)"
        tolerance = f": {FUSED_RTOL:.0e} of the largest |grad|"
        rows.append(_agree(measure, fl, ("logps", "metrics", "gradient"), ".1e", tolerance))
    for name, section in sections.items():
        if "skipped" in section:
            rows.append((f"{name}: skipped", "", "", section["skipped"], []))
        elif "error" in section:
            rows.append((f"{name}: FAILED", "", "", section["error"], ["SECTION FAILED: the error is on this row"]))
    return rows


#: How to get what the bench needs beyond trl-ext itself (the `bench` and `deepspeed` extras).
BENCH_EXTRA = 'pip install "trl-ext[bench]"; from a clone: pip install -c constraints.txt -e ".[bench]"'


def matplotlib_missing() -> str | None:
    """The one line that says `bench.png` is not drawn and how to get matplotlib; None when it is installed."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        return None
    return f"bench.png not drawn: matplotlib is not installed ({BENCH_EXTRA})"


def _auto_choice(tokens: list[Any] | None) -> str:
    """What "auto" chose in the rounds (tokens per batch, from a probe of the free memory, so it can vary)."""
    kept = sorted({int(t) for t in tokens or () if t})
    if not kept:
        return ""
    return f"; auto chose {kept[0]}" + (f"-{kept[-1]}" if len(kept) > 1 else "") + " tokens per batch"


def _peak(values: list[float | None]) -> str:
    kept = [v for v in values if v is not None]
    return f"{statistics.median(kept):.0f} MiB" if kept else "n/a"


_HEADER = (
    "measure",
    "baseline (stock TRL unless named)",
    "trl-ext",
    "ratio: median of per-round baseline/trl-ext [spread], or verdict",
)


def text_table(report: dict[str, Any]) -> str:
    """The plain-text table; a flagged row is followed by one `!!` line per flag, under its ratio column."""
    rows = _rows(report)
    widths = [max(len(r[i]) for r in [_HEADER, *rows]) for i in range(3)]
    indent = " " * (sum(widths) + 6)
    lines = []
    header: tuple[str, str, str, str, list[str]] = (*_HEADER, [])
    for measure, stock, ext, text, flags in [header, *rows]:
        cells = (measure.ljust(widths[0]), stock.ljust(widths[1]), ext.ljust(widths[2]), text)
        lines.append("  ".join(cells))
        lines.extend(f"{indent}!! {flag}" for flag in flags)
    return "\n".join(lines)


def markdown_table(report: dict[str, Any]) -> str:
    """The table in Markdown, with a caption naming the run; a flag ends its row's last cell in bold."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    load = report["load_average"]
    incomplete = "" if report.get("complete", True) else "; INCOMPLETE: the sections finished so far"
    caption = (
        f"`trl-ext bench{' --quick' if report['quick'] else ''}` on trl {report['trl']}, torch {report['torch']} "
        f"({load['cores']} CPU cores, load average {load['start']} -> {load['end']}; {report['model']}; "
        f"{report['rounds']} rounds; {report['wall_seconds']:.0f} s wall{incomplete}):"
    )
    lines = [caption, "", "| " + " | ".join(_HEADER) + " |", "|---|---|---|---|"]
    for measure, stock, ext, text, flags in _rows(report):
        last = cell(text) + "".join(f" **!! {cell(flag)}**" for flag in flags)
        lines.append(f"| {cell(measure)} | {cell(stock)} | {cell(ext)} | {last} |")
    return "\n".join(lines)


def section_flags(section: dict[str, Any]) -> list[str]:
    """Every flag a section's results carry."""
    return [f for value in section.values() if isinstance(value, dict) for f in value.get("flags", [])]


def headline(report: dict[str, Any]) -> dict[str, float]:
    """The ratios a reader takes away: padding-free and precompute speed-ups, collectives per step, memory."""
    out: dict[str, float] = {}
    sections = report["sections"]
    if "speedup" in sections.get("padding_free", {}):
        out["padding_free_speedup"] = sections["padding_free"]["speedup"]["median"]
    if "speedup" in sections.get("precompute", {}):
        out["precompute_speedup"] = sections["precompute"]["speedup"]["median"]
        out["precompute_auto_speedup"] = sections["precompute"]["speedup_auto"]["median"]
    if "stock" in sections.get("sync_metrics", {}):
        out["stock_collectives_per_step"] = sections["sync_metrics"]["stock"]["collectives_per_step"]
        out["sync_metrics_collectives_per_step"] = sections["sync_metrics"]["trl_ext"]["collectives_per_step"]
    for mode in sections.get("generation", {}).get("modes", []):
        if mode["mode"] == "ext False":
            out["zero3_generation_memory_vs_gather"] = mode["peak_vs_gather"]
    if "speedup" in sections.get("token_budget", {}):
        out["token_budget_speedup_vs_padding_free"] = sections["token_budget"]["speedup"]["median"]
    if "speedup" in sections.get("fused_logprobs", {}):
        out["fused_logprobs_speedup"] = sections["fused_logprobs"]["speedup"]["median"]
        if sections["fused_logprobs"]["memory"]["ratio"] is not None:
            out["fused_logprobs_memory_vs_stock"] = sections["fused_logprobs"]["memory"]["ratio"]
    return out


#: One colour per meaning, the same in every panel.
COLOURS = {"stock": "#7f7f7f", "trl_ext": "#d62728", "auto": "#ff7f0e", "bound": "#1f77b4", "flag": "#9467bd"}


#: The section each panel draws, in panel order, and the name its one-line note gives it.
PANELS = {name: "ZeRO-3 generation" if name == "generation" else name for name in SECTIONS}


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
