"""The one line `token_budget` logs when `train()` returns: what the cut did over that run."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["summary"]


def summary(state: Any, first_step: int) -> str | None:
    """What the optimizer steps from `first_step` on ran: micro-batches against stock's, the largest micro-batch
    against the budget, pairs over the budget, and on several processes the balance of tokens across ranks (None
    when no step ran)."""
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
    balance = [most / mean for most, mean in state.rank_tokens[first_step:] if mean > 0]
    if balance:
        text += (
            f"; tokens per rank, most / mean: median {statistics.median(balance):.2f}, worst {max(balance):.2f} "
            f"over {state.ranks.world} ranks"
        )
    return text
