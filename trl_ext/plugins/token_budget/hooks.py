"""The hook implementations of `token_budget` (declared in its package), imported when the plugin is registered."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trl_ext import _compat
from trl_ext.api import UsageError, did_you_mean, get_logger, hookimpl
from trl_ext.toolkit.roles import METRICS, PACKING

from . import NAME

if TYPE_CHECKING:  # pragma: no cover
    from trl_ext.api import Call

logger = get_logger(__name__)

#: The DPO loss types token_budget accepts, each verified exact against stock (tests/plugins/test_token_budget.py)
#: on TRL 1.12, 1.14 and 1.16 (trl/trainer/dpo_trainer.py `_compute_loss`): means over pairs, which the loss weights
#: keep exact ...
PER_PAIR_LOSS_TYPES = frozenset(
    {
        "sigmoid",
        "hinge",
        "ipo",
        "exo_pair",
        "nca_pair",
        "robust",
        "bco_pair",
        "sppo_hard",
        "apo_zero",
        "apo_down",
        "discopop",
        "sigmoid_norm",
    }
)
#: ... and means over the micro-batch's chosen completion tokens, which `metrics.sft_correction` re-weights per token
#: by the tokens of the stock micro-batch each token belongs to.
TOKEN_MEAN_LOSS_TYPES = frozenset({"sft"})
#: Loss types whose value for one pair depends on the other pairs of its micro-batch in a way no weighting undoes,
#: with the reason. Refused; so is any loss type TRL lists that is in none of these sets (not verified yet).
COUPLED_LOSS_TYPES = {
    "aot": "it sorts the log-ratios across the micro-batch",
    "aot_unpaired": "it sorts the chosen and rejected log-ratios across the micro-batch",
}
ACCEPTED_LOSS_TYPES = PER_PAIR_LOSS_TYPES | TOKEN_MEAN_LOSS_TYPES


def trl_loss_types() -> set[str]:
    """The DPO loss types the installed TRL knows, read from TRL itself: the `'name'` list of `DPOConfig.loss_type`'s
    help and every `loss_type == "name"` branch of `DPOTrainer._compute_loss` (so a type added to either shows)."""
    import dataclasses
    import inspect
    import re

    from trl import DPOConfig, DPOTrainer

    field = next(f for f in dataclasses.fields(DPOConfig) if f.name == "loss_type")
    listed = set(re.findall(r"`'(\w+)'`", field.metadata.get("help", "")))
    branches = set(re.findall(r"loss_type == \"(\w+)\"", inspect.getsource(DPOTrainer._compute_loss)))
    return listed | branches


def _refuse(reason: str) -> UsageError:
    return UsageError(f"`token_budget` {reason}")


def check_loss_types(loss_types: list[str], use_weighting: bool) -> None:
    """Refuse the loss types token_budget cannot keep exact (`ACCEPTED_LOSS_TYPES` is an allow-list)."""
    for loss_type in loss_types:
        if loss_type in COUPLED_LOSS_TYPES:
            raise _refuse(
                f"cannot re-cut micro-batches for `loss_type={loss_type!r}`: {COUPLED_LOSS_TYPES[loss_type]}, so its "
                "value changes with the cut. Use a loss type that is a mean over pairs, or disable `token_budget`."
            )
        known = trl_loss_types()
        if loss_type not in known:
            # Not a trl-ext limit: stock TRL itself fails on it, at the first step (`_compute_loss`). Say that now,
            # in TRL's words, rather than "not verified".
            raise UsageError(
                f"`loss_type={loss_type!r}` is no loss type of the installed TRL (stock TRL raises `ValueError: "
                f"Unknown loss type: {loss_type}` at the first step).{did_you_mean(loss_type, sorted(known))} TRL's "
                f"loss types: {', '.join(sorted(known))}."
            )
        if loss_type not in ACCEPTED_LOSS_TYPES:
            raise _refuse(
                f"has not been verified with `loss_type={loss_type!r}` (it accepts {sorted(ACCEPTED_LOSS_TYPES)}): "
                "re-cutting micro-batches may change its value. Use one of those, or disable `token_budget`."
            )
    if use_weighting and TOKEN_MEAN_LOSS_TYPES & set(loss_types):
        raise _refuse(
            "cannot re-cut micro-batches for `loss_type='sft'` with `use_weighting=True`: TRL multiplies the token "
            "mean of the micro-batch by the mean of its pairs' weights, a product over the whole micro-batch. Set "
            "`use_weighting=False`, drop 'sft', or disable `token_budget`."
        )


def check_trainer(trainer: Any) -> None:
    """The refusals that read the built trainer: its config (TRL's default `DPOConfig` when none was given), its
    loss types, Liger, the MoE auxiliary loss, FSDP v1, and `bco_pair` on a TRL that keeps a running mean."""
    args = trainer.args
    check_loss_types(list(trainer.loss_types), bool(getattr(args, "use_weighting", False)))
    if getattr(args, "use_liger_kernel", False):
        raise _refuse(
            "does not support `DPOConfig(use_liger_kernel=True)`: the Liger loss logs per-micro-batch means of the "
            "logits that cannot be re-cut. Set `use_liger_kernel=False` or disable `token_budget`."
        )
    if getattr(trainer, "is_fsdp_enabled", False) and not getattr(trainer.accelerator, "is_fsdp2", False):
        raise _refuse(
            "does not support FSDP v1 (`fsdp_version: 1`): its re-cut micro-batches were verified under FSDP2 only. "
            "Use `fsdp_version: 2` (accelerate's FSDP plugin / `fsdp_config`) or disable `token_budget`."
        )
    if getattr(trainer, _compat.DPO_AUX_LOSS_FLAG):
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


@hookimpl
def trl_ext_trainer_models_ready(trainer: Any, context: Any) -> None:
    # token_budget changes the math of every step it runs: `verify` checks this trainer's first steps.
    if NAME not in context.math_plugins:
        context.math_plugins.append(NAME)


@hookimpl(tryfirst=True)
def trl_ext_trainer_init_end(trainer: Any, context: Any) -> None:
    """The refusals that read the built trainer, the budget ("auto" measured now, before the other plugins' own
    wrappers are set), the trainer's state, and transformers' flag that `compute_loss` scales the loss for the step."""
    from .step import TokenBudgetState

    check_trainer(trainer)
    reducers = [name for name in context.plugins_serving(METRICS) if context.is_enabled(name)]
    if trainer.accelerator.num_processes > 1 and reducers:
        raise _refuse(
            f"cannot run with `{reducers[0]}` on several processes: to keep the ranks in step, a rank with fewer "
            f"micro-batches runs zero-weight repeats, whose pairs `{reducers[0]}` would count in the metrics it "
            "reduces. Disable one of the two."
        )
    from .auto import STATE_KEY, measure
    from .cut import layout

    # The packing role's holder collates the micro-batches; its layout (`cut.Layout`, truthy when packed) says what
    # the budget counts. "auto" is measured here, before the first step (`.auto`).
    packing = any(context.is_enabled(name) for name in context.plugins_serving(PACKING))
    packed = layout(trainer.data_collator if packing else None)
    budget = context.config.token_budget
    if budget == "auto":  # measured now, recorded in `context.state[auto.STATE_KEY]`
        context.state[STATE_KEY] = measured = measure(trainer, packed, context.options(NAME))
        budget = measured.budget
    context.state[NAME] = TokenBudgetState(trainer, budget, packed)
    # `compute_loss` returns each micro-batch's loss already weighted for the step: transformers' `training_step`
    # must not divide it by the accumulation steps again.
    context.patcher.setattr(trainer, _compat.TRAINER_LOSS_SCALED_ATTR, True)
    processes = trainer.accelerator.num_processes
    logger.info(
        "token_budget: each optimizer step's %d x %d pairs run in micro-batches of at most %d %s tokens%s",
        trainer.args.per_device_train_batch_size,
        trainer.args.gradient_accumulation_steps,
        budget,
        "packed" if packed else "padded",
        f"; the {processes} ranks' pairs are cut together, tokens balanced, in lockstep" if processes > 1 else "",
    )


@hookimpl(trylast=True)
def trl_ext_call(trainer: Any, context: Any, call: Call) -> Any:
    """Innermost, next to TRL (`trylast`): the plugins outside see one `training_step` per stock batch. `.calls` says
    what each method does."""
    state = context.state.get(NAME)
    if state is None:  # before `trl_ext_trainer_init_end` (the "auto" probe): stock
        return call.proceed()
    from . import calls

    return calls.run(trainer, context, state, call)


@hookimpl
def trl_ext_describe(trainer: Any, context: Any) -> str | None:
    state = context.state.get(NAME)
    from .auto import STATE_KEY
    from .cut import as_layout

    if state is None:
        return None
    budget = f"auto:{state.budget}" if STATE_KEY in context.state else str(state.budget)  # "auto" shows what it chose
    return f"budget={budget} {as_layout(state.packed)} tokens"
