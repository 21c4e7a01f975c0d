"""`trl-ext bench --device cuda`: the one GPU proof command (docs/benchmarks.md). Each part (`PARTS`) runs in a process
of its own under its own timeout, all within `--time-limit`, each part's JSON written to `--out/parts/` as soon as it
is done; `report.json` (every part, the targets of issue 34 with verdicts computed here from the numbers), `table.md`
and `bench.png` go to `--out`. `--device cpu --preset tiny` runs the same pipeline in seconds (the tests).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ...errors import UsageError
from .device_workload import PRESETS
from .report import matplotlib_missing
from .stats import direction, progress

PARTS = ("kernel_probe", "gpu_tests", "packing", "fused_logprobs", "token_budget")
#: Each part's own timeout (seconds) by preset; a part also stops at what is left of `--time-limit`.
PART_SECONDS = {
    "1b": {"kernel_probe": 45, "gpu_tests": 120, "packing": 150, "fused_logprobs": 90, "token_budget": 100},
    "tiny": {"kernel_probe": 60, "gpu_tests": 180, "packing": 240, "fused_logprobs": 180, "token_budget": 240},
}
#: Default `--time-limit`: the 8 minutes one H100 call may take, less the wheels' install and a margin.
TIME_LIMIT = 440
#: A part not started with less than this left is reported as skipped.
MIN_PART_SECONDS = 15
ROOT = Path(__file__).resolve().parents[3]
GPU_TESTS = ROOT / "tests" / "plugins" / "test_varlen_gpu.py"


def check(device: str, preset: str | None, model: str | None) -> str:
    """The preset to run, or a one-line `UsageError` for what cannot run here."""
    import torch

    if model:
        raise UsageError("`--model` is not used with `--device`: the device run builds its preset's model.")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"`--device cuda`: torch {torch.__version__} sees no CUDA device here; run it on a GPU machine "
            "(`--device cpu --preset tiny` runs the same pipeline on a CPU)."
        )
    chosen = preset or ("1b" if device == "cuda" else "tiny")
    if device == "cpu" and chosen != "tiny":
        raise UsageError(f"`--preset {chosen}` is a GPU workload; on a CPU use `--preset tiny`.")
    return chosen


def run(device: str, preset: str, out: Path, rounds: int | None, time_limit: float) -> int:
    started = time.perf_counter()
    deadline = started + time_limit
    parts_dir = out / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    report = _header(device, preset, rounds, time_limit)
    for part in PARTS:
        left = deadline - time.perf_counter()
        limit = min(PART_SECONDS[preset][part], left)
        if limit < MIN_PART_SECONDS:
            report["parts"][part] = {"status": "skipped", "reason": f"{left:.0f} s left of --time-limit"}
        elif part == "gpu_tests":
            report["parts"][part] = _gpu_tests(limit)
        else:
            report["parts"][part] = _worker(part, device, preset, rounds, parts_dir / f"{part}.json", limit)
        progress(f"{part}: {report['parts'][part]['status']}")
        _write(report, out, started, draw=False)
    _write(report, out, started, draw=matplotlib_missing() is None)
    print(markdown(report))
    print(f"report: {out / 'report.json'}  table: {out / 'table.md'}  ({report['wall_seconds']:.0f} s)")
    return 0 if all(p["status"] in ("done", "skipped") for p in report["parts"].values()) else 1


def _header(device: str, preset: str, rounds: int | None, time_limit: float) -> dict[str, Any]:
    import torch

    from ... import __version__, _compat

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {
        "command": "trl-ext bench --device " + device + f" --preset {preset}",
        "device": name,
        "preset": preset,
        "model": PRESETS[preset]["model"],
        "dtype": PRESETS[preset]["dtype"],
        "rounds": rounds or PRESETS[preset]["rounds"],
        "warmup": PRESETS[preset]["warmup"],
        "time_limit": time_limit,
        "versions": {
            "trl_ext": __version__,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": _compat.installed_version("transformers"),
            "trl": _compat.installed_version("trl"),
        },
        "parts": {},
    }


def _run(command: list[str], limit: float, **popen: Any) -> tuple[subprocess.Popen, str, str]:
    """`command` in its own process session, killed with everything it started after `limit` seconds: the process,
    its status and its output (when piped)."""
    proc = subprocess.Popen(command, start_new_session=True, **popen)
    try:
        output, _ = proc.communicate(timeout=limit)
        status = "done" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = "timeout"
    return proc, status, output or ""


def _worker(part: str, device: str, preset: str, rounds: int | None, path: Path, limit: float) -> dict[str, Any]:
    """`device_parts PART` under `limit`; its JSON (what it measured so far, if it was cut short) with the status."""
    path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "trl_ext.app.bench.device_parts", part, "--device", device, "--preset", preset]
    command += ["--out", str(path)] + (["--rounds", str(rounds)] if rounds else [])
    progress(f"{part}: started (timeout {limit:.0f} s)")
    start = time.perf_counter()
    status = _run(command, limit)[1]
    result: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    result.update(status=status, seconds=time.perf_counter() - start, timeout=limit)
    return result


def _gpu_tests(limit: float) -> dict[str, Any]:
    """The `gpu`-marked tests, run by pytest under `limit`; its counts and the end of its output."""
    if not GPU_TESTS.exists():
        return {"status": "skipped", "reason": f"{GPU_TESTS} not found (not a source checkout)"}
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(GPU_TESTS), "-p", "no:cacheprovider"]
    progress(f"gpu_tests: {' '.join(command[1:])} (timeout {limit:.0f} s)")
    start = time.perf_counter()
    pipe = dict(cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc, status, output = _run(command, limit, **pipe)
    print(output[-4000:], flush=True)
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    return {
        "status": status,
        "command": "python -m pytest -q -m gpu tests/plugins/test_varlen_gpu.py",
        "returncode": proc.returncode,
        "counts": counts,
        "summary": summary,
        "output_tail": output[-3000:],
        "seconds": time.perf_counter() - start,
        "timeout": limit,
    }


def _write(report: dict[str, Any], out: Path, started: float, draw: bool) -> None:
    report["targets"] = targets(report)
    report["complete"] = len(report["parts"]) == len(PARTS)
    report["wall_seconds"] = time.perf_counter() - started
    if draw:
        plot(report, out / "bench.png")
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "table.md").write_text(markdown(report) + "\n")


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
