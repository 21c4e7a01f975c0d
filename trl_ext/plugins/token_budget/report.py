"""The one line `token_budget` logs when `train()` returns: what the cut did over that run, and the largest micro-batch
it built against the largest one stock TRL builds from the same batches (the figure activation memory follows)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["largest_stock_batch", "summary"]


def largest_stock_batch(batches: Sequence[Mapping[str, Any]]) -> tuple[int, int] | None:
    """`(rows, width)` of the largest of one step's stock micro-batches, read from the `input_ids` the trainer's
    collator built for them (TRL's `DataCollatorForPreference`: chosen and rejected rows, right-padded; a packing
    plugin's collator keeps that padded batch), so `rows x width` are the tokens stock's model call runs. None when a
    batch has no 2D `input_ids` tensor: then nothing is said about stock."""
    shapes = []
    for batch in batches:
        ids = batch.get("input_ids")
        shape = tuple(getattr(ids, "shape", ()))
        if len(shape) != 2:
            return None
        shapes.append((int(shape[0]), int(shape[1])))
    return max(shapes, key=lambda s: s[0] * s[1], default=None)


def _stock_text(state: Any, first_step: int) -> str:
    """The clause on stock's largest micro-batch of the steps from `first_step` on."""
    shapes = state.stock_largest[first_step:]
    where = " on this rank" if state.ranks.world > 1 else ""
    if not shapes or any(shape is None for shape in shapes):
        return f"; stock TRL's micro-batches{where} not measured (a batch of the collator has no 2D `input_ids`)"
    rows, width = max(shapes, key=lambda s: s[0] * s[1])
    return (
        f"; stock TRL's largest micro-batch from the same batches{where}: {rows * width} padded tokens ({rows} rows x "
        f"{width})"
    )


def summary(state: Any, first_step: int) -> str | None:
    """What the optimizer steps from `first_step` on ran: micro-batches against stock's, the largest micro-batch
    against the budget and against stock's largest, pairs over the budget, and on several processes the balance of
    tokens across ranks (None when no step ran)."""
    counts = state.micro_batch_counts[first_step:]
    if not counts:
        return None
    stock = sum(state.stock_micro_batch_counts[first_step:])
    largest = max(state.max_tokens[first_step:], default=0)
    text = (
        f"token_budget: {len(counts)} optimizer step(s) ran {sum(counts)} micro-batches (stock: {stock}) within the "
        f"budget of {state.budget} {state.packed} tokens"
    )
    over = sum(state.over_budget[first_step:])
    if over == 1 and largest > state.budget:
        text += f"; a pair of {largest} tokens is over the budget of {state.budget} and ran alone"
    elif over:
        # on several processes the pairs over the budget may have run on other ranks than this one
        text += f"; {over} pairs over the budget ran alone"
        text += f", the largest of {largest} tokens" if largest > state.budget else ""
    else:
        text += f", the largest micro-batch {largest} tokens"
    text += _stock_text(state, first_step)
    balance = [most / mean for most, mean in state.rank_tokens[first_step:] if mean > 0]
    if balance:
        text += (
            f"; tokens per rank, most / mean: median {statistics.median(balance):.2f}, worst {max(balance):.2f} "
            f"over {state.ranks.world} ranks"
        )
    return text
