"""`loss_type` "sft" (alone or combined, e.g. RPO's `["sigmoid", "sft"]`) under a re-cut.

TRL's sft term is one mean over the chosen completion tokens of the micro-batch (trl/trainer/dpo_trainer.py
`_compute_loss`: `-chosen_per_token_logps[chosen_mask].mean()` on 1.15+, `F.cross_entropy` over the same tokens on
1.10-1.14): stock weighs each chosen token by `1 / (T_m x A)`, `T_m` the chosen tokens of its stock micro-batch and
`A` the stock micro-batches of the step. A re-cut micro-batch `k` of `T_k` chosen tokens, its loss multiplied by its
weight `w_k` (its pairs' share of the step), weighs them by `w_k / T_k` instead. The plugin adds to the loss, with
its graph, `c x sum over the chosen tokens t of log p(t) x (w_k / T_k - 1 / (T_m(t) x A))` (`c`: the sft loss weight),
so each token counts as stock counts it: the gradient and the step's summed loss are stock's. `T_m` is counted on the
collated micro-batches (`completion_mask`, as TRL counts), on several processes exchanged (one all-gather per step).
Refused with `use_weighting=True` (`hooks.check_loss_types` says why).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .cut import MicroBatch
from .metrics import token_logps


def sft_weight(trainer: Any) -> float:
    """The summed loss weight of the trainer's "sft" terms (0.0: none)."""
    return float(sum(w for t, w in zip(trainer.loss_types, trainer.loss_weights, strict=True) if t == "sft"))


def chosen_tokens(mb: MicroBatch) -> dict[tuple[int, int], int]:
    """The chosen completion tokens TRL counts for each pair `(batch, row)` of a collated micro-batch."""
    n = len(mb.pairs)
    counts = mb.inputs["completion_mask"][:n, 1:].sum(dim=1).tolist()
    return {(p.batch, p.row): int(c) for p, c in zip(mb.pairs, counts, strict=True)}


def assign_scales(micro_batches: Sequence[MicroBatch], slots: int, ranks: Any = None) -> None:
    """Give each micro-batch the per-pair token weights stock gives (`MicroBatch.sft_scales`), from the chosen tokens
    of every pair of the step (`chosen_tokens`; on several processes exchanged through `ranks`) and the stock
    micro-batches of the step (`slots`)."""
    counts = [chosen_tokens(mb) for mb in micro_batches]
    if ranks is not None:
        counts = [part for parts in ranks.all_gather(counts) for part in parts]
    per_batch: dict[int, int] = {}
    for (batch, _), count in (item for part in counts for item in part.items()):
        per_batch[batch] = per_batch.get(batch, 0) + count
    for mb in micro_batches:
        # a stock micro-batch without chosen tokens has a NaN sft loss in TRL (the mean of nothing): NaN here too
        mb.sft_scales = [1.0 / (per_batch[p.batch] * slots) if per_batch[p.batch] else float("nan") for p in mb.pairs]


def correction(output: Any, inputs: dict[str, torch.Tensor], mb: MicroBatch, weight: float) -> torch.Tensor:
    """What to add to `mb.weight x` TRL's loss so that its sft term weighs tokens as stock does (`weight`: the sft
    loss weight)."""
    assert mb.sft_scales is not None
    n = len(mb.pairs)
    mask = inputs["completion_mask"][:n, 1:].bool()
    logps = token_logps(output, inputs, n)
    per_pair = torch.where(mask, logps, torch.zeros((), dtype=logps.dtype, device=logps.device)).sum(dim=1)
    total = int(mask.sum().item())
    own = mb.weight / total if total else float("nan")
    coefficients = torch.tensor([own - s for s in mb.sft_scales], dtype=per_pair.dtype, device=per_pair.device)
    return weight * (coefficients * per_pair).sum()
