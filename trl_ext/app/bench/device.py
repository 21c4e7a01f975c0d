"""`trl-ext bench --device cuda`: the one GPU proof command (docs/benchmarks.md). Each part (`PARTS`) runs in a process
of its own under its own timeout, all within `--time-limit`, each part's JSON written to `--out/parts/` as soon as it
is done; `report.json` (every part, the targets of issue 34 with their verdicts), `table.md` and `bench.png` go to
`--out`. `--device cpu --preset tiny` runs the same pipeline in seconds (the tests).
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
from .stats import progress

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
    if device not in ("cuda", "cpu"):
        raise UsageError(f"`--device` must be cuda or cpu, got {device!r}.")
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
        _write(report, out, started, plot=False)
    from . import device_report

    _write(report, out, started, plot=device_report.matplotlib_missing() is None)
    print(device_report.markdown(report))
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


def _write(report: dict[str, Any], out: Path, started: float, plot: bool) -> None:
    from . import device_report

    report["targets"] = device_report.targets(report)
    report["complete"] = len(report["parts"]) == len(PARTS)
    report["wall_seconds"] = time.perf_counter() - started
    if plot:
        device_report.plot(report, out / "bench.png")
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "table.md").write_text(device_report.markdown(report) + "\n")
