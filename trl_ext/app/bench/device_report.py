"""What `trl-ext bench --device` reports (`bench.device`): the targets of issue 34, each a verdict computed from the
measured numbers; the Markdown table of `table.md`; the figure of `bench.png`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import matplotlib_missing
from .stats import direction

__all__ = ["markdown", "matplotlib_missing", "plot", "targets"]

#: (part, variant, what, threshold): padding_free's speed-up at least 0.8 of the token bound; prompt_sharing at least
#: 1.2x padding_free; fused_logprobs at least 0.95x stock at no more than 0.5x its step peak; token_budget at least
#: 1.3x padding_free at no more than `MEMORY_SLACK` x its step peak (the same memory).
TARGETS = (
    ("packing", "padding_free", "speed-up >= 0.8 x the token bound", 0.8),
    ("packing", "prompt_sharing", "speed-up over padding_free >= 1.2", 1.2),
    ("fused_logprobs", "fused_logprobs", "speed >= 0.95 x stock", 0.95),
    ("fused_logprobs", "fused_logprobs", "step peak <= 0.5 x stock's", 0.5),
    ("token_budget", "token_budget", "speed-up over padding_free >= 1.3", 1.3),
    ("token_budget", "token_budget", "step peak <= 1.10 x padding_free's", 1.10),
)


def _value(part: dict[str, Any], entry: dict[str, Any], what: str) -> float | None:
    speed = entry.get("speedup") or {}
    if "over padding_free" in what:  # prompt_sharing's own ratio; token_budget's baseline is padding_free already
        speed = entry.get("speedup_vs_padding_free") or speed
    if "token bound" in what:
        bound = part.get("token_bound")
        return speed["median"] / bound if speed and bound else None
    if "step peak" in what:
        return entry.get("peak_ratio")
    return speed.get("median")


#: Why a target has no verdict although its numbers exist: `verify` checked timed steps (extra stock forwards in the
#: plugin's time), or the run does not say that it did not (runs before the bench advanced `state.global_step`).
VERIFIED_TIMED = "verify checked the timed steps"


def _verified_timed(variants: dict[str, Any]) -> bool:
    return any(e.get("verified_timed_steps", 1) for e in variants.values())


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target in every checkpointing setting measured: its value and `met` (True, False, or None where the
    number was not measured: peak memory on a CPU, a part that did not run, `VERIFIED_TIMED`)."""
    out = []
    for part_name, variant, what, threshold in TARGETS:
        part = report.get("parts", {}).get(part_name) or {}
        for setting, variants in (part.get("settings") or {}).items():
            entry = variants.get(variant)
            if entry is None:
                continue
            value = _value(part, entry, what)
            met = None if value is None else (value <= threshold if "<=" in what else value >= threshold)
            target = {"part": part_name, "setting": setting, "variant": variant, "target": what}
            if _verified_timed(variants):
                target.update(value=None, met=None, why=VERIFIED_TIMED)
            else:
                target.update(value=value, met=met)
            out.append(target)
    return out


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ratio(r: dict[str, Any] | None) -> str:
    if not r:
        return "1x (baseline)"
    return f"{r['median']:.2f}x [IQR {r['q1']:.2f}-{r['q3']:.2f}] {direction(r)}"


def markdown(report: dict[str, Any]) -> str:
    v = report["versions"]
    lines = [
        f"# trl-ext bench --device: {report['device']}, preset {report['preset']} ({report['dtype']})",
        "",
        f"trl-ext {v['trl_ext']}, torch {v['torch']} (CUDA {v['cuda']}), transformers {v['transformers']}, trl "
        f"{v['trl']}; {report['rounds']} interleaved rounds after {report['warmup']} warm-up; "
        f"{report.get('wall_seconds', 0):.0f} s.",
        "",
    ]
    if any(_verified_timed(s) for p in report["parts"].values() for s in (p.get("settings") or {}).values()):
        lines += [f"**Not the plugins' own times:** {VERIFIED_TIMED} of this run: each such step of a plugin also "
                  "ran `verify`'s stock forwards, so the targets have no verdict.", ""]  # fmt: skip
    lines += [
        "| part | checkpointing | variant | step (median) | tokens/s | speed vs baseline | step peak | memory vs "
        "baseline | attention |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, part in report["parts"].items():
        for setting, variants in (part.get("settings") or {}).items():
            for variant, e in variants.items():
                lines.append(
                    f"| {name} | {setting.removeprefix('checkpointing_')} | {variant} | {e['step_median_s']:.3f} s | "
                    f"{_num(e['tokens_per_s'], '.0f')} | {_ratio(e.get('speedup'))} | "
                    f"{_num(e['step_peak_gb'], '.2f')} GB | {_num(e.get('peak_ratio'), '.2f')} | "
                    f"{e['attention'] or '-'} |"
                )
    packing = report["parts"].get("packing") or {}
    if "token_bound" in packing:
        lines += ["", f"Token bound of the packing step: {packing['token_bound']:.2f} (padded / real tokens)."]
    lines += ["", "| target | part | checkpointing | measured | met |", "|---|---|---|---|---|"]
    for t in report.get("targets", []):
        met = {True: "yes", False: "NO", None: "not measured"}[t["met"]] + (f" ({t['why']})" if t.get("why") else "")
        setting = t["setting"].removeprefix("checkpointing_")
        lines.append(
            f"| {t['variant']}: {t['target']} | {t['part']} | {setting} | {_num(t['value'], '.2f')} | {met} |"
        )
    lines += ["", "| part | status | seconds | note |", "|---|---|---|---|"]
    for name, part in report["parts"].items():
        note = part.get("reason") or part.get("error") or part.get("summary") or part.get("kernel_probe") or ""
        lines.append(f"| {name} | {part['status']} | {_num(part.get('seconds'), '.0f')} | {note} |")
    kernels = (report["parts"].get("kernel_probe") or {}).get("kernels") or []
    if kernels:
        lines += [
            "",
            "| kernel | dtype | pattern | passed | error | tolerance | exception |",
            "|---|---|---|---|---|---|---|",
        ]
        for k in kernels:
            lines.append(
                f"| {k.get('kernel')} | {k.get('dtype')} | {k.get('pattern')} | {k.get('passed')} | "
                f"{_num(k.get('error'), '.2e')} | {_num(k.get('tolerance'), '.2e')} | {k.get('exception') or ''} |"
            )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """`bench.png`: speed over the baseline (bars: median, error bars: IQR) and step peak over the baseline, per part,
    variant and checkpointing setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, speeds, lows, highs, peaks = [], [], [], [], []
    for part in report["parts"].values():
        for setting, variants in (part.get("settings") or {}).items():
            for variant, e in variants.items():
                r = e.get("speedup")
                if not r:
                    continue
                labels.append(
                    f"{variant}\nvs {r.get('baseline', 'stock')}, ckpt {setting.removeprefix('checkpointing_')}"
                )
                speeds.append(r["median"])
                lows.append(r["median"] - r["q1"])
                highs.append(r["q3"] - r["median"])
                peaks.append(e.get("peak_ratio") or 0.0)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(labels)), 8), sharex=True)
    x = list(range(len(labels)))
    top.bar(x, speeds, color="tab:blue")
    top.errorbar(x, speeds, yerr=[lows, highs], fmt="none", ecolor="black", capsize=4)
    top.axhline(1, color="grey", linewidth=1)
    top.set_ylabel("speed vs baseline (x)")
    top.set_title(f"trl-ext bench --device: {report['device']}, preset {report['preset']}")
    bottom.bar(x, peaks, color="tab:orange")
    bottom.axhline(1, color="grey", linewidth=1)
    bottom.set_ylabel("step peak vs baseline (x; 0: not measured)")
    bottom.set_xticks(x, labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
