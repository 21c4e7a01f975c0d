"""What a causal LM's layers do to a packed row: the mechanisms that decide whether packing is exact.

Packing is exact when every layer is per-token except attention, and attention is kept inside each sequence (the
varlen attention of `trl_ext.plugins._packing`, flash-attention's varlen kernels, or transformers' block-diagonal
mask) with positions that restart per sequence (`position_ids`). `inspect_model` reads the model's modules and
config and either returns the mechanisms it found or the reason packing cannot be exact (a layer that carries state
from token to token, ALiBi biases, capacity-limited routing). Architectures checked end to end (packed == padded in
float64, loss, MoE auxiliary loss and gradients) by tests/plugins/test_padding_free_sweep.py are listed in
`VERIFIED_MODEL_TYPES`; any other model is measured by the self-check (`self_check.py`) before its first step.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

#: `config.model_type`s whose packed training equals padded training in float64 (losses, MoE auxiliary loss,
#: gradients), measured by the architecture sweep (tests/plugins/test_padding_free_sweep.py). Other models run the
#: self-check before their first step.
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
    "stablelm",
    "starcoder2",
)

# Class-name fragments of token mixers that carry state from one token to the next (recurrences, convolutions over
# the sequence). Packed, they would run across sequence boundaries.
_STATEFUL_NAMES = (
    "mamba",
    "shortconv",
    "short_conv",
    "deltanet",
    "linearattention",
    "lightning",
    "recurrent",
    "rwkv",
    "mlstm",
    "slstm",
    "xlstm",
)
_ADVICE = "Train this model without padding_free (leave `padding_free` unset)."


@dataclasses.dataclass
class Inspection:
    """What `inspect_model` found.

    Attributes:
        mechanisms (`list[str]`): the sequence-related mechanisms found (positions, windows, sinks, MoE...).
        refusal (`str` or `None`): why packing cannot be exact, naming the layer; None when it can be.
        verified (`bool`): whether `config.model_type` is in `VERIFIED_MODEL_TYPES`.
    """

    mechanisms: list[str]
    refusal: str | None
    verified: bool


def _config_value(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _stateful_module(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    for name, module in model.named_modules():
        cls = type(module).__name__.lower()
        if any(part in cls for part in _STATEFUL_NAMES):
            return name, module
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv1d):
            return name, module
    return None


def _uses_alibi(model: torch.nn.Module) -> bool:
    config = model.config
    if hasattr(config, "alibi"):  # falcon
        return bool(config.alibi)
    attn_config = getattr(config, "attn_config", None)  # mpt
    if attn_config is not None:
        alibi = attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", None)
        if alibi is not None:
            return bool(alibi)
    modeling = sys.modules.get(type(model).__module__)
    return modeling is not None and any("alibi" in name.lower() for name in dir(modeling))  # bloom


def _positions(model: torch.nn.Module) -> str:
    config = model.config
    partial = _config_value(config, "partial_rotary_factor", "rotary_pct")
    rope = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and partial is None:
        partial = rope.get("partial_rotary_factor")
    names = {type(m).__name__.lower() for m in model.modules()}
    if any("rotary" in n for n in names):
        return "partial rotary" if partial is not None and float(partial) < 1 else "rotary"
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and any(k in name for k in ("wpe", "pos", "position")):
            return "learned positions"
    return "positions?"


def inspect_model(model: torch.nn.Module) -> Inspection:
    """The mechanisms of `model` that matter for packing, or the reason packing cannot be exact."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    verified = model_type in VERIFIED_MODEL_TYPES
    stateful = _stateful_module(model)
    if stateful is not None:
        name, module = stateful
        return Inspection(
            ["stateful mixer"],
            f"its layer `{name}` ({type(module).__name__}) mixes neighbouring tokens with state carried along the "
            "sequence (a convolution or recurrence), which would run across the sequence boundaries of a packed row. "
            + _ADVICE,
            verified,
        )
    if _uses_alibi(model):
        return Inspection(
            ["alibi"],
            f"its attention uses ALiBi biases ({type(model).__name__}), which this model computes from the padded "
            "attention mask and not from per-sequence positions, so a packed row would bias across sequences. "
            + _ADVICE,
            verified,
        )
    mechanisms = [_positions(model)]
    window = _config_value(config, "sliding_window", "attention_window")
    if isinstance(window, int) and window > 0:
        mechanisms.append("sliding window")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        mechanisms.append("attention sinks")
    if _config_value(config, "attn_logit_softcapping") is not None:
        mechanisms.append("softcapping")
    if any(n.endswith(("q_norm", "k_norm", "q_layernorm", "k_layernorm")) for n, _ in model.named_modules()):
        mechanisms.append("QK-norm")
    experts = _config_value(config, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    if isinstance(experts, int) and experts > 1:
        capacity = _config_value(config, "expert_capacity", "capacity_factor", "moe_capacity_factor")
        if capacity:
            return Inspection(
                [*mechanisms, "MoE (capacity-limited)"],
                f"its MoE routing is capacity-limited (`{capacity}`), so which tokens an expert takes depends on the "
                "other tokens of the row, and a packed row routes differently from a padded batch. " + _ADVICE,
                verified,
            )
        mechanisms.append("MoE (token choice)")
    return Inspection(mechanisms, None, verified)
