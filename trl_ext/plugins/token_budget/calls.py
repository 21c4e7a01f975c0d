"""`token_budget`'s part in the trainer's method calls (its `trl_ext_call`, innermost; `.step` does the work).

While a `get_*_dataloader` builds its loader (which captures its collate function), `trainer.data_collator` is
`cut.KeepExamples`, so each batch also hands over its examples. After each `training_step` and `prediction_step`, what
the re-cut `compute_loss` calls stood for in stock's batches is announced through `trl_ext_stock_batches`; `train`
logs one line (notice, main process) when it returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trl_ext.api import NOTICE, Patcher, UsageError, get_logger, is_main_process

from . import sft
from .cut import EXAMPLES_KEY, KeepExamples, Padding
from .dispatch import Encoder, dispatches
from .report import summary
from .step import Slot, TokenBudgetState

if TYPE_CHECKING:  # pragma: no cover
    from trl_ext.api import Call

logger = get_logger(__name__)

LOADERS = ("get_train_dataloader", "get_eval_dataloader", "get_test_dataloader")


def run(trainer: Any, context: Any, state: TokenBudgetState, call: Call) -> Any:
    name = call.name
    if name.startswith("accelerator."):
        if state.gathered is None:  # not inside a micro-batch's `compute_loss`
            return call.proceed()
        data = call.args[0] if call.args else next(iter(call.kwargs.values()))
        if name == "accelerator.gather":
            return state.gather(call.proceed, data)
        return state.gather_for_metrics(call.proceed, data)
    if name in LOADERS:
        return build_loader(trainer, state, call)
    if name == "get_batch_samples":
        batches, num_items_in_batch = call.proceed()
        return cut(state, batches, num_items_in_batch), None
    if name == "compute_loss":
        (model, inputs), args, kwargs = _split(call, 2)
        return compute_loss(state, call.proceed, model, inputs, args, kwargs)
    if name == "training_step":
        (model, inputs), args, kwargs = _split(call, 2)
        result = training_step(state, call.proceed, model, inputs, args, kwargs)
    elif name == "prediction_step":
        (model, inputs, loss_only), args, kwargs = _split(call, 3)
        if EXAMPLES_KEY not in inputs:
            result = call.proceed()
        else:
            result = state.run_eval_batch(call.proceed, model, inputs, loss_only, args, kwargs)
    elif name == "train":
        state.first_step = len(state.micro_batch_counts)
        result = call.proceed()
        line = summary(state, state.first_step)
        if line is not None and is_main_process(trainer.accelerator):
            logger.log(NOTICE, line)
        return result
    else:
        return call.proceed()
    told, state.stock_batches = state.stock_batches, []
    for mode, calls, sizes in told:
        context.hook.trl_ext_stock_batches(trainer=trainer, context=context, mode=mode, calls=calls, sizes=sizes)
    return result


def _split(call: Call, count: int) -> tuple[list[Any], tuple, dict[str, Any]]:
    """The method's first `count` parameters (given by position or by name) and the rest of its arguments."""
    args, kwargs = list(call.args), dict(call.kwargs)
    names = ("model", "inputs", "prediction_loss_only")[:count]
    first = [args.pop(0) if args else kwargs.pop(name) for name in names]
    return first, tuple(args), kwargs


def build_loader(trainer: Any, state: TokenBudgetState, call: Call) -> Any:
    collator = KeepExamples(trainer.data_collator)
    with Patcher("token_budget (loader)") as scoped:
        scoped.setattr(trainer, "data_collator", collator)
        loader = call.proceed()
    if dispatches(loader):
        # accelerate joins the batches: the examples travel as tensors (`.dispatch`), truncated as the collator
        # truncates (`DataCollatorForPreference`'s fields; one without them does not)
        inner = collator.collator
        truncation = getattr(inner, "truncation_mode", "keep_start")
        collator.encoder = Encoder(getattr(inner, "max_length", None), truncation, state.multiple)
    return loader


def cut(state: TokenBudgetState, batches: list[Any], num_items_in_batch: Any) -> list[Any]:
    if num_items_in_batch is not None:
        raise UsageError(
            "token_budget: the training batches carry `labels` and the model takes loss kwargs (or a "
            "`compute_loss_func` is set), so the Trainer counts their items for loss scaling "
            "(`num_items_in_batch`), which DPO does not use and token_budget cannot keep for the micro-batches it "
            "cuts. Use a data collator that returns no `labels` key, or disable token_budget."
        )
    return state.cut(batches) if batches else batches


def training_step(state: TokenBudgetState, proceed: Any, model: Any, inputs: Any, args: tuple, kwargs: dict) -> Any:
    if isinstance(inputs, Slot):
        return state.run_slot(proceed, model, inputs, args, kwargs)
    # A plain batch from outside the loop: stock scaling (transformers divides by the accumulation steps).
    state.plain_scale = 1.0 / state.trainer.current_gradient_accumulation_steps
    try:
        return proceed(model, inputs, *args, **kwargs)
    finally:
        state.plain_scale = None


def compute_loss(state: TokenBudgetState, proceed: Any, model: Any, inputs: Any, args: tuple, kwargs: dict) -> Any:
    mb = state.active
    if mb is None:
        result = proceed(model, inputs, *args, **kwargs)
        if state.plain_scale is None:
            return result
        return result * state.plain_scale
    with state.capture(model, inputs) as outputs:
        loss = proceed(model, inputs, *args, **kwargs)
    if not state.sft_weight or isinstance(mb, Padding):
        return loss * mb.weight
    return loss * mb.weight + sft.correction(outputs[0], inputs, mb, state.sft_weight)
