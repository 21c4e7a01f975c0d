"""Installing `token_budget` on one trainer: its loaders, `get_batch_samples`, `training_step`, `compute_loss`,
`prediction_step` and `train` wrapped (`.step` says what each does), every change through the plugin's `Patcher`."""

from __future__ import annotations

import functools
from typing import Any

import torch

from ... import _compat
from ..._logging import NOTICE, get_logger, is_main_process
from ...errors import UsageError
from ...patching import Patcher
from . import sft
from .cut import EXAMPLES_KEY, KeepExamples
from .dispatch import Encoder, dispatches
from .ranks import Padding
from .report import summary
from .step import Slot, TokenBudgetState

logger = get_logger(__name__)


def install(trainer: Any, patcher: Any, state: TokenBudgetState) -> None:
    """Wrap the trainer's loaders (`get_train_dataloader`, `get_eval_dataloader`, `get_test_dataloader`),
    `get_batch_samples`, `training_step`, `compute_loss` and `prediction_step`."""

    def keep_examples(original: Any) -> Any:
        @functools.wraps(original)
        def build_loader(*args: Any, **kwargs: Any) -> Any:
            # The loader captures its collate function when it is built.
            scoped = Patcher("token_budget (loader)")
            keep = KeepExamples(trainer.data_collator)
            scoped.setattr(trainer, "data_collator", keep)
            try:
                loader = original(*args, **kwargs)
            finally:
                scoped.undo()
            if dispatches(loader):  # accelerate joins the batches: the examples travel as tensors (`.dispatch`)
                # truncated as the collator truncates (`DataCollatorForPreference`'s fields; one without them does not)
                collator = keep.collator
                truncation = getattr(collator, "truncation_mode", "keep_start")
                keep.encoder = Encoder(getattr(collator, "max_length", None), truncation, state.multiple)
            return loader

        return build_loader

    original_prediction_step = trainer.prediction_step

    @functools.wraps(original_prediction_step)
    def prediction_step(model: Any, inputs: Any, prediction_loss_only: bool, *args: Any, **kwargs: Any) -> Any:
        if EXAMPLES_KEY not in inputs:
            return original_prediction_step(model, inputs, prediction_loss_only, *args, **kwargs)
        return state.run_eval_batch(original_prediction_step, model, inputs, prediction_loss_only, args, kwargs)

    original_get_batch_samples = getattr(trainer, _compat.TRAINER_BATCH_SAMPLES_METHOD)

    @functools.wraps(original_get_batch_samples)
    def get_batch_samples(epoch_iterator: Any, num_batches: int, *args: Any, **kwargs: Any) -> tuple[list, Any]:
        batches, num_items_in_batch = original_get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
        if num_items_in_batch is not None:
            raise UsageError(
                "token_budget: the training batches carry `labels` and the model takes loss kwargs (or a "
                "`compute_loss_func` is set), so the Trainer counts their items for loss scaling "
                "(`num_items_in_batch`), which DPO does not use and token_budget cannot keep for the micro-batches it "
                "cuts. Use a data collator that returns no `labels` key, or disable token_budget."
            )
        return (state.cut(batches) if batches else batches), None

    original_training_step = trainer.training_step

    @functools.wraps(original_training_step)
    def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(inputs, Slot):
            return state.run_slot(original_training_step, model, inputs, args, kwargs)
        # A plain batch from outside the loop: stock scaling (transformers divides by the accumulation steps).
        state.plain_scale = 1.0 / trainer.current_gradient_accumulation_steps
        try:
            return original_training_step(model, inputs, *args, **kwargs)
        finally:
            state.plain_scale = None

    original_compute_loss = trainer.compute_loss

    @functools.wraps(original_compute_loss)
    def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        mb = state.active
        if mb is None:
            result = original_compute_loss(model, inputs, *args, **kwargs)
            if state.plain_scale is None:
                return result
            return result * state.plain_scale
        with state.capture(model, inputs) as outputs:
            loss = original_compute_loss(model, inputs, *args, **kwargs)
        if not state.sft_weight or isinstance(mb, Padding):
            return loss * mb.weight
        return loss * mb.weight + sft.correction(outputs[0], inputs, mb, state.sft_weight)

    original_train = trainer.train

    @functools.wraps(original_train)
    def train(*args: Any, **kwargs: Any) -> Any:
        first_step = len(state.micro_batch_counts)
        result = original_train(*args, **kwargs)
        line = summary(state, first_step)
        if line is not None and is_main_process(trainer.accelerator):
            logger.log(NOTICE, line)
        return result

    patcher.setattr(trainer, "train", train)
    patcher.setattr(trainer, _compat.TRAINER_BATCH_SAMPLES_METHOD, get_batch_samples)
    patcher.setattr(trainer, "training_step", training_step)
    patcher.setattr(trainer, "compute_loss", compute_loss)
    patcher.setattr(trainer, _compat.TRAINER_LOSS_SCALED_ATTR, True)
    for name in ("get_train_dataloader", "get_eval_dataloader", "get_test_dataloader"):
        patcher.setattr(trainer, name, keep_examples(getattr(trainer, name)))
    patcher.setattr(trainer, "prediction_step", prediction_step)
