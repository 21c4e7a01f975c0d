"""Fused varlen attention (`toolkit/packing/kernels.py`) on CPU: the kernel choice per device, dtype and feature with
its log line and refusals, the per-batch metadata, and the fused paths of padding_free and prompt_sharing.

The fused kernels run on CUDA only. Here a CPU reference of varlen attention (`reference_varlen`, float64 softmax
attention per segment with the kernels' bottom-right causal alignment and windows) stands in for them through the one
place every kernel call goes through (`kernels.KERNELS`), so the dispatch, the metadata the layers receive and the
shared-prompt segment plan are tested against the stock padded forward in float64 (the sweep's 1e-6 relative). The
real kernels against stock in bf16 are tests/plugins/test_varlen_gpu.py (marked `gpu`).
"""

from __future__ import annotations

import logging

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from tests.helpers import ReferenceVarlen
from tests.plugins import sweep
from trl_ext import UsageError
from trl_ext.testing import make_preference_dataset
from trl_ext.toolkit.packing import kernels, segments

_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)


@pytest.fixture
def reference(monkeypatch):
    """The CPU reference as the only fused kernel, for CPU in float64/float32 (what the tiny models run in)."""
    ref = ReferenceVarlen()
    kernel = kernels.Kernel("varlen_attn", ("cpu",), (torch.float64, torch.float32), True, ref)
    monkeypatch.setattr(kernels, "KERNELS", {"varlen_attn": kernel})
    monkeypatch.setattr(segments, "_CACHE", type(segments._CACHE)())  # no segments built by an earlier test
    ref.kernel = kernel
    return ref


def _cuda_kernel(name="varlen_attn", windows=True):
    return kernels.Kernel(name, ("cuda",), kernels.FUSED_DTYPES, windows, ReferenceVarlen())


# ---------------------------------------------------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------------------------------------------------


def test_choice_per_device_dtype_and_feature(monkeypatch):
    varlen = _cuda_kernel()
    monkeypatch.setattr(kernels, "KERNELS", {"varlen_attn": varlen})
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert kernels.choose("auto", "cuda", bf16, []).kernel is varlen
    assert kernels.choose("auto", "cuda:0", fp16, []).kernel is varlen
    assert kernels.choose("fused", "cuda", bf16, [], windows=True).kernel is varlen
    for device, dtype in (("cpu", bf16), ("cuda", fp32), ("cpu", torch.float64)):
        choice = kernels.choose("auto", device, dtype, [])
        assert choice.kernel is None and choice.fallbacks == ("varlen_attn runs on cuda in bf16/fp16",)
    for feature in ("softcapping", "attention sinks", "dropout in attention", "eager attention"):
        choice = kernels.choose("auto", "cuda", bf16, [feature])
        assert choice.kernel is None and choice.fallbacks == (feature,)
    assert kernels.choose("segments", "cuda", bf16, []).kernel is None
    # a kernel without window_size (torch <= 2.10) leaves sliding-window models to the loop
    monkeypatch.setattr(kernels, "KERNELS", {"varlen_attn": _cuda_kernel(windows=False)})
    choice = kernels.choose("auto", "cuda", bf16, [], windows=True)
    assert choice.kernel is None and "sliding windows" in choice.fallbacks[0]
    # flash-attn first for a model loaded with flash_attention_2, varlen_attn otherwise
    flash = _cuda_kernel("flash_attn")
    monkeypatch.setattr(kernels, "KERNELS", {"varlen_attn": varlen, "flash_attn": flash})
    assert kernels.choose("auto", "cuda", bf16, [], prefer="flash_attn").kernel is flash
    assert kernels.choose("auto", "cuda", bf16, []).kernel is varlen
    monkeypatch.setattr(kernels, "KERNELS", {})
    assert "no fused kernel installed" in kernels.choose("auto", "cuda", bf16, []).fallbacks[0]


def test_autocast_calls_run_in_the_autocast_dtype():
    """A float32 model trained with `bf16=True`: its rotary embeddings promote the queries to float32 under autocast;
    the kernel still runs the call, in bf16 (as SDPA casts it under autocast), and not outside autocast."""
    ref = ReferenceVarlen()
    kernel = kernels.Kernel("varlen_attn", ("cpu",), (torch.bfloat16,), True, ref)
    choice = kernels.Choice(kernel, "cpu", torch.bfloat16)
    query = torch.randn(1, 2, 5, 8)
    assert kernels.runs_fused(choice, query) is None
    assert kernels.runs_fused(choice, query.double()) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernels.runs_fused(choice, query) is kernel
        assert kernels.runs_fused(choice, query.bfloat16()) is kernel
        q, k = kernels.kernel_inputs(kernel, query, query[:, :1])
        cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        out = kernels.run_packed(kernel, query, query[:, :1], query[:, :1].bfloat16(), cu, 3, None, None)
    assert q.dtype == k.dtype == torch.bfloat16 and q.shape == (5, 2, 8) and k.shape == (5, 1, 8)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 5, 2, 8) and len(ref.calls) == 1


def test_fused_where_it_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "KERNELS", {"varlen_attn": _cuda_kernel()})
    with pytest.raises(UsageError, match=r"padding_free: `attention: fused`.*cpu.*Set `attention: auto`"):
        kernels.choose("fused", "cpu", torch.bfloat16, [], plugin="padding_free")
    with pytest.raises(UsageError, match="softcapping"):
        kernels.choose("fused", "cuda", torch.bfloat16, ["softcapping"])


def test_log_text():
    kernel = _cuda_kernel()
    assert kernels.describe_choice(kernels.Choice(kernel, "cuda", torch.bfloat16)) == "varlen_attn (CUDA, bf16)"
    loop = kernels.Choice(None, "cpu", torch.float32, ("varlen_attn runs on cuda in bf16/fp16", "softcapping"))
    assert kernels.describe_choice(loop) == (
        "per-segment loop (cpu, float32; not fused: varlen_attn runs on cuda in bf16/fp16; softcapping)"
    )


@pytest.mark.parametrize(
    ("model_type", "feature"),
    [("gemma2", "softcapping"), ("gpt_oss", "attention sinks"), ("llama", None), ("mistral", None)],
)
def test_unsupported_features_of_real_models(model_type, feature):
    model = sweep.build_tiny(model_type)
    found = kernels.unsupported_features(model, "sdpa")
    assert (feature in found) if feature else found == []
    assert kernels.unsupported_features(model, "eager")[0].startswith("eager attention")
    if model_type == "llama":
        model.model.layers[0].self_attn.attention_dropout = 0.1
        assert kernels.unsupported_features(model, "sdpa") == ["dropout in attention"]
        model.config.head_dim = 12
        assert kernels.unsupported_features(model, "sdpa")[1].startswith("head_dim 12 (the flash kernels need")
    assert kernels.has_windows(model.config) == (model_type in ("mistral", "gemma2", "gpt_oss"))


# ---------------------------------------------------------------------------------------------------------------------
# Real trainers: the log line, the refusal, float64 equal to stock, metadata once per batch
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset():
    return make_preference_dataset(12, seed=0, prompt_median=10, completion_median=6)


@pytest.mark.parametrize("plugin", ["padding_free", "prompt_sharing"])
def test_fused_on_cpu_is_refused_before_the_first_step(plugin, dpo_args, tokenizer, dataset):
    build = eq.dpo_builder(dpo_args, tokenizer, dataset)
    with trl_ext.install(**{plugin: True}, plugins={plugin: {"attention": "fused"}}):
        with pytest.raises(UsageError, match=rf"{plugin}: `attention: fused`.*runs on cuda in bf16/fp16"):
            build()


@pytest.mark.parametrize("plugin", ["padding_free", "prompt_sharing"])
def test_log_line_names_the_loop_and_why(plugin, dpo_args, tokenizer, dataset, caplog):
    build = eq.dpo_builder(dpo_args, tokenizer, dataset)
    with caplog.at_level(logging.INFO, logger="trl_ext"), trl_ext.install(**{plugin: True}):
        trainer = build()
    lines = [r.getMessage() for r in caplog.records if "packed attention" in r.getMessage()]
    expected = f"{plugin}: packed attention: per-segment loop (cpu, float32; not fused: "
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert trainer._trl_ext.state[plugin].kernels["policy"].kernel is None


@pytest.mark.parametrize("plugin", ["padding_free", "prompt_sharing"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_dpo_step_with_the_reference_kernel_equals_stock(
    plugin, checkpointing, reference, dpo_args, tokenizer, dataset, caplog
):
    """A real DPOTrainer in float64 with `attention: fused` (the reference kernel is "installed" for CPU) equals the
    stock trainer: per-sequence log-probs, loss and gradients; the kernel ran once per layer and forward, on
    metadata built once per batch (the same `cu_seq_q` tensor in every layer, the recomputed ones included)."""
    build = eq.dpo_builder(dpo_args, tokenizer, dataset, dtype=torch.float64)
    stock = build(gradient_checkpointing=checkpointing)
    with caplog.at_level(logging.INFO, logger="trl_ext"):
        with trl_ext.install(**{plugin: True}, plugins={plugin: {"attention": "fused"}}):
            fused = build(gradient_checkpointing=checkpointing)
    lines = [r.getMessage() for r in caplog.records if "packed attention" in r.getMessage()]
    assert lines == [f"{plugin}: packed attention: varlen_attn (cpu, float64)"]
    state = fused._trl_ext.state[plugin]
    counter = (lambda: state.packed_calls) if plugin == "padding_free" else (lambda: state.shared_calls)
    misses = (lambda: state.unpacked_calls) if plugin == "padding_free" else (lambda: state.unshared_calls)
    key = "trl_ext_packing" if plugin == "padding_free" else "trl_ext_prompt_sharing"
    examples = eq.examples(stock)
    if checkpointing:  # as `Trainer.train` sets it up; layers are checkpointed in training mode only (dropout is off)
        for model in (stock.model, fused.model):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
    builds = dict(segments.BUILDS)
    # 1e-6 as the sweep: the per-segment loop is 1.5e-8 (gradients, relative) from stock here as well (TRL scores
    # parts of the float64 model in float32); a segment that sees another one moves them by > 1e-3
    eq.compare(
        stock, fused, examples, batch_key=key, calls=counter, misses=misses,
        logps_rtol=1e-6, loss_rtol=1e-6, grad_rtol=1e-6,
    )  # fmt: skip
    layers = fused.model.config.num_hidden_layers
    forwards = 3  # compute_ref_log_probs (policy), then compare's loss: policy and reference
    recomputed = layers if checkpointing else 0  # the policy's layers, recomputed in the backward
    assert len(reference.calls) == forwards * layers + recomputed
    assert all(c["causal"] and c["window"] is None for c in reference.calls)
    # the metadata is built once per model call (padding_free: from the batch's; prompt_sharing: once for the batch)
    # and every layer of that call, recomputed or not, gets the same device tensor
    ids = [id(c["cu_q"]) for c in reference.calls]
    assert len(set(ids)) == (forwards if plugin == "padding_free" else 1)
    assert all(len(set(ids[i : i + layers])) == 1 for i in range(0, forwards * layers, layers))
    new_builds = {k: v - builds.get(k, 0) for k, v in segments.BUILDS.items()}
    if plugin == "prompt_sharing":
        assert new_builds.get("shared") == 1  # one build for the batch, reused by every layer and forward
    else:
        assert not new_builds.get("packed")  # the layers use the batch's cu_seq_lens as they are


# ---------------------------------------------------------------------------------------------------------------------
# Architectures in float64 through each plugin's own path, with the reference kernel
# ---------------------------------------------------------------------------------------------------------------------

FUSED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
#: Qwen2 and Qwen3 are `slow` here: without windows they reach the kernel as Llama does (their biases and QK norms are
#: checked on the per-segment path in the fast loop: test_padding_free.py and test_prompt_sharing.py
#: `test_architectures`).
_FUSED_FAST = ("llama", "mistral", "qwen3_moe", "mixtral")


@pytest.fixture
def fused_everywhere(reference, monkeypatch):
    """Every model runs the reference kernel (the choice the trainer hooks make, made for any model)."""
    choice = kernels.Choice(reference.kernel, "cpu", torch.float64)
    monkeypatch.setattr(kernels, "choice_for", lambda module: choice)
    return reference


@pytest.mark.parametrize(
    "model_type", [t if t in _FUSED_FAST else pytest.param(t, marks=pytest.mark.slow) for t in FUSED_TYPES]
)
@pytest.mark.parametrize("plugin", ["padding_free", "prompt_sharing"])
def test_fused_path_equals_stock(plugin, model_type, fused_everywhere):
    """Per-sequence log-probs, DPO loss (+ MoE aux loss) and every gradient within 1e-6 of the stock padded forward,
    in float64 (the sweep's check), with every attention layer run by the kernel; Mistral with a window of 4 tokens
    that reaches across prompt/response and sequence boundaries."""
    with sweep.single_thread_float64():
        model = sweep.build_tiny(model_type)
        moe = model_type in ("qwen3_moe", "mixtral")
        if plugin == "padding_free":
            ids, mask = sweep.padded_batch(sweep.token_range(model))
            stock = sweep.dpo_loss_and_grads(model, model.forward, ids, mask, moe)
            outcome = sweep.padding_free_outcome(model, stock, ids, mask, moe)
        else:
            outcome = sweep.prompt_sharing_outcome(model, moe)
    assert outcome.status == "exact", outcome.detail
    layers = model.config.num_hidden_layers
    assert len(fused_everywhere.calls) >= layers  # every layer of the plugin's forward ran the kernel
    windows = {c["window"] for c in fused_everywhere.calls}
    window = getattr(model.config, "sliding_window", None)
    assert windows <= {None, None if window is None else window - 1}
    assert (window is not None and window - 1 in windows) == (model_type in ("mistral", "mixtral", "qwen3_moe"))
