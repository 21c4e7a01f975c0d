"""`fused_logprobs.chunked` does no work nothing asks for: the head matmuls it runs, counted per kind (the forward
logits, the backward's recomputed logits, d(hidden), d(weight)); its gradient equals autograd's bitwise; the CUDA
chunk size as a function of free memory.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from trl_ext.plugins.fused_logprobs import chunked
from trl_ext.plugins.fused_logprobs.chunked import (
    AUTO_CHUNK_CUDA_BYTES,
    AUTO_CHUNK_CUDA_FRACTION,
    AUTO_CHUNK_CUDA_RANGE,
    accumulation_dtype,
    auto_chunk,
    chunk_for_memory,
    target_logprobs,
    token_logprobs,
)
from trl_ext.plugins.fused_logprobs.lazy import LazyLogits, Root

HIDDEN, VOCAB, ROWS, LENGTH, CHUNK = 16, 53, 3, 7, 5  # 21 positions: 5 chunks, the last one short
CHUNKS = math.ceil(ROWS * LENGTH / CHUNK)
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class HeadMatmuls(TorchDispatchMode):
    """Counts the matmuls involving the `[VOCAB, HIDDEN]` head by what they compute: `logits` (`[n, V]` out),
    `grad_hidden` (`[n, H]` out from a `[n, V]` operand) and `grad_weight` (`[V, H]` or `[H, V]` out)."""

    def __init__(self):
        super().__init__()
        self.counts = {"logits": 0, "grad_hidden": 0, "grad_weight": 0}
        #: passes of a log-sum-exp over `[n, V]` (its max over the vocabulary, whichever way it is dispatched)
        self.lse = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.logsumexp.default, torch.ops.aten.amax.default) and args[0].size(-1) == VOCAB:
            self.lse += 1
        if func in _MATMULS:
            shape = tuple(out.shape[-2:])
            operands = [a for a in args if isinstance(a, torch.Tensor)]
            if shape in ((VOCAB, HIDDEN), (HIDDEN, VOCAB)):
                self.counts["grad_weight"] += 1
            elif shape[-1] == VOCAB:
                self.counts["logits"] += 1
            elif shape[-1] == HIDDEN and any(a.dim() == 2 and a.size(-1) == VOCAB for a in operands):
                self.counts["grad_hidden"] += 1
        return out


def _problem(dtype=torch.float64, bias=True, head_grad=True, hidden_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64))
        if bias:
            head.bias.copy_(torch.randn(VOCAB, generator=g, dtype=torch.float64))
    head.requires_grad_(head_grad)
    hidden = torch.randn(ROWS, LENGTH, HIDDEN, generator=g, dtype=torch.float64).to(dtype).requires_grad_(hidden_grad)
    targets = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    return head, hidden, targets


def _previous(head, hidden, targets, chunk):
    """The chunk pass before `_TargetLogprobs` (autograd's own graph of cast, gather, logsumexp, per-chunk
    checkpoint): the reference the new path must equal."""

    def one(h, t):
        logits = head(h)
        logits = logits.to(accumulation_dtype(logits.dtype))
        return logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    flat, goals = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    parts = [
        checkpoint(one, flat[s : s + chunk], goals[s : s + chunk], use_reentrant=False)
        if grad
        else one(flat[s : s + chunk], goals[s : s + chunk])
        for s in range(0, flat.size(0), chunk)
    ]
    return torch.cat(parts).reshape(targets.shape)


@pytest.mark.parametrize("context", ["no_grad", "frozen"])
def test_reference_scoring_one_matmul_per_chunk(context):
    """The reference model (under `no_grad`) and a frozen head on inputs without gradients: one head matmul per
    chunk, nothing saved for a backward (no graph), values bitwise those of the previous path."""
    frozen = context == "frozen"
    head, hidden, targets = _problem(head_grad=not frozen, hidden_grad=not frozen)
    guard = contextlib.nullcontext() if frozen else torch.no_grad()
    with guard, HeadMatmuls() as counts:
        got = token_logprobs(hidden, targets, head, chunk=CHUNK)
    assert counts.counts == {"logits": CHUNKS, "grad_hidden": 0, "grad_weight": 0}
    assert got.grad_fn is None and not got.requires_grad
    with guard:
        assert torch.equal(got, _previous(head, hidden, targets, CHUNK))


def test_reference_scoring_lazy_one_matmul_per_chunk():
    """The DPO path (`lazy.LazyLogits`) of a reference forward: one head matmul per chunk for the log-probs and the
    statistics together, no graph."""
    head, hidden, targets = _problem()
    scored = torch.ones(ROWS * LENGTH, dtype=torch.bool)
    with torch.no_grad():
        root = Root(head, contextlib.nullcontext, CHUNK, scored, ("entropy", "lse"), grad=False)
        with HeadMatmuls() as counts:
            got = LazyLogits(hidden, root).logprobs(targets)
            LazyLogits(hidden, root).logsumexp()  # read from the stored statistics: no further pass
    assert counts.counts == {"logits": CHUNKS, "grad_hidden": 0, "grad_weight": 0}
    assert got.grad_fn is None and root.passes == CHUNKS
    with torch.no_grad():
        assert torch.equal(got, _previous(head, hidden, targets, CHUNK))


def test_backward_matmuls():
    """A trainable head: one head matmul per chunk in the forward; in the backward each chunk's logits recomputed
    once, d(hidden) and d(weight) once, no log-sum-exp. Values and gradients bitwise the previous path's."""
    head_grad = True
    head, hidden, targets = _problem(head_grad=head_grad)
    weights = torch.randn(targets.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with HeadMatmuls() as forward:
        got = token_logprobs(hidden, targets, head, chunk=CHUNK)
    assert forward.counts == {"logits": CHUNKS, "grad_hidden": 0, "grad_weight": 0}
    with HeadMatmuls() as backward:
        (got * weights).sum().backward()
    assert backward.counts == {"logits": CHUNKS, "grad_hidden": CHUNKS, "grad_weight": CHUNKS if head_grad else 0}
    assert forward.lse >= CHUNKS and backward.lse == 0  # the recompute reuses the forward's log-sum-exp
    got_grads = [hidden.grad] + [p.grad for p in head.parameters() if p.requires_grad]
    head.zero_grad(set_to_none=True)
    hidden.grad = None
    want = _previous(head, hidden, targets, CHUNK)
    (want * weights).sum().backward()
    want_grads = [hidden.grad] + [p.grad for p in head.parameters() if p.requires_grad]
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_target_logprobs_gradient_bitwise(dtype):
    """`_TargetLogprobs`: values, log-sum-exp and the gradient to the logits (in their dtype) bitwise autograd's on
    the same expression (the cast to the accumulation dtype, gather, logsumexp)."""
    g = torch.Generator().manual_seed(2)
    logits = (4 * torch.randn(9, 301, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    targets = torch.randint(0, 301, (9,), generator=g)
    grad = torch.randn(9, generator=g, dtype=torch.float64).to(accumulation_dtype(dtype))
    values, lse = target_logprobs(logits, targets)
    assert not lse.requires_grad
    (got,) = torch.autograd.grad(values, logits, grad)
    wide = logits.to(accumulation_dtype(dtype))
    want_lse = torch.logsumexp(wide, dim=-1)
    want = wide.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - want_lse
    (want_grad,) = torch.autograd.grad(want, logits, grad)
    assert torch.equal(values, want) and torch.equal(lse, want_lse)
    assert got.dtype == dtype and torch.equal(got, want_grad)
    with torch.no_grad():
        plain, plain_lse = target_logprobs(logits, targets)
    assert torch.equal(plain, want) and torch.equal(plain_lse, want_lse)


def test_chunk_for_memory_bound():
    """Pure function of (free bytes, vocab, dtype, hidden): the largest chunk whose per-position bytes fit the share
    of free memory (capped), within the bounds; more free memory never gives a smaller chunk."""
    low, high = AUTO_CHUNK_CUDA_RANGE
    cases = [(32_000, torch.bfloat16, 1024), (151_936, torch.float32, 896), (50, torch.float64, 8)]
    for vocab, dtype, hidden in cases:
        model = torch.empty((), dtype=dtype).element_size()
        wide = torch.empty((), dtype=accumulation_dtype(dtype)).element_size()
        per_position = vocab * 2 * (model + wide) + 4 * hidden * model
        previous = 0
        for free in [0, 2**20, 2**30, 8 * 2**30, 80 * 2**30, 140 * 2**30]:
            chunk = chunk_for_memory(free, vocab, dtype, hidden)
            budget = min(free * AUTO_CHUNK_CUDA_FRACTION, AUTO_CHUNK_CUDA_BYTES)
            assert low <= chunk <= high and chunk >= previous
            if low < chunk < high:
                assert chunk * per_position <= budget < (chunk + 1) * per_position
            elif chunk == low:
                assert (low + 1) * per_position > budget  # too little memory: the lower bound
            else:
                assert high * per_position <= budget  # the upper bound, not the memory, limits it
            previous = chunk
    # a large GPU gets larger chunks than the CPU default at a large vocabulary, a small free memory smaller ones
    assert chunk_for_memory(80 * 2**30, 151_936, torch.bfloat16, 896) > auto_chunk(151_936, torch.bfloat16)
    assert chunk_for_memory(2**28, 151_936, torch.bfloat16, 896) < auto_chunk(151_936, torch.bfloat16)


def test_auto_chunk_device(monkeypatch):
    """`auto_chunk` on CPU (or without a device) is the fixed-bytes chunk; on CUDA `chunk_for_memory` of the free
    memory `cuda_free_bytes` reports (patched here: no GPU needed)."""
    assert auto_chunk(32_000, torch.float32, "cpu", 1024) == auto_chunk(32_000, torch.float32)
    seen = []

    def free_bytes(device):
        seen.append(device)
        return 40 * 2**30

    monkeypatch.setattr(chunked, "cuda_free_bytes", free_bytes)
    got = auto_chunk(150_000, torch.bfloat16, "cuda:0", 2048)
    assert got == chunk_for_memory(40 * 2**30, 150_000, torch.bfloat16, 2048) and seen == [torch.device("cuda:0")]


def test_lazy_backward_reuses_logsumexp():
    """The DPO path's chunk pass with gradients: the backward recomputes each chunk's logits once, runs no
    log-sum-exp over them, and its gradients equal the full-logit `log_softmax`'s (float64, 1e-12)."""
    head, hidden, targets = _problem()
    scored = torch.ones(ROWS * LENGTH, dtype=torch.bool)
    root = Root(head, contextlib.nullcontext, CHUNK, scored, ("entropy",), parameters=head.parameters())
    got = LazyLogits(hidden, root).logprobs(targets)
    with HeadMatmuls() as backward:
        got.sum().backward()
    assert backward.counts == {"logits": CHUNKS, "grad_hidden": CHUNKS, "grad_weight": CHUNKS} and backward.lse == 0
    got_grads = [hidden.grad, head.weight.grad, head.bias.grad]
    head.zero_grad(set_to_none=True)
    hidden.grad = None
    want = head(hidden).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want.sum().backward()
    for a, b in zip([got, *got_grads], [want, hidden.grad, head.weight.grad, head.bias.grad], strict=True):
        assert (a - b).abs().max().item() <= 1e-12 * b.abs().max().item()


@pytest.mark.parametrize("bias", [False, True])
def test_frozen_head_no_backward_matmul(bias):
    """A frozen head (no parameter needs a gradient) on hidden states that need one (a trainable backbone): the
    logits and d(hidden) in the forward, no grad-weight matmul anywhere and no head matmul in the backward. Values
    and d(hidden) equal to the previous path's and to the full-logit `log_softmax`'s (float64, 1e-14)."""
    head, hidden, targets = _problem(head_grad=False, bias=bias)
    scored = torch.rand(targets.shape, generator=torch.Generator().manual_seed(3)) > 0.3
    weights = torch.randn(targets.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    live = int(scored.sum())
    with HeadMatmuls() as forward:
        got = token_logprobs(hidden, targets, head, chunk=CHUNK, scored=scored)
    chunks = math.ceil(live / CHUNK) + math.ceil((scored.numel() - live) / CHUNK)  # scored, then the rest
    assert forward.counts == {"logits": chunks, "grad_hidden": math.ceil(live / CHUNK), "grad_weight": 0}
    with HeadMatmuls() as backward:
        (got * weights).sum().backward()
    assert backward.counts == {"logits": 0, "grad_hidden": 0, "grad_weight": 0}
    got_grad, hidden.grad = hidden.grad, None
    with torch.no_grad():  # (the scored positions form other chunks than `_previous`'s: equal to round-off)
        previous = _previous(head, hidden, targets, CHUNK)
    assert (got - previous).abs().max().item() <= 1e-14 * previous.abs().max().item()
    want = head(hidden).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (want * weights * scored).sum().backward()
    assert (got_grad - hidden.grad).abs().max().item() <= 1e-14 * hidden.grad.abs().max().item()
    hidden.grad = None
    (_previous(head, hidden, targets, CHUNK) * weights * scored).sum().backward()
    assert (got_grad - hidden.grad).abs().max().item() <= 1e-14 * hidden.grad.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_frozen_head_16bit(dtype):
    """The frozen-head path in 16-bit: values bitwise the previous path's; d(hidden) (it scales `d(value_i)/d(h_i)`
    by `g_i` after the head's backward, the previous path before it) within 2 ulps of the largest element of the
    previous path's and of the float64 truth, the bound the previous path meets against the truth too."""
    head, hidden, targets = _problem(dtype=dtype, head_grad=False)
    weights = torch.randn(targets.shape, generator=torch.Generator().manual_seed(1))
    got = token_logprobs(hidden, targets, head, chunk=CHUNK)
    (got * weights).sum().backward()
    got_grad, hidden.grad = hidden.grad.double(), None
    want = _previous(head, hidden, targets, CHUNK)
    (want * weights).sum().backward()
    previous = hidden.grad.double()
    assert torch.equal(got.detach(), want.detach()) and hidden.grad.dtype == dtype
    exact = hidden.detach().double().requires_grad_()
    logits = torch.nn.functional.linear(exact, head.weight.double(), head.bias.double())
    (logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) * weights.double()).sum().backward()
    bound = 2 * torch.finfo(dtype).eps * exact.grad.abs().max().item()
    assert (got_grad - previous).abs().max().item() <= bound
    assert (got_grad - exact.grad).abs().max().item() <= bound and (previous - exact.grad).abs().max().item() <= bound


def test_lazy_frozen_head():
    """The DPO path with a frozen head: no head matmul in the backward, the statistics stored from the forward's
    logits, log-probs and d(hidden) equal to the full-logit `log_softmax`'s (float64, 1e-12)."""
    head, hidden, targets = _problem(head_grad=False)
    scored = torch.ones(ROWS * LENGTH, dtype=torch.bool)
    root = Root(head, contextlib.nullcontext, CHUNK, scored, ("entropy", "lse"), parameters=head.parameters())
    with HeadMatmuls() as forward:
        got = LazyLogits(hidden, root).logprobs(targets)
        lse = LazyLogits(hidden, root).logsumexp()  # stored by the pass: no further matmul
    assert forward.counts == {"logits": CHUNKS, "grad_hidden": CHUNKS, "grad_weight": 0}
    with HeadMatmuls() as backward:
        got.sum().backward()
    assert backward.counts == {"logits": 0, "grad_hidden": 0, "grad_weight": 0}
    got_grad, hidden.grad = hidden.grad, None
    logits = head(hidden)
    want = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want.sum().backward()
    for a, b in [(got, want), (got_grad, hidden.grad), (lse, torch.logsumexp(logits, -1))]:
        assert (a - b).abs().max().item() <= 1e-12 * b.abs().max().item()
