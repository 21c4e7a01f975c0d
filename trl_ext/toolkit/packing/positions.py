"""Where a packed model call computes each position of the padded batch it stands for.

A packing plugin that runs a padded `[rows, length]` call on one packed row `[1, N]` announces around it
(`packed_positions`) which packed position computes each padded position. A module inside that works on per-position
inputs (fused_logprobs' output head) reads it (`current_packed_positions`) and, when it returns the padded layout
itself, says so (`PackedPositions.padded_output`): the packing plugin then leaves that output as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import cast

import torch

from ...call_context import call_entered, current_call

__all__ = ["PackedPositions", "current_packed_positions", "packed_positions"]


@dataclasses.dataclass
class PackedPositions:
    """The packed positions of a padded `[rows, length]` call run on one packed row: `padded` (`(M,)`), the flat
    padded positions (`row * length + column`) the packed row computes, and `packed` (`(M,)`), the packed position
    computing each (several may share one: a prompt token computed once for two rows). `padded_output` is set by a
    module inside the call that returned the padded layout itself; the packing plugin then leaves the output."""

    rows: int
    length: int
    padded: torch.Tensor
    packed: torch.Tensor
    padded_output: bool = False

    def index(self) -> torch.Tensor:
        """`[rows, length]`: the packed position of each padded position, -1 where the packed row has none."""
        out = torch.full((self.rows * self.length,), -1, dtype=torch.long, device=self.packed.device)
        out = out.index_copy(0, self.padded.to(out.device), self.packed.to(torch.long))
        return out.view(self.rows, self.length)


@contextlib.contextmanager
def packed_positions(positions: PackedPositions) -> Iterator[PackedPositions]:
    """Announce `positions` to the modules called inside the block (one packed model call)."""
    with call_entered(packed_positions=positions):
        yield positions


def current_packed_positions() -> PackedPositions | None:
    """The announcement of the packed call being run, or None outside one."""
    return cast("PackedPositions | None", current_call().packed_positions)
