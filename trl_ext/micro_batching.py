"""Cutting a training step into micro-batches of a plugin's own: the `trl_ext_make_micro_batcher` extension point.

transformers' `Trainer._inner_training_loop` fetches one optimizer step's batches with `get_batch_samples`, then runs
`training_step` once per fetched batch; its gradient synchronisation, callbacks and epoch position count those calls.
A plugin that runs the step's pairs in micro-batches of its own (token_budget: by tokens) answers
`trl_ext_make_micro_batcher` with a `MicroBatcher`, and the core wraps, on the trainer instance and through the
trainer's undo stack (`context.patcher`, undone by `Installation.detach(trainer)`):

- `get_train_dataloader`, `get_eval_dataloader`, `get_test_dataloader`: while one of them builds its loader (a loader
  captures its collate function when it is built), `trainer.data_collator` is `batcher.loader_collator(collator)`;
  the loader built goes to `batcher.loader_built(loader, that_collator)`;
- `get_batch_samples`: the fetched batches go through `batcher.cut(batches, num_items_in_batch)`, which returns one
  entry per stock batch (the Trainer counts its `training_step` calls by them); the Trainer gets
  `num_items_in_batch=None`;
- `training_step`, `compute_loss`, `prediction_step`: every call goes to the batcher's method of the same name, with
  the trainer's own method to call;
- `Trainer.loss_is_scaled_for_ga` is set True: the batcher's `compute_loss` returns each micro-batch's loss already
  scaled for the step, so transformers does not divide it by the accumulation steps again;
- `train`: `batcher.train_started()` before, and the line `batcher.train_summary()` returns after (logged at level
  notice, on the main process).

After each `training_step` and `prediction_step`, the batches the batcher reports (`batcher.stock_batches()`) are
announced to every enabled plugin through `trl_ext_stock_batches`, so that a plugin counting pairs per `compute_loss`
call (a metrics reducer) counts stock's batches instead of the re-cut ones.

The wrappers are installed after the core's own (`attach.attach_after_init`) and before the
`trl_ext_trainer_init_end` hooks run: they are the innermost, and another plugin wrapping the same methods at
`trl_ext_trainer_init_end` sees one `training_step` per stock batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from . import _compat
from ._logging import NOTICE, get_logger, is_main_process
from .errors import UsageError
from .patching import Patcher

if TYPE_CHECKING:  # pragma: no cover
    from .context import TrainerContext

__all__ = ["LOADER_METHODS", "MicroBatcher", "StockBatches", "attach"]

logger = get_logger(__name__)

#: The trainer's loader builders, wrapped so that a loader they build collates with `MicroBatcher.loader_collator`.
LOADER_METHODS = ("get_train_dataloader", "get_eval_dataloader", "get_test_dataloader")

#: `(mode, calls, sizes)`: the last `calls` `compute_loss` calls of `mode` (`"train"` or `"eval"`) ran what stock
#: runs as batches of `sizes` pairs (see `trl_ext_stock_batches`).
StockBatches = tuple[str, int, list[int]]


@runtime_checkable
class MicroBatcher(Protocol):
    """What a plugin answering `trl_ext_make_micro_batcher` returns: how one trainer's steps run in micro-batches of
    its own. Every method is called on every rank, in the same order; the core calls nothing else on it.

    `original` is always the trainer's method as it was before the core wrapped it (bound: call it without the
    trainer). `args` and `kwargs` are the caller's further arguments, to pass on as they are.
    """

    def loader_collator(self, collator: Callable) -> Callable:
        """The collator a loader built now (training, evaluation or test) collates with, given the trainer's
        `data_collator`: for instance one that also hands over each batch's examples, to cut them again later."""
        ...

    def loader_built(self, loader: Any, collator: Callable) -> None:
        """`loader` was just built with `collator` (what `loader_collator` returned): e.g. check how accelerate
        dispatches its batches."""
        ...

    def cut(self, batches: list[Any], num_items_in_batch: Any) -> list[Any]:
        """The entries `training_step` will be called with for one optimizer step, one per fetched stock batch (same
        count: the Trainer's bookkeeping counts them), from the batches `get_batch_samples` fetched (possibly none) and
        the item count transformers computed for loss scaling (refuse it with `UsageError` if it cannot be kept: the
        Trainer then gets None)."""
        ...

    def training_step(
        self, original: Callable, model: Any, inputs: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run one `training_step` call (`inputs`: an entry of `cut`, or a batch from outside the training loop) and
        return its loss, as transformers' `training_step` does. Rebuilding what TRL logs per micro-batch into what
        stock logs per stock batch is the batcher's part (TRL's metric buffer `_metrics`), at the end of the step."""
        ...

    def compute_loss(
        self, original: Callable, model: Any, inputs: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Compute the loss of one micro-batch, scaled for the optimizer step (`loss_is_scaled_for_ga`)."""
        ...

    def prediction_step(
        self,
        original: Callable,
        model: Any,
        inputs: Any,
        prediction_loss_only: bool,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run one evaluation or prediction batch; return what transformers' `prediction_step` returns."""
        ...

    def stock_batches(self) -> list[StockBatches]:
        """What the `compute_loss` calls since the last question stand for in stock's batches, and forget it (the
        core announces each through `trl_ext_stock_batches`); an empty list when nothing is to be told."""
        ...

    def train_started(self) -> None:
        """`train()` is starting."""
        ...

    def train_summary(self) -> str | None:
        """One line on what the micro-batches of this `train()` call were (None: nothing to say)."""
        ...


def attach(ctx: TrainerContext) -> MicroBatcher | None:
    """Ask the enabled plugins for the trainer's micro-batcher (`trl_ext_make_micro_batcher`, exclusive) and, when one
    answers, wrap the trainer's methods to delegate to it, every change through `ctx.patcher`."""
    trainer = ctx.trainer
    batcher = ctx.call_math("trl_ext_make_micro_batcher", trainer=trainer, context=ctx)
    if batcher is None:
        return None
    if not isinstance(batcher, MicroBatcher):
        raise UsageError(
            f"`trl_ext_make_micro_batcher` returned a {type(batcher).__qualname__}, which lacks methods of "
            "`trl_ext.api.MicroBatcher`; return an object with all of them, or None."
        )
    patcher = ctx.patcher

    def announce() -> None:
        for mode, calls, sizes in batcher.stock_batches():
            ctx.hook.trl_ext_stock_batches(trainer=trainer, context=ctx, mode=mode, calls=calls, sizes=sizes)

    def build_with_collator(original: Callable) -> Callable:
        @functools.wraps(original)
        def build_loader(*args: Any, **kwargs: Any) -> Any:
            scoped = Patcher("trl-ext micro-batcher (loader)")
            collator = batcher.loader_collator(trainer.data_collator)
            scoped.setattr(trainer, "data_collator", collator)
            try:
                loader = original(*args, **kwargs)
            finally:
                scoped.undo()
            batcher.loader_built(loader, collator)
            return loader

        return build_loader

    original_get_batch_samples = getattr(trainer, _compat.TRAINER_BATCH_SAMPLES_METHOD)

    @functools.wraps(original_get_batch_samples)
    def get_batch_samples(epoch_iterator: Any, num_batches: int, *args: Any, **kwargs: Any) -> tuple[list, Any]:
        batches, num_items_in_batch = original_get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
        return batcher.cut(batches, num_items_in_batch), None

    original_training_step = trainer.training_step

    @functools.wraps(original_training_step)
    def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = batcher.training_step(original_training_step, model, inputs, args, kwargs)
        announce()
        return loss

    original_compute_loss = trainer.compute_loss

    @functools.wraps(original_compute_loss)
    def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return batcher.compute_loss(original_compute_loss, model, inputs, args, kwargs)

    original_prediction_step = trainer.prediction_step

    @functools.wraps(original_prediction_step)
    def prediction_step(model: Any, inputs: Any, prediction_loss_only: bool, *args: Any, **kwargs: Any) -> Any:
        result = batcher.prediction_step(original_prediction_step, model, inputs, prediction_loss_only, args, kwargs)
        announce()
        return result

    original_train = trainer.train

    @functools.wraps(original_train)
    def train(*args: Any, **kwargs: Any) -> Any:
        batcher.train_started()
        result = original_train(*args, **kwargs)
        line = batcher.train_summary()
        if line is not None and is_main_process(trainer.accelerator):
            logger.log(NOTICE, line)
        return result

    patcher.setattr(trainer, "train", train)
    patcher.setattr(trainer, _compat.TRAINER_BATCH_SAMPLES_METHOD, get_batch_samples)
    patcher.setattr(trainer, "training_step", training_step)
    patcher.setattr(trainer, "compute_loss", compute_loss)
    patcher.setattr(trainer, _compat.TRAINER_LOSS_SCALED_ATTR, True)
    for name in LOADER_METHODS:
        patcher.setattr(trainer, name, build_with_collator(getattr(trainer, name)))
    patcher.setattr(trainer, "prediction_step", prediction_step)
    return batcher
