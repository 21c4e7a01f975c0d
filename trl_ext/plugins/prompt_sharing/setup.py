"""Per-trainer state, the refusals, and the wiring of the shared forward into a trainer's models."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..._logging import get_logger
from ...errors import UsageError
from .._packing import check_packable_trainer, switch_attention
from ..padding_free.architecture import inspect_model
from .attention import base_of, register_shared_attention, shared_attention_name, unregister_shared_attention
from .dropout import describe, disable_dropout, dropout_sites
from .forward import make_causal_lm_forward, make_online_forward
from .layout import SharedLayout
from .moe import MoeAuxLoss
from .selfcheck import self_check

logger = get_logger(__name__)

NAME = "prompt_sharing"


@dataclasses.dataclass
class PromptSharingState:
    """Per-trainer state of the plugin (`context.state["prompt_sharing"]`)."""

    self_check: bool = True
    checked_trainer: bool = False
    #: roles whose first shared forward passed the self-check
    checked: set[str] = dataclasses.field(default_factory=set)
    #: attention implementation each wrapped model runs, by role
    attn_implementations: dict[str, str] = dataclasses.field(default_factory=dict)
    shared_calls: int = 0
    #: padded scoring calls that could not be shared (ran as they came)
    unshared_calls: int = 0
    rows: int = 0
    unshared_rows: int = 0
    padded_tokens: int = 0
    shared_tokens: int = 0

    def record(self, layout: SharedLayout) -> None:
        first = self.unshared_rows == 0
        self.shared_calls += 1
        self.rows += layout.rows
        self.unshared_rows += layout.unshared_rows
        self.padded_tokens += layout.padded_tokens
        self.shared_tokens += layout.num_tokens
        if layout.unshared_rows and first:
            logger.warning(
                "prompt_sharing: %d of %d sequences in a batch share no prompt prefix with another sequence (a "
                "single-token prompt, or a pair whose prompts differ after truncation) and run unshared; running total"
                " in `trainer._trl_ext.state['prompt_sharing'].summary()`",
                layout.unshared_rows,
                layout.rows,
            )

    @property
    def unshared_fraction(self) -> float:
        return self.unshared_rows / self.rows if self.rows else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "shared_calls": self.shared_calls,
            "unshared_calls": self.unshared_calls,
            "sequences": self.rows,
            "unshared_sequences": self.unshared_rows,
            "unshared_fraction": self.unshared_fraction,
            "padded_tokens": self.padded_tokens,
            "shared_tokens": self.shared_tokens,
            "self_checked": sorted(self.checked),
            "attention": dict(self.attn_implementations),
        }


def state_of(context: Any) -> PromptSharingState:
    state = context.state.get(NAME)
    if state is None:
        state = context.state[NAME] = PromptSharingState(self_check=context.options(NAME).self_check)
    return state


def check_init_kwargs(init_kwargs: dict[str, Any]) -> None:
    args = init_kwargs.get("args")
    if args is not None and getattr(args, "use_liger_kernel", False):
        raise UsageError(
            "prompt_sharing does not support `use_liger_kernel=True` (on TRL <= 1.14 the Liger DPO loss calls the "
            "backbone directly with its own layout). Set `use_liger_kernel=False` or disable prompt_sharing."
        )


def check_trainer(trainer: Any, context: Any) -> PromptSharingState:
    """Refuse what sharing cannot do correctly; runs once, before the first shared forward."""
    state = state_of(context)
    if state.checked_trainer:
        return state
    check_packable_trainer(trainer, NAME)
    state.checked_trainer = True
    return state


#: Model types whose shared forward equals the stock padded forward in float64 (loss over per-sequence log-probs, MoE
#: auxiliary loss with the router on, gradients; sliding windows shorter than prompt + response, attention sinks,
#: softcapping), measured by tests/plugins/test_prompt_sharing_architectures.py: every model type of padding_free's
#: verified table except `stablelm`, whose decoder layer does not hand attention keyword arguments (the segments) to
#: its attention. Other model types are refused (padding_free alone runs them, with its self-check).
VERIFIED_MODEL_TYPES = (
    "cohere",
    "cohere2",
    "ernie4_5_moe",
    "exaone4",
    "gemma",
    "gemma2",
    "gemma3_text",
    "glm4_moe",
    "gpt2",
    "gpt_neox",
    "gpt_oss",
    "granite",
    "granitemoe",
    "jetmoe",
    "llama",
    "mistral",
    "mixtral",
    "olmo2",
    "olmo3",
    "olmoe",
    "opt",
    "phi",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "seed_oss",
    "smollm3",
    "starcoder2",
)
#: Kept for code that imported the previous name.
SUPPORTED_MODEL_TYPES = VERIFIED_MODEL_TYPES

_ADVICE = "Disable prompt_sharing for this model"


def configure_model(context: Any, role: str, model: Any) -> str:
    """Check one causal LM and switch its attention to the shared attention; returns the implementation it runs."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    inspection = inspect_model(model)
    if inspection.refusal is not None:
        reason = inspection.refusal.split(" Train this model without padding_free")[0]
        raise UsageError(
            f"prompt_sharing cannot share prompts in this `{model_type}` model ({role} model {type(model).__name__}): "
            f"{reason} {_ADVICE} (and padding_free, which refuses it for the same reason)."
        )
    if model_type not in VERIFIED_MODEL_TYPES:
        raise UsageError(
            f"prompt_sharing is not verified on `{model_type}` models ({role} model {type(model).__name__}); it is "
            f"verified on {', '.join(VERIFIED_MODEL_TYPES)}. {_ADVICE}: `padding_free` alone runs any attention "
            "decoder, and checks models outside its verified table before the first step."
        )
    MoeAuxLoss.of(model)  # refuses a MoE model whose auxiliary loss cannot be reproduced
    impl = config._attn_implementation
    base = base_of(impl)
    if base is None:
        raise UsageError(
            f"prompt_sharing supports the attention implementations sdpa and eager, but the {role} model uses "
            f'`{impl}`. Load it with `attn_implementation="sdpa"`, or use padding_free alone (which also runs '
            "flash-attention varlen kernels)."
        )
    # Held per trainer (not per installation): the trainer keeps its plugins after `uninstall()` (issue 15).
    context.hold("prompt_sharing_attention", register_shared_attention, unregister_shared_attention)
    name = shared_attention_name(base)
    if impl != name:
        # A property over `_attn_implementation_internal` (transformers 5); never serialized, so checkpoints keep the
        # user's choice (configuration_utils.py `_remove_keys_not_serialized`).
        switch_attention(context.patcher, config, name)
    return name


def handle_dropout(context: Any, role: str, model: Any, trainer: Any) -> None:
    """Turn off every dropout site of `model` under `disable_dropout=True` (TRL's default; TRL itself zeroes
    `nn.Dropout` modules only), or refuse a policy that drops under `disable_dropout=False` (`dropout.py`)."""
    sites = dropout_sites(model)
    if not sites:
        return
    args = getattr(trainer, "args", None)
    if getattr(args, "disable_dropout", True):
        disable_dropout(context.patcher, model)
        logger.info(
            "prompt_sharing: disable_dropout=True: set to 0 the dropout of the %s model that TRL's disable_dropout "
            "leaves on: %s",
            role,
            describe(sites),
        )
        return
    if role == "ref":
        return  # TRL runs a separate reference model in eval mode: its dropout never acts
    raise UsageError(
        f"prompt_sharing cannot share prompts of the {role} model ({type(model).__name__}) with dropout on in "
        f"training ({describe(sites)}; `disable_dropout=False`): a shared prompt is computed once, so both responses "
        "would see one dropout mask where padded training draws two. Set `disable_dropout=True` (TRL's default; "
        f"prompt_sharing then also zeroes the dropout TRL misses), or {_disable_advice(context)}."
    )


def _disable_advice(context: Any) -> str:
    """What to do instead of sharing, for this trainer."""
    if getattr(context, "trainer_class", None) == "OnlineDPOTrainer":
        return "disable prompt_sharing for this model (Online DPO then scores padded, as stock TRL does)"
    return "disable prompt_sharing for this model (padding_free alone packs without sharing)"


def wrap_models(trainer: Any, context: Any) -> None:
    state = check_trainer(trainer, context)
    for role, model in context.models().items():
        state.attn_implementations[role] = configure_model(context, role, model)
        handle_dropout(context, role, model, trainer)
        check = None
        if state.self_check:

            def check(run, kwargs, layout, outputs, role, _model=model):
                if role in state.checked:
                    return
                if self_check(run, kwargs, layout, outputs, role, type(_model).__name__):
                    state.checked.add(role)

        forward = make_causal_lm_forward(model.forward, state, role, check, MoeAuxLoss.of(model))
        context.patcher.setattr(model, "forward", forward)
    if context.trainer_class == "OnlineDPOTrainer":
        context.patcher.setattr(
            trainer, "_forward", make_online_forward(trainer._forward, lambda: getattr(trainer, "max_length", None))
        )
    logger.info("prompt_sharing: sharing prompts in %s", state.attn_implementations)
