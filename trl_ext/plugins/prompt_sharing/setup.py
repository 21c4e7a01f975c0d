"""Per-trainer state, the refusals, and the wiring of the shared forward into a trainer's models."""

from __future__ import annotations

import dataclasses
from typing import Any

from trl_ext import _compat
from trl_ext.api import UsageError, get_logger
from trl_ext.toolkit.architecture import inspect_model, verified_except
from trl_ext.toolkit.online_forward import verify_against_trl
from trl_ext.toolkit.packing.attention import switch_attention
from trl_ext.toolkit.packing.glue import check_packable_trainer
from trl_ext.toolkit.packing.kernels import Choice, choose_for_model, log_choices, training_dtype
from trl_ext.toolkit.probe import model_probe_lengths, training_max_length
from trl_ext.toolkit.randomness import describe_draws, training_draws
from trl_ext.toolkit.roles import PACKING as PACKING_ROLE

from . import NAME
from .attention import base_of, register_shared_attention, shared_attention_name
from .dropout import describe, disable_dropout, dropout_sites
from .forward import is_trl_online_forward, make_causal_lm_forward
from .layout import SharedLayout
from .moe import MoeAuxLoss
from .selfcheck import SelfCheckResult, self_check

logger = get_logger(__name__)


@dataclasses.dataclass
class PromptSharingState:
    """Per-trainer state of the plugin (`context.state["prompt_sharing"]`)."""

    self_check: str | bool = "auto"
    #: the `attention` option, and the shared attention's kernel (`kernels.Choice`) of each model, by role
    attention: str = "auto"
    kernels: dict[str, Choice] = dataclasses.field(default_factory=dict)
    checked_trainer: bool = False
    #: whether TRL's own Online DPO `_forward` is next in its chain (`forward.online_forward` runs its steps)
    online_own: bool = False
    #: roles whose self-check passed, and the results
    checked: set[str] = dataclasses.field(default_factory=set)
    self_checks: dict[str, SelfCheckResult] = dataclasses.field(default_factory=dict)
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
                " in `trainer._trl_ext.state['prompt_sharing'].counts()`",
                layout.unshared_rows,
                layout.rows,
            )

    def summary(self) -> str:
        """The end-of-run line of `trl-ext dpo` / `online-dpo`, in words (the numbers: `counts()`)."""
        if not self.shared_calls:
            unshared = f" ({self.unshared_calls} scoring calls ran unshared)" if self.unshared_calls else ""
            return f"did nothing: no scoring call was shared{unshared}"
        saved = 1 - self.shared_tokens / self.padded_tokens if self.padded_tokens else 0.0
        text = (
            f"{self.shared_calls} scoring calls shared their prompts: {self.rows} sequences, {self.padded_tokens} "
            f"padded tokens computed as {self.shared_tokens} ({saved:.0%} fewer)"
        )
        if self.unshared_rows:
            text += f"; {self.unshared_rows} sequences shared no prompt and ran unshared"
        if self.unshared_calls:
            text += f"; {self.unshared_calls} scoring calls ran unshared"
        return text

    def counts(self) -> dict[str, Any]:
        """What `summary()` says, as numbers."""
        return {
            "shared_calls": self.shared_calls,
            "unshared_calls": self.unshared_calls,
            "sequences": self.rows,
            "unshared_sequences": self.unshared_rows,
            "unshared_fraction": self.unshared_rows / self.rows if self.rows else 0.0,
            "padded_tokens": self.padded_tokens,
            "shared_tokens": self.shared_tokens,
            "self_checked": sorted(self.checked),
            "attention": dict(self.attn_implementations),
        }


def state_of(context: Any) -> PromptSharingState:
    state = context.state.get(NAME)
    if state is None:
        options = context.options(NAME)
        state = context.state[NAME] = PromptSharingState(self_check=options.self_check, attention=options.attention)
    return state


def check_trainer(trainer: Any, context: Any) -> PromptSharingState:
    """Refuse what sharing cannot do correctly; runs once, before the first shared forward."""
    state = state_of(context)
    if not state.checked_trainer:
        check_packable_trainer(trainer, NAME)
        state.checked_trainer = True
    return state


#: Model types of the shared packing table (`toolkit.architecture.VERIFIED_MODEL_TYPES`) whose shared forward is not
#: verified, with why. The others equal the stock padded forward in float64 (measured by
#: tests/plugins/test_prompt_sharing_architectures.py); types outside the table are admitted by the self-check.
NOT_VERIFIED = {
    "stablelm": "its decoder layer does not hand attention keyword arguments (the segments) to its attention",
    "dory": "not measured shared yet",
    "gpt_neox_japanese": "not measured shared yet",
    "llama4_text": "not measured shared yet",
    "phimoe": "not measured shared yet",
}
VERIFIED_MODEL_TYPES = verified_except(NOT_VERIFIED)


def configure_model(context: Any, role: str, model: Any) -> str:
    """Check one causal LM and switch its attention to the shared attention; returns the implementation it runs.

    A model type outside `VERIFIED_MODEL_TYPES` is admitted here and measured by the self-check before the first step
    (`check_models`)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    inspection = inspect_model(model, NAME, VERIFIED_MODEL_TYPES)
    if inspection.refusal is not None:
        reason = _reason(inspection.refusal)
        raise UsageError(
            f"prompt_sharing cannot share prompts in this `{model_type}` model ({role} model {type(model).__name__}): "
            f"{reason} {_disable_advice(context, refused_by_packing=True)}."
        )
    packers = " or ".join(_other_packers(context))
    own = [m for m in inspection.mechanisms if "alibi" in m.lower() or "own attention" in m.lower()]
    if own:
        what = "ALiBi attention" if any("alibi" in m.lower() for m in own) else "attention"
        if _online(context) or not packers:
            advice = _disable_advice(context)
        else:
            advice = f"Disable prompt_sharing for this model: {packers} alone packs it, without sharing"
        raise UsageError(
            f"prompt_sharing cannot share prompts in this `{model_type}` model ({role} model {type(model).__name__}): "
            f"its layers compute {what} in their own module from the padded mask ({', '.join(own)}), outside "
            f"transformers' attention interface, so the shared attention cannot keep the two responses apart. "
            f"{advice}."
        )
    MoeAuxLoss.of(model)  # refuses a MoE model whose auxiliary loss cannot be reproduced
    impl = config._attn_implementation
    base = base_of(impl)
    if base is None:
        if _online(context):
            instead = "or disable prompt_sharing (Online DPO then scores padded, with any attention)"
        elif not packers:
            instead = "or disable prompt_sharing (training then runs padded, with any attention)"
        else:
            instead = f"or use {packers} alone (packing without sharing)"
        raise UsageError(
            f"prompt_sharing supports the attention implementations sdpa and eager, but the {role} model uses "
            f'`{impl}`. Load it with `attn_implementation="sdpa"`, {instead}.'
        )
    # Held per trainer (not per installation): the trainer keeps its plugins after `uninstall()`.
    context.patch("process", register_shared_attention, key="prompt_sharing_attention")
    name = shared_attention_name(base)
    if impl != name:
        switch_attention(context.patcher, config, name)
    return name


#: Where the shared inspection's refusal starts its advice, cut from a prompt_sharing refusal (which gives its own).
_INSPECTION_ADVICE = (
    " Train this model without",
    " Load the model with",
    " Set `attn_temperature_tuning",
)


def _reason(refusal: str) -> str:
    """The inspection's refusal as a prompt_sharing reason: the mechanism, without the inspection's advice."""
    for marker in _INSPECTION_ADVICE:
        refusal = refusal.split(marker)[0]
    return refusal


def _online(context: Any) -> bool:
    return getattr(context, "trainer_class", None) == "OnlineDPOTrainer"


def _other_packers(context: Any) -> tuple[str, ...]:
    """Other plugins that pack for this trainer (declared by role, never by name): what the advice may offer."""
    serving = getattr(context, "plugins_serving", None)
    return tuple(n for n in serving(PACKING_ROLE) if n != NAME) if serving is not None else ()


def _disable_advice(context: Any, refused_by_packing: bool = False) -> str:
    """What to do instead of sharing, for this trainer (only plugins that pack for it are offered)."""
    if _online(context):
        return "Disable prompt_sharing for this model (Online DPO then scores padded, as stock TRL does)"
    if refused_by_packing:
        return "Disable prompt_sharing for this model (packing is refused for the same reason: train it padded)"
    packers = " or ".join(_other_packers(context))
    if not packers:
        return "Disable prompt_sharing for this model: padded training runs it as stock TRL does"
    return (
        "Disable prompt_sharing for this model: padded training runs it as stock TRL does "
        f"({packers} packs without sharing where its own self-check passes)"
    )


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
        f"prompt_sharing then also zeroes the dropout TRL misses). Or: {_disable_advice(context)}."
    )


def refuse_acting_chunks(context: Any, role: str, model: Any, trainer: Any) -> None:
    """Refuse chunked attention (`attention_chunk_size`, Llama 4) whose chunks act on the sequences training feeds:
    transformers applies it only through the attention mask, which the shared attention does not rebuild for a
    prompt and its responses. A chunk at least as long as every training sequence never acts (stock or shared)."""
    chunk = getattr(model.config, "attention_chunk_size", None)
    longest = training_max_length(trainer)
    if not isinstance(chunk, int) or chunk <= 0 or (longest is not None and longest <= chunk):
        return
    raise UsageError(
        f"prompt_sharing cannot share prompts in this `{model.config.model_type}` model ({role} model "
        f"{type(model).__name__}): its attention applies chunked attention (`attention_chunk_size={chunk}`) only "
        "through the attention mask transformers builds, which the shared attention does not rebuild for a prompt and "
        f"its responses, so a response would attend across chunks (training feeds sequences of up to {longest} "
        f"tokens). Set `max_length` to at most {chunk}, or: {_disable_advice(context)}."
    )


def refuse_random_draws(context: Any, role: str, model: Any) -> None:
    """Refuse a policy whose forward still draws random numbers in training mode once its dropout is handled
    (`toolkit.randomness.training_draws`: dropout read inside `forward`, or a layer that samples, such as PhiMoE's
    router). A separate reference model runs in the mode it was given (TRL never changes it): checked when that is
    training."""
    if role != "policy" and not model.training:
        return
    draws = training_draws(model)
    if not draws:
        return
    if all(d.dropout for d in draws):
        kind = "dropout that neither TRL's `disable_dropout` nor prompt_sharing could turn off"
    else:
        kind = (
            "a layer that samples in training (PhiMoE's router samples its experts), or dropout applied inside "
            "`forward` that neither TRL's `disable_dropout` nor prompt_sharing could turn off"
        )
    raise UsageError(
        f"prompt_sharing cannot share prompts in this `{getattr(model.config, 'model_type', None)}` model ({role} "
        f"model {type(model).__name__}): its forward draws random numbers in training mode, in "
        f"{describe_draws(draws)} ({kind}). A shared prompt is computed once, so both responses would see one random "
        f"sample of it where padded training draws one per response. {_disable_advice(context)}."
    )


def model_forward(trainer: Any, context: Any, role: str, model: Any) -> Any:
    """prompt_sharing's answer to `trl_ext_make_model_forward`: check `model`, switch its attention to the shared
    attention, handle its dropout, choose its kernel, then return its shared causal-LM forward (the core installs it,
    outermost). Refuses (`UsageError`) what sharing cannot reproduce."""
    state = check_trainer(trainer, context)
    model_type = getattr(model.config, "model_type", None)
    if state.self_check is False and model_type not in VERIFIED_MODEL_TYPES:
        raise UsageError(
            f"prompt_sharing is not verified on `{model_type}` models ({role} model {type(model).__name__}) and "
            "`self_check` is false. Set `plugins: {prompt_sharing: {self_check: auto}}` (the default) to admit it "
            f"through the self-check before the first step. Or: {_disable_advice(context)}."
        )
    state.attn_implementations[role] = configure_model(context, role, model)
    handle_dropout(context, role, model, trainer)
    refuse_acting_chunks(context, role, model, trainer)
    refuse_random_draws(context, role, model)
    base = base_of(state.attn_implementations[role]) or "sdpa"
    state.kernels[role] = choose_for_model(model, base, state.attention, trainer, NAME, patcher=context.patcher)
    return make_causal_lm_forward(model.forward, state, MoeAuxLoss.of(model))


def check_models(trainer: Any, context: Any) -> None:
    """With every model's shared forward installed: check Online DPO's `_forward` against TRL's steps where
    prompt_sharing runs them, and run the self-checks (`run_self_check`) where they run."""
    state = check_trainer(trainer, context)
    if context.trainer_class == "OnlineDPOTrainer":
        # TRL's own `_forward` next in the chain: its steps run in prompt_sharing's link, checked against TRL now.
        chain = context.calls[_compat.ONLINE_DPO_FORWARD_METHOD]
        original = context.stock_methods[_compat.ONLINE_DPO_FORWARD_METHOD]
        state.online_own = chain[-1] == NAME and is_trl_online_forward(original)
        if state.online_own:
            verify_against_trl(original.__func__, NAME, trainer)
    for role, model in context.models().items():
        if role not in state.attn_implementations:
            continue  # never offered to the plugin (`trl_ext_make_model_forward`): not shared
        verified = getattr(model.config, "model_type", None) in VERIFIED_MODEL_TYPES
        if state.self_check is True or (state.self_check == "auto" and not verified):
            run_self_check(context, state, role, model, trainer)
    logger.info("prompt_sharing: sharing prompts in %s", state.attn_implementations)
    log_choices(logger, NAME, state.kernels)


def run_self_check(context: Any, state: PromptSharingState, role: str, model: Any, trainer: Any) -> None:
    """Measure, before the first step, that `model`'s shared forward equals its stock padded forward on a probe of
    prompt-sharing pairs sized from what training will feed (`selfcheck.py`); refuse if it does not."""
    counters = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.type == "int"}
    lengths = model_probe_lengths(model, trainer, "prompt_sharing")
    dtype = training_dtype(model, trainer)
    # mixed precision: accelerate's autocast, which the prepared model's forward runs under in training
    accelerator = getattr(trainer, "accelerator", None)
    autocast = accelerator.autocast if dtype != next(model.parameters()).dtype and accelerator is not None else None
    # the policy trains in training mode (its dropout off); a separate reference model runs in the mode it was given
    training = role == "policy" or model.training
    result = self_check(model, model.forward, lengths, dtype=dtype, training=training, autocast=autocast)
    for name, value in counters.items():  # the probe's forwards are not training forwards
        setattr(state, name, value)
    state.self_checks[role] = result
    model_type = getattr(model.config, "model_type", None)
    if result.failure is not None:
        raise UsageError(
            f"prompt_sharing's self-check failed for the {role} model ({type(model).__name__}, `{model_type}`): "
            f"{result.failure}. {_disable_advice(context)}."
        )
    state.checked.add(role)
    logger.info(
        "prompt_sharing: self-check passed for the %s model (%s, `%s`, %s): the shared forward equals the stock "
        "padded forward (max relative difference %.2g <= %g) on %d prompt-sharing pairs of %s tokens; cost %d "
        "forwards, %.2f s",
        role,
        type(model).__name__,
        model_type,
        str(dtype).replace("torch.", ""),
        result.max_error,
        result.tolerance,
        len(result.lengths),
        list(result.lengths),
        result.forwards,
        result.seconds,
    )
