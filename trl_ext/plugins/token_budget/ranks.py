"""Several processes: the same number of micro-batches on every rank, and the exchange of each step's metrics.

TRL's `_compute_loss` gathers its metrics across ranks on every call, DDP reduces gradients on the synchronised
backward, and ZeRO-3 and FSDP2 gather parameters on every forward: every rank must run the same number of forwards and
backwards per step, in the same slots. A rank whose pairs cut into fewer micro-batches than another's runs extra ones:
its smallest micro-batch again with loss weight 0 (no gradient, its metrics not recorded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .cut import MicroBatch


@dataclasses.dataclass
class Padding(MicroBatch):
    """A micro-batch run only to keep the ranks in step: weight 0, metrics and tokens not counted."""


def pad_to(micro_batches: Sequence[MicroBatch], count: int) -> list[MicroBatch]:
    """`micro_batches` followed by `count - len(micro_batches)` zero-weight copies of the smallest (fewest tokens,
    the first of equals)."""
    if count < len(micro_batches):
        raise ValueError(f"cannot pad {len(micro_batches)} micro-batches to {count}")
    if not micro_batches:
        raise ValueError("a step without micro-batches cannot be padded")
    smallest = min(micro_batches, key=lambda mb: mb.tokens)
    extra = [Padding(smallest.pairs, smallest.inputs, 0.0, smallest.tokens) for _ in range(count - len(micro_batches))]
    return [*micro_batches, *extra]


class Ranks:
    """The `size` processes of a run, over `torch.distributed`'s default group (`device`: where the backend takes
    tensors)."""

    def __init__(self, size: int, device: torch.device | str) -> None:
        self.size = size
        self.device = torch.device(device)

    def max(self, value: int) -> int:
        """The largest `value` over the ranks (one all-reduce)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return int(tensor.item())

    def gather(self, obj: Any) -> list[Any]:
        """`obj` of every rank, in rank order (one all-gather)."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(out, obj)
        return out
