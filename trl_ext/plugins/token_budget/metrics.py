"""TRL's DPO metrics on the stock partition of a step, from per-pair values recorded on the re-cut micro-batches:
the per-pair tensors TRL passes to `accelerator.gather` and per-row token sums of the policy forward. At the end of
the step it appends, for each stock micro-batch in order, the value stock would have appended (on several processes:
stock's micro-batch `i` is the `i`-th of every rank, joined by TRL's gather, wherever the plugin ran its pairs).

`loss_type` "sft" (alone or combined, e.g. RPO's `["sigmoid", "sft"]`, `sft_weight` to `sft_correction`): TRL's sft
term is one mean over the chosen completion tokens of the micro-batch (trl/trainer/dpo_trainer.py `_compute_loss`:
`-chosen_per_token_logps[chosen_mask].mean()` on 1.15+, `F.cross_entropy` over the same tokens on 1.10-1.14): stock
weighs each chosen token by `1 / (T_m x A)`, `T_m` the chosen tokens of its stock micro-batch and `A` the stock
micro-batches of the step. A re-cut micro-batch `k` of `T_k` chosen tokens, its loss multiplied by its weight `w_k`
(its pairs' share of the step), weighs them by `w_k / T_k` instead. The plugin adds to the loss, with its graph, `c x
sum over the chosen tokens t of log p(t) x (w_k / T_k - 1 / (T_m(t) x A))` (`c`: the sft loss weight), so each token
counts as stock counts it: the gradient and the step's summed loss are stock's. `T_m` is counted on the collated
micro-batches (`completion_mask`, as TRL counts), on several processes exchanged (one all-gather per step). Refused
with `use_weighting=True` (`hooks.check_loss_types` says why).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from trl_ext import _compat
from trl_ext.api import InternalError, UsageError

from .cut import MicroBatch

#: TRL's per-pair metrics (gathered per pair, in order) and token-weighted ones (rebuilt from per-row sums).
PAIR_METRICS, TOKEN_METRICS = _compat.DPO_PAIR_METRICS, _compat.DPO_TOKEN_METRICS
#: Per-row sums kept for the token metrics (chosen `_c` / rejected `_r` rows of each pair).
ROW_SUMS = ("entropy_c", "entropy_r", "tokens_c", "tokens_r", "logits_c", "logits_r", "correct_c")


def row_sums(output: Any, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-pair sums behind TRL's token metrics, computed as TRL computes them from the policy forward's output.

    Chosen by what the output carries, not by TRL's version: TRL's fused LM head (1.15+) returns per-token `entropy`,
    `mean_logits` and `is_top1`; otherwise they come from `logits` as TRL's logits path computes them
    (trl/trainer/dpo_trainer.py, 1.12.0:1614-1661; 1.14.2 takes the entropy from `selective_log_softmax_and_entropy`).
    """
    mask = inputs["completion_mask"][:, 1:].bool()
    width = mask.size(1)
    if getattr(output, "entropy", None) is not None:
        entropy = output.entropy[:, -width:].detach()
        mean_logits = output.mean_logits[:, -width:].detach()
        top1 = output.is_top1[:, -width:]
    else:
        # TRL < 1.15 (1.15+ returns the fused head's `entropy` above): the entropy through the helper TRL's DPO module
        # calls (a plugin may have replaced it there for its own logits type).
        shift_logits = output.logits[..., :-1, :].detach()
        entropy = logits_entropy(shift_logits, inputs["input_ids"][..., 1:], mask)
        mean_logits = shift_logits.mean(-1)
        top1 = shift_logits.argmax(dim=-1) == inputs["input_ids"][..., 1:]
    zero = torch.zeros((), dtype=entropy.dtype, device=entropy.device)
    entropy = torch.where(mask, entropy, zero).sum(dim=1)
    logits = torch.where(mask, mean_logits, zero.to(mean_logits.dtype)).sum(dim=1)
    tokens = mask.sum(dim=1)
    correct = (top1.bool() & mask).sum(dim=1)
    n = mask.size(0) // 2
    return {
        "entropy_c": entropy[:n],
        "entropy_r": entropy[n:],
        "tokens_c": tokens[:n],
        "tokens_r": tokens[n:],
        "logits_c": logits[:n],
        "logits_r": logits[n:],
        "correct_c": correct[:n],
    }


#: TRL 1.14's joint log-prob and entropy helper (trl/trainer/utils.py), imported by name into its DPO module and called
#: there in place of `entropy_from_logits` (which 1.14's DPO module no longer imports); probed by name, absent from
#: the DPO module on 1.12 and 1.16.
JOINT_HELPER = "selective_log_softmax_and_entropy"


def _dpo_helper(name: str) -> Any:
    """The helper `name` as TRL's DPO module looks it up (a plugin may have replaced it there), or None."""
    import importlib

    return getattr(importlib.import_module(_compat.DPO_LOGITS_MODULE), name, None)


def logits_entropy(shift_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of `shift_logits` as TRL < 1.15's `_compute_loss` computes it, found by capability: the
    DPO module's `entropy_from_logits(logits)` (1.10-1.13), else its joint helper `JOINT_HELPER(logits, index,
    entropy_requires_grad, row_mask=...)` (1.14)."""
    entropy_from_logits = _dpo_helper(_compat.DPO_LOGITS_HELPERS[1])
    if entropy_from_logits is not None:
        return entropy_from_logits(shift_logits)
    joint = _dpo_helper(JOINT_HELPER)
    if joint is None:
        raise UsageError(
            f"token_budget: TRL's DPO module has neither `{_compat.DPO_LOGITS_HELPERS[1]}` nor `{JOINT_HELPER}` to "
            f"compute the entropy metric with: {_compat.unexpected_trl('token_budget')}"
        )
    with torch.no_grad():
        return joint(shift_logits, labels, entropy_requires_grad=False, row_mask=mask)[1]


def token_logps(output: Any, inputs: dict[str, torch.Tensor], rows: int) -> torch.Tensor:
    """Per-token log-probs of the first `rows` rows (the chosen sequences) of the policy forward, with their graph,
    aligned with `completion_mask[:, 1:]`: the fused head's `log_probs` (TRL >= 1.15), else TRL's DPO module's
    `selective_log_softmax(logits, labels)` (1.10-1.14) on the shifted logits."""
    width = inputs["completion_mask"].size(1) - 1
    if getattr(output, "log_probs", None) is not None:
        return output.log_probs[:rows, -width:]
    helper = _dpo_helper(_compat.DPO_LOGITS_HELPERS[0])
    if helper is None:
        missing = _compat.DPO_LOGITS_HELPERS[0]
        raise UsageError(
            f"token_budget: TRL's DPO module has no `{missing}`: {_compat.unexpected_trl('token_budget')}"
        )
    return helper(output.logits[:rows, :-1, :], inputs["input_ids"][:rows, 1:])


class StepRecord:
    """The per-pair values of one step's micro-batches, in step order."""

    def __init__(self) -> None:
        self.values: dict[str, list[torch.Tensor]] = {name: [] for name in PAIR_METRICS + ROW_SUMS}
        #: micro-batches recorded; None when TRL's own values never reached its buffer (nothing to rebuild)
        self.count: int | None = 0

    def add(
        self, gathered: Sequence[tuple[torch.Tensor, Any]], sums: dict[str, torch.Tensor], appended: dict[str, list]
    ) -> None:
        """Record one micro-batch: the tensors TRL gathered (with what `gather` returned), the row sums, and what TRL
        appended (each appended value must be the mean of what `gather` returned: the tensors are the metrics they are
        taken for)."""
        expected = set(PAIR_METRICS) | set(TOKEN_METRICS)
        if not appended and self.count in (0, None):
            # Another plugin took TRL's values out of its buffer as they were appended (it reduces the metrics
            # itself): there is nothing to put back for this step.
            self.count = None
            return
        if self.count is None:
            raise InternalError("token_budget: TRL's metric buffer was emptied for some micro-batches of a step only.")
        self.count += 1
        if set(appended) != expected or len(gathered) != len(PAIR_METRICS):
            raise UsageError(
                f"token_budget: DPOTrainer logged {sorted(appended)} and gathered {len(gathered)} per-pair tensors; "
                f"expected {sorted(expected)} and {len(PAIR_METRICS)}: {_compat.unexpected_trl('token_budget')}"
            )
        for name, (tensor, result) in zip(PAIR_METRICS, gathered, strict=True):
            if (
                len(appended[name]) != 1
                or not same_value(appended[name][0], result.mean().item())
                or tensor.dim() != 1
            ):
                raise UsageError(
                    f"token_budget: TRL's `{name}` is not the mean of the tensor it gathered: "
                    f"{_compat.unexpected_trl('token_budget')}"
                )
            self.values[name].append(tensor.detach())
        for name in ROW_SUMS:
            self.values[name].append(sums[name])

    def local(self) -> dict[str, torch.Tensor] | None:
        """The recorded per-pair values, concatenated in step order, on the CPU (None when another plugin reduces the
        metrics: nothing to rebuild)."""
        if not self.count:
            return None
        return {name: torch.cat(parts).cpu() for name, parts in self.values.items()}


def same_value(a: float, b: float) -> bool:
    """Equal, NaN equal to NaN (a NaN metric is what stock logs too)."""
    return a == b or (math.isnan(a) and math.isnan(b))


def stock_values(ranks: Sequence[tuple[Sequence[int], dict[str, torch.Tensor] | None]]) -> list[dict[str, float]]:
    """The values TRL appends for each stock micro-batch of a step, from every rank's `(sizes, per-pair values)`
    (`StepRecord.local`; rank order), each rank's pairs in stock's order (`stock_values_of_pairs`). Stock micro-batch
    `i` is the `i`-th batch of every rank, gathered by TRL."""
    counts = {len(sizes) for sizes, _ in ranks}
    if len(counts) != 1:
        raise InternalError(f"token_budget: ranks ran different numbers of stock micro-batches in a step: {counts}.")
    slots = counts.pop()
    recorded = [
        ([(r * slots + i, j) for i, size in enumerate(sizes) for j in range(size)], values)
        for r, (sizes, values) in enumerate(ranks)
    ]
    return stock_values_of_pairs(recorded, [size for sizes, _ in ranks for size in sizes], slots)


def stock_values_of_pairs(
    ranks: Sequence[tuple[Sequence[tuple[int, int]], dict[str, torch.Tensor] | None]], sizes: Sequence[int], slots: int
) -> list[dict[str, float]]:
    """The values TRL appends for each stock micro-batch of a step whose pairs ran on other ranks than stock's.

    `ranks`: per rank, the ids `(batch, row)` of the pairs it recorded, in order, with their values
    (`StepRecord.local`); `batch` is `rank * slots + slot` of the pair's stock micro-batch, of `sizes[batch]` pairs.
    Stock micro-batch `i` joins the `i`-th micro-batch of every rank, in rank order (TRL's gather): its pair metrics
    are means over all those pairs, its token metrics ratios of sums over them. None: nothing to rebuild (on every
    rank).
    """
    if any(values is None for _, values in ranks):
        if not all(values is None for _, values in ranks):
            raise InternalError("token_budget: TRL's metric buffer was emptied on some ranks only.")
        return []
    ids = [pair for pair_ids, _ in ranks for pair in pair_ids]
    flat = {name: torch.cat([values[name] for _, values in ranks if values is not None]) for name in ranks[0][1] or {}}
    where = {pair: k for k, pair in enumerate(ids)}
    if len(where) != len(ids) or len(ids) != sum(sizes):
        raise InternalError(f"token_budget: {len(ids)} pairs recorded for a step of {sum(sizes)}.")
    out = []
    for i in range(slots):
        rows = [where[(b, j)] for b in range(i, len(sizes), slots) for j in range(sizes[b])]
        index = torch.tensor(rows, dtype=torch.long)
        part = {name: tensor[index] for name, tensor in flat.items()}  # stock micro-batch i's pairs, from every rank
        values = {name: part[name].mean().item() for name in PAIR_METRICS}
        tokens = part["tokens_c"].sum() + part["tokens_r"].sum()
        entropy = part["entropy_c"].sum() + part["entropy_r"].sum()
        values["entropy"] = (entropy / tokens).item() if tokens > 0 else 0.0
        tokens_c, tokens_r = part["tokens_c"].sum().item(), part["tokens_r"].sum().item()
        values["logits/chosen"] = part["logits_c"].sum().item() / tokens_c if tokens_c > 0 else 0.0
        values["logits/rejected"] = part["logits_r"].sum().item() / tokens_r if tokens_r > 0 else 0.0
        correct = part["correct_c"].sum()
        values["mean_token_accuracy"] = (correct / part["tokens_c"].sum()).item() if tokens_c > 0 else 0.0
        out.append(values)
    return out


def sft_weight(trainer: Any) -> float:
    """The summed loss weight of the trainer's "sft" terms (0.0: none)."""
    return float(sum(w for t, w in zip(trainer.loss_types, trainer.loss_weights, strict=True) if t == "sft"))


def chosen_tokens(mb: MicroBatch) -> dict[tuple[int, int], int]:
    """The chosen completion tokens TRL counts for each pair `(batch, row)` of a collated micro-batch."""
    n = len(mb.pairs)
    counts = mb.inputs["completion_mask"][:n, 1:].sum(dim=1).tolist()
    return {(p.batch, p.row): int(c) for p, c in zip(mb.pairs, counts, strict=True)}


def assign_sft_scales(micro_batches: Sequence[MicroBatch], slots: int, ranks: Any = None) -> None:
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


def sft_correction(output: Any, inputs: dict[str, torch.Tensor], mb: MicroBatch, weight: float) -> torch.Tensor:
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
