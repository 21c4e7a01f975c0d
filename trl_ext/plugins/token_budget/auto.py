"""`token_budget="auto"`: the budget measured when the trainer is built (docs/plugins/token_budget.md), with the
memory probe `toolkit.memory` shares with `precompute_ref_batch_size`: training steps on the dataset's heaviest 1, 2,
4, ... pairs, up to one optimizer step's, until one does not fit (or is projected not to); then `choose`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

from trl_ext import _compat
from trl_ext.api import NOTICE, Ranks, UsageError, get_logger

from . import NAME
from .cut import (
    OPTIONAL_FIELDS,
    TEXT_FIELDS,
    Layout,
    Pair,
    check_example,
    padded_multiple,
    pair_length,
    tokens,
)

logger = get_logger(__name__)

#: Share of the memory budget the chosen budget's projected peak may fill.
HEADROOM = 0.9
#: `context.state` key of the `AutoBudget` a trainer's "auto" resolved to.
STATE_KEY = f"{NAME}.auto"
#: Example fields passed to the collator besides the text ones: vision columns are passed so that `check_example`
#: refuses them.
VISION_FIELDS = ("image", "images")


@dataclasses.dataclass(frozen=True)
class Probe:
    """One measured training step: its pairs, its tokens by the budget's count, the peak bytes it added."""

    pairs: int
    tokens: int
    used: float


@dataclasses.dataclass(frozen=True)
class AutoBudget:
    """What `"auto"` resolved to and what it was measured against."""

    budget: int
    layout: Layout
    memory: float  #: the memory budget in bytes
    device: str
    probes: tuple[Probe, ...]
    stop: str  #: why the probes stopped

    def line(self) -> str:
        largest = max(self.probes, key=lambda p: p.tokens)
        return (
            f'trl-ext `{NAME}`: "auto" chose {self.budget} {self.layout} tokens per micro-batch, measured against a '
            f"memory budget of {self.memory / 2**20:.0f} MiB on {self.device} ({len(self.probes)} training-step "
            f"probes of the heaviest pairs, the largest {largest.tokens} tokens adding "
            f"{largest.used / 2**20:.1f} MiB; stopped by: {self.stop})"
        )


def choose(fitting: Sequence[Probe], memory: float, cap: int, failed: int | None) -> int:
    """The budget where peak memory, linear in tokens through the two largest probes that fit (through zero with one,
    or when the line does not rise), reaches `HEADROOM x memory`: at least the largest probe that fit, at most the
    heaviest step's tokens `cap`, below the first probe that did not (`failed`; None: every probe fit)."""
    if not fitting:
        raise ValueError("no probe fit")
    largest = fitting[-1]
    if failed is None:
        return cap
    projected = math.inf
    target = HEADROOM * memory
    if len(fitting) >= 2 and fitting[-2].tokens < largest.tokens:
        below = fitting[-2]
        slope = (largest.used - below.used) / (largest.tokens - below.tokens)
        if slope > 0:
            projected = largest.tokens + (target - largest.used) / slope
    if math.isinf(projected) and largest.used > 0:
        projected = largest.tokens * target / largest.used
    return int(max(largest.tokens, min(projected, failed - 1, cap)))


def heaviest(trainer: Any, kind: Layout) -> tuple[Any, list[str], list[int], list[int]]:
    """The training dataset, the columns passed to the collator, its rows' indices from the heaviest pair down
    (stable) and each row's length."""
    from datasets import Dataset

    dataset = trainer.train_dataset
    if not isinstance(dataset, Dataset):
        raise UsageError(
            f'`{NAME}="auto"` measures the heaviest pairs of the training dataset, which needs a `datasets.Dataset` '
            f"(got {type(dataset).__name__}). Set a number of tokens instead."
        )
    columns = [c for c in dataset.column_names if c in TEXT_FIELDS + OPTIONAL_FIELDS + VISION_FIELDS]
    if len(dataset) == 0:
        raise UsageError(f'`{NAME}="auto"` has no training pairs to measure.')
    check_example({c: dataset[0][c] for c in columns})
    lengths: list[int] = []
    multiple = padded_multiple(trainer.data_collator, kind)
    for batch in dataset.select_columns(list(TEXT_FIELDS)).iter(batch_size=1024):
        for values in zip(*(batch[f] for f in TEXT_FIELDS), strict=True):
            example = dict(zip(TEXT_FIELDS, values, strict=True))
            lengths.append(pair_length(example, kind, trainer.args.max_length, multiple))
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return dataset, columns, order, lengths


@contextlib.contextmanager
def _untouched(trainer: Any) -> Iterator[None]:
    """Put back what a training step outside the loop changes: random state, metrics, token count, gradients, mode."""
    import torch

    model = trainer.model
    training = model.training
    kept = getattr(trainer, _compat.DPO_METRICS_BUFFER)
    metrics = {mode: {k: list(v) for k, v in values.items()} for mode, values in kept.items()}
    total_tokens = getattr(trainer, _compat.DPO_TOTAL_TRAIN_TOKENS)
    device = trainer.args.device
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        model.zero_grad(set_to_none=True)
        model.train(training)
        for mode, values in kept.items():
            values.clear()
            values.update(metrics.get(mode, {}))
        trainer._total_train_tokens = total_tokens  # _compat.DPO_TOTAL_TRAIN_TOKENS


def _train_step(trainer: Any, inputs: dict[str, Any]) -> None:
    """What `Trainer.training_step` does to memory: the loss under the trainer's autocast, then the backward."""
    model = trainer.model
    model.train()
    inputs = trainer._prepare_inputs(inputs)
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(model, inputs)
    del inputs
    trainer.accelerator.backward(loss)
    del loss
    model.zero_grad(set_to_none=True)


def measure(trainer: Any, kind: Layout, options: Any) -> AutoBudget:
    """Probe training steps on the heaviest pairs and choose the budget (`choose`)."""
    import torch

    from trl_ext.toolkit.memory import ExtraMemory, budget_bytes, over_budget

    if any(getattr(trainer, flag, False) for flag in _compat.TRAINER_SHARDING_FLAGS):
        raise UsageError(
            f'`{NAME}="auto"` cannot measure under DeepSpeed or FSDP: the model is not sharded yet when the trainer '
            "is built, so its memory is not the training step's. Set a number of tokens."
        )
    args = trainer.args
    device = args.device
    ranks = Ranks.of(trainer.accelerator)
    memory = budget_bytes(options, device, ranks)
    if device.type == "cuda":  # Adam's two moments per trainable parameter, allocated at the first optimizer step
        memory -= 2 * sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    dataset, columns, order, lengths = heaviest(trainer, kind)
    limit = min(len(order), args.per_device_train_batch_size * args.gradient_accumulation_steps)
    cap = tokens([Pair(0, i, lengths[i]) for i in order[:limit]], kind)
    fill_ref = bool(trainer.args.precompute_ref_log_probs) and "ref_chosen_logps" not in columns

    def example(i: int) -> dict[str, Any]:
        row = dataset[i]
        out = {c: row[c] for c in columns}
        if fill_ref:  # the precompute has not run yet; the step then runs no reference forward
            out.update(ref_chosen_logps=0.0, ref_rejected_logps=0.0)
        return out

    fitting: list[Probe] = []
    failed: int | None = None
    stop = "the heaviest step fit"
    k = 1
    with _untouched(trainer):
        while True:
            batch = [example(i) for i in order[:k]]
            cost = tokens([Pair(0, j, lengths[i]) for j, i in enumerate(order[:k])], kind)
            largest = fitting[-1] if fitting else None
            if largest is not None and over_budget(cost, largest.tokens, largest.used, memory):
                failed, stop = cost, "memory (projected from the largest probe)"
                break
            used: float | None
            try:
                with ExtraMemory(device) as peak:
                    _train_step(trainer, trainer.data_collator(batch))
                used = float(peak.used)
            except torch.OutOfMemoryError:
                trainer.model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                used = None
            if used is None or used > memory:
                failed, stop = cost, "out of memory" if used is None else "memory"
                break
            fitting.append(Probe(k, cost, used))
            if k >= limit:
                break
            k = min(2 * k, limit)
    budget = choose(fitting, memory, cap, failed) if fitting else 0
    if ranks.world > 1:  # every rank cuts by the same budget: the smallest any rank can hold (0: one could not)
        budget = min(ranks.all_gather(budget))
    if budget == 0:
        raise UsageError(
            f'`{NAME}="auto"`: one training step on the heaviest pair ({failed} {kind} tokens on this process) needs '
            f"more than the memory budget of {memory / 2**20:.0f} MiB. Raise `plugins.{NAME}.ram_budget` (CPU), "
            "shorten `max_length`, or set a number of tokens."
        )
    result = AutoBudget(budget, kind, memory, device.type, tuple(fitting), stop)
    if ranks.is_main:
        logger.log(NOTICE, "%s", result.line())
    return result
