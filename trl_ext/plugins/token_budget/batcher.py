"""`token_budget`'s micro-batcher (`trl_ext.api.MicroBatcher`, answered through `trl_ext_make_micro_batcher`): the core
wraps the trainer's loaders, `get_batch_samples`, `training_step`, `compute_loss`, `prediction_step` and `train` and
calls these methods; `.step` says what each does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...errors import UsageError
from . import sft
from .cut import EXAMPLES_KEY, KeepExamples
from .dispatch import Encoder, dispatches
from .ranks import Padding
from .report import summary
from .step import Slot, TokenBudgetState


class TokenBudgetBatcher:
    """The micro-batcher of one trainer, over its `TokenBudgetState` (`context.state["token_budget"]`)."""

    def __init__(self, state: TokenBudgetState) -> None:
        self.state = state
        self.first_step = 0

    def loader_collator(self, collator: Callable) -> Callable:
        return KeepExamples(collator)

    def loader_built(self, loader: Any, collator: Callable) -> None:
        if not isinstance(collator, KeepExamples) or not dispatches(loader):
            return
        # accelerate joins the batches: the examples travel as tensors (`.dispatch`), truncated as the collator
        # truncates (`DataCollatorForPreference`'s fields; one without them does not)
        inner = collator.collator
        truncation = getattr(inner, "truncation_mode", "keep_start")
        collator.encoder = Encoder(getattr(inner, "max_length", None), truncation, self.state.multiple)

    def cut(self, batches: list[Any], num_items_in_batch: Any) -> list[Any]:
        if num_items_in_batch is not None:
            raise UsageError(
                "token_budget: the training batches carry `labels` and the model takes loss kwargs (or a "
                "`compute_loss_func` is set), so the Trainer counts their items for loss scaling "
                "(`num_items_in_batch`), which DPO does not use and token_budget cannot keep for the micro-batches it "
                "cuts. Use a data collator that returns no `labels` key, or disable token_budget."
            )
        return self.state.cut(batches) if batches else batches

    def training_step(self, original: Callable, model: Any, inputs: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        state = self.state
        if isinstance(inputs, Slot):
            return state.run_slot(original, model, inputs, args, kwargs)
        # A plain batch from outside the loop: stock scaling (transformers divides by the accumulation steps).
        state.plain_scale = 1.0 / state.trainer.current_gradient_accumulation_steps
        try:
            return original(model, inputs, *args, **kwargs)
        finally:
            state.plain_scale = None

    def compute_loss(self, original: Callable, model: Any, inputs: Any, args: tuple, kwargs: dict) -> Any:
        state = self.state
        mb = state.active
        if mb is None:
            result = original(model, inputs, *args, **kwargs)
            if state.plain_scale is None:
                return result
            return result * state.plain_scale
        with state.capture(model, inputs) as outputs:
            loss = original(model, inputs, *args, **kwargs)
        if not state.sft_weight or isinstance(mb, Padding):
            return loss * mb.weight
        return loss * mb.weight + sft.correction(outputs[0], inputs, mb, state.sft_weight)

    def prediction_step(
        self, original: Callable, model: Any, inputs: Any, prediction_loss_only: bool, args: tuple, kwargs: dict
    ) -> Any:
        if EXAMPLES_KEY not in inputs:
            return original(model, inputs, prediction_loss_only, *args, **kwargs)
        return self.state.run_eval_batch(original, model, inputs, prediction_loss_only, args, kwargs)

    def stock_batches(self) -> list[tuple[str, int, list[int]]]:
        told, self.state.stock_batches = self.state.stock_batches, []
        return told

    def train_started(self) -> None:
        self.first_step = len(self.state.micro_batch_counts)

    def train_summary(self) -> str | None:
        return summary(self.state, self.first_step)
