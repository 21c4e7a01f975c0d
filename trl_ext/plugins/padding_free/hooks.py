"""The hook implementations of `padding_free` (declared in its package), imported when the plugin is registered."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trl_ext import _compat
from trl_ext.api import UsageError, current_call, get_logger, hookimpl
from trl_ext.toolkit import architecture
from trl_ext.toolkit.architecture import Inspection
from trl_ext.toolkit.packing.attention import (
    VARLEN_BASES,
    register_varlen_attention,
    switch_attention,
    varlen_attention_name,
)
from trl_ext.toolkit.packing.glue import (
    AnnotatingCollator,
    check_packable_trainer,
    positional_input_ids,
    refuse_liger,
    repad_outputs,
    scoring_call,
)
from trl_ext.toolkit.packing.kernels import Choice, choose_for_model, log_choices, training_dtype
from trl_ext.toolkit.packing.metadata import (
    PACKING_KEY,
    PackInfo,
    pack_rows,
    packed_call,
    packing_metadata,
    unpack_rows,
    unpack_shifted,
)
from trl_ext.toolkit.packing.positions import PackedPositions, packed_positions
from trl_ext.toolkit.probe import model_probe_lengths
from trl_ext.toolkit.randomness import RandomDraw, training_draws

from . import NAME, PaddingFreeOptions
from .selfcheck import SelfCheckResult, random_draws_notice, self_check

if TYPE_CHECKING:  # pragma: no cover
    from transformers import Trainer

    from trl_ext.api import TrainerContext

logger = get_logger(__name__)

_FLASH = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
#: The model types padding_free packs without a self-check: the shared table, whole.
VERIFIED_MODEL_TYPES = architecture.VERIFIED_MODEL_TYPES


def inspect_model(model: Any) -> Inspection:
    """The packing mechanisms of `model`, or why padding_free refuses it (`toolkit.architecture`)."""
    return architecture.inspect_model(model, NAME, VERIFIED_MODEL_TYPES)


@dataclasses.dataclass
class PaddingFreeState:
    """Per-trainer state of the plugin (`context.state["padding_free"]`)."""

    attention: str = "auto"
    self_check: str | bool = "auto"
    checked: bool = False
    #: the architecture inspection of each wrapped model, and the self-check results, by role
    inspections: dict[str, Inspection] = dataclasses.field(default_factory=dict)
    self_checks: dict[str, SelfCheckResult] = dataclasses.field(default_factory=dict)
    #: attention implementation each wrapped model runs, by role (for logs and tests)
    attn_implementations: dict[str, str] = dataclasses.field(default_factory=dict)
    #: the packed attention of each model switched to the varlen attention, by role (`toolkit.packing.kernels.Choice`)
    kernels: dict[str, Choice] = dataclasses.field(default_factory=dict)
    #: number of packed forward calls, and of calls that could not be packed and ran padded
    packed_calls: int = 0
    unpacked_calls: int = 0
    #: tokens of the packed calls' padded batches, and of their packed rows (the padding not computed)
    padded_tokens: int = 0
    packed_tokens: int = 0
    #: the layers of each model that draw random numbers in training mode (`randomness.training_draws`), by role
    random_draws: dict[str, list[RandomDraw]] = dataclasses.field(default_factory=dict)

    def count(self, info: Any) -> None:
        """One packed call of the padded `[rows, length]` batch `info` describes."""
        self.packed_calls, self.padded_tokens = self.packed_calls + 1, self.padded_tokens + info.rows * info.length
        self.packed_tokens += info.num_tokens

    def summary(self) -> str:
        """The end-of-run line of `trl-ext dpo`: what packing left out."""
        if not self.packed_calls:
            return "did nothing: no scoring call was packed" + (
                f" ({self.unpacked_calls} ran padded)" if self.unpacked_calls else ""
            )
        saved = 1 - self.packed_tokens / self.padded_tokens if self.padded_tokens else 0.0
        text = (
            f"{self.packed_calls} scoring calls packed: {self.padded_tokens} padded tokens computed as "
            f"{self.packed_tokens} ({saved:.0%} padding not computed)"
        )
        return text + (f"; {self.unpacked_calls} calls ran padded" if self.unpacked_calls else "")


def _state(context) -> PaddingFreeState:
    state = context.state.get(NAME)
    if state is None:
        options: PaddingFreeOptions = context.options(NAME)
        state = context.state[NAME] = PaddingFreeState(attention=options.attention, self_check=options.self_check)
    return state


# ---------------------------------------------------------------------------------------------------------------------
# Trainer lifecycle
# ---------------------------------------------------------------------------------------------------------------------


@hookimpl
def trl_ext_trainer_init_start(trainer: Trainer, context: TrainerContext, init_kwargs: dict[str, Any]) -> None:
    _state(context)
    refuse_liger(init_kwargs, NAME, "not verified; on TRL <= 1.14 the Liger DPO loss calls the backbone directly")


def _check_trainer(trainer, context) -> PaddingFreeState:
    """Refuse what packing cannot do correctly; runs once, before the first packed forward."""
    state = _state(context)
    if not state.checked:
        check_packable_trainer(trainer, NAME)
        state.checked = True
    return state


def _configure_model(context, role: str, model) -> str:
    """Check one causal LM and switch its attention to varlen if needed; returns the implementation it runs."""
    state = _state(context)
    config = model.config
    model_type = getattr(config, "model_type", None)
    inspection = state.inspections[role] = inspect_model(model)
    if inspection.refusal is not None:
        raise UsageError(
            f"padding_free cannot keep packed sequences apart in this `{model_type}` model ({role} model "
            f"{type(model).__name__}): {inspection.refusal}"
        )
    impl = config._attn_implementation
    if impl in _FLASH:
        return impl
    if impl in (varlen_attention_name(b) for b in VARLEN_BASES):
        return impl  # already switched (the same config object serves the policy and its PEFT base)
    if impl not in VARLEN_BASES:
        raise UsageError(
            f"padding_free supports the attention implementations sdpa, eager and {', '.join(_FLASH)}, but the {role} "
            f'model uses `{impl}`. Load it with `attn_implementation="sdpa"` (or flash_attention_2 on GPU).'
        )
    if state.attention == "dense":
        return impl
    # Held per trainer (not per installation): the trainer keeps its plugins after `uninstall()`.
    context.patch("process", register_varlen_attention, key="varlen_attention")
    switch_attention(context.patcher, config, varlen_attention_name(impl))
    return varlen_attention_name(impl)


@hookimpl
def trl_ext_make_collator(trainer: Trainer, context: TrainerContext, collator: Callable) -> Callable | None:
    _check_trainer(trainer, context)
    return PaddingFreeCollator(collator)


@hookimpl
def trl_ext_make_packed_forward(
    trainer: Trainer, context: TrainerContext, role: str, backbone: torch.nn.Module
) -> Callable | None:
    state = _check_trainer(trainer, context)
    model = context.models()[role]
    state.attn_implementations[role] = _configure_model(context, role, model)
    return _make_backbone_forward(backbone.forward, state, row_limit(model))


@hookimpl
def trl_ext_make_model_forward(trainer: Trainer, context: TrainerContext, role: str, model: torch.nn.Module) -> Any:
    state = _check_trainer(trainer, context)
    if role not in state.attn_implementations:  # a model whose backbone the core could not reach
        state.attn_implementations[role] = _configure_model(context, role, model)
    return _make_causal_lm_forward(model.forward, state, row_limit(model))


@hookimpl
def trl_ext_trainer_models_ready(trainer: Trainer, context: TrainerContext) -> None:
    state = _check_trainer(trainer, context)
    for role, model in context.models().items():
        # models switched to the varlen attention: one fused kernel per layer where it runs (`toolkit.packing.kernels`)
        impl = state.attn_implementations[role]
        base = next((b for b in VARLEN_BASES if impl == varlen_attention_name(b)), None)
        if base is not None:
            state.kernels[role] = choose_for_model(
                model, base, state.attention, trainer, NAME, patcher=context.patcher
            )
        check_model(state, role, model, trainer)
    logger.info("padding_free: packing %s", state.attn_implementations)
    log_choices(logger, NAME, state.kernels)


def row_limit(model) -> int | None:
    """The most tokens one packed row of `model` may hold, or None: MPT computes its ALiBi biases for rows of at most
    `max_seq_len` tokens (a padded row never holds more, a packed row of a whole batch can), so its packed batches are
    split into several packed rows of at most that many tokens."""
    table = getattr(model.config, _compat.MPT_ALIBI_TABLE_ATTR, None)
    return table if getattr(model.config, "model_type", None) == "mpt" and isinstance(table, int) else None


def check_model(state: PaddingFreeState, role: str, model, trainer) -> None:
    """Before the first step: the layers of a wrapped model that draw random numbers in training mode (one notice),
    then the self-check where it runs (outside the verified table, or `self_check: true`), in its training mode
    (eval mode where it draws); a `UsageError` if the packed forward differs from the stock padded forward."""
    # TRL trains the policy in training mode (`Trainer.train` calls `model.train()`) and runs a separate reference
    # model in the mode it was given (eval after `from_pretrained`; TRL never changes it)
    training = role == "policy" or model.training
    draws = training_draws(model) if training else []
    if draws:
        state.random_draws[role] = draws
        logger.warning("padding_free: %s", random_draws_notice(role, model, draws))
    if state.self_check is not True and state.inspections[role].verified:
        return
    # the self-check: `model`'s packed forward must equal its stock padded forward on a probe sized from training
    training = training and not draws
    counts = state.packed_calls, state.unpacked_calls, state.padded_tokens, state.packed_tokens
    moe = any(m.startswith("MoE") for m in state.inspections[role].mechanisms)
    lengths = model_probe_lengths(model, trainer, "padding_free")
    dtype = training_dtype(model, trainer)  # 16 bits for a float32 model trained under 16-bit autocast
    autocast = dtype if next(model.parameters()).dtype == torch.float32 and dtype != torch.float32 else None
    result = self_check(model, model.forward, lengths=lengths, moe=moe, autocast=autocast, training=training)
    # the probe's forwards are not training forwards: none of them in the end-of-run counts
    state.packed_calls, state.unpacked_calls, state.padded_tokens, state.packed_tokens = counts
    state.self_checks[role] = result
    model_type = getattr(model.config, "model_type", None)
    if result.leak is not None:
        raise UsageError(
            f"padding_free's self-check failed for the {role} model ({type(model).__name__}, `{model_type}`): "
            f"{result.leak}. Packed training would differ from stock; train this model without padding_free."
        )
    logger.info(
        "padding_free: self-check passed for the %s model (%s, `%s`, %s, %s mode): packed sequences stay apart "
        "(bit-identical) and equal the stock padded forward (max relative difference %.2g <= %g) on probe sequences "
        "of %s tokens; cost %d forwards, %.2f s",
        role,
        type(model).__name__,
        model_type,
        f"{autocast} autocast" if autocast is not None else next(model.parameters()).dtype,
        "training" if training else "eval",
        result.max_position_error,
        result.tolerance,
        list(result.lengths),
        result.forwards,
        result.seconds,
    )


@hookimpl
def trl_ext_describe(trainer: Trainer, context: TrainerContext) -> str | None:
    return ", ".join(f"{role}: {impl}" for role, impl in _state(context).attn_implementations.items()) or None


# ---------------------------------------------------------------------------------------------------------------------
# Collator
# ---------------------------------------------------------------------------------------------------------------------


class PaddingFreeCollator(AnnotatingCollator):
    """Wraps a preference collator and adds the packing metadata under `trl_ext_packing` (see `AnnotatingCollator`)."""

    plugin = NAME

    def annotate(self, batch: dict[str, Any]) -> None:
        mask = batch.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise UsageError(
                "padding_free needs the collator to return a 2D `attention_mask` (1 = real token), as TRL's "
                f"DataCollatorForPreference does; {type(self.collator).__name__} returned "
                f"{type(mask).__name__ if mask is None else tuple(mask.shape)}."
            )
        batch[PACKING_KEY] = packing_metadata(mask).to_batch()


# ---------------------------------------------------------------------------------------------------------------------
# Forward wrappers
# ---------------------------------------------------------------------------------------------------------------------


def _pack_kwargs(kwargs: dict[str, Any], meta: Any) -> tuple[dict[str, Any], PackInfo]:
    global _REBUILT_WARNED
    input_ids = kwargs["input_ids"]
    info = PackInfo.from_batch(meta, input_ids, kwargs["attention_mask"]) if meta is not None else None
    if info is None:
        if meta is not None and not _REBUILT_WARNED:
            _REBUILT_WARNED = True
            logger.warning(
                "padding_free: the packing metadata of a batch did not match its %s input_ids and attention_mask "
                "(changed after collation); it was rebuilt from attention_mask (once-only warning).",
                tuple(input_ids.shape),
            )
        info = packing_metadata(kwargs["attention_mask"])
    packed = dict(kwargs)
    packed["input_ids"] = pack_rows(input_ids, info)
    packed["attention_mask"] = None  # transformers only isolates packed sequences without a 2D mask
    position_ids = kwargs.get("position_ids")
    packed["position_ids"] = info.position_ids if position_ids is None else pack_rows(position_ids, info)
    cu, longest = info.cu_seq_lens.to(torch.int32), info.max_length  # flash-attention's varlen arguments
    packed.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return packed, info


_REBUILT_WARNED = False


def _row_groups(info: PackInfo, limit: int) -> list[tuple[int, int]]:
    """Consecutive rows `[start, end)` whose real tokens fit one packed row of at most `limit` tokens (a row longer
    than `limit` alone in its group)."""
    lengths = (info.cu_seq_lens[1:] - info.cu_seq_lens[:-1]).tolist()
    groups, start, total = [], 0, 0
    for row, n in enumerate(lengths):
        if row > start and total + n > limit:
            groups.append((start, row))
            start, total = row, 0
        total += n
    groups.append((start, len(lengths)))
    return groups


def _split_call(run: Callable, kwargs: dict[str, Any], info: PackInfo, limit: int) -> Any:
    """`run(kwargs, None)` on each group of rows that fits a packed row of `limit` tokens, the per-row outputs
    concatenated along the rows; `loss` (a mean over the whole call, which TRL's DPO does not read) is dropped, any
    other field (not combinable exactly) refused."""
    outputs = []
    for start, end in _row_groups(info, limit):
        part = {k: v[start:end] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == info.rows else v
                for k, v in kwargs.items()}  # fmt: skip
        outputs.append((end - start, run(part, None)))
    first = outputs[0][1]
    combined = {}
    for key, value in first.items():
        if isinstance(value, torch.Tensor) and value.dim() and all(o[key].shape[0] == n for n, o in outputs):
            combined[key] = torch.cat([o[key] for _, o in outputs])
        elif key != "loss":
            raise UsageError(
                f"padding_free: this model's packed rows hold at most {limit} tokens, so a batch of {info.num_tokens} "
                f"tokens runs as several packed rows, whose `{key}` output cannot be combined exactly. Lower "
                f"per_device_train_batch_size / max_length so that a batch holds at most {limit} tokens, or train "
                "without padding_free."
            )
    return type(first)(**combined)


def _make_backbone_forward(original: Callable, state: PaddingFreeState, limit: int | None = None) -> Callable:
    """Backbone (`model.base_model`) forward: pack a padded batch, scatter `last_hidden_state` back to `[R, L, H]`
    (in several packed rows of at most `limit` tokens where the model has a row limit)."""

    def run(kwargs: dict[str, Any], meta: Any) -> Any:
        packed, info = _pack_kwargs(kwargs, meta)
        with packed_call(info):
            outputs = original(**packed)
        state.count(info)
        outputs.last_hidden_state = unpack_rows(outputs.last_hidden_state, info)
        return outputs

    return _packing_forward(original, run, limit)


def _make_causal_lm_forward(original: Callable, state: PaddingFreeState, limit: int | None = None) -> Callable:
    """Causal-LM forward: pack, run backbone and LM head on real tokens only, return outputs in the padded layout (in
    several packed rows of at most `limit` tokens where the model has a row limit: `row_limit`)."""

    def run(kwargs: dict[str, Any], meta: Any) -> Any:
        packed, info = _pack_kwargs(kwargs, meta)
        labels = kwargs.get("labels")
        if labels is not None:
            # The shift (`hidden[:, :-1]` vs `labels[:, 1:]`) runs over the whole packed row, so the last token of a
            # sequence would "predict" the first token of the next one: never score a sequence's first token (the
            # padded layout never does either). Same rule as TRL's SFT padding-free path (sft_trainer.py).
            packed_labels = pack_rows(labels, info).clone()
            starts = info.cu_seq_lens[:-1].long().clamp(max=max(info.num_tokens - 1, 0))
            packed["labels"] = packed_labels.index_fill_(1, starts, -100)
        # announced to the modules inside (fused_logprobs' output head scores padded positions from the packed row)
        packed_ids = torch.arange(info.num_tokens, device=info.indices.device)
        positions = PackedPositions(info.rows, info.length, info.indices, packed_ids)
        with packed_call(info), packed_positions(positions):
            outputs = original(**packed)
        state.count(info)
        if positions.padded_output:  # a module inside returned the padded layout already
            return outputs
        fused = bool(kwargs.get("fused_lm_head"))
        return repad_outputs(outputs, fused, lambda x: unpack_rows(x, info), lambda x: unpack_shifted(x, info))

    def unpacked(kwargs: dict[str, Any]) -> None:
        if kwargs.get("use_cache") is False and isinstance(kwargs.get("attention_mask"), torch.Tensor):
            if not current_call().stock:
                # A scoring call on a padded batch that packing cannot reproduce (e.g. `output_hidden_states`): it
                # runs padded, which is correct; say so once instead of hiding it.
                state.unpacked_calls += 1
                if state.unpacked_calls == 1:
                    logger.warning("padding_free: a forward with %s ran padded (not packable)", sorted(kwargs))

    return _packing_forward(original, run, limit, unpacked)


def _packing_forward(
    original: Callable, run: Callable, limit: int | None, unpacked: Callable | None = None
) -> Callable:
    """`original`, its packable scoring calls run by `run(kwargs, meta)` (split by `_split_call` where the model has a
    row `limit`); any other call runs as it came, seen first by `unpacked(kwargs)`."""

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        meta = kwargs.pop(PACKING_KEY, None)
        args = positional_input_ids(args, kwargs)
        if args or not scoring_call(kwargs):
            if unpacked is not None:
                unpacked(kwargs)
            return original(*args, **kwargs)
        if limit is not None and (info := packing_metadata(kwargs["attention_mask"])).num_tokens > limit:
            return _split_call(run, kwargs, info, limit)
        return run(kwargs, meta)

    return forward
