"""`fused_logprobs.chunked.token_logprobs` against the full-logit `log_softmax` (float64), and its memory bound."""

from __future__ import annotations

import pytest
import torch

from tests.equivalence import LargestTensor
from trl_ext.plugins.fused_logprobs.chunked import accumulation_dtype, auto_chunk, token_logprobs

RTOL = 1e-10


def _problem(rows=3, length=7, hidden=16, vocab=53, bias=True, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=bias, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g, dtype=dtype))
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=g, dtype=dtype))
    h = torch.randn(rows, length, hidden, generator=g, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (rows, length), generator=g)
    return head, h, targets


def _stock(head, h, targets):
    return torch.take_along_dim(head(h).log_softmax(-1), targets.unsqueeze(-1), dim=2).squeeze(-1)


def _close(a, b, rtol):
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= rtol * scale, ((a - b).abs().max().item(), scale)


@pytest.mark.parametrize("chunk", [2, 5, 8, 21, 1000])  # vocab 53 and 21 positions: no chunk divides either
def test_values_and_gradients_equal_full_logits(chunk):
    head, h, targets = _problem()
    weights = torch.randn(targets.shape, dtype=torch.float64)
    want = _stock(head, h, targets)
    (want * weights).sum().backward()
    want_grads = [t.grad.clone() for t in (h, head.weight, head.bias)]
    for t in (h, head.weight, head.bias):
        t.grad = None
    got = token_logprobs(h, targets, head, chunk=chunk)
    assert got.dtype == torch.float64 and got.shape == targets.shape
    _close(got, want, RTOL)
    (got * weights).sum().backward()
    for g, w in zip((h.grad, head.weight.grad, head.bias.grad), want_grads, strict=True):
        _close(g, w, RTOL)


@pytest.mark.parametrize("rest", ["detach", "skip"])
def test_scored_positions(rest):
    """Masked positions: with `detach` their values equal stock and their gradient is zero (as under a stock mask);
    with `skip` they are 0 and never computed. Scored positions equal stock in value and gradient."""
    head, h, targets = _problem(bias=False)
    scored = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    want = _stock(head, h, targets)
    (want * scored).sum().backward()
    want_grads = [h.grad.clone(), head.weight.grad.clone()]
    h.grad = head.weight.grad = None
    calls = []
    head.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    got = token_logprobs(h, targets, head, chunk=4, scored=scored, rest=rest)
    _close(got[scored], want[scored], RTOL)
    if rest == "detach":
        _close(got[~scored], want[~scored], RTOL)
    else:
        assert (got[~scored] == 0).all()
    assert sum(calls) == (21 if rest == "detach" else int(scored.sum()))
    (got * scored).sum().backward()
    _close(h.grad, want_grads[0], RTOL)
    _close(head.weight.grad, want_grads[1], RTOL)


def test_float32_accumulation():
    """bfloat16 logits: the log-sum-exp runs in float32 (the result is float32 and close to the float64 value)."""
    head64, h64, targets = _problem(vocab=301, seed=3)
    head = torch.nn.Linear(16, 301, dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(head64.weight)
        head.bias.copy_(head64.bias)
    h = h64.detach().to(torch.bfloat16)
    got = token_logprobs(h, targets, head, chunk=7)
    assert got.dtype == torch.float32 and accumulation_dtype(torch.bfloat16) == torch.float32
    logits64 = head(h).double()  # the bf16 logits, accumulated exactly
    want = torch.take_along_dim(logits64.log_softmax(-1), targets.unsqueeze(-1), dim=2).squeeze(-1)
    _close(got.double(), want, 1e-6)


def test_auto_chunk():
    assert auto_chunk(32_000) == 524 and auto_chunk(150_000) == 111 and auto_chunk(50, torch.float64) == 4096


def test_never_allocates_full_logits():
    """Forward and backward: no tensor as large as `[rows, length, vocab]`; the largest is one chunk of logits."""
    rows, length, vocab, chunk = 4, 16, 97, 8
    head, h, targets = _problem(rows=rows, length=length, vocab=vocab)
    with LargestTensor() as sizes:
        token_logprobs(h, targets, head, chunk=chunk).sum().backward()
    assert sizes.largest < rows * length * vocab
    assert sizes.largest <= max(chunk * vocab, vocab * h.size(-1))  # a chunk of logits, or the head weight
    with LargestTensor() as stock:
        _stock(head, h, targets).sum().backward()
    assert stock.largest >= rows * length * vocab  # the check sees the full logits where they exist
