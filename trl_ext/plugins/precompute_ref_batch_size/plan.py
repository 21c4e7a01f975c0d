"""The batch plan of a precompute: what each pair costs in a batch, length-sorted fixed-size or token-budget batches,
and how batches are dealt to ranks."""

from __future__ import annotations

from typing import Any


class BatchPlan:
    """Costs of the pairs of one split and the batches built from them.

    Args:
        lengths (`dict[str, np.ndarray]`): per-row token counts of `prompt_ids`, `chosen_ids`, `rejected_ids`.
        max_length (`int` or `None`): the collator's truncation length.
        packed (`bool`): batches are packed (padding_free): a batch costs its real tokens, else its padded tokens.
        sort (`str`): `"length"` (longest first) or `"none"` (dataset order, TRL's batches).
    """

    def __init__(self, lengths: dict[str, Any], max_length: int | None, packed: bool, sort: str) -> None:
        import numpy as np

        self.packed = packed
        self.sort = sort
        chosen = lengths["prompt_ids"] + lengths["chosen_ids"]
        rejected = lengths["prompt_ids"] + lengths["rejected_ids"]
        if max_length is not None:
            chosen = np.minimum(chosen, max_length)
            rejected = np.minimum(rejected, max_length)
        self.pair_len = np.maximum(chosen, rejected)  # a padded batch pads both sequences of every pair to this
        self.real_tokens = chosen + rejected
        # The key pairs are sorted by: what a pair costs in a batch of its own.
        self.unit_cost = self.real_tokens if packed else 2 * self.pair_len

    def batch_cost(self, indices) -> float:
        if len(indices) == 0:
            return 0.0
        if self.packed:
            return float(self.real_tokens[indices].sum())
        return float(2 * len(indices) * self.pair_len[indices].max())

    def order(self, indices):
        """Planning order of `indices`: longest first (so "auto" and out-of-memory meet the worst batch first)."""
        import numpy as np

        if self.sort == "none":
            return np.sort(indices)
        return indices[np.argsort(-self.unit_cost[indices], kind="stable")]

    def fixed_batches(self, indices, batch_size: int):
        ordered = self.order(indices)
        return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]

    def budget_batches(self, indices, budget: float):
        import numpy as np

        ordered = self.order(indices)
        batches: list[list[int]] = []
        current: list[int] = []
        cur_max, cur_sum = 0, 0
        for i in ordered.tolist():
            new_max = max(cur_max, int(self.pair_len[i]))
            new_sum = cur_sum + int(self.real_tokens[i])
            cost = new_sum if self.packed else 2 * (len(current) + 1) * new_max
            if current and cost > budget:
                batches.append(current)
                current, new_max, new_sum = [], int(self.pair_len[i]), int(self.real_tokens[i])
            current.append(i)
            cur_max, cur_sum = new_max, new_sum
        if current:
            batches.append(current)
        return [np.asarray(b, dtype=np.int64) for b in batches]

    def deal(self, batches, world: int):
        """Split batches across ranks, heaviest first in snake order, with equal batch counts on every rank.

        ZeRO-3 forwards all-gather parameters, so every rank must run the same number of forwards; a rank with fewer
        batches runs a one-pair filler batch whose result is dropped. Returns, per rank, `(indices, is_filler)` items.
        """
        import numpy as np

        ranked = sorted(range(len(batches)), key=lambda b: -self.batch_cost(batches[b]))
        per_rank: list[list] = [[] for _ in range(world)]
        for pos, b in enumerate(ranked):
            turn, slot = divmod(pos, world)
            per_rank[slot if turn % 2 == 0 else world - 1 - slot].append((batches[b], False))
        count = max((len(r) for r in per_rank), default=0)
        filler = np.asarray([int(np.argmin(self.unit_cost))], dtype=np.int64)
        for lst in per_rank:
            lst.sort(key=lambda item: -self.batch_cost(item[0]))  # heaviest first: memory peaks early
            lst.extend([(filler, True)] * (count - len(lst)))
        return per_rank


def concat_results(results):
    """`[(indices, chosen, rejected), ...]` -> one `(indices, chosen, rejected)` triple (possibly empty)."""
    import numpy as np

    if not results:
        return np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32)
    return tuple(np.concatenate([np.asarray(r[i]) for r in results]) for i in range(3))
