"""Helpers the built-in plugins share (re-exported by `trl_ext.api`); nothing heavy is imported at import
time: `Ranks`, free memory, and the peak memory of this process (the resident set on Linux: reset the high-water
mark, read it back; the CUDA allocator's peak), as the line each trainer logs when `train()` returns, the bench and
`benchmarks/` measure it."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["PeakMemory", "Ranks", "free_memory_bytes", "peak_bytes", "reset_peak_rss", "rss_mib", "size_text"]


class Ranks:
    """The processes of a run (`world`, this `rank`, `local_world` on this node: `LOCAL_WORLD_SIZE`, else `world`),
    and the one way trl-ext runs a collective across them: every rank calls the same methods in the same order, and
    with one process no method calls `torch.distributed` at all."""

    def __init__(self, world: int, rank: int, local_world: int | None = None) -> None:
        self.world = max(1, int(world))
        self.rank = int(rank)
        self.is_main = self.rank == 0
        if local_world is None:
            local = os.environ.get("LOCAL_WORLD_SIZE")
            local_world = int(local) if local and local.isdigit() else self.world
        self.local_world = local_world

    @classmethod
    def of(cls, accelerator: Any) -> Ranks:
        """The ranks of a trainer's `accelerate.Accelerator` (anything without `num_processes` is one process)."""
        return cls(
            int(getattr(accelerator, "num_processes", 1) or 1), int(getattr(accelerator, "process_index", 0) or 0)
        )

    def __repr__(self) -> str:
        return f"Ranks(world={self.world}, rank={self.rank})"

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (one `all_gather_object`)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (one `broadcast_object_list`)."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_rows(self, vec: Any) -> Any:
        """Every rank's 1-D tensor `vec` as the rows of a `[world, numel]` tensor, in rank order (one collective)."""
        if self.world == 1:
            return vec.unsqueeze(0)
        import torch
        import torch.distributed as dist

        out = torch.empty(self.world * vec.numel(), dtype=vec.dtype, device=vec.device)
        # torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single` and warns on the old name.
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, vec)
        return out.view(self.world, vec.numel())

    def max(self, value: int, device: Any) -> int:
        """The largest integer `value` over the ranks (one `all_reduce(MAX)` of a one-element tensor on `device`)."""
        if self.world == 1:
            return int(value)
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([int(value)], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def all_true(self, flag: bool, device: Any) -> bool:
        """True only if `flag` is True on every rank (one `max` over the ranks)."""
        return not self.max(0 if flag else 1, device)

    def any_true(self, flag: bool, device: Any) -> bool:
        """True if `flag` is True on any rank (one `max` over the ranks)."""
        return bool(self.max(1 if flag else 0, device))


def free_memory_bytes(device: Any) -> int:
    """Free memory where tensors on `device` would live: device memory on an accelerator, available RAM on CPU."""
    import torch

    kind = getattr(device, "type", "cpu")
    if kind == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    if kind == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[0])
    from deepspeed.accelerator import get_accelerator  # other accelerators (XPU, NPU, ...)

    return int(get_accelerator().available_memory(getattr(device, "index", None)))


def size_text(size: float) -> str:
    """A number of bytes as a user reads it: `1.23 GiB`, `510 MiB`, `3.5 MiB`, `24 KiB`, `512 bytes`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            value = size / scale
            digits = 2 if unit == "GiB" else 0 if value >= 10 else 1
            return f"{value:.{digits}f} {unit}"
    return f"{size:.0f} bytes"


def rss_mib(field: str = "VmHWM") -> float | None:
    """`VmHWM` (peak RSS since the last reset) or `VmRSS` (current RSS) of this process in MiB; None where
    `/proc/self/status` does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_bytes(device: Any) -> float | None:
    """The peak since the last reset: allocated by the CUDA allocator on a CUDA `device`, else the resident set (None
    where `/proc` does not say)."""
    if getattr(device, "type", None) == "cuda":
        import torch

        return float(torch.cuda.max_memory_allocated(device))
    mib = rss_mib("VmHWM")
    return None if mib is None else mib * 2**20


def reset_peak_rss() -> float | None:
    """Reset the peak-RSS counter (`clear_refs` 5, Linux >= 4.0); the current RSS in MiB, or None where this cannot
    be measured."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return rss_mib("VmRSS")


class PeakMemory:
    """The peak memory of a span of work on `device`: allocated by the CUDA allocator on a CUDA device (its peak
    reset when the span starts), the process's resident set on CPU (its high-water mark reset). `text()` is the
    phrase the log line uses."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = getattr(device, "type", None) == "cuda" and torch.cuda.is_available()
        self.device = device
        self.peak_bytes: float | None = None

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_rss()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak_bytes = peak_bytes(self.device if self.cuda else None)

    def text(self) -> str:
        if self.peak_bytes is None:
            return "peak memory not measured on this platform"
        return f"peak memory {size_text(self.peak_bytes)} " + (
            f"allocated on {self.device}" if self.cuda else "resident (CPU)"
        )
