"""The hook implementations of `prompt_sharing` (declared in its package), imported when the plugin is registered;
the behaviour lives in .setup, .layout, .attention, .forward and .selfcheck."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trl_ext import _compat
from trl_ext.api import hookimpl
from trl_ext.toolkit.packing.glue import refuse_liger

from .forward import make_backbone_forward, online_forward
from .layout import PromptSharingCollator
from .setup import check_models, check_trainer, model_forward, state_of

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import Trainer

    from trl_ext.api import TrainerContext


@hookimpl
def trl_ext_trainer_init_start(trainer: Trainer, context: TrainerContext, init_kwargs: dict[str, Any]) -> None:
    state_of(context)
    why = "on TRL <= 1.14 the Liger DPO loss calls the backbone directly with its own layout"
    refuse_liger(init_kwargs, "prompt_sharing", why)


@hookimpl
def trl_ext_make_collator(trainer: Trainer, context: TrainerContext, collator: Callable) -> Callable | None:
    check_trainer(trainer, context)
    if context.trainer_class != "DPOTrainer":
        return None  # Online DPO's collator hands prompts to generation; its scoring calls are shared in `_forward`
    return PromptSharingCollator(collator)


@hookimpl
def trl_ext_make_packed_forward(
    trainer: Trainer, context: TrainerContext, role: str, backbone: torch.nn.Module
) -> Callable | None:
    state = check_trainer(trainer, context)
    # The model's attention is switched in `trl_ext_make_model_forward`.
    return make_backbone_forward(backbone.forward, state)


@hookimpl
def trl_ext_make_model_forward(
    trainer: Trainer, context: TrainerContext, role: str, model: torch.nn.Module
) -> Callable:
    return model_forward(trainer, context, role, model)


@hookimpl
def trl_ext_call(trainer: Trainer, context: TrainerContext, call: Any) -> Any:
    # Online DPO's `_forward`; outside fused_logprobs' when both take part (registered later: called first). The model
    # call inside learns its prompt columns (`forward.online_forward`).
    max_length = getattr(trainer, _compat.ONLINE_DPO_MAX_LENGTH_ATTR, None)
    return online_forward(call, state_of(context).online_own, max_length)


@hookimpl(trylast=True)
def trl_ext_trainer_models_ready(trainer: Trainer, context: TrainerContext) -> None:
    # The shared forwards are installed (`trl_ext_make_model_forward`). trylast: the self-checks (a few forwards each)
    # run after the other plugins' checks, so that a refusal comes before them, as it did.
    check_models(trainer, context)


@hookimpl
def trl_ext_describe(trainer: Trainer, context: TrainerContext) -> str | None:
    state = state_of(context)
    parts = [f"{role}: {impl}" for role, impl in state.attn_implementations.items()]
    if state.self_check is False:
        parts.append("self-check off")
    elif state.checked:
        parts.append(f"self-checked: {', '.join(sorted(state.checked))}")
    return ", ".join(parts) or None
