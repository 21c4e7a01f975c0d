"""Architecture sweep: every causal-LM type of the installed transformers, packed (padding_free) and shared
(prompt_sharing) against the stock padded forward.

For each `model_type` of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`:

- **excluded** when its causal-LM class is not a text decoder, by one of three computed rules:
  its default config is an encoder-decoder (`is_encoder_decoder`: the class is the decoder half of a seq2seq model,
  fed by an encoder); its forward takes an image, video or audio input (`pixel_values`, `input_features`, ...:
  a vision/audio model; its text decoder has a type of its own in the mapping); or its forward takes another
  model's key/value states (`shared_kv_states`: a draft model that runs only on top of its target model);
- otherwise a tiny float64 model is built from its config class (2-4 layers, one of each per-layer kind; hidden 32;
  sliding windows and attention chunks of 4 tokens so that they act on the test lengths; 4 experts / top-2 with the
  router auxiliary loss on), and each plugin's outcome is:
  - `exact`: through the plugin's own code paths (inspection, self-check, packed/shared forward), a DPO loss (sigmoid,
    beta 0.1, plus 0.5 x the MoE auxiliary loss where the model returns one), the per-sequence log-probs, the
    auxiliary loss and every gradient equal the stock padded forward within 1e-6 relative;
  - `refused`: the plugin refuses the model with a `UsageError` (inspection or self-check), whose reason is listed;
  - anything else (a crash, a difference, a model that does not build) is `FAIL`, and the sweep's tests fail.

`python tests/plugins/sweep.py --markdown docs/architectures.md` writes the table; `python tests/plugins/sweep.py
TYPE...` prints the rows of some types.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import inspect
import re
import sys
import time
import types
from collections import Counter
from pathlib import Path
from typing import Any

import torch

REL = 1e-6
BETA = 0.1
AUX_COEF = 0.5
#: padding_free's batch: two chosen rows, then two rejected rows; lengths within a window (4) of each other, so no
#: padded query row is fully masked (eager attention turns one into NaN in float64).
LENGTHS = (12, 10, 11, 12)
#: The `max_length` the plugins' self-checks size their probe from: the longest sequence the sweep feeds.
MAX_LENGTH = 12
MAX_PARAMETERS = 5_000_000
LOCALITY = 4  # sliding windows, attention chunks, local windows

_SMALL = {
    "vocab_size": 128,
    "hidden_size": 32,
    "n_embd": 32,
    "d_model": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "ffn_dim": 64,
    "n_inner": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "sliding_window": LOCALITY,
    "window_size": LOCALITY,
    "attention_chunk_size": LOCALITY,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "first_k_dense_replace": 0,
    "n_group": 1,
    "topk_group": 1,
    "router_aux_loss_coef": AUX_COEF,
    "output_router_logits": True,
    # multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...) and partial rotary dims
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "rotary_dim": 4,
    "index_head_dim": 8,
    "index_n_heads": 2,
    "index_topk": 4,
    # per-layer inputs (Gemma 3n / 4), extra embeddings (RoCBert), hashed byte groups (BLT)
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 8,
    "unpadded_vocab_size": 128,
    "shape_vocab_size": 16,
    "shape_embed_dim": 8,
    "pronunciation_vocab_size": 16,
    "pronunciation_embed_dim": 8,
    "encoder_hash_byte_group_vocab": 64,
    "hidden_size_global": 32,
    "local_attention_window_len": LOCALITY,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 8,
    "sliding_window_size": LOCALITY,
    "mlp_only_layers": [],
    # sparse-attention indexers (Qwen4-Exp QSA), hyper-connections, n-gram embeddings
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 8,
    "indexer_budget": 4,
    "indexer_compress_ratio": 2,
    "hc_lowrank": 8,
    "ngram_vocab_size_base": 64,
    "ple_embed_dim": 32,
    "n_groups": 1,
    "mamba_n_groups": 1,
    # linear attention (gated delta nets, Kimi delta attention)
    "linear_num_heads": 4,
    "linear_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    # state-space mixers (Mamba-2 heads must tile expand x hidden)
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_d_state": 8,
    "mamba_d_ssm": 64,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "ssm_state_size": 8,
    "moe_shared_expert_intermediate_size": 32,
    "adapter_rank": 8,
    "dim_head": 8,  # CPM-Ant
    "dim_ff": 64,
    "state_size": 8,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

#: Per-type settings the generic shrinking cannot infer: a config whose defaults hide the mechanism released
#: checkpoints use, or whose size fields have names of their own.
_OVERRIDES: dict[str, dict[str, Any]] = {
    # LFM2's default `layer_types` are all attention; its checkpoints interleave short-convolution layers.
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # per-layer-type rotary parameters
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": 1e4} for kind in ("sliding_attention", "full_attention")
        },
    },
    # the last layers reuse the K/V cache of the last earlier layer of their kind
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
    },
    "mamba2": {"head_dim": 16},
    # hybrid layers every other layer; their shared transformer block is tied across them
    "zamba": {"num_hidden_layers": 4, "layers_block_type": ["mamba", "hybrid"] * 2},
    # released checkpoints carry the rotary base in `attn_config`, where the attention reads it
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # local and LSH attention in chunks of 4 tokens; plain learned positions (axial ones fix the training length)
    "reformer": {
        "attn_layers": ["local", "lsh"],
        "local_attn_chunk_length": LOCALITY,
        "lsh_attn_chunk_length": LOCALITY,
        "axial_pos_embds": False,
    },
    "zaya": {"num_experts_per_tok": 1},  # the only routing it supports
    # sliding-window layers of latent attention take their sizes from `swa_` aliases
    "dots3_note_text": {
        "num_key_value_heads": 4,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_q_lora_rank": 16,
        "swa_kv_lora_rank": 16,
        "swa_head_dim": 16,
        "swa_qk_nope_head_dim": 8,
        "swa_v_head_dim": 8,
    },
}

#: Per-type steps after building: state that a checkpoint or the user sets before the first forward.
_AFTER_BUILD: dict[str, Any] = {
    "xmod": lambda model: model.set_default_language(model.config.languages[0]),  # X-MOD needs its adapter language
    # Reformer's backward (reversible layers) runs only after a training-mode forward, as training does
    "reformer": lambda model: _train_without_dropout(model),
}

#: Input names of a causal-LM forward that carry another modality than text.
_NON_TEXT_INPUT = re.compile(r"pixel|image|video|audio|input_features")
#: The input of a draft ("assistant") model that only runs on top of its target model's key/value states.
_OTHER_MODEL_STATE = "shared_kv_states"


# ---------------------------------------------------------------------------------------------------------------------
# Enumeration and exclusion
# ---------------------------------------------------------------------------------------------------------------------


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_class(model_type: str) -> type:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def config_class(model_type: str) -> type:
    """The config the causal-LM class is built from: the type's own config, or, when that config is a composite
    (`text_config` among its sub-configs) and the class takes its text part, that text config class."""
    from transformers import CONFIG_MAPPING

    own = CONFIG_MAPPING[model_type]
    wanted = model_class(model_type).config_class
    if wanted is not own and "text_config" in (getattr(own, "sub_configs", None) or {}):
        return wanted
    return own


def exclusion(model_type: str) -> str | None:
    """Why `model_type`'s causal-LM class is not a text decoder, or None when it is one."""
    cls = model_class(model_type)
    config = config_class(model_type)
    if getattr(_default_config(config), "is_encoder_decoder", False):
        return f"encoder-decoder: {cls.__name__} is the decoder of a seq2seq model (`is_encoder_decoder`)"
    parameters = inspect.signature(cls.forward).parameters
    inputs = [name for name in parameters if _NON_TEXT_INPUT.search(name)]
    if inputs:
        return f"not text-only: {cls.__name__}.forward takes {', '.join(f'`{n}`' for n in inputs[:3])}"
    if _OTHER_MODEL_STATE in parameters:
        return f"assistant model: {cls.__name__}.forward runs on its target model's `{_OTHER_MODEL_STATE}`"
    return None


def _default_config(config_cls: type) -> Any:
    try:
        return config_cls()
    except Exception:  # noqa: BLE001 - a config whose defaults do not validate: read the class defaults
        return types.SimpleNamespace(**{k: getattr(config_cls, k) for k in dir(config_cls) if not k.startswith("__")})


# ---------------------------------------------------------------------------------------------------------------------
# Building a tiny model
# ---------------------------------------------------------------------------------------------------------------------


def _read(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except Exception:  # noqa: BLE001 - a property that raises (per-layer attributes): not a plain field
        return None


def _has(obj: Any, name: str) -> bool:
    try:
        getattr(obj, name)
    except Exception:  # noqa: BLE001 - missing, or a property that raises (per-layer attributes)
        return False
    return True


def _settable(config_cls: type, name: str, default: Any = None) -> bool:
    """Whether `name` can be passed to `config_cls` (not a read-only property, nor one whose setter refuses)."""
    attr = inspect.getattr_static(config_cls, name, None)
    if not isinstance(attr, property):
        return True
    if attr.fset is None:
        return False
    try:
        attr.fset(copy.copy(default), attr.fget(default))
    except Exception:  # noqa: BLE001 - a setter that refuses any value (XLNet's `max_position_embeddings`)
        return False
    return True


def _per_layer_fields(default: Any, config_cls: type, num_layers: int) -> dict[str, list]:
    found = {}
    for name in dir(default):
        if name.startswith("_") or not _settable(config_cls, name):
            continue
        value = _read(default, name)
        if isinstance(value, list) and len(value) == num_layers and num_layers > 1:
            if all(isinstance(v, str) for v in value):
                found[name] = value
    return found


def tiny_config(model_type: str) -> Any:
    """A tiny config of `model_type`: the size fields it has set small (in its sub-configs too), and one layer of
    each per-layer kind (sliding + full attention, convolution + attention, dense + sparse MLP, ...)."""
    config_cls = config_class(model_type)
    kwargs = _tiny_kwargs(config_cls, _default_config(config_cls))
    for key, value in _OVERRIDES.get(model_type, _OVERRIDES.get(config_cls.model_type, {})).items():
        kwargs[key] = {**kwargs[key], **value} if isinstance(kwargs.get(key), dict) else value
    config = config_cls(**kwargs)
    config._experts_implementation = "eager"  # grouped-mm experts have no fp64 CPU kernel
    return config


def _tiny_kwargs(config_cls: type, default: Any) -> dict[str, Any]:
    fields = _field_names(config_cls)
    kwargs = {
        k: v for k, v in _SMALL.items() if (k in fields or _has(default, k)) and _settable(config_cls, k, default)
    }
    layer_keys = [k for k in ("num_hidden_layers", "n_layer", "num_layers") if k in kwargs]
    num_layers = next((n for k in layer_keys if isinstance(n := _read(default, k), int)), 0)
    per_layer = _per_layer_fields(default, config_cls, num_layers)
    if per_layer:
        first: dict[tuple, int] = {}
        for i in range(num_layers):
            first.setdefault(tuple(v[i] for v in per_layer.values()), i)
        keep = sorted(first.values())[:4]
        if len(keep) < 2:
            keep = [0, 1]
        for name, values in per_layer.items():
            kwargs[name] = [values[i] for i in keep]
        for key in layer_keys:
            kwargs[key] = len(keep)
    if "kv_lora_rank" in kwargs and "num_key_value_heads" in kwargs:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # latent attention: one K/V head per head
    if _read(default, "use_sliding_window") is False:
        kwargs.update(use_sliding_window=True, max_window_layers=1)
    if _read(default, "is_decoder") is False and _settable(config_cls, "is_decoder", default):
        kwargs["is_decoder"] = True  # an encoder's causal-LM head runs it as a decoder only with this flag
    for key in getattr(config_cls, "sub_configs", None) or {}:
        sub_cls = _sub_config_class(config_cls, default, key)
        if sub_cls is not None:
            kwargs[key] = _tiny_kwargs(sub_cls, _default_config(sub_cls))
    return kwargs


def _sub_config_class(config_cls: type, default: Any, key: str) -> type | None:
    from transformers import CONFIG_MAPPING

    sub = _read(default, key)
    if sub is not None and hasattr(sub, "to_dict"):
        return type(sub)
    spec = (getattr(config_cls, "sub_configs_defaults", None) or {}).get(key)
    if getattr(spec, "model_type", None) in CONFIG_MAPPING:
        return CONFIG_MAPPING[spec.model_type]
    cls = config_cls.sub_configs[key]
    return cls if hasattr(cls, "model_type") and cls.model_type else None


def _field_names(config_cls: type) -> set[str]:
    names = set()
    for cls in config_cls.__mro__:
        names.update(getattr(cls, "__annotations__", {}))
    return names


def build_tiny(model_type: str) -> torch.nn.Module:
    """The tiny float64 eval-mode model of `model_type` (output embeddings scaled up so logits are not flat)."""
    cls = model_class(model_type)
    config = tiny_config(model_type)
    # Count the parameters on the meta device first: a config whose size fields have other names would build a
    # full-size model and exhaust the machine's memory before any check.
    with torch.device("meta"):
        try:
            meta = cls(config)
        except Exception:  # noqa: BLE001 - the real build below raises it
            meta = None
    if meta is not None and (size := sum(p.numel() for p in meta.parameters())) > MAX_PARAMETERS:
        raise ValueError(f"the config could not be shrunk ({size / 1e6:.0f}M parameters)")
    torch.manual_seed(0)
    try:
        config._attn_implementation = "sdpa"
        model = cls(config)
    except (ValueError, ImportError):
        config._attn_implementation = "eager"
        model = cls(config)
    model = model.to(torch.float64).eval()
    # What the model declares float32 whatever the dtype (`_keep_in_fp32_modules_strict`: routers whose forward
    # casts its input to float32) stays float32, as its own code expects.
    strict = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if strict and any(part in name for part in strict) and tensor.is_floating_point():
            tensor.data = tensor.data.float()
    after_build = _AFTER_BUILD.get(model_type)
    if after_build is not None:
        after_build(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def token_range(model: Any) -> int:
    """Token ids the test batches draw from: ids both embedded and scored (CPM-Ant and Mllama embed extra ids)."""
    return min(model.get_input_embeddings().num_embeddings, model.get_output_embeddings().weight.shape[0])


def no_dropout(model: Any) -> None:
    """Dropout off, modules and functional alike (for a model that must run its forward in training mode)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout", "attn_dropout", "residual_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def _train_without_dropout(model: Any) -> None:
    no_dropout(model)
    model.train()


def is_moe(model: Any, mechanisms: list[str]) -> bool:
    return any(m.startswith("MoE") for m in mechanisms) and hasattr(model.config, "output_router_logits")


# ---------------------------------------------------------------------------------------------------------------------
# The DPO-style loss, stock against plugin
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Measured:
    logps: torch.Tensor
    loss: float
    aux: float | None
    grads: dict[str, torch.Tensor]


def padded_batch(vocab: int, lengths: tuple[int, ...] = LENGTHS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


def dpo_loss_and_grads(model, forward, ids, mask, moe: bool, **extra) -> Measured:
    """Rows are `[chosen..., rejected...]`: the sigmoid DPO loss against a fixed reference (beta 0.1), plus
    0.5 x the MoE auxiliary loss when the model returns one; its per-sequence log-probs and gradients."""
    model.zero_grad(set_to_none=True)
    kwargs = dict(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
    if moe:
        kwargs["output_router_logits"] = True
    out = forward(**kwargs)
    logps = out.logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    per_seq = torch.where(mask[:, 1:].bool(), logps, 0.0).sum(1)
    half = len(per_seq) // 2
    reference = torch.linspace(-40.0, -30.0, len(per_seq), dtype=per_seq.dtype)
    ratios = per_seq - reference
    loss = -torch.nn.functional.logsigmoid(BETA * (ratios[:half] - ratios[half:])).mean()
    aux = getattr(out, "aux_loss", None) if moe else None
    if aux is not None:
        loss = loss + AUX_COEF * aux
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Measured(per_seq.detach(), loss.item(), None if aux is None else aux.detach().item(), grads)


def differences(stock: Measured, plugin: Measured) -> list[str]:
    """What differs beyond `REL`: per-sequence log-probs, loss, auxiliary loss, gradients."""
    problems = []
    worst = ((plugin.logps - stock.logps).abs() / stock.logps.abs().clamp(min=1.0)).max().item()
    if not worst <= REL:
        problems.append(f"log-probs differ by {worst:.3g} (relative)")
    if not abs(plugin.loss - stock.loss) <= REL * max(1.0, abs(stock.loss)):
        problems.append(f"loss {plugin.loss:.10g} vs {stock.loss:.10g}")
    if (plugin.aux is None) != (stock.aux is None) or (
        plugin.aux is not None and not abs(plugin.aux - stock.aux) <= REL * max(1.0, stock.aux)
    ):
        problems.append(f"aux loss {plugin.aux} vs {stock.aux}")
    if plugin.grads.keys() != stock.grads.keys() or not plugin.grads:
        problems.append("different parameters got gradients")
    else:
        scale = max(g.abs().max().item() for g in stock.grads.values())
        worst = max((plugin.grads[k] - stock.grads[k]).abs().max().item() for k in plugin.grads)
        if not worst <= REL * scale:
            problems.append(f"grad diff {worst:.3g} vs max |grad| {scale:.3g}")
    return problems


# ---------------------------------------------------------------------------------------------------------------------
# The plugins' code paths
# ---------------------------------------------------------------------------------------------------------------------


class _Context:
    """What the packing plugins' setup uses of a DPOTrainer's plugin context: per-plugin state and default options,
    a patcher, process-scope changes (undone by `close`)."""

    trainer_class = "DPOTrainer"

    def __init__(self) -> None:
        from trl_ext.patching import Patcher

        self.patcher = Patcher("sweep")
        self.state: dict[str, Any] = {}
        self._releases: list[Any] = []

    @staticmethod
    def options(name: str) -> Any:
        from trl_ext.plugins import padding_free as pf

        assert name == pf.NAME
        return pf.PaddingFreeOptions()

    def patch(self, scope: str, apply: Any, *, key: str | None = None) -> None:
        from trl_ext.patching import Patcher

        assert scope in ("trainer", "process"), scope  # the packing plugins' setup uses no run scope
        held = self.patcher if scope == "trainer" else Patcher(f"sweep: {key}")
        apply(held)
        if held is not self.patcher:
            self._releases.append(held.undo)

    def close(self) -> None:
        self.patcher.undo()
        while self._releases:
            self._releases.pop()()


@contextlib.contextmanager
def packed_forward(model, state, limit: int | None | str = "model", install: bool = True):
    """padding_free's packed causal-LM forward for `model` (varlen attention registered, backbone wrapped, the
    wrapper installed as `model.forward` as the trainer does unless `install=False`); undone on exit. `limit`: the
    most tokens of a packed row (`"model"`: the model's own, `row_limit`; None: no limit)."""
    from trl_ext.plugins import padding_free as pf
    from trl_ext.toolkit.packing.attention import (
        register_varlen_attention,
        unregister_varlen_attention,
        varlen_attention_name,
    )

    base = model.config._attn_implementation
    register_varlen_attention()
    try:
        model.config._attn_implementation_internal = varlen_attention_name(base)
        limit = pf.row_limit(model) if limit == "model" else limit
        model.base_model.forward = pf._make_backbone_forward(model.base_model.forward, state, limit)
        forward = pf._make_causal_lm_forward(model.forward, state, limit)
        if install:
            model.forward = forward
        yield forward
    finally:
        model.config._attn_implementation_internal = base
        model.base_model.__dict__.pop("forward", None)
        model.__dict__.pop("forward", None)
        unregister_varlen_attention()


def packed_model(context, model) -> Any:
    """padding_free's setup of `model` as a DPOTrainer's policy with default options: configure (inspection, which may
    refuse; varlen attention), wrap the backbone and the causal-LM forward, and the self-check where the plugin runs
    it by default (model types outside its verified table), for `max_length=MAX_LENGTH`. Raises `UsageError` when it
    refuses; returns the plugin state. The sweep's one call into padding_free's setup and self-check."""
    from trl_ext.plugins import padding_free as pf

    state = pf._state(context)
    state.attn_implementations["policy"] = pf._configure_model(context, "policy", model)
    backbone, limit = model.base_model, pf.row_limit(model)
    context.patcher.setattr(backbone, "forward", pf._make_backbone_forward(backbone.forward, state, limit))
    context.patcher.setattr(model, "forward", pf._make_causal_lm_forward(model.forward, state, limit))
    pf.check_model(state, "policy", model, _trainer())
    return state


@dataclasses.dataclass(frozen=True)
class Outcome:
    status: str  # "exact", "refused" or "FAIL"
    detail: str
    #: what the plugin's notice says of an exact outcome (layers that draw random numbers in training mode)
    notice: str = ""


def _exception(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:limit]}"


def _set_up_and_measure(context, model, set_up, measure, what: str) -> Outcome | tuple[Any, Measured]:
    """`set_up()`, then `measure()`, `context` closed after: `(set_up's result, the measurement)`, or the `Outcome` of
    a refusal, a crash (`what`: the forward's name) or a model left changed."""
    from trl_ext import UsageError

    base = model.config._attn_implementation
    try:
        try:
            result = set_up()
        except UsageError as exc:
            return Outcome("refused", str(exc))
        except Exception as exc:  # noqa: BLE001 - a crash is neither exact nor a refusal
            return Outcome("FAIL", f"the setup or self-check raised {_exception(exc)}")
        try:
            measured = measure()
        except UsageError as exc:
            return Outcome("refused", f"in training: {exc}")
        except Exception as exc:  # noqa: BLE001 - a crash is neither exact nor a refusal
            return Outcome("FAIL", f"the {what} forward raised {_exception(exc)}")
    finally:
        context.close()
    if model.config._attn_implementation != base or "forward" in model.__dict__:
        return Outcome("FAIL", "the model was not restored")
    return result, measured


def padding_free_outcome(model, stock: Measured, ids, mask, moe: bool) -> Outcome:
    from trl.trainer.utils import disable_dropout_in_model

    from trl_ext.toolkit.randomness import describe_draws

    context = _Context()
    disable_dropout_in_model(model)  # what DPOTrainer does first under `disable_dropout=True`
    measure = lambda: dpo_loss_and_grads(model, model.forward, ids, mask, moe)  # noqa: E731
    result = _set_up_and_measure(context, model, lambda: packed_model(context, model), measure, "packed")
    if isinstance(result, Outcome):
        return result
    state, packed = result
    if state.packed_calls == 0:
        return Outcome("FAIL", "the packed path did not run")
    problems = differences(stock, packed)
    if problems:
        return Outcome("FAIL", "; ".join(problems))
    draws = state.random_draws.get("policy")
    notice = f"in training mode, random draws in {describe_draws(draws, 1)} (notice)" if draws else ""
    return Outcome("exact", _exact_detail(packed), notice)


def _exact_detail(measured: Measured) -> str:
    return f"log-probs, DPO loss{', aux loss' if measured.aux is not None else ''}, grads within {REL:g}"


def prompt_pairs(vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Three pairs (prompts of 7 / 5 / 6 tokens): rows `[chosen..., rejected...]` of 10-12 tokens (within a window
    of each other; 12, a multiple of Reformer's chunk, long)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (7, 5, 6)]
    responses = [[torch.randint(3, vocab, (n,), generator=g) for n in pair] for pair in ((4, 5), (6, 5), (5, 6))]
    seqs = [torch.cat([p, r[0]]) for p, r in zip(prompts, responses, strict=True)]
    seqs += [torch.cat([p, r[1]]) for p, r in zip(prompts, responses, strict=True)]
    ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return ids, mask, [len(p) for p in prompts] * 2


def _trainer(max_length: int = MAX_LENGTH) -> Any:
    """What the plugins' setups read of a DPOTrainer: its `args` (`max_length`, float64: no bf16/fp16, TRL's
    default `disable_dropout=True`)."""
    args = types.SimpleNamespace(max_length=max_length, bf16=False, fp16=False, disable_dropout=True)
    return types.SimpleNamespace(args=args)


def shared_model(context, state, model) -> None:
    """prompt_sharing's setup of `model` as `setup.model_forward` and `setup.check_models` run it for a DPOTrainer's
    policy: configure (may refuse), wrap the forward, and the self-check where the plugin runs it by default (model
    types outside its verified table); raises `UsageError` when it refuses. The sweep's one call into prompt_sharing's
    setup."""
    from trl.trainer.utils import disable_dropout_in_model

    from trl_ext.plugins.prompt_sharing import setup
    from trl_ext.plugins.prompt_sharing.forward import make_causal_lm_forward
    from trl_ext.plugins.prompt_sharing.moe import MoeAuxLoss

    trainer = _trainer()
    disable_dropout_in_model(model)  # what DPOTrainer does first under `disable_dropout=True`
    state.attn_implementations["policy"] = setup.configure_model(context, "policy", model)
    setup.handle_dropout(context, "policy", model, trainer)
    setup.refuse_acting_chunks(context, "policy", model, trainer)
    setup.refuse_random_draws(context, "policy", model)
    forward = make_causal_lm_forward(model.forward, state, MoeAuxLoss.of(model))
    context.patcher.setattr(model, "forward", forward)
    if state.self_check is True or model.config.model_type not in setup.VERIFIED_MODEL_TYPES:
        setup.run_self_check(context, state, "policy", model, trainer)


def prompt_sharing_outcome(model, moe: bool) -> Outcome:
    from trl_ext.plugins.prompt_sharing.layout import LAYOUT_KEY, build_layout
    from trl_ext.plugins.prompt_sharing.setup import PromptSharingState

    ids, mask, prompt_end = prompt_pairs(token_range(model))
    try:
        stock = dpo_loss_and_grads(model, model.forward, ids, mask, moe)
    except Exception as exc:  # noqa: BLE001
        return Outcome("FAIL", f"the stock padded forward raised {_exception(exc)}")
    context = _Context()
    state = PromptSharingState()
    layout = build_layout(ids, mask, prompt_end)
    measure = lambda: dpo_loss_and_grads(model, model.forward, ids, mask, moe, **{LAYOUT_KEY: layout.to_batch()})  # noqa: E731
    result = _set_up_and_measure(context, model, lambda: shared_model(context, state, model), measure, "shared")
    if isinstance(result, Outcome):
        return result
    shared = result[1]
    if state.shared_calls != 1 or layout.shared_rows == 0:
        return Outcome("FAIL", f"{state.shared_calls} shared calls, {layout.shared_rows} shared rows")
    problems = differences(stock, shared)
    if problems:
        return Outcome("FAIL", "; ".join(problems))
    return Outcome("exact", _exact_detail(shared))


# ---------------------------------------------------------------------------------------------------------------------
# One row per type, the whole sweep, the table
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    model_type: str
    excluded: str | None = None
    mechanism: str = ""
    padding_free: Outcome | None = None
    prompt_sharing: Outcome | None = None
    seconds: float = 0.0

    @property
    def outcomes(self) -> tuple[Outcome, ...]:
        return tuple(o for o in (self.padding_free, self.prompt_sharing) if o is not None)


def sweep_row(model_type: str) -> Row:
    """Build `model_type` once and classify it for both plugins."""
    from trl_ext.plugins.padding_free.hooks import inspect_model

    start = time.perf_counter()
    reason = exclusion(model_type)
    if reason is not None:
        return Row(model_type, excluded=reason)
    try:
        model = build_tiny(model_type)
    except Exception as exc:  # noqa: BLE001 - a decoder that does not build fails the sweep
        fail = Outcome("FAIL", f"the tiny model did not build: {_exception(exc)}")
        return Row(model_type, padding_free=fail, prompt_sharing=fail, seconds=time.perf_counter() - start)
    inspection = inspect_model(model)
    moe = is_moe(model, inspection.mechanisms)
    mechanism = ", ".join(inspection.mechanisms)
    ids, mask = padded_batch(token_range(model))
    try:
        stock = dpo_loss_and_grads(model, model.forward, ids, mask, moe)
    except Exception as exc:  # noqa: BLE001
        fail = Outcome("FAIL", f"the stock padded forward raised {_exception(exc)}")
        return Row(model_type, None, mechanism, fail, fail, time.perf_counter() - start)
    pf = padding_free_outcome(model, stock, ids, mask, moe)
    ps = prompt_sharing_outcome(model, moe)
    return Row(model_type, None, mechanism, pf, ps, time.perf_counter() - start)


def counts(rows: list[Row]) -> dict[str, int]:
    """`types`, `decoders`, `excluded`, and per plugin `<plugin> exact / refused / FAIL`."""
    found: Counter[str] = Counter(types=len(rows))
    for row in rows:
        if row.excluded is not None:
            found["excluded"] += 1
            continue
        found["decoders"] += 1
        for plugin in ("padding_free", "prompt_sharing"):
            found[f"{plugin} {getattr(row, plugin).status}"] += 1
    return {
        k: found[k]
        for k in (
            "types",
            "decoders",
            "excluded",
            "padding_free exact",
            "padding_free refused",
            "padding_free FAIL",
            "prompt_sharing exact",
            "prompt_sharing refused",
            "prompt_sharing FAIL",
        )
    }


def summary(rows: list[Row]) -> str:
    c = counts(rows)
    return (
        f"architecture sweep (transformers {_version('transformers')}): {c['types']} causal-LM types, "
        f"{c['decoders']} text decoders built (0 not built), {c['excluded']} excluded (not text decoders); "
        f"padding_free {c['padding_free exact']} exact / {c['padding_free refused']} refused / "
        f"{c['padding_free FAIL']} FAIL; prompt_sharing {c['prompt_sharing exact']} exact / "
        f"{c['prompt_sharing refused']} refused / {c['prompt_sharing FAIL']} FAIL"
    )


def _version(name: str) -> str:
    return importlib.import_module(name).__version__


def _cell(text: str, limit: int = 220) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reason(outcome: Outcome) -> str:
    """A refusal's reason without the plugin's framing (which model, which role) and its advice."""
    text = outcome.detail
    for prefix in (r"^in training: ", r"^\w+'s self-check failed for the policy model \([^)]*\): "):
        text = re.sub(prefix, "", text)
    framing = r"^(prompt_sharing cannot share prompts|padding_free cannot keep packed sequences apart) in this "
    text = re.sub(framing + r"`[^`]*` model \(policy model \w+\): ", "", text)
    return re.split(r"(?<=[\w)`'\]])\. (?=[A-Z])", text)[0]  # the first sentence: what and where; advice follows


def _outcome_cell(outcome: Outcome) -> str:
    if outcome.status != "exact":
        return f"{outcome.status}: {_cell(_reason(outcome), 600)}"
    return f"exact; {outcome.notice}" if outcome.notice else "exact"


HEADER = "| type | mechanisms | padding_free | prompt_sharing |"


def markdown(rows: list[Row]) -> str:
    c = counts(rows)
    decoders = [r for r in rows if r.excluded is None]
    excluded = [r for r in rows if r.excluded is not None]
    lines = [
        "# Architecture table: padding_free and prompt_sharing on every causal-LM type",
        "",
        "Generated by `python tests/plugins/sweep.py --markdown docs/architectures.md` from the architecture sweep "
        "(`tests/plugins/test_padding_free_sweep.py`, run by the default test command; a test fails when this file "
        "disagrees with it).",
        "",
        f"transformers {_version('transformers')}: every type of "
        f"`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` ({c['types']}). Each text decoder is built as a tiny float64 model "
        "(2-4 layers, one of each per-layer kind; sliding windows and attention chunks of 4 tokens; 4 experts top-2, "
        "router auxiliary loss on, coefficient 0.5) and run through each plugin's own code path with its default "
        "options, as a DPOTrainer's policy (inspection; the self-check for model types outside the plugin's verified "
        f"table, sized for `max_length` {MAX_LENGTH}; the packed or shared forward). **exact**: a DPO loss (sigmoid, "
        f"beta {BETA}, plus the auxiliary loss), the per-sequence log-probs, the auxiliary loss and every gradient "
        f"equal the stock padded forward within {REL:g} relative. **exact; in training mode, random draws in ... "
        "(notice)**: exact as above (the comparison runs in eval mode), and the named layers draw random numbers in "
        "training mode (a sampling router, dropout TRL's `disable_dropout` misses): padding_free trains the model "
        "with one warning that packed training takes other random samples than stock TRL (prompt_sharing refuses "
        "such a model). **refused**: the plugin raises `UsageError` before the first step, with the reason shown "
        "(the layer or feature). Anything else fails the sweep.",
        "",
        f"**{c['decoders']} text decoders, 0 not built.** padding_free: **{c['padding_free exact']} exact, "
        f"{c['padding_free refused']} refused**, {c['padding_free FAIL']} failing. prompt_sharing: "
        f"**{c['prompt_sharing exact']} exact, {c['prompt_sharing refused']} refused**, "
        f"{c['prompt_sharing FAIL']} failing. **{c['excluded']} excluded**: not text decoders (rule below).",
        "",
        HEADER,
        "|---|---|---|---|",
    ]
    for row in decoders:
        cells = [_outcome_cell(o) for o in row.outcomes]
        lines.append(f"| {row.model_type} | {row.mechanism or '-'} | {cells[0]} | {cells[1]} |")
    lines += [
        "",
        "## Excluded: not text decoders",
        "",
        "A type is excluded when its default config is an encoder-decoder (`is_encoder_decoder`: the causal-LM class "
        "is the decoder half of a seq2seq model, fed by an encoder), when its causal-LM class's forward takes an "
        "image, video or audio input (a vision or audio model; its text decoder, where it has one, is a type of its "
        "own above), or when its forward takes another model's key/value states (`shared_kv_states`: a draft model "
        "that runs only on top of its target model).",
        "",
        "| type | rule |",
        "|---|---|",
    ]
    lines += [f"| {row.model_type} | {_cell(row.excluded or '')} |" for row in excluded]
    return "\n".join(lines) + "\n"


_NUMBER = re.compile(r"\d+(\.\d+)?(e[-+]?\d+)?")


def parse_markdown(text: str) -> tuple[dict[str, tuple[str, ...]], str]:
    """The rows (type -> cells) and the counts paragraph of a table written by `markdown`. Numbers inside a reason
    (a measured difference, a probe length) are masked: they are round-off of the machine, not the outcome."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith(("| type |", "|---")):
            cells = tuple(c.strip() for c in line.strip().strip("|").split(" | "))
            rows[cells[0]] = tuple(_NUMBER.sub("#", c) for c in cells[1:])
    paragraph = next((line for line in text.splitlines() if "text decoders, 0 not built" in line), "")
    return rows, paragraph


_CACHE: dict[str, Row] = {}


@contextlib.contextmanager
def single_thread_float64():
    """One torch thread, float64 as the default dtype: tensors a model creates without a dtype (mask constants,
    XGLM's `torch.full((), finfo(dtype).min)`) are float64 like its weights."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)


def row(model_type: str) -> Row:
    """`sweep_row`, once per process (single-threaded torch while it runs)."""
    if model_type not in _CACHE:
        with single_thread_float64():
            _CACHE[model_type] = sweep_row(model_type)
    return _CACHE[model_type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--markdown", type=Path, help="write the table to this file")
    args = parser.parse_args(argv)
    rows = []
    for model_type in args.types or causal_lm_types():
        rows.append(r := row(model_type))
        if not args.markdown:
            cells = " | ".join(f"{o.status}: {_cell(o.detail, 160)}" for o in r.outcomes) or r.excluded
            print(f"{r.model_type} ({r.seconds:.1f} s) [{r.mechanism}] {cells}", flush=True)
    if args.markdown:
        args.markdown.write_text(markdown(rows))
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
