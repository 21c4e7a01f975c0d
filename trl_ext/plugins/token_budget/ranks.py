"""Several processes: the cut of every rank's pairs, balanced, and the same number of micro-batches on every rank
(TRL's gathers, DDP's reduction and ZeRO-3/FSDP2's parameter gathers need as many forwards and backwards on each): a
rank with fewer runs its smallest again with loss weight 0 (`Padding`: no gradient, its metrics not recorded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from trl_ext.api import InternalError

from .cut import Layout, MicroBatch, Pair, check_example, pair_length, plan, tokens


@dataclasses.dataclass
class Padding(MicroBatch):
    """A micro-batch run only to keep the ranks in step: weight 0, metrics and tokens not counted."""


def pad_to(micro_batches: Sequence[MicroBatch], count: int, smallest: MicroBatch | None = None) -> list[MicroBatch]:
    """`micro_batches` followed by `count - len(micro_batches)` zero-weight copies of `smallest`, by default the
    smallest of them (fewest tokens, the first of equals)."""
    if count < len(micro_batches):
        raise ValueError(f"cannot pad {len(micro_batches)} micro-batches to {count}")
    if smallest is None:
        if not micro_batches:
            raise ValueError("no micro-batch to repeat")
        smallest = min(micro_batches, key=lambda mb: mb.tokens)
    extra = [Padding(smallest.pairs, smallest.inputs, 0.0, smallest.tokens) for _ in range(count - len(micro_batches))]
    return [*micro_batches, *extra]


def global_pairs(
    examples: Sequence[Sequence[Sequence[Mapping[str, Any]]]],
    packed: bool | Layout,
    max_length: int | None,
    multiple: int | None = None,
) -> tuple[list[Pair], list[int]]:
    """The pairs of one step on every rank (`examples[rank][slot]`: the examples of that rank's stock micro-batch),
    as `Pair`s whose `batch` is `rank * slots + slot`, and the size of each such stock micro-batch."""
    slots = {len(part) for part in examples}
    if len(slots) != 1:
        raise InternalError(f"token_budget: ranks fetched different numbers of stock micro-batches in a step: {slots}")
    pairs = []
    sizes = []
    for r, rank in enumerate(examples):
        for i, batch in enumerate(rank):
            sizes.append(len(batch))
            for j, example in enumerate(batch):
                check_example(example)
                pairs.append(Pair(r * len(rank) + i, j, pair_length(example, packed, max_length, multiple)))
    return pairs, sizes


def balanced_plan(
    pairs: Sequence[Pair], sizes: Sequence[int], budget: int, packed: bool | Layout, ranks: int
) -> tuple[list[list[Pair]], list[int]]:
    """Cut a step's pairs of every rank (`global_pairs`) into micro-batches of at most `budget` tokens, by stock weight
    then length (similar lengths share one), and give each, most tokens first, to the least-loaded rank; the same on
    every rank (deterministic). Returns the micro-batches and their ranks."""
    order = sorted(pairs, key=lambda p: (sizes[p.batch], -p.length, p.batch, p.row))
    runs = plan(order, sizes, budget, packed)
    load = [0] * ranks
    count = [0] * ranks
    owner = [0] * len(runs)
    for k in sorted(range(len(runs)), key=lambda k: (-tokens(runs[k], packed), k)):
        r = min(range(ranks), key=lambda r: (load[r], count[r], r))
        owner[k] = r
        load[r] += tokens(runs[k], packed)
        count[r] += 1
    return runs, owner
