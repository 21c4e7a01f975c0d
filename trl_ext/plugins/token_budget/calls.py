"""`token_budget`'s part in the trainer's method calls (its `trl_ext_call`, innermost; `.step` does the work).

While a `get_*_dataloader` builds its loader (which captures its collate function), `trainer.data_collator` is
`cut.KeepExamples`, so each batch also hands over its examples. After each `training_step` and `prediction_step`, what
the re-cut `compute_loss` calls stood for in stock's batches is announced through `trl_ext_stock_batches`; `train`
logs one line (notice, main process) when it returns (`summary`): what the cut did over that run, and the largest
micro-batch it built against the largest one stock TRL builds from the same batches (the figure activation memory
follows).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from trl_ext.api import NOTICE, Patcher, UsageError, get_logger, is_main_process

from .cut import EXAMPLES_KEY, Encoder, KeepExamples, Padding, dispatches
from .metrics import sft_correction
from .step import Slot, TokenBudgetState

if TYPE_CHECKING:  # pragma: no cover
    from trl_ext.api import Call

logger = get_logger(__name__)


def run(trainer: Any, context: Any, state: TokenBudgetState, call: Call) -> Any:
    name = call.name
    if name.startswith("accelerator."):
        if state.gathered is None:  # not inside a micro-batch's `compute_loss`
            return call.proceed()
        data = call.args[0] if call.args else next(iter(call.kwargs.values()))
        if name == "accelerator.gather":
            return state.gather(call.proceed, data)
        return state.gather_for_metrics(call.proceed, data)
    if name.endswith("_dataloader"):  # get_train_dataloader, get_eval_dataloader, get_test_dataloader
        return build_loader(trainer, state, call)
    if name == "get_batch_samples":
        batches, num_items_in_batch = call.proceed()
        if num_items_in_batch is not None:
            raise UsageError(
                "token_budget: the training batches carry `labels` and the model takes loss kwargs (or a "
                "`compute_loss_func` is set), so the Trainer counts their items for loss scaling "
                "(`num_items_in_batch`), which DPO does not use and token_budget cannot keep for the micro-batches it "
                "cuts. Use a data collator that returns no `labels` key, or disable token_budget."
            )
        return (state.cut(batches) if batches else batches), None
    if name == "compute_loss":
        (model, inputs), args, kwargs = _split(call, 2)
        mb = state.active
        if mb is None:  # outside a re-cut step: stock, scaled as stock when `training_step` got a plain batch
            result = call.proceed(model, inputs, *args, **kwargs)
            return result if state.plain_scale is None else result * state.plain_scale
        with state.capture(model, inputs) as outputs:
            loss = call.proceed(model, inputs, *args, **kwargs)
        if not state.sft_weight or isinstance(mb, Padding):
            return loss * mb.weight
        return loss * mb.weight + sft_correction(outputs[0], inputs, mb, state.sft_weight)
    if name == "training_step":
        (model, inputs), args, kwargs = _split(call, 2)
        if isinstance(inputs, Slot):
            result = state.run_slot(call.proceed, model, inputs, args, kwargs)
        else:
            # A plain batch from outside the loop: stock scaling (transformers divides by the accumulation steps).
            state.plain_scale = 1.0 / state.trainer.current_gradient_accumulation_steps
            try:
                result = call.proceed(model, inputs, *args, **kwargs)
            finally:
                state.plain_scale = None
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
        # accelerate joins the batches: the examples travel as tensors (`cut.Encoder`), truncated as the collator
        # truncates (`DataCollatorForPreference`'s fields; one without them does not)
        inner = collator.collator
        truncation = getattr(inner, "truncation_mode", "keep_start")
        collator.encoder = Encoder(getattr(inner, "max_length", None), truncation, state.multiple)
    return loader


def _stock_text(state: Any, first_step: int) -> str:
    """The clause on stock's largest micro-batch of the steps from `first_step` on."""
    shapes = state.stock_largest[first_step:]
    where = " on this rank" if state.ranks.world > 1 else ""
    if not shapes or any(shape is None for shape in shapes):
        return f"; stock TRL's micro-batches{where} not measured (a batch of the collator has no 2D `input_ids`)"
    rows, width = max(shapes, key=lambda s: s[0] * s[1])
    return (
        f"; stock TRL's largest micro-batch from the same batches{where}: {rows * width} padded tokens ({rows} rows x "
        f"{width})"
    )


def summary(state: Any, first_step: int) -> str | None:
    """What the optimizer steps from `first_step` on ran: micro-batches against stock's, the largest micro-batch
    against the budget and against stock's largest, pairs over the budget, and on several processes the balance of
    tokens across ranks (None when no step ran)."""
    counts = state.micro_batch_counts[first_step:]
    if not counts:
        return None
    stock = sum(state.stock_micro_batch_counts[first_step:])
    largest = max(state.max_tokens[first_step:], default=0)
    text = (
        f"token_budget: {len(counts)} optimizer step(s) ran {sum(counts)} micro-batches (stock: {stock}) within the "
        f"budget of {state.budget} {state.packed} tokens"
    )
    over = sum(state.over_budget[first_step:])
    if over == 1 and largest > state.budget:
        text += f"; a pair of {largest} tokens is over the budget of {state.budget} and ran alone"
    elif over:
        # on several processes the pairs over the budget may have run on other ranks than this one
        text += f"; {over} pairs over the budget ran alone"
        text += f", the largest of {largest} tokens" if largest > state.budget else ""
    else:
        text += f", the largest micro-batch {largest} tokens"
    text += _stock_text(state, first_step)
    balance = [most / mean for most, mean in state.rank_tokens[first_step:] if mean > 0]
    if balance:
        text += (
            f"; tokens per rank, most / mean: median {statistics.median(balance):.2f}, worst {max(balance):.2f} "
            f"over {state.ranks.world} ranks"
        )
    return text
