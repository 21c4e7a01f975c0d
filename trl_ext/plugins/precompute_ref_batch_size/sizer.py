"""The batch plan of a precompute (what each pair costs in a batch, length-sorted fixed-size or token-budget batches,
how batches are dealt to ranks) and the `"auto"` batch size: memory probing (peak RSS on CPU, the allocator on GPU)
and the probe that picks the per-batch token budget."""

from __future__ import annotations

import math
import time
from typing import Any

from trl_ext import _compat
from trl_ext.api import NOTICE, get_logger
from trl_ext.toolkit.memory import ExtraMemory, budget_bytes, over_budget

from . import NAME

logger = get_logger(f"trl_ext.plugins.{NAME}")

#: `"auto"` stops doubling when real tokens/s grew by < 10%, but only past this many tokens per batch: below it, fixed
#: per-batch costs dominate and timings are noise.
PLATEAU_MIN_TOKENS = 4096
#: Added to an out-of-memory error that is re-raised because the ranks run in lockstep.
OOM_ADVICE = (
    f"trl-ext `{NAME}`: out of memory in the reference precompute under multi-process DeepSpeed/FSDP, where every "
    "rank must run the same forwards, so a rank cannot back off alone. Set a smaller fixed "
    f'`precompute_ref_batch_size`, or "auto" with a smaller `plugins.{NAME}.ram_budget` on CPU.'
)


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


def lockstep(trainer, ranks) -> bool:
    """Whether the ranks must run the same forwards: several processes under DeepSpeed or FSDP, whose forwards gather
    parameters with collectives. There, an out-of-memory error is never caught: the rank that caught it would enter
    the next collective while the others are still inside the forward's, and the job could hang."""
    sharded = any(getattr(trainer, flag, False) for flag in _compat.TRAINER_SHARDING_FLAGS)
    return ranks.world > 1 and bool(sharded)


def probe(run, model, todo, store, progress):
    """Find the largest useful batch that fits (docs/plugins/precompute_ref_batch_size.md, `"auto"`); keep what the
    probes computed (each probe takes the next heaviest pairs, so none is computed twice); set the token budget.
    Every rank probes its share of the heaviest pairs and all take each decision from everyone's outcome, so they
    run the same forwards (ZeRO-3 lockstep)."""
    import numpy as np
    import torch

    device = run.trainer.accelerator.device
    budget = budget_bytes(run.opts, device, run.ranks)
    world, rank = run.ranks.world, run.ranks.rank
    heavy = todo[np.argsort(-run.plan.unit_cost[todo], kind="stable")]
    share = heavy[rank::world]
    limit = len(todo) // world  # every rank can run a probe of this many pairs
    strict = lockstep(run.trainer, run.ranks)
    projected_stops = 0
    largest = {"k": 0, "cost": 0.0, "used": 0.0}  # the largest probe that fit
    fastest = {"k": 0, "cost": 0.0, "speed": 0.0}  # the fitting probe with the most real tokens per second
    fail = {"k": math.inf, "cost": math.inf, "oom": False}
    taken = 0  # pairs per rank the probes computed: each probe takes the next `k` heaviest, so none is redone

    def probe(k: int) -> float | None:
        """Probe `k` pairs per rank; return the real tokens/s over all ranks if it fit everywhere, else None."""
        nonlocal taken, projected_stops
        if strict and largest["k"]:
            # Every rank knows every rank's share, so all take this decision alike without a collective.
            cost = max(run.plan.batch_cost(heavy[r::world][taken : taken + k]) for r in range(world))
            if over_budget(cost, largest["cost"], largest["used"], budget):
                projected_stops += 1
                fail.update(k=k, cost=cost, oom=False)
                run.info(
                    "trl-ext `%s`: auto probe %d pairs/rank not run: %.1f MiB projected, over the budget",
                    NAME,
                    k,
                    largest["used"] * cost / largest["cost"] / 2**20,
                )
                return None
        batch = share[taken : taken + k]
        cost = run.plan.batch_cost(batch)
        # CPU: process CPU time, which other jobs on a shared machine barely disturb; GPU: wall time.
        clock = time.process_time if device.type == "cpu" else time.perf_counter
        start = clock()
        try:
            with ExtraMemory(device) as peak:
                result = run.forward(model, batch)
            used = float(peak.used)
        except torch.OutOfMemoryError as exc:
            if strict:  # `lockstep`
                exc.add_note(OOM_ADVICE)
                raise
            if device.type == "cuda":
                torch.cuda.empty_cache()
            result, used = None, 0.0
        seconds = clock() - start
        fits = result is not None and used <= budget
        real = float(run.plan.real_tokens[batch].sum())
        outcomes = run.ranks.all_gather((fits, result is None, cost, used, real, seconds))
        if not any(o[1] for o in outcomes):
            # Nobody ran out of memory: keep the values (also from a probe that was merely over budget).
            store(concat_results([(batch, *result)]))
            progress.update(k * world)
            taken += k
        else:
            store(concat_results([]))
        speed = sum(o[4] for o in outcomes) / max(max(o[5] for o in outcomes), 1e-9)
        run.info(
            "trl-ext `%s`: auto probe %d pairs/rank, %s tokens: %s, %.0f real tokens/s",
            NAME,
            k,
            [int(o[2]) for o in outcomes],
            ["out of memory" if o[1] else f"{o[3] / 2**20:.1f} MiB" for o in outcomes],
            speed,
        )
        if all(o[0] for o in outcomes):
            largest.update(k=k, cost=min(o[2] for o in outcomes), used=max(o[3] for o in outcomes))
            if speed > fastest["speed"]:
                fastest.update(k=k, cost=largest["cost"], speed=speed)
            return speed
        fail.update(k=k, cost=min(o[2] for o in outcomes if not o[0]), oom=any(o[1] for o in outcomes))
        return None

    k, reason = 1, "the whole split fit"
    while limit and k <= limit - taken:
        before = fastest["speed"]
        speed = probe(k)
        if speed is None:
            reason = "memory"
            break
        if largest["cost"] >= PLATEAU_MIN_TOKENS and speed < 1.1 * before:
            reason = "throughput stopped growing"
            break
        if taken == limit:
            break
        k = min(2 * k, limit - taken)
    if reason == "memory":
        for _ in range(2):  # bisect between the last fit and the first failure
            mid = min((largest["k"] + fail["k"]) // 2, limit - taken)
            if mid <= largest["k"] or mid >= fail["k"]:
                break
            probe(mid)

    if limit == 0:
        batch_tokens = math.inf  # fewer pairs than processes: one batch each, nothing to measure
    elif largest["k"] == 0:
        # Even one pair per batch does not fit: run one pair at a time and say so.
        logger.warning(
            "trl-ext `%s`: a single pair needs more than the memory budget (%.0f MiB); using one pair per batch. "
            "On CPU, raise `plugins.%s.ram_budget`.",
            NAME,
            budget / 2**20,
            NAME,
        )
        batch_tokens = 0.0
    elif reason != "memory":
        batch_tokens = fastest["cost"] if reason != "the whole split fit" else largest["cost"]
    elif fail["oom"]:
        batch_tokens = largest["cost"]  # out of memory is not measured: never go beyond what ran
    else:
        # Memory grows about linearly with tokens: extrapolate from the largest probe that fit, with 10% headroom,
        # but never up to the size that did not fit.
        projected = largest["cost"] * 0.9 * budget / largest["used"] if largest["used"] > 0 else math.inf
        batch_tokens = max(largest["cost"], min(projected, fail["cost"] - 1))
    batch_tokens = run.ranks.broadcast(batch_tokens)
    run.state.batch_tokens = batch_tokens
    if reason == "memory" and projected_stops:
        reason = "memory (projected from the largest probe)"
    run.record.update(
        batch_tokens=batch_tokens, probe_pairs_per_rank=taken, auto_stop=reason, auto_projected_stops=projected_stops
    )
    if run.ranks.is_main:  # the one line a user sees by default (`notice`): what "auto" chose and why
        logger.log(
            NOTICE,
            'trl-ext `%s`: "auto" chose a budget of %s %s tokens per batch for the %s split (probed %d pairs per '
            "process; stopped by: %s; memory budget %.0f MiB per process on %s)",
            NAME,
            "unlimited" if math.isinf(batch_tokens) else f"{batch_tokens:.0f}",
            "real" if run.packed else "padded",
            run.name,
            taken,
            reason,
            budget / 2**20,
            device.type,
        )
    covered = np.concatenate([heavy[r::world][:taken] for r in range(world)]) if taken else np.zeros(0, np.int64)
    return np.setdiff1d(todo, covered, assume_unique=True)
