"""Running one optimizer step's re-cut micro-batches inside transformers' training loop, unchanged.

transformers' `_inner_training_loop` counts its `training_step` calls (gradient synchronisation, callbacks, epoch
position), so `get_batch_samples` returns one `Slot` per stock batch (equal to it, so FLOs and token counting see
stock's inputs) and spreads the step's micro-batches over the slots; `training_step` runs a slot's in turn (possibly
none). `compute_loss` returns each micro-batch's mean loss times its weight (`Trainer.loss_is_scaled_for_ga` keeps
`training_step` from dividing it again). See docs/plugins/token_budget.md.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from trl_ext import _compat
from trl_ext.api import InternalError, Ranks, UsageError, get_logger, is_main_process

from .cut import (
    EXAMPLES_KEY,
    Layout,
    MicroBatch,
    Padding,
    balanced_plan,
    cut_step,
    examples_of,
    global_pairs,
    pad_to,
    padded_multiple,
    spread,
    tokens,
)
from .metrics import StepRecord, assign_sft_scales, row_sums, sft_weight, stock_values, stock_values_of_pairs

logger = get_logger(__name__)


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


class Slot(dict):
    """The stock batch at one position of a step (its items), carrying the re-cut micro-batches to run there."""

    micro_batches: list[MicroBatch]
    last: bool


class TokenBudgetState:
    """Per-trainer state (`context.state["token_budget"]`)."""

    def __init__(self, trainer: Any, budget: int, packed: bool | Layout) -> None:
        self.trainer = trainer
        self.budget = budget
        #: whether the collator packs (the budget then counts real tokens, not padded ones)
        self.packed = packed
        #: the padded layout's `pad_to_multiple_of` (the budget counts the padded width the model sees)
        self.multiple = padded_multiple(trainer.data_collator, packed)
        #: the summed loss weight of `loss_type` "sft" (`metrics.sft_weight`; 0.0: none)
        self.sft_weight = sft_weight(trainer)
        #: the micro-batch `compute_loss` is running, or None
        self.active: MicroBatch | None = None
        #: the stock factor for a `training_step` called outside the loop with a plain batch
        self.plain_scale: float | None = None
        self.record = StepRecord()
        self.sizes: list[int] = []
        self.ranks = Ranks.of(trainer.accelerator)
        #: several processes: the step's stock micro-batch sizes (`rank * slots + slot`) and the ids `(batch, row)`
        #: of the pairs this rank recorded, in order
        self.global_sizes: list[int] = []
        self.recorded: list[tuple[int, int]] = []
        #: per optimizer step: micro-batches run (for logs and tests); on several processes the same on every rank
        self.micro_batch_counts: list[int] = []
        #: per optimizer step: the micro-batches stock runs (the Trainer's batches of the step)
        self.stock_micro_batch_counts: list[int] = []
        #: per optimizer step: micro-batches of real pairs this rank ran (the rest are `cut.Padding`)
        self.local_micro_batch_counts: list[int] = []
        #: per optimizer step on several processes: pairs this rank ran that stock runs on another rank
        self.moved_pairs: list[int] = []
        #: per evaluation/prediction batch: micro-batches it was cut into
        self.eval_micro_batch_counts: list[int] = []
        #: TRL's token count (`num_tokens`) at the start of the step, and what it counted for its padding micro-batches
        self.tokens_before = 0
        self.padding_tokens = 0
        #: per optimizer step on several processes: the most and the mean tokens (by the budget's count) per rank
        self.rank_tokens: list[tuple[int, float]] = []
        self.warned_logits = False
        self.max_tokens: list[int] = []
        #: per optimizer step: `(rows, width)` of stock's largest batch (`largest_stock_batch`)
        self.stock_largest: list[tuple[int, int] | None] = []
        #: per optimizer step: pairs longer than the budget
        self.over_budget: list[int] = []
        #: the current step's micro-batch losses and slots without micro-batches (`filter_like_stock`)
        self.step_losses: list[torch.Tensor] = []
        self.empty_slots = 0
        self.warned_nonfinite = False
        self.warned_over = False
        #: `(mode, calls, sizes)` not yet told to the other plugins (`trl_ext_stock_batches`, `.calls`): the `calls`
        #: re-cut micro-batches just run stand for stock's batches of `sizes` pairs (for a metrics reducer)
        self.stock_batches: list[tuple[str, int, list[int]]] = []
        #: while `compute_loss` runs a micro-batch (`capture`): the tensors TRL gathered, with what `gather` returned
        self.gathered: list[tuple[torch.Tensor, Any]] | None = None
        #: inside `accelerator.gather_for_metrics` (whose own `gather` calls are not TRL's per-pair ones)
        self.inside_for_metrics = 0
        #: `len(micro_batch_counts)` when the current `train()` started (`calls.summary`)
        self.first_step = 0

    def gather(self, gather: Callable[[], Any], tensor: Any) -> Any:
        """Record a tensor TRL gathers (its per-pair metrics: `accelerate`'s `gather_for_metrics` calls `gather` too,
        not recorded); on several processes answer it locally: the ranks' micro-batches hold different numbers of
        pairs, which `accelerator.gather` cannot join (`capture`)."""
        assert self.gathered is not None
        result = tensor if self.ranks.world > 1 else gather()
        if not self.inside_for_metrics and isinstance(tensor, torch.Tensor):
            self.gathered.append((tensor.detach(), result))
        return result

    def gather_for_metrics(self, gather_for_metrics: Callable[[], Any], data: Any) -> Any:
        if self.ranks.world > 1:
            return data
        self.inside_for_metrics += 1
        try:
            return gather_for_metrics()
        finally:
            self.inside_for_metrics -= 1

    def cut(self, batches: list[dict[str, Any]]) -> list[Slot]:
        if any(EXAMPLES_KEY not in batch for batch in batches):
            raise UsageError(
                "token_budget: this training batch carries no examples, so its loader was not built by the trainer's "
                "own `get_train_dataloader` (which token_budget wraps). Build the training loader with the trainer's "
                "`get_train_dataloader` (do not override it or pass batches of your own), or disable token_budget."
            )
        examples = [examples_of(batch[EXAMPLES_KEY]) for batch in batches]
        stock = [{key: value for key, value in batch.items() if key != EXAMPLES_KEY} for batch in batches]
        if self.ranks.world > 1:
            micro_batches, over, count, smallest = self.cut_across_ranks(examples)
        else:
            micro_batches, over = self.cut_step(examples)
            count, smallest = len(micro_batches), None
        if over and not self.warned_over and is_main_process(self.trainer.accelerator):
            # once per run (on several processes every rank counts all pairs): the end line gives the run's count
            self.warned_over = True
            logger.warning(
                "token_budget: %d pair(s) of this step exceed the budget of %d %s tokens; each runs alone (said once: "
                "the line at the end of train() counts them all).",
                over,
                self.budget,
                self.packed,
            )
        self.record = StepRecord()
        self.padding_tokens = 0
        self.tokens_before = getattr(self.trainer, _compat.DPO_TOTAL_TRAIN_TOKENS)
        self.sizes = [len(part) for part in examples]
        self.recorded = []
        self.local_micro_batch_counts.append(len(micro_batches))
        micro_batches = pad_to(micro_batches, count, smallest)
        self.micro_batch_counts.append(len(micro_batches))
        self.stock_micro_batch_counts.append(len(batches))
        self.over_budget.append(over)
        self.max_tokens.append(max((mb.tokens for mb in micro_batches), default=0))
        self.stock_largest.append(largest_stock_batch(stock))
        slots = []
        for i, indices in enumerate(spread(len(micro_batches), len(batches))):
            slot = Slot(stock[i])
            slot.micro_batches = [micro_batches[j] for j in indices]
            slot.last = i == len(batches) - 1
            slots.append(slot)
        return slots

    def cut_across_ranks(self, examples: list[list[Any]]) -> tuple[list[MicroBatch], int, int, MicroBatch | None]:
        """Cut the step's pairs of every rank together (one all-gather of the examples), tokens balanced across ranks
        (`cut.balanced_plan`), each pair keeping its stock weight. Returns this rank's micro-batches, the pairs over
        the budget, the most micro-batches a rank runs, and (for a rank given none) the step's smallest to repeat."""
        collate, max_length = self.trainer.data_collator, self.trainer.args.max_length
        everyone = self.ranks.all_gather(examples)
        pairs, sizes = global_pairs(everyone, self.packed, max_length, self.multiple)
        runs, owner = balanced_plan(pairs, sizes, self.budget, self.packed, self.ranks.world)
        slots = len(examples)
        self.global_sizes = sizes

        def micro_batch(run: list[Any]) -> MicroBatch:
            inputs = collate([everyone[p.batch // slots][p.batch % slots][p.row] for p in run])
            return MicroBatch(run, inputs, len(run) / (sizes[run[0].batch] * slots), tokens(run, self.packed))

        mine = [micro_batch(run) for run, r in zip(runs, owner, strict=True) if r == self.ranks.rank]
        if self.sft_weight:  # every rank's chosen tokens per pair, for the token weights of stock's micro-batches
            assign_sft_scales(mine, slots, self.ranks)
        self.moved_pairs.append(sum(1 for mb in mine for p in mb.pairs if p.batch // slots != self.ranks.rank))
        smallest = None
        if not mine:
            smallest = micro_batch(min(runs, key=lambda run: tokens(run, self.packed)))
        per_rank = [0] * self.ranks.world
        for run, r in zip(runs, owner, strict=True):
            per_rank[r] += tokens(run, self.packed)
        self.rank_tokens.append((max(per_rank), sum(per_rank) / len(per_rank)))
        count = max(owner.count(r) for r in range(self.ranks.world))
        logger.debug(
            "token_budget: step cut into %d micro-batches over %d ranks (%d per rank, this rank's own: %d); tokens "
            "per rank max %d, mean %.1f",
            len(runs),
            self.ranks.world,
            count,
            len(mine),
            *self.rank_tokens[-1],
        )
        over = sum(1 for p in pairs if tokens([p], self.packed) > self.budget)
        return mine, over, count, smallest

    def cut_step(self, examples: list[list[Any]]) -> tuple[list[MicroBatch], int]:
        """`cut.cut_step` on this rank's stock micro-batches, with the micro-batches' sft token weights."""
        trainer = self.trainer
        micro_batches, over = cut_step(
            examples, self.budget, trainer.data_collator, self.packed, trainer.args.max_length, self.multiple
        )
        if self.sft_weight:
            assign_sft_scales(micro_batches, len(examples))
        return micro_batches, over

    def run_slot(self, training_step: Any, model: Any, slot: Slot, args: tuple, kwargs: dict) -> torch.Tensor:
        total: torch.Tensor | None = None
        for i, mb in enumerate(slot.micro_batches):
            # The Trainer synchronises gradients (and, under DeepSpeed, steps) on its last `training_step` of the
            # step: only the last micro-batch of the last slot may run synchronised.
            unsynced = slot.last and i < len(slot.micro_batches) - 1
            self.active = mb
            try:
                with self.unsynced(model) if unsynced else contextlib.nullcontext():
                    loss = training_step(model, mb.inputs, *args, **kwargs)
            finally:
                self.active = None
            total = loss if total is None else total + loss
            if not isinstance(mb, Padding):
                self.step_losses.append(loss.detach())
        if not slot.micro_batches:
            self.empty_slots += 1
        if slot.last:
            self.filter_like_stock()
            self.finish_step()
        if total is None:
            total = torch.zeros((), device=self.trainer.args.device)
        return total

    def filter_like_stock(self) -> None:
        """transformers' `logging_nan_inf_filter` replaces a non-finite `training_step` loss by the window's mean so
        far (`_tr_loss += _tr_loss / steps`). If every micro-batch of the step was non-finite, so was every stock call:
        the slots that ran none returned 0, so their replacements are applied here. A mixed step warns instead."""
        losses, empty = self.step_losses, self.empty_slots
        self.step_losses, self.empty_slots = [], 0
        trainer = self.trainer
        if not losses or not getattr(trainer.args, "logging_nan_inf_filter", False):
            return
        finite = torch.isfinite(torch.stack(losses))
        if bool(finite.all()):
            return
        if bool(finite.any()) or not hasattr(trainer, "_tr_loss"):
            if not self.warned_nonfinite:
                self.warned_nonfinite = True
                logger.warning(
                    "token_budget: a step's losses were partly non-finite; with `logging_nan_inf_filter` the logged "
                    "`loss` of this window may differ from stock TRL's (the metrics do not)."
                )
            return
        windows = 1 + trainer.state.global_step - trainer._globalstep_last_logged
        for _ in range(empty):
            trainer._tr_loss += trainer._tr_loss / windows

    def run_eval_batch(
        self, prediction_step: Any, model: Any, inputs: dict[str, Any], loss_only: bool, args: tuple, kwargs: dict
    ) -> Any:
        """`prediction_step` on one evaluation batch: split by the budget when it holds more (never merged with other
        batches), its loss the pair-weighted mean of the parts, its metrics those of the whole batch (on several
        processes: every rank runs as many parts as the rank with most, and the metrics are those of the batch
        gathered over the ranks, as stock's)."""
        examples = examples_of(inputs.pop(EXAMPLES_KEY))
        micro_batches, _ = self.cut_step([examples])
        count = self.ranks.max(len(micro_batches), self.trainer.args.device)
        self.eval_micro_batch_counts.append(count)
        if count == 1:
            return prediction_step(model, inputs, loss_only, *args, **kwargs)
        if not loss_only:
            if not self.warned_logits:
                self.warned_logits = True
                logger.warning(
                    "token_budget: prediction batches are not cut when logits are asked for "
                    "(`prediction_loss_only=False` or `compute_metrics`); batches over the budget run whole."
                )
            return prediction_step(model, inputs, loss_only, *args, **kwargs)
        record, self.record = self.record, StepRecord()
        micro_batches = pad_to(micro_batches, count)
        try:
            total = None
            for mb in micro_batches:
                self.active = mb
                try:
                    loss, _, _ = prediction_step(model, mb.inputs, loss_only, *args, **kwargs)
                finally:
                    self.active = None
                # `compute_loss` weighted it already: `mb.weight` is its share of this batch's pairs
                total = loss if total is None else total + loss
            metrics = getattr(self.trainer, _compat.DPO_METRICS_BUFFER)["eval"]
            self.stock_batches.append(("eval", len(micro_batches), [len(examples)]))
            ranks = self.ranks.all_gather(([len(examples)], self.record.local()))
            for values in stock_values(ranks):
                for name, value in values.items():
                    metrics[name].append(value)
        finally:
            self.record = record
        return total, None, None

    @contextlib.contextmanager
    def unsynced(self, model: Any) -> Iterator[None]:
        """Run a micro-batch of the step's last slot without gradient synchronisation, as transformers runs the
        step's earlier `training_step` calls (`Trainer._inner_training_loop`): `sync_gradients` False (under
        DeepSpeed, accelerate's `backward` then neither marks the accumulation boundary nor steps the engine) and,
        unless DeepSpeed or accelerate's `sync_each_batch`, `accelerator.no_sync` (DDP, FSDP)."""
        from accelerate.utils import DistributedType

        accelerator = self.trainer.accelerator
        state = accelerator.gradient_state
        sync_context: Any = contextlib.nullcontext
        if not (
            state.plugin_kwargs.get("sync_each_batch", False)
            or accelerator.distributed_type == DistributedType.DEEPSPEED
        ):
            sync_context = functools.partial(accelerator.no_sync, model=model)
        synced = state.sync_gradients
        state._set_sync_gradients(False)
        try:
            with sync_context():
                yield
        finally:
            state._set_sync_gradients(synced)

    def finish_step(self) -> None:
        """Append to TRL's metric buffer the values stock would have appended for this step (on several processes
        from every rank's per-pair values, one all-gather on every rank), and take the padding micro-batches' tokens
        back out of TRL's `num_tokens`."""
        trainer = self.trainer
        metrics = getattr(trainer, _compat.DPO_METRICS_BUFFER)["train"]
        if self.ranks.world == 1:
            step_values = stock_values([(list(self.sizes), self.record.local())])
        else:
            counted = getattr(trainer, _compat.DPO_TOTAL_TRAIN_TOKENS) - self.tokens_before - self.padding_tokens
            ranks = self.ranks.all_gather((self.recorded, self.record.local(), counted))
            # TRL counted this rank's tokens only (its gathers answered locally): the step's count is every rank's
            # (`_compat.DPO_TOTAL_TRAIN_TOKENS`)
            trainer._total_train_tokens = self.tokens_before + sum(r[2] for r in ranks)
            metrics["num_tokens"] = [trainer._total_train_tokens]
            step_values = stock_values_of_pairs([(r[0], r[1]) for r in ranks], self.global_sizes, len(self.sizes))
        for values in step_values:
            for name, value in values.items():
                metrics[name].append(value)
        self.record = StepRecord()  # the step's captured tensors are not kept through evaluation and saves
        self.padding_tokens = 0
        self.stock_batches.append(("train", self.micro_batch_counts[-1], list(self.sizes)))

    @contextlib.contextmanager
    def capture(self, model: Any, inputs: dict[str, torch.Tensor]) -> Iterator[list[Any]]:
        """Record what the metrics of the micro-batch TRL's `_compute_loss` runs now are made of (the tensors it
        passes to `accelerator.gather`, checked against what it appends; the policy forward's output), and take the
        values TRL appends back out of its buffer."""
        trainer = self.trainer
        metrics = getattr(trainer, _compat.DPO_METRICS_BUFFER)[
            "train" if trainer.model.training else "eval"
        ]  # TRL rule
        before = {name: len(values) for name, values in metrics.items()}
        tokens_before = getattr(trainer, _compat.DPO_TOTAL_TRAIN_TOKENS)
        outputs: list[Any] = []
        gathered: list[tuple[torch.Tensor, Any]] = []

        def keep_first(module: Any, args: Any, output: Any) -> None:
            if not outputs:  # the policy forward; a PEFT reference forward through the same module comes after
                outputs.append(output)

        handle = model.register_forward_hook(keep_first)
        self.gathered = gathered
        try:
            yield outputs
        finally:
            self.gathered = None
            handle.remove()
        appended = {}
        for name, values in metrics.items():
            if name != "num_tokens" and len(values) > before.get(name, 0):
                appended[name] = values[before.get(name, 0) :]
                del values[before.get(name, 0) :]
        if not outputs:
            raise InternalError("token_budget: the policy forward of DPOTrainer._compute_loss was not seen")
        if isinstance(self.active, Padding):
            # run to keep the ranks in step: its pairs and tokens are counted by the micro-batch it repeats
            self.padding_tokens += getattr(trainer, _compat.DPO_TOTAL_TRAIN_TOKENS) - tokens_before
            return
        self.record.add(gathered, row_sums(outputs[0], inputs), appended)
        if self.active is not None:
            self.recorded.extend((p.batch, p.row) for p in self.active.pairs)
