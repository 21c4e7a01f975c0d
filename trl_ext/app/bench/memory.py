"""Peak resident memory of this process on Linux: reset the high-water mark, read it back (the bench and
`benchmarks/` measure CPU memory this way)."""

from __future__ import annotations


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


def reset_peak_rss() -> float | None:
    """Reset the peak-RSS counter (`clear_refs` 5, Linux >= 4.0); the current RSS in MiB, or None where this cannot
    be measured."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return rss_mib("VmRSS")
