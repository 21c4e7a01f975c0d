"""What a causal LM's layers do to a packed row: the mechanisms that decide whether packing is exact.

Packing is exact when every layer is per-token except attention, and attention is kept inside each sequence with
positions that restart per sequence. `inspect_model` reads the model's modules and config and returns the mechanisms
it found or the reason packing cannot be exact, naming the layer and the plugin that asked (the refusals are listed
in docs/plugins/padding_free.md). `VERIFIED_MODEL_TYPES` are checked end to end by the architecture sweep; a plugin
that packs more selectively declares its own table with `verified_except`; any other model is measured by the
plugin's self-check before its first step.

ALiBi: within a block-diagonal attention a key's bias depends on its distance to the query only up to a per-query
constant, which softmax ignores, so Bloom and MPT pack exactly on sdpa/eager (`packing.attention` gives their own
attention the per-sequence mask). transformers runs no ALiBi model with flash-attention (Falcon raises for
`alibi=True`); one that did would pass its slopes to the varlen kernels, which bias per sequence of `cu_seqlens`.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Mapping, Sequence

import torch

from .. import _compat

#: `config.model_type`s whose packed training equals padded training in float64 (losses, MoE auxiliary loss,
#: gradients), measured by the architecture sweep (tests/plugins/test_padding_free_sweep.py). Other models run a
#: self-check before their first step.
VERIFIED_MODEL_TYPES = (
    "cohere",
    "cohere2",
    "dory",
    "ernie4_5_moe",
    "exaone4",
    "gemma",
    "gemma2",
    "gemma3_text",
    "glm4_moe",
    "gpt2",
    "gpt_neox",
    "gpt_neox_japanese",
    "gpt_oss",
    "granite",
    "granitemoe",
    "jetmoe",
    "llama",
    "llama4_text",
    "mistral",
    "mixtral",
    "olmo2",
    "olmo3",
    "olmoe",
    "opt",
    "phi",
    "phi3",
    "phimoe",
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


def verified_except(excluded: Mapping[str, str]) -> tuple[str, ...]:
    """`VERIFIED_MODEL_TYPES` less the types in `excluded` (`{model_type: why}`), in the same order: the table of a
    plugin whose packing covers fewer models."""
    unknown = sorted(set(excluded) - set(VERIFIED_MODEL_TYPES))
    if unknown:
        raise ValueError(f"excluded model types {unknown} are not in VERIFIED_MODEL_TYPES")
    return tuple(t for t in VERIFIED_MODEL_TYPES if t not in excluded)


@dataclasses.dataclass
class Inspection:
    """What `inspect_model` found: the sequence-related `mechanisms` (positions, windows, sinks, MoE...), the `refusal`
    (why packing cannot be exact, naming the layer; None when it can be), and whether the model type is `verified`."""

    mechanisms: list[str]
    refusal: str | None
    verified: bool


def _config_value(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _nested_config_value(config, *names):
    """`_config_value` of `config`, else of its nested configs (DBRX keeps its expert count in `ffn_config`)."""
    value = _config_value(config, *names)
    if value is not None:
        return value
    for nested in vars(config).values():
        if isinstance(nested, dict):
            value = next((nested[n] for n in names if nested.get(n) is not None), None)
        elif hasattr(nested, "to_dict"):
            value = _config_value(nested, *names)
        if value is not None:
            return value
    return None


def _stateful_module(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    def stateful(module: torch.nn.Module) -> bool:
        cls = type(module).__name__.lower()
        return any(part in cls for part in _STATEFUL_NAMES) and not any(k in cls for k in ("norm", "embed"))

    for name, module in model.named_modules():
        # the innermost match: the mixer itself, not the model or block classes named after it (MambaForCausalLM)
        if name and stateful(module) and not any(stateful(m) for m in list(module.modules())[1:]):
            return name, module
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv1d):
            return name, module
    return None


def _row_mixing_layer(model: torch.nn.Module) -> tuple[str, str, str] | None:
    """A layer that would mix the sequences of a packed row outside attention's per-sequence keys (a sparse-attention
    indexer: DeepSeek-V3.2, GLM-MoE-DSA; a KV compressor: DeepSeek-V4; byte patches: BLT; prepended prompt tokens:
    CPM-Ant; positions numbered from the padding id: RoBERTa): the layer, the mechanism's name and what it does."""
    config = model.config
    for name, module in model.named_modules():
        cls = type(module).__name__
        if name.rsplit(".", 1)[-1] == "indexer" or cls.endswith("Indexer"):
            topk = _config_value(config, "index_topk", "indexer_budget")
            return (
                f"`{name}` ({cls})",
                "sparse-attention indexer",
                f"is a sparse-attention indexer: it picks each query's top {f'`index_topk={topk}`' if topk else 'k'} "
                "keys of the whole row by learned scores, against the padded attention mask, so in a packed row "
                "(which has no mask) it would score and select keys of other sequences",
            )
        if name.rsplit(".", 1)[-1] == "compressor" or cls.endswith("Compressor"):
            return (
                f"`{name}` ({cls})",
                "KV compressor",
                "compresses the key/value states of windows of the row's tokens into extra entries that every query "
                "attends to, so in a packed row a window would span sequences",
            )
        if cls.endswith("Patcher") or cls.endswith("GlobalTransformer"):
            return (
                f"`{name}` ({cls})",
                "byte patches",
                "is part of a byte-patch model: the row's bytes are grouped into patches that a global transformer "
                "attends across (`patch_size`), so in a packed row patches and their attention would span sequences",
            )
    for name, module in model.named_modules():
        if hasattr(module, "create_position_ids_from_input_ids") and isinstance(
            getattr(module, "padding_idx", 0), int
        ):
            offset = module.padding_idx + 1  # type: ignore[operator]
            return (
                f"`{name}` ({type(module).__name__})",
                "positions from the padding id",
                "numbers each row's real tokens from the padding id on (`create_position_ids_from_input_ids`: the "
                f"first real token gets position `padding_idx + 1 = {offset}`), in its own code, so the packed "
                "position ids, which restart at 0 for every sequence, would give other learned positions",
            )
    prompt = _config_value(config, "prompt_length")
    if isinstance(prompt, int) and prompt > 0 and _config_value(config, "prompt_types"):
        return (
            f"`{getattr(model, 'base_model_prefix', '')}` ({type(model.base_model).__name__})",
            "prepended prompt tokens",
            f"prepends `prompt_length={prompt}` learned prompt tokens to every row and derives its attention mask "
            "and segments from the token ids (non-zero ids are real tokens), not from `attention_mask`, so a packed "
            "row would get one prompt for all its sequences and attend across them",
        )
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


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The self-attention modules: those holding query/key projections (fused or not)."""
    found = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if any(k in children for k in ("q_proj", "query", "query_key_value", "c_attn", "Wqkv", "qkv_proj", "q_lin")):
            found.append((name, module))
        elif type(module).__name__.endswith("RelativeAttention"):  # XLNet: projections are parameters, not modules
            found.append((name, module))
    return found


def _own_attention(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """An attention module whose modeling code does not dispatch through transformers' attention interface (it
    computes attention itself, so the varlen attention never runs for it)."""
    for name, module in _attention_modules(model):
        modeling = sys.modules.get(type(module).__module__)
        if modeling is not None and not hasattr(modeling, "ALL_ATTENTION_FUNCTIONS"):
            return name, module
    return None


def _first_attention(model: torch.nn.Module) -> str:
    found = _attention_modules(model)
    return f"`{found[0][0]}` ({type(found[0][1]).__name__})" if found else f"({type(model).__name__})"


def _layers_receive_window(model: torch.nn.Module, window: int) -> bool:
    """Whether the attention modules hand a window to the attention function (a `sliding_window` attribute equal to the
    declared window, or `sliding_window=` in their `forward`); PhiMoE's does neither: its window lives in the mask."""
    for _, module in _attention_modules(model):
        if getattr(module, "sliding_window", None) == window:
            return True
        try:
            source = inspect.getsource(type(module).forward)
        except (OSError, TypeError):
            continue
        if "sliding_window=" in source.replace(" ", ""):
            return True
    return False


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


def inspect_model(
    model: torch.nn.Module, plugin: str, verified_types: Sequence[str] = VERIFIED_MODEL_TYPES
) -> Inspection:
    """The mechanisms of `model` that matter for packing, or the reason packing cannot be exact (its advice names
    `plugin`); `verified` says whether the model type is in `verified_types`."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    verified = model_type in verified_types
    _ADVICE = f"Train this model without {plugin} (leave `{plugin}` unset)."

    def refuse(mechanisms: list[str], refusal: str) -> Inspection:
        return Inspection(mechanisms, refusal, verified)

    stateful = _stateful_module(model)
    if stateful is not None:
        name, module = stateful
        return refuse(
            ["stateful mixer"],
            f"its layer `{name}` ({type(module).__name__}) mixes neighbouring tokens with state carried along the "
            "sequence (a convolution or recurrence), which would run across the sequence boundaries of a packed row. "
            + _ADVICE,
        )
    mixing = _row_mixing_layer(model)
    if mixing is not None:
        layer, label, what = mixing
        return refuse([label], f"its layer {layer} {what}. " + _ADVICE)
    impl = str(getattr(config, _compat.ATTN_IMPLEMENTATION_ATTR, None) or "")
    flash = impl.startswith("flash")
    own = _own_attention(model)
    alibi = _uses_alibi(model)
    if own is not None or alibi:
        name, module = own if own is not None else ("", model)
        layer = f"`{name}` ({type(module).__name__})" if name else f"({type(model).__name__})"
        if model_type not in _compat.OWN_ATTENTION_MODEL_TYPES:
            what = "computes ALiBi attention" if alibi else "computes attention"
            return refuse(
                ["alibi" if alibi else "own attention"],
                f"its attention {layer} {what} in its own module, outside transformers' attention interface, "
                "from a mask packing does not know how to build for a packed row, so the packed sequences "
                "would attend to each other. " + _ADVICE,
            )
        if model_type == "falcon" and alibi:
            return refuse(
                ["alibi"],
                f"its attention {layer} adds ALiBi biases that Falcon computes in bfloat16 from each key's index in "
                "the row (`build_alibi_tensor`: bfloat16 slopes times the index). In a packed row the indices run "
                "over all its sequences, so the biases round differently from the padded batch's once a product no "
                "longer fits bfloat16's 8-bit significand (past 256 tokens at the latest). " + _ADVICE,
            )
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        if model_type == "bloom" and dtype in (torch.bfloat16, torch.float16):
            return refuse(
                ["alibi"],
                f"its attention {layer} adds ALiBi biases that Bloom casts to the model's dtype ({dtype}) from each "
                "key's index in the row. In a packed row the indices run over all its sequences, so in 16 bits "
                "they round much more coarsely than in the padded batch. Load the model in float32 (mixed precision "
                f"through `bf16=True` keeps float32 weights), or train without {plugin}.",
            )
    mechanisms = [_positions(model)]
    if alibi:
        mechanisms = ["alibi (per-sequence mask)"]
    elif own is not None:
        mechanisms.append("own attention (per-sequence mask)")
    # Doge: a learned per-key mask replaces the causal one
    dynamic = next(((n, m) for n, m in _attention_modules(model) if hasattr(m, "prepare_dynamic_mask")), None)
    if dynamic is not None:
        name, module = dynamic
        return refuse(
            [*mechanisms, "dynamic mask"],
            f"its attention `{name}` ({type(module).__name__}) builds a dynamic mask from learned per-key scores "
            "and passes it as the attention mask, dropping the causal mask of a packed row and keeping the top "
            "`keep_window_size` keys of the whole row, so packed sequences would attend to each other. " + _ADVICE,
        )
    if getattr(config, "attn_temperature_tuning", False) and not all(getattr(config, "no_rope_layers", None) or [0]):
        return refuse(
            [*mechanisms, "attention temperature tuning"],
            "its attention layers without rotary positions (`no_rope_layers`) scale queries by the token's index in "
            "the row (`attn_temperature_tuning`), not by its position in its sequence, so a packed row scales them "
            "differently from a padded batch. Set `attn_temperature_tuning=False` in the config only if the "
            "checkpoint was trained that way; otherwise " + _ADVICE[0].lower() + _ADVICE[1:],
        )
    chunk = _config_value(config, "attention_chunk_size")
    if isinstance(chunk, int) and chunk > 0:
        layer = _first_attention(model)
        if flash or model_type not in _compat.CHUNKED_MASK_MODEL_TYPES:
            where = "which flash-attention does not use" if flash else "which packing cannot rebuild for this model"
            advice = _ADVICE
            if flash and model_type in _compat.CHUNKED_MASK_MODEL_TYPES:
                advice = f'Load the model with `attn_implementation="sdpa"`, or train without {plugin}.'
            return refuse(
                [*mechanisms, "chunked attention (mask only)"],
                f"its attention {layer} applies chunked attention (`attention_chunk_size={chunk}`) only through the "
                f"attention mask, {where}, so a packed row would attend across chunks and sequences. " + advice,
            )
        mechanisms.append("chunked attention (per-sequence mask)")
    window = _config_value(config, "sliding_window", "attention_window")
    if isinstance(window, int) and window > 0:
        if _layers_receive_window(model, window):
            mechanisms.append("sliding window")
        elif flash:
            layer = _first_attention(model)
            return refuse(
                [*mechanisms, "sliding window (mask only)"],
                f"its attention {layer} never receives `sliding_window={window}`: the window lives only in the "
                "attention mask, which flash-attention does not use, so a packed row would attend past the window. "
                f'Load the model with `attn_implementation="sdpa"` ({plugin} then applies the mask per '
                f"sequence), or train without {plugin}.",
            )
        else:
            mechanisms.append("sliding window (per-sequence mask)")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        mechanisms.append("attention sinks")
    if _config_value(config, "attn_logit_softcapping") is not None:
        mechanisms.append("softcapping")
    if any(n.endswith(("q_norm", "k_norm", "q_layernorm", "k_layernorm")) for n, _ in model.named_modules()):
        mechanisms.append("QK-norm")
    experts = _nested_config_value(config, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    if isinstance(experts, int) and experts > 1:
        capacity = _nested_config_value(config, "expert_capacity", "capacity_factor", "moe_capacity_factor")
        if capacity:
            return refuse(
                [*mechanisms, "MoE (capacity-limited)"],
                f"its MoE routing is capacity-limited (`{capacity}`), so which tokens an expert takes depends on the "
                "other tokens of the row, and a packed row routes differently from a padded batch. " + _ADVICE,
            )
        mechanisms.append("MoE (token choice)")
    return Inspection(mechanisms, None, verified)
