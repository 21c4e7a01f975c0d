"""The shared-prompt attention's fused plan (`prompt_sharing/attention.py`: `shared_segments`, `run_shared`) against
its per-segment loop, on CPU with the reference kernel of test_varlen_dispatch.py, in float64 (outputs and
gradients): shared and unshared pairs, Online DPO's trailing padding (a second, non-causal call), sliding windows
that reach across the prompt/response boundary, windows that would cut the padding's keys (left to the loop), GQA.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ReferenceVarlen
from trl_ext.plugins.prompt_sharing import attention as shared
from trl_ext.plugins.prompt_sharing.layout import build_layout
from trl_ext.toolkit.packing import kernels, segments


class _Config:
    """A model config (weakly referenced by the kernel choice)."""


class _Layer(torch.nn.Module):
    """What the shared attention reads of a layer: its `config` (the kernel choice is looked up through it)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()


def _batch(trailing: bool):
    """Rows `[chosen x3, rejected x3]`: pairs sharing prompts of 6, 4 and 5 tokens; the third pair's rejected row has
    another prompt (runs unshared); with `trailing`, every row is padded to the longest (Online DPO)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=g) for n in (6, 4, 5)]
    other = torch.randint(3, 100, (5,), generator=g)
    lengths = ((3, 5), (6, 2), (4, 4))
    rows = [
        torch.cat([p, torch.randint(3, 100, (c,), generator=g)]) for p, (c, _) in zip(prompts, lengths, strict=True)
    ]
    rows += [
        torch.cat([p, torch.randint(3, 100, (r,), generator=g)]) for p, (_, r) in zip(prompts, lengths, strict=True)
    ]
    rows[5][:5] = other
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    prompt_end = [6, 4, 5] * 2
    return build_layout(ids, mask, prompt_end, trailing_padding=trailing)


def _attend(layout, choice, window, heads=4, kv_heads=2, dim=8):
    torch.manual_seed(1)
    n = layout.num_tokens
    q = torch.randn(1, heads, n, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, n, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, n, dim, dtype=torch.float64, requires_grad=True)
    layer = _Layer()
    if choice is not None:
        kernels.set_choice(layer.config, choice)
    forward = shared._make_shared_attention("sdpa")
    extra = {} if window is None else {"sliding_window": window}
    out, _ = forward(layer, q, k, v, None, scaling=0.3, **{shared.GROUPS_KWARG: layout.groups}, **extra)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("trailing", [False, True])
@pytest.mark.parametrize("window", [None, 4, 64])
def test_fused_plan_equals_the_loop(trailing, window, monkeypatch):
    ref = ReferenceVarlen()
    kernel = kernels.Kernel("varlen_attn", ("cpu",), (torch.float64,), True, ref)
    monkeypatch.setattr(segments, "_CACHE", type(segments._CACHE)())
    layout = _batch(trailing)
    assert layout.shared_rows == 4 and layout.unshared_rows == 2
    tails = any(be > ke for _, _, branches in layout.groups for _, be, ke in branches)
    assert tails == trailing
    loop_out, loop_grads = _attend(layout, None, window)
    fused_out, fused_grads = _attend(layout, kernels.Choice(kernel, "cpu", torch.float64), window)
    # A window of 4 cuts the keys the trailing padding attends to: that row runs per segment (exact), no kernel call.
    cut = trailing and window == 4
    plan = shared.shared_segments(layout.groups, torch.device("cpu"), window)
    assert (plan is None) == cut
    assert len(ref.calls) == (0 if cut else 2 if trailing else 1)
    if not cut:
        assert [c["causal"] for c in ref.calls] == [True, False][: len(ref.calls)]
        assert ref.calls[0]["window"] == (None if window is None else window - 1)
    torch.testing.assert_close(fused_out, loop_out, rtol=1e-12, atol=1e-12)
    for fused, loop in zip(fused_grads, loop_grads, strict=True):
        torch.testing.assert_close(fused, loop, rtol=1e-12, atol=1e-12)


def test_plan_is_built_once_per_layout(monkeypatch):
    monkeypatch.setattr(segments, "_CACHE", type(segments._CACHE)())
    layout = _batch(True)
    before = segments.BUILDS["shared"]
    plans = {id(shared.shared_segments(layout.groups, torch.device("cpu"), None)) for _ in range(5)}
    assert len(plans) == 1 and segments.BUILDS["shared"] == before + 1
    plan = shared.shared_segments(layout.groups, torch.device("cpu"), None)
    # every query once: the prefixes and real branch tokens in the main call, the padding in the tail call
    assert plan.main.cu_q[-1].item() + plan.tail.cu_q[-1].item() == layout.num_tokens
    assert sorted(plan.inverse.tolist()) == list(range(layout.num_tokens))
    # the keys of a branch are its prefix's followed by its own: more keys than queries in the main call
    assert plan.main.cu_k[-1].item() > plan.main.cu_q[-1].item()


# ---------------------------------------------------------------------------------------------------------------------
# A real Online DPO step (trailing padding in every branch) with the reference kernel
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # ~40 s on a shared 2-core machine: two Online DPO trainers
def test_online_dpo_step_with_the_reference_kernel_equals_stock(online_build, monkeypatch):
    """prompt_sharing with `attention: fused` on a real OnlineDPOTrainer (float64; the reference kernel "installed"
    for CPU): the completions' log-probs, the loss and the gradients equal stock's; the completions' trailing padding
    ran as the second, non-causal kernel call in every layer."""
    import trl_ext
    from tests import equivalence as eq
    from tests.helpers import ONLINE_GRAD_RTOL, ONLINE_LOGPS_RTOL, online_step

    ref = ReferenceVarlen()
    kernel = kernels.Kernel("varlen_attn", ("cpu",), (torch.float64,), True, ref)
    monkeypatch.setattr(kernels, "KERNELS", {"varlen_attn": kernel})
    monkeypatch.setattr(segments, "_CACHE", type(segments._CACHE)())
    stock = online_build()
    with trl_ext.install(prompt_sharing=True, plugins={"prompt_sharing": {"attention": "fused"}}):
        shared = online_build()
    assert shared._trl_ext.state["prompt_sharing"].kernels["policy"].kernel is kernel
    generation = eq.online_generation()
    a = stock._forward(stock.model, *generation)
    b = shared._forward(shared.model, *generation)
    real = generation[3].bool()
    assert (a[real] - b[real]).abs().max().item() <= ONLINE_LOGPS_RTOL * a[real].abs().max().item()
    stock_loss, stock_grads = online_step(stock)
    shared_loss, shared_grads = online_step(shared)
    assert shared_loss.item() == pytest.approx(stock_loss.item(), rel=1e-9)
    eq.assert_same_grads(stock_grads, shared_grads, ONLINE_GRAD_RTOL)
    causal = [c["causal"] for c in ref.calls]
    assert causal.count(False) == causal.count(True) > 0  # every layer: the main call and the padding's call
