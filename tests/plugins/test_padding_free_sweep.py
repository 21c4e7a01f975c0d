"""Architecture sweep: every causal-LM architecture the installed transformers ships, packed against padded.

For each `model_type` of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, a tiny float64 model is built from its config class
(2 layers, hidden 32, sliding windows of 4 tokens so that windows trigger on the test lengths, 4 experts / top-2 with
the router auxiliary loss on). The outcome is one of:

- `exact`: the plugin's packed forward gives the same loss (per-sequence log-probs, weighted, plus the MoE auxiliary
  loss) and the same gradients as the stock padded forward, within 1e-6 relative;
- `refused`: the plugin refuses it (inspection or self-check) with its reason;
- `not built`: the tiny model could not be built from its config alone (a vision/audio model, a config that needs
  sub-configs); listed, not counted.

A model that is neither exact nor refused fails. Run `python tests/plugins/test_padding_free_sweep.py` to print the
markdown table (architecture, mechanism, status) that the docs carry.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from trl_ext.plugins.padding_free.architecture import VERIFIED_MODEL_TYPES

REL = 1e-6
LENGTHS = (12, 10, 11, 12)  # within a window (4) of each other: no fully masked padded query row (eager fp64 NaN)
AUX_COEF = 0.5
# A representative handful that runs in the quick suite (the full sweep is `slow`): the named set.
NAMED = (
    "qwen2",
    "llama",
    "cohere2",
    "olmo3",
    "glm4_moe",
    "gpt_oss",
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "gemma2",
    "lfm2",
    "nemotron_h",
)
_SMALL = {
    "vocab_size": 128,
    "hidden_size": 32,
    "n_embd": 32,
    "d_model": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "ffn_dim": 64,
    "n_inner": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "sliding_window": 4,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "first_k_dense_replace": 0,
    "n_group": 1,
    "topk_group": 1,
    "router_aux_loss_coef": AUX_COEF,
    "output_router_logits": True,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


# Configs whose defaults hide the mechanism their released checkpoints use: LFM2's default `layer_types` are all
# attention, its checkpoints interleave short-convolution layers.
_OVERRIDES = {"lfm2": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2}}


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build_tiny(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    default = AutoConfig.for_model(model_type)
    kwargs = {k: v for k, v in _SMALL.items() if hasattr(default, k)}
    layer_types = getattr(default, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and layer_types:
        kinds = list(dict.fromkeys(layer_types))  # one layer of each kind, mixed (sliding + full, conv + attention)
        kwargs["layer_types"] = (kinds * 2)[:2] if len(kinds) < 2 else kinds[:2]
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if key in kwargs:
                kwargs[key] = len(kwargs["layer_types"])
    if getattr(default, "use_sliding_window", None) is False:
        kwargs.update(use_sliding_window=True, max_window_layers=1)
    kwargs.update(_OVERRIDES.get(model_type, {}))
    config = AutoConfig.for_model(model_type, **kwargs)
    config._experts_implementation = "eager"  # grouped-mm experts have no fp64 CPU kernel
    # Count the parameters on the meta device first: a config whose size fields have other names builds a full-size
    # model (dots3_note: 280B parameters), which would exhaust the machine's memory before any check.
    with torch.device("meta"):
        try:
            meta = AutoModelForCausalLM.from_config(config)
        except Exception:  # noqa: BLE001 - the real build below raises it, or builds another way
            meta = None
    if meta is not None and (size := sum(p.numel() for p in meta.parameters())) > 5_000_000:
        raise ValueError(f"the config could not be shrunk ({size / 1e6:.0f}M parameters)")
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except (ValueError, ImportError):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    size = sum(p.numel() for p in model.parameters())
    if size > 5_000_000:  # a config whose size fields have other names: not tiny, and too slow for the sweep
        raise ValueError(f"the config could not be shrunk ({size / 1e6:.0f}M parameters)")
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


def _loss_and_grads(model, forward, ids, mask, moe: bool):
    model.zero_grad(set_to_none=True)
    kwargs = dict(input_ids=ids, attention_mask=mask, use_cache=False)
    if moe:
        kwargs["output_router_logits"] = True
    out = forward(**kwargs)
    logps = out.logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    per_seq = torch.where(mask[:, 1:].bool(), logps, 0.0).sum(1)
    weights = torch.linspace(0.5, 1.5, len(LENGTHS), dtype=per_seq.dtype)
    loss = -(per_seq * weights).sum() / mask.sum()
    aux = getattr(out, "aux_loss", None) if moe else None
    if aux is not None:
        loss = loss + AUX_COEF * aux
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), None if aux is None else float(aux), grads


@contextlib.contextmanager
def _packed_forward(model, state):
    """The plugin's packed causal-LM forward for `model` (varlen attention registered, backbone wrapped); undone on
    exit."""
    from trl_ext.plugins import padding_free as pf
    from trl_ext.plugins._packing import register_varlen_attention, unregister_varlen_attention, varlen_attention_name

    base = model.config._attn_implementation
    register_varlen_attention()
    try:
        model.config._attn_implementation_internal = varlen_attention_name(base)
        model.base_model.forward = pf._make_backbone_forward(model.base_model.forward, state)
        yield pf._make_causal_lm_forward(model.forward, state)
    finally:
        model.config._attn_implementation_internal = base
        model.base_model.__dict__.pop("forward", None)
        unregister_varlen_attention()


def _differences(stock, packed) -> list[str]:
    """What differs between two `_loss_and_grads` results beyond `REL`: loss, auxiliary loss, gradients."""
    (stock_loss, stock_aux, stock_grads), (loss, aux, grads) = stock, packed
    problems = []
    if abs(loss - stock_loss) > REL * max(1.0, abs(stock_loss)):
        problems.append(f"loss {loss:.10g} vs {stock_loss:.10g}")
    if (aux is None) != (stock_aux is None) or aux is not None and abs(aux - stock_aux) > REL * max(1.0, stock_aux):
        problems.append(f"aux loss {aux} vs {stock_aux}")
    if grads.keys() != stock_grads.keys() or not grads:
        problems.append("different parameters got gradients")
    else:
        scale = max(g.abs().max().item() for g in stock_grads.values())
        worst = max((grads[k] - stock_grads[k]).abs().max().item() for k in grads)
        if not worst <= REL * scale:
            problems.append(f"grad diff {worst:.3g} vs max |grad| {scale:.3g}")
    return problems


def sweep_one(model_type: str) -> tuple[str, str, str]:
    """(mechanism, status, detail) of one architecture."""
    from trl_ext.plugins import padding_free as pf
    from trl_ext.plugins.padding_free.architecture import inspect_model
    from trl_ext.plugins.padding_free.self_check import self_check

    try:
        model = build_tiny(model_type)
    except Exception as exc:  # noqa: BLE001 - recorded in the table
        return "-", "not built", f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
    inspection = inspect_model(model)
    mechanism = ", ".join(inspection.mechanisms)
    if inspection.refusal is not None:
        return mechanism, "refused", inspection.refusal.split(". ")[0]
    moe = any("MoE" in m for m in inspection.mechanisms) and hasattr(model.config, "output_router_logits")
    ids, mask = _batch(model.config.vocab_size)
    try:
        stock = _loss_and_grads(model, model.forward, ids, mask, moe)
    except Exception as exc:  # noqa: BLE001 - the stock tiny model does not run: nothing to compare
        return mechanism, "not built", f"stock forward raised {type(exc).__name__}: {str(exc)[:100]}"
    state = pf.PaddingFreeState()
    with _packed_forward(model, state) as forward:
        try:
            check = self_check(model, forward, moe=any(m.startswith("MoE") for m in inspection.mechanisms))
            if check.leak is not None:
                return mechanism, "refused", f"self-check: {check.leak}"
            packed = _loss_and_grads(model, forward, ids, mask, moe)
        except Exception as exc:  # noqa: BLE001 - a crash is neither exact nor a refusal
            return mechanism, "FAIL", f"packed forward raised {type(exc).__name__}: {str(exc)[:200]}"
    if state.packed_calls == 0:
        return mechanism, "FAIL", "the packed path did not run"
    problems = _differences(stock, packed)
    if problems:
        return mechanism, "FAIL", "; ".join(problems)
    aux = packed[1]
    detail = f"loss, grads{', aux loss' if aux is not None else ''} within {REL:g}"
    return mechanism, "exact", detail


def _check(model_type: str) -> None:
    mechanism, status, detail = sweep_one(model_type)
    if status == "not built":
        pytest.skip(f"{model_type}: tiny model not buildable from its config alone ({detail})")
    assert status in ("exact", "refused"), f"{model_type} [{mechanism}]: {detail}"


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_enumerates_the_installed_architectures():
    types = causal_lm_types()
    assert len(types) > 100 and set(NAMED) <= set(types)


@pytest.mark.parametrize("model_type", NAMED)
def test_named_architectures(model_type):
    expected_refusals = {"lfm2", "nemotron_h"}
    mechanism, status, detail = sweep_one(model_type)
    assert status == ("refused" if model_type in expected_refusals else "exact"), f"{mechanism}: {detail}"


@pytest.mark.sweep
@pytest.mark.slow
@pytest.mark.parametrize("model_type", causal_lm_types())
def test_every_architecture(model_type):
    _check(model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", VERIFIED_MODEL_TYPES)
def test_verified_table(model_type):
    """Every model type that skips the self-check by default is exact in the sweep."""
    mechanism, status, detail = sweep_one(model_type)
    assert status == "exact", f"{mechanism}: {detail}"


def _no_dropout(model) -> None:
    """Dropout off in train mode (gradient checkpointing only runs in training), modules and functional alike."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout", "attn_dropout", "residual_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", VERIFIED_MODEL_TYPES)
def test_verified_table_gradient_checkpointing(model_type):
    """Packed with gradient checkpointing equals padded without it. Checkpointing recomputes each layer during the
    backward, outside the packed call; a layer that drops `cu_seq_lens_q` on the way to its attention (StableLM) must
    find the same sequence bounds there (it raised `CheckpointError` before the bounds were read off the packed
    `position_ids`)."""
    from trl_ext.plugins import padding_free as pf
    from trl_ext.plugins.padding_free.architecture import inspect_model

    model = build_tiny(model_type)
    if not model.supports_gradient_checkpointing:  # transformers refuses it for this model, packed or not
        with pytest.raises(ValueError, match="does not support"):
            model.gradient_checkpointing_enable()
        return
    _no_dropout(model)
    model.train()
    moe = any("MoE" in m for m in inspect_model(model).mechanisms) and hasattr(model.config, "output_router_logits")
    ids, mask = _batch(model.config.vocab_size)
    stock = _loss_and_grads(model, model.forward, ids, mask, moe)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    state = pf.PaddingFreeState()
    with _packed_forward(model, state) as forward:
        packed = _loss_and_grads(model, forward, ids, mask, moe)
    assert state.packed_calls == 1
    assert (packed[1] is None) == (stock[1] is None)
    assert _differences(stock, packed) == []


def test_position_ids_that_hide_the_packed_bounds_are_refused_in_training():
    """StableLM's layer drops `cu_seq_lens_q`: a recomputed layer splits the row where the position_ids restart.
    Position ids that run on across sequences would split it elsewhere, so training refuses them up front."""
    from trl_ext import UsageError
    from trl_ext.plugins import padding_free as pf

    model = build_tiny("stablelm")
    _no_dropout(model)
    model.train()
    ids, mask = _batch(model.config.vocab_size)
    rows, length = ids.shape
    with _packed_forward(model, pf.PaddingFreeState()) as forward:
        running_on = torch.arange(rows * length).view(rows, length)  # row 1 continues row 0 (12 tokens, no padding)
        with pytest.raises(UsageError, match="do not restart at every packed sequence"):
            forward(input_ids=ids, attention_mask=mask, position_ids=running_on, use_cache=False)
        restarting = torch.arange(length).expand(rows, length)
        out = forward(input_ids=ids, attention_mask=mask, position_ids=restarting, use_cache=False)
    stock = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    assert torch.allclose(out.logits[real], stock[real], rtol=REL, atol=0)


def main(types: list[str]) -> None:
    torch.set_num_threads(1)
    print("| architecture | mechanism | status | detail |\n|---|---|---|---|")
    for model_type in types:
        mechanism, status, detail = sweep_one(model_type)
        print(f"| {model_type} | {mechanism} | {status} | {detail.replace('|', '/')} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or causal_lm_types())
