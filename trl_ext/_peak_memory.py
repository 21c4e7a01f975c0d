"""Peak memory of this process: the resident set on Linux (reset the high-water mark, read it back) and the CUDA
allocator's peak. The line each trainer logs when `train()` returns, the bench and `benchmarks/` measure memory this
way."""

from __future__ import annotations

from typing import Any


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
