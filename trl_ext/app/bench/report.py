"""The bench's report: the table (plain text, with each flag on its own line, and Markdown) and the headline ratios;
the figure is in `plot`.
"""

from __future__ import annotations

import statistics
from typing import Any

from .plugin_sections import BUDGET_RTOL, FUSED_RTOL
from .sections import REF_LOGP_RTOL
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


def duration_text(seconds: float) -> str:
    """`about 2.5 min`: a wall time rounded to the half minute, as `--help` and the README state it."""
    return f"about {max(0.5, round(seconds / 30) / 2):g} min"


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
