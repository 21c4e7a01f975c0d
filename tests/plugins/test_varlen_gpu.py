"""The fused varlen attention on CUDA (marked `gpu`, skipped without CUDA): the installed kernel's alignment and
windows against the CPU reference, and each fused path (padding_free's packed attention, prompt_sharing's shared
attention) against the stock padded forward in bf16, within stock's own bf16-vs-fp32 difference, for Llama, Mistral
(sliding window), Qwen2, Qwen3 and a MoE model (Mixtral), with and without gradient checkpointing.

The CPU suite tests the dispatch and the metadata with a CPU reference kernel (test_varlen_dispatch.py,
test_varlen_shared.py); these tests are what a session with a GPU runs:

    python -m pytest -q -m gpu tests/plugins/test_varlen_gpu.py
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from tests.helpers import ReferenceVarlen
from tests.plugins import sweep
from trl_ext.api import current_call
from trl_ext.testing import make_preference_dataset
from trl_ext.toolkit.packing import kernels, probe, segments

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: A fused path's worst difference from the fp32 padded forward may be this many times stock bf16's own (plus a
#: floor for quantities stock happens to round exactly): the kernels sum in another order than SDPA's padded call.
FACTOR = 2.0
FLOOR = 1e-3


def _spy(monkeypatch) -> list[str]:
    """Count the real kernel's calls (every installed kernel wrapped)."""
    calls: list[str] = []
    wrapped = {}
    for name, kernel in kernels.installed_kernels().items():

        def call(*args, _kernel=kernel, **kwargs):
            if not current_call().probing:  # the model's calls, not the kernel probe's
                calls.append(_kernel.name)
            return _kernel.call(*args, **kwargs)

        wrapped[name] = dataclasses.replace(kernel, call=call)
    monkeypatch.setattr(kernels, "KERNELS", wrapped)
    monkeypatch.setattr(segments, "_CACHE", type(segments._CACHE)())
    return calls


def test_the_probe_passes_every_installed_kernel():
    """The kernel probe (`toolkit/packing/probe.py`) on this GPU: every installed kernel, bf16 and fp16, packed and
    shared patterns, grouped-query heads, a window and a scale of its own, within the tolerance (a right kernel
    measured at most 0.24 of it on CPU stand-ins)."""
    rows = probe.probe_installed_kernels("cuda")
    assert rows and all(row["passed"] for row in rows), [row for row in rows if not row["passed"]]


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize(("causal", "window"), [(True, None), (True, 5), (False, None)])
def test_kernel_alignment_and_windows(gqa, causal, window):
    """The installed `varlen_attn` on CUDA in bf16 equals the CPU reference (float64 on the same bf16 inputs):
    segments with more keys than queries are aligned to the bottom right (what the shared attention relies on)."""
    kernel = kernels.installed_kernels()["varlen_attn"]
    if window is not None and not kernel.windows:
        pytest.skip("this torch's varlen_attn has no window_size")
    g = torch.Generator().manual_seed(0)
    lengths_q, lengths_k = [7, 1, 33, 12], [19, 1, 33, 40]
    heads, kv_heads, dim = 8, 2 if gqa else 8, 64
    q = torch.randn(sum(lengths_q), heads, dim, generator=g).bfloat16()
    k = torch.randn(sum(lengths_k), kv_heads, dim, generator=g).bfloat16()
    v = torch.randn(sum(lengths_k), kv_heads, dim, generator=g).bfloat16()
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    args = (max(lengths_q), max(lengths_k))
    options = dict(causal=causal, window=window, scale=0.1)
    expected = ReferenceVarlen()(q.double(), k.double(), v.double(), cu_q, cu_k, *args, **options)
    cuda = [t.cuda().requires_grad_() for t in (q, k, v)]
    out = kernel.call(*cuda, cu_q.cuda(), cu_k.cuda(), *args, **options)
    torch.testing.assert_close(out.float().cpu(), expected.float(), rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in cuda)


def _model(model_type: str) -> torch.nn.Module:
    """A small fp32 model of `model_type` on CUDA: head_dim 16, sliding windows of 16 tokens where the type has them
    (shorter than prompt + response), MoE with 4 experts / top-2."""
    config = sweep.tiny_config(model_type)
    for name, value in dict(hidden_size=64, head_dim=16, max_position_embeddings=512).items():
        setattr(config, name, value)
    if getattr(config, "sliding_window", None):
        config.sliding_window = 16
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = sweep.model_class(model_type)(config).cuda().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def _pairs(vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Four chosen/rejected pairs, prompts of 20-60 tokens, responses of 8-70: rows `[chosen..., rejected...]`."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (20, 45, 60, 33)]
    sizes = ((8, 40), (70, 12), (25, 25), (50, 9))
    seqs = []
    for side in (0, 1):
        for p, s in zip(prompts, sizes, strict=True):
            seqs.append(torch.cat([p, torch.randint(3, vocab, (s[side],), generator=g)]))
    ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return ids.to(device), mask.to(device), [len(p) for p in prompts] * 2


def _measure(model, forward, ids, mask, moe, **extra):
    """Per-sequence log-probs (float32) and the gradients of their sum (+ the MoE aux loss)."""
    model.zero_grad(set_to_none=True)
    kwargs = dict(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
    if moe:
        kwargs["output_router_logits"] = True
    out = forward(**kwargs)
    logps = out.logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    per_seq = torch.where(mask[:, 1:].bool(), logps, 0.0).sum(1)
    loss = per_seq.sum() / 100
    if moe and getattr(out, "aux_loss", None) is not None:
        loss = loss + 0.5 * out.aux_loss.float()
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return per_seq.detach(), grads


def _worst(a, b):
    logps = ((a[0] - b[0]).abs() / b[0].abs().clamp(min=1.0)).max().item()
    scale = max(g.abs().max().item() for g in b[1].values())
    grads = max((a[1][n] - b[1][n]).abs().max().item() for n in b[1]) / scale
    return logps, grads


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "mixtral"])
@pytest.mark.parametrize("plugin", ["padding_free", "prompt_sharing"])
def test_fused_path_equals_stock_in_bf16(plugin, model_type, checkpointing, monkeypatch):
    from trl_ext.plugins.prompt_sharing.layout import LAYOUT_KEY, build_layout
    from trl_ext.plugins.prompt_sharing.setup import PromptSharingState

    calls = _spy(monkeypatch)
    model = _model(model_type)
    moe = model_type == "mixtral"
    ids, mask, prompt_end = _pairs(sweep.token_range(model), "cuda")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    reference = _measure(model, model.forward, ids, mask, moe)  # fp32, padded
    model.to(torch.bfloat16)
    stock = _measure(model, model.forward, ids, mask, moe)
    context = sweep._Context()
    extra = {}
    try:
        if plugin == "padding_free":
            sweep.packed_model(context, model)
        else:
            sweep.shared_model(context, PromptSharingState(), model)
            extra = {LAYOUT_KEY: build_layout(ids, mask, prompt_end).to_batch()}
        trainer = sweep._trainer()
        # `attention: fused`: refuses if the kernel cannot run
        choice = kernels.choose_for_model(model, "sdpa", "fused", trainer, plugin, patcher=None)
        assert choice.kernel is not None
        fused = _measure(model, model.forward, ids, mask, moe, **extra)
    finally:
        context.close()
    layers = model.config.num_hidden_layers
    assert len(calls) >= layers * (2 if checkpointing else 1)
    stock_err, fused_err = _worst(stock, reference), _worst(fused, reference)
    for what, s, f in zip(("log-probs", "grads"), stock_err, fused_err, strict=True):
        assert f <= FACTOR * s + FLOOR, f"{what}: fused {f:.3g} vs stock bf16 {s:.3g} (from fp32)"


def test_trainer_logs_the_fused_kernel(dpo_args, tokenizer, caplog, monkeypatch):
    """A float32 model trained with `bf16=True` (autocast; TRL's default where supported): the kernel is chosen, logged
    and runs in training (the queries, promoted to float32 by the rotary embedding, are cast to bf16 as SDPA does)."""
    calls = _spy(monkeypatch)
    dataset = make_preference_dataset(8, seed=0)
    build = eq.dpo_builder(dpo_args, tokenizer, dataset)
    with caplog.at_level(logging.INFO, logger="trl_ext"), trl_ext.install(padding_free=True, prompt_sharing=False):
        trainer = build(use_cpu=False, bf16=True)
    lines = [r.getMessage() for r in caplog.records if "packed attention" in r.getMessage()]
    assert lines == ["padding_free: packed attention: varlen_attn (CUDA, bf16)"]
    trainer.train()  # two steps through the kernel
    assert len(calls) >= 2 * 2 * trainer.model.config.num_hidden_layers  # policy and reference forwards, two steps
