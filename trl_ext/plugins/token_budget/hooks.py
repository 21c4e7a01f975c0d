"""The hook implementations of `token_budget` (declared in its package), imported when the plugin is registered."""

from __future__ import annotations

from typing import Any

from ..._logging import get_logger
from ...errors import UsageError
from ...hookspecs import hookimpl
from .._roles import METRICS, PACKING
from . import NAME

logger = get_logger(__name__)

#: DPO loss types whose value for one pair depends on the other pairs of its micro-batch, with the reason
#: (trl/trainer/dpo_trainer.py `_compute_loss`, 1.12.0 and 1.16.0).
COUPLED_LOSS_TYPES = {
    "aot": "it sorts the log-ratios across the micro-batch",
    "aot_unpaired": "it sorts the chosen and rejected log-ratios across the micro-batch",
    "sft": "it is one mean over all chosen completion tokens of the micro-batch, not a mean over pairs",
}


def _refuse(reason: str) -> UsageError:
    return UsageError(f"`token_budget` {reason}")


@hookimpl
def trl_ext_trainer_init_start(trainer: Any, context: Any, init_kwargs: dict[str, Any]) -> None:
    args = init_kwargs.get("args")
    if args is None:
        raise _refuse("needs an explicit `DPOConfig` (`args=`) to check the loss types before training.")
    loss_types = args.loss_type if isinstance(args.loss_type, list | tuple) else [args.loss_type]
    for loss_type in loss_types:
        if loss_type in COUPLED_LOSS_TYPES:
            raise _refuse(
                f"cannot re-cut micro-batches for `loss_type={loss_type!r}`: {COUPLED_LOSS_TYPES[loss_type]}, so its "
                "value changes with the cut. Use a loss type that is a mean over pairs, or disable `token_budget`."
            )
    if getattr(args, "use_liger_kernel", False):
        raise _refuse(
            "does not support `DPOConfig(use_liger_kernel=True)`: the Liger loss logs per-micro-batch means of the "
            "logits that cannot be re-cut. Set `use_liger_kernel=False` or disable `token_budget`."
        )


@hookimpl
def trl_ext_trainer_init_end(trainer: Any, context: Any) -> None:
    from .step import TokenBudgetState, install

    if getattr(trainer, "aux_loss_enabled", False):
        raise _refuse(
            "cannot re-cut micro-batches of a MoE model with `router_aux_loss_coef != 0`: the router auxiliary loss "
            "is computed over all tokens of a micro-batch, so its value changes with the cut. Set "
            "`DPOConfig(router_aux_loss_coef=0.0)` or disable `token_budget`."
        )
    if "bco_pair" in trainer.loss_types and hasattr(trainer, "running"):
        raise _refuse(
            "cannot re-cut micro-batches for `loss_type='bco_pair'` on this TRL: it keeps a running mean of the "
            "rewards across micro-batches. Disable `token_budget` or upgrade TRL."
        )
    reducers = [name for name in context.plugins_serving(METRICS) if context.is_enabled(name)]
    if trainer.accelerator.num_processes > 1 and reducers:
        raise _refuse(
            f"cannot run with `{reducers[0]}` on several processes: to keep the ranks in step, a rank with fewer "
            f"micro-batches runs zero-weight repeats, whose pairs `{reducers[0]}` would count in the metrics it "
            "reduces. Disable one of the two."
        )
    from .auto import resolve
    from .cut import layout

    # The packing role's holder collates the micro-batches; its layout (`cut.Layout`, truthy when packed) says what
    # the budget counts. "auto" is measured here, before the first step (`.auto`).
    packing = any(context.is_enabled(name) for name in context.plugins_serving(PACKING))
    packed = layout(trainer.data_collator if packing else None)
    budget = resolve(trainer, context, packed)
    state = TokenBudgetState(trainer, budget, packed)
    context.state[NAME] = state
    install(trainer, context.patcher, state)
    processes = trainer.accelerator.num_processes
    logger.info(
        "token_budget: each optimizer step's %d x %d pairs run in micro-batches of at most %d %s tokens%s",
        trainer.args.per_device_train_batch_size,
        trainer.args.gradient_accumulation_steps,
        budget,
        "packed" if packed else "padded",
        f"; the {processes} ranks' pairs are cut together, tokens balanced, in lockstep" if processes > 1 else "",
    )


@hookimpl
def trl_ext_describe(trainer: Any, context: Any) -> str | None:
    state = context.state.get(NAME)
    from .auto import budget_text
    from .cut import as_layout

    return None if state is None else f"budget={budget_text(context, state.budget)} {as_layout(state.packed)} tokens"
