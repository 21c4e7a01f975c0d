"""Where a step's time goes: `torch.profiler` over the `trl-ext bench --device` workload, per variant.

`trl-ext bench --device cuda` says how fast each plugin's step is; this says why. Each variant of the bench's
`packing` part (stock, padding_free, prompt_sharing) and of its `fused_logprobs` part (stock, fused_logprobs) is built
as the bench builds it, warmed on every batch, then one step per batch is timed by phase (`get_batch_samples`, each
`training_step`, the optimizer, each between synchronisations) and one more pass over the batches runs under the
profiler. Written to `--out`: `summary.json` (per variant: phase medians, the device's busy time against the wall
time, host-device synchronisations counted, the top operators by device and by host time) and `<variant>.txt` (the
profiler's tables). Gradient checkpointing off (`--checkpointing` turns it on).

    python benchmarks/gpu_profile.py --device cuda --out /tmp/profile        # one H200: about 2 minutes
    python benchmarks/gpu_profile.py --device cpu --preset tiny --out /tmp/p  # the pipeline on a CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from trl_ext.app.bench import device_parts as parts
from trl_ext.app.bench.device_parts import OnlineStepper, Stepper, dpo_trainer, set_checkpointing
from trl_ext.app.bench.device_workload import online_trainer

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def phases(stepper: Stepper, index: int) -> dict[str, float]:
    """One step with a synchronisation after each phase: seconds of each."""
    trainer, device = stepper.trainer, stepper.device
    trainer.model.zero_grad(set_to_none=True)
    _sync(device)
    out: dict[str, float] = {}
    t = time.perf_counter()
    batches = stepper.steps[index % len(stepper.steps)]
    samples, items = trainer.get_batch_samples(iter(batches), len(batches), trainer.args.device)
    _sync(device)
    out["get_batch_samples"], t = time.perf_counter() - t, time.perf_counter()
    for inputs in samples:
        trainer.training_step(trainer.model, inputs, items)
    _sync(device)
    out["training_step"], t = time.perf_counter() - t, time.perf_counter()
    if stepper.optimizer is not None:
        stepper.optimizer.step()
    _sync(device)
    out["optimizer"] = time.perf_counter() - t
    trainer.state.global_step += 1  # as train() does: `verify` checks the first step only
    out["step"] = sum(out.values())
    return out


def profiled(stepper: Stepper, name: str, out: Path, device: str) -> dict[str, Any]:
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    n = len(stepper.steps)
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities, record_shapes=False) as prof:
        for i in range(n):
            stepper.step(i, keep=False)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    device_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]  # an operator's time is theirs
    busy = sum(getattr(e, device_key, 0) for e in kernels) / 1e6 if cuda else None
    syncs = {e.key: e.count for e in events if e.key in SYNC_EVENTS}
    lines = [f"# {name}: {n} steps in {wall:.3f} s under the profiler"]
    if cuda:
        lines.append(events.table(sort_by=device_key, row_limit=30))
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=30))
    (out / f"{name}.txt").write_text("\n".join(lines) + "\n")

    def top(key: str, k: int = 12) -> list[list[Any]]:
        ranked = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:k]
        return [[e.key[:80], e.count, round(getattr(e, key, 0) / 1e3 / n, 3)] for e in ranked]

    return {
        "profiled_steps": n,
        "wall_per_step_s": wall / n,
        "device_busy_per_step_s": None if busy is None else busy / n,
        "syncs": syncs,
        "top_device_ms_per_step": top(device_key) if cuda else None,
        "top_host_self_ms_per_step": top("self_cpu_time_total"),
    }


def variant(stepper: Stepper, name: str, out: Path, device: str, warm: int) -> dict[str, Any]:
    for _ in range(warm):
        for i in range(len(stepper.steps)):
            stepper.step(i, keep=False)
    timed = [phases(stepper, i) for i in range(len(stepper.steps))]
    entry: dict[str, Any] = {k: statistics.median(t[k] for t in timed) for k in timed[0]}
    entry["steps"] = [round(t["step"], 4) for t in timed]
    entry["attention"] = parts.attention_of(stepper.trainer)
    entry.update(profiled(stepper, name, out, device))
    busy = entry["device_busy_per_step_s"]
    print(
        f"{name}: step {entry['step']:.3f} s (batch {entry['get_batch_samples']:.3f}, train "
        f"{entry['training_step']:.3f}, optimizer {entry['optimizer']:.3f}); profiled "
        f"{entry['wall_per_step_s']:.3f} s/step, device busy "
        f"{'-' if busy is None else f'{busy:.3f}'} s/step; syncs {entry['syncs']}",
        flush=True,
    )
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--out", required=True)
    parser.add_argument("--warm", type=int, default=1, help="warm-up passes over the batches per variant")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--parts", default="packing,fused_logprobs")
    opts = parser.parse_args(argv)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    parts._quiet()
    summary: dict[str, Any] = {"device": opts.device, "preset": opts.preset, "checkpointing": opts.checkpointing}
    if opts.device.startswith("cuda"):
        summary["gpu"] = torch.cuda.get_device_name()
    summary["torch"] = torch.__version__
    with tempfile.TemporaryDirectory() as tmp:
        opts.tmp = tmp
        chosen = opts.parts.split(",")
        if "packing" in chosen:
            preset, models, data = parts._dpo_setup(opts)
            for name in ("stock", "padding_free", "prompt_sharing"):
                trainer = dpo_trainer(preset, models, data, opts, {name: True} if name != "stock" else {})
                stepper = Stepper(trainer, opts.device)
                set_checkpointing(trainer, opts.checkpointing)
                summary[name] = variant(stepper, name, out, opts.device, opts.warm)
                del stepper, trainer
                if opts.device.startswith("cuda"):
                    torch.cuda.empty_cache()
                (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            del models
        if "fused_logprobs" in chosen:
            for name in ("stock", "fused_logprobs"):
                online = OnlineStepper(online_trainer(opts, name), opts.device)
                set_checkpointing(online.trainer, opts.checkpointing)
                summary[f"online_{name}"] = variant(online, f"online_{name}", out, opts.device, opts.warm)
                del online
                if opts.device.startswith("cuda"):
                    torch.cuda.empty_cache()
                (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
