"""The memory probe shared by the precompute's and token_budget's `"auto"` (`trl_ext.toolkit.memory`)."""

from __future__ import annotations

import sys

import pytest
import torch

from trl_ext.toolkit import memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is read from /proc (Linux)")


def _measure_reused_hole(monkeypatch, trim: bool) -> float:
    """MiB the probe sees for 600 allocations of 64 KiB that fit in a hole earlier work left in the C heap."""
    if not trim:
        monkeypatch.setattr(memory, "_MALLOC_TRIM", False)
    earlier = [torch.ones(16 * 1024) for _ in range(600)]  # 64 KiB each: from the C heap, not mmap
    pin = torch.ones(16 * 1024)  # above them, so that freeing them leaves a hole the heap cannot give back itself
    del earlier
    with memory.ExtraMemory(torch.device("cpu")) as peak:
        again = [torch.ones(16 * 1024) for _ in range(600)]
    del again, pin
    return peak.used / 2**20


def test_memory_freed_by_earlier_work_is_measured(monkeypatch):
    """The allocator's free memory is given back before the probe (`malloc_trim`): work that reuses it is seen at
    its size, not as free."""
    assert _measure_reused_hole(monkeypatch, trim=True) > 30  # 37.5 MiB allocated
    monkeypatch.undo()
    # Without the release the same work reads as nearly free: what the release guards against.
    assert _measure_reused_hole(monkeypatch, trim=False) < 10


def test_over_budget_projects_linearly():
    assert memory.over_budget(cost=400, ref_cost=100, ref_used=30, budget=100)
    assert not memory.over_budget(cost=300, ref_cost=100, ref_used=30, budget=100)
    assert not memory.over_budget(cost=10**9, ref_cost=100, ref_used=0, budget=1)  # nothing measured
