"""The hook implementations of `fused_logprobs` (declared in its package), imported when the plugin is registered."""

from __future__ import annotations

from typing import Any

from trl_ext import _compat
from trl_ext.api import UsageError, get_logger, hookimpl, unwrap_causal_lm
from trl_ext.toolkit.online_forward import verify_against_trl
from trl_ext.toolkit.roles import PACKING

from . import NAME, FusedLogprobsOptions
from .dpo import install_dpo, score
from .online import FusedState, head_forward, make_fused_forward, output_head, resolve_chunk
from .selfcheck import head_mechanism, self_check

logger = get_logger(__name__)


def _state(context: Any) -> FusedState:
    state = context.state.get(NAME)
    if state is None:
        options: FusedLogprobsOptions = context.options(NAME)
        state = context.state[NAME] = FusedState(chunk=options.chunk)
    return state


@hookimpl
def trl_ext_trainer_init_start(trainer: Any, context: Any, init_kwargs: dict[str, Any]) -> None:
    state = _state(context)
    if not _scores(context):
        state.left_to_trl = True
        logger.info(
            "fused_logprobs: this TRL's DPOTrainer already scores with its own fused LM head (no full-vocabulary "
            "logits); fused_logprobs leaves it as it is"
        )


def _check_model(context: Any, role: str, model: Any, trainer: Any) -> None:
    state = _state(context)
    causal_lm = unwrap_causal_lm(model)
    name = f"{role} model ({type(causal_lm).__name__}, `{getattr(causal_lm.config, 'model_type', None)}`)"
    if any(hasattr(causal_lm.config, key) for key in ("vision_config", "audio_config")):
        raise UsageError(f"fused_logprobs does not score multimodal models ({name}). Train without fused_logprobs.")
    mechanism = head_mechanism(causal_lm)
    if mechanism is not None:
        raise UsageError(
            f"fused_logprobs cannot reproduce the logits of the {name}: its config sets {mechanism}, which changes "
            "the logits after the output head. Train this model without fused_logprobs."
        )
    head = output_head(causal_lm, role)  # its forward is `head_forward` (`trl_ext_make_head_forward`)
    chunk = state.chunks[role] = resolve_chunk(state, head, next(causal_lm.parameters()).dtype)
    result = state.self_checks[role] = self_check(causal_lm, trainer, role, min(chunk, 7))
    if result.failure is not None:
        raise UsageError(
            f"fused_logprobs' self-check failed for the {name}: {result.failure}. Train this model without "
            "fused_logprobs."
        )
    logger.info(
        "fused_logprobs: self-check passed for the %s: stock logits = output head of the hidden states (max relative "
        "difference %.2g), fused log-probs = stock log_softmax (%.2g <= %.2g%s) on probe rows of %s tokens; %.2f s",
        name,
        result.head_error,
        result.logprob_error,
        result.tolerance,
        f": {result.basis}" if result.basis else "",
        list(result.lengths),
        result.seconds,
    )


def _check_engine(trainer: Any, context: Any, state: FusedState) -> None:
    """Refuse, under DeepSpeed ZeRO-3, an output head with sub-modules of its own: ZeRO-3 would gather their
    parameters on each chunk's call, and the chunk count differs between ranks."""
    deepspeed_flag, _ = _compat.TRAINER_SHARDING_FLAGS
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    if not (getattr(trainer, deepspeed_flag, False) and getattr(plugin, "zero_stage", None) == 3):
        return
    for role, model in context.models().items():
        head = output_head(model, role)
        inner = [n for n, m in head.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
        if inner:
            raise UsageError(
                f"fused_logprobs does not run under DeepSpeed ZeRO-3 with the {role} model's output head "
                f"({type(head).__name__}), which calls sub-modules with parameters of their own ({inner[:3]}; "
                "e.g. a PEFT adapter on the head): ZeRO-3 gathers their parameters on each call, once per "
                "chunk, and the chunk count differs between ranks. Keep adapters off the output head, use ZeRO-2 "
                "or DDP, or train without fused_logprobs."
            )


def _scores(context: Any) -> bool:
    """Whether the plugin scores this trainer (not a DPOTrainer that TRL's own fused LM head scores already)."""
    return not (context.trainer_class == "DPOTrainer" and _compat.dpo_has_fused_head())


@hookimpl
def trl_ext_make_head_forward(trainer: Any, context: Any, role: str, head: Any) -> Any:
    import torch

    if not _scores(context) or not isinstance(head, torch.nn.Module):
        return None  # a head that is not a module is refused with its reason in `trl_ext_trainer_models_ready`
    return head_forward(head)


@hookimpl
def trl_ext_call(trainer: Any, context: Any, call: Any) -> Any:
    """The scoring methods: DPO's run with `LazyLogits` model outputs, Online DPO's `_forward` replaced."""
    if not _scores(context):
        return call.proceed()
    state = _state(context)
    if context.trainer_class == "DPOTrainer":
        return score(call, trainer, state, context)
    return state.online_forward(*call.args, **call.kwargs)


@hookimpl
def trl_ext_trainer_models_ready(trainer: Any, context: Any) -> None:
    if not _scores(context):
        return
    state = _state(context)
    # The head's forward and the scoring methods are installed by the core; here the trainer and its models are checked
    _check_engine(trainer, context, state)
    models = context.models()
    packing = tuple(n for n in context.plugins_serving(PACKING) if context.is_enabled(n))
    if context.trainer_class == "DPOTrainer" and packing:
        install_dpo(trainer, context, state, packing)  # refuses, before any self-check runs
    for role, model in models.items():
        _check_model(context, role, model, trainer)
    if context.trainer_class == "DPOTrainer":
        install_dpo(trainer, context, state, packing)
        return
    # refuse a TRL whose `OnlineDPOTrainer._forward` is not what `make_fused_forward` reproduces
    verify_against_trl(getattr(type(trainer), _compat.ONLINE_DPO_FORWARD_METHOD), NAME, trainer)
    policy = context.models().get("policy")
    state.online_forward = make_fused_forward(
        trainer, state, lambda m: "policy" if unwrap_causal_lm(m) is policy else "ref"
    )
    logger.info(
        "fused_logprobs: Online DPO scores completions in chunks of %s positions inside the output head's call",
        state.chunks,
    )


@hookimpl
def trl_ext_describe(trainer: Any, context: Any) -> str | None:
    state = _state(context)
    if state.left_to_trl:
        return "left TRL's own fused LM head in place"
    return ", ".join(f"{role}: chunk {chunk}" for role, chunk in state.chunks.items()) or None
