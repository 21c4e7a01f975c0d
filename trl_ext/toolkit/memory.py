"""Memory measurement shared by the plugins that size work by probing it (the reference precompute's and
token_budget's `"auto"`): the extra memory a piece of work needs (peak RSS on CPU, the allocator's peak on GPU), the
budget it may use, and the linear projection that stops a probe before it runs."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

from .._shared import free_memory_bytes, reset_peak_rss

__all__ = ["GPU_MEMORY_FRACTION", "ExtraMemory", "budget_bytes", "over_budget"]

#: Share of the free GPU memory a probe may fill.
GPU_MEMORY_FRACTION = 0.9


def over_budget(cost: float, ref_cost: float, ref_used: float, budget: float) -> bool:
    """Whether a batch of `cost` tokens is expected to need more than `budget` bytes, extrapolated linearly from a
    measured batch of `ref_cost` tokens that needed `ref_used` bytes (nothing measured: not expected)."""
    if ref_cost <= 0 or ref_used <= 0:
        return False
    return ref_used * cost / ref_cost > budget


def _cpu_rss(field: str = "VmRSS:") -> int:
    """The resident set (or another `/proc/self/status` size `field`, such as the peak `VmHWM:`), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _release_free_heap() -> None:
    """Give the C allocator's free memory back to the kernel (glibc `malloc_trim`; a no-op without glibc), so that
    work measured by the resident set touches fresh pages instead of reusing what earlier work freed (it would look
    free)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None


class ExtraMemory:
    """Extra memory one forward needs beyond what the process holds before it (GPU: allocator; CPU: peak RSS, the
    allocator's free memory released first). Not `trl_ext._shared.PeakMemory`, the peak of a whole span (the
    line `train()` ends with)."""

    def __init__(self, device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def __enter__(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            _release_free_heap()
            self.base = _cpu_rss()
            self.cpu_ok = reset_peak_rss() is not None  # else the peak is not measured: the RSS at the end is used
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.used = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.used = max(0, (_cpu_rss("VmHWM:") if self.cpu_ok else _cpu_rss()) - self.base)


def budget_bytes(options, device, ranks) -> float:
    """Memory one probe forward may use: a share of the free device memory on GPU, `ram_budget` on CPU."""
    if device.type == "cuda":
        return GPU_MEMORY_FRACTION * free_memory_bytes(device)
    kind, value = options.ram_budget.kind, options.ram_budget.value
    if kind == "bytes":
        return value
    return value * free_memory_bytes(device) / max(1, ranks.local_world)
