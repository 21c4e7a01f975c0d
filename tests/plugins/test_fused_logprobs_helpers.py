"""The replacements of TRL's DPO logits helpers (`fused_logprobs.lazy`), on every signature the supported TRLs have:
`selective_log_softmax(logits, index)` (1.10-1.13), `selective_log_softmax(logits, index, temperature, row_mask)` and
`selective_log_softmax_and_entropy(logits, index, entropy_requires_grad, temperature, row_mask)` (1.14). A
`LazyLogits` gets the full-logit values (float64), masked as TRL's `row_mask` masks them; any other argument goes to
TRL's own helper untouched; options the fused path cannot reproduce are refused by name.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from trl_ext.errors import UsageError
from trl_ext.plugins.fused_logprobs.lazy import LazyLogits, Root, logprobs_and_entropy, selective_logprobs

RTOL = 1e-12


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(8, 29, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(29, 8, generator=g, dtype=torch.float64))
    hidden = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 29, (2, 5), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.long)
    return head, hidden, targets, mask


def _lazy(head, hidden, mask, stats=("entropy",)):
    root = Root(head, contextlib.nullcontext, 3, mask.bool().reshape(-1), stats, parameters=head.parameters())
    return LazyLogits(hidden, root)


def _reference(head, hidden, targets, mask):
    """TRL 1.14's `selective_log_softmax_and_entropy(..., row_mask=mask)` on the full logits."""
    logps = head(hidden).log_softmax(-1)
    chosen = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1).masked_fill(mask == 0, 0.0)
    entropy = -(logps.exp() * logps).sum(-1).masked_fill(mask == 0, 0.0)
    return chosen, entropy


def _close(a, b):
    assert (a - b).abs().max().item() <= RTOL * b.abs().max().item()


def test_logprobs_and_entropy_equal_the_full_logits_with_row_mask():
    head, hidden, targets, mask = _problem()
    want_logps, want_entropy = _reference(head, hidden, targets, mask)
    want_logps.sum().backward()
    want_grad = hidden.grad.clone()
    hidden.grad = None

    def trl_helper(logits, index, entropy_requires_grad=True, temperature=1.0, row_mask=None):
        raise AssertionError("a LazyLogits must not reach TRL's helper")

    helper = logprobs_and_entropy(trl_helper)
    logps, entropy = helper(_lazy(head, hidden, mask), targets, entropy_requires_grad=False, row_mask=mask)
    _close(logps, want_logps)
    _close(entropy, want_entropy)
    assert not entropy.requires_grad  # as TRL's with `entropy_requires_grad=False`
    logps.sum().backward()
    _close(hidden.grad, want_grad)


@pytest.mark.parametrize("signature", ["1.10", "1.14"])
def test_selective_log_softmax_on_each_signature(signature):
    head, hidden, targets, mask = _problem(seed=1)
    want, _ = _reference(head, hidden, targets, mask)
    if signature == "1.10":

        def trl_helper(logits, index):
            raise AssertionError

        got = selective_logprobs(trl_helper)(_lazy(head, hidden, mask), targets)
    else:

        def trl_helper(logits, index, temperature=1.0, row_mask=None):
            raise AssertionError

        got = selective_logprobs(trl_helper)(_lazy(head, hidden, mask), targets, row_mask=mask)
    _close(got, want)


def test_other_arguments_reach_trls_helpers_and_unknown_options_are_refused():
    calls = []

    def trl_helper(logits, index, entropy_requires_grad=True, temperature=1.0, row_mask=None):
        calls.append((logits, index, entropy_requires_grad, temperature, row_mask))
        return "trl"

    logits, index = torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long)
    assert logprobs_and_entropy(trl_helper)(logits, index, False, row_mask=None) == "trl"
    assert calls == [(logits, index, False, 1.0, None)]
    assert selective_logprobs(lambda logits, index, temperature=1.0: "trl")(logits, index, 0.5) == "trl"
    head, hidden, targets, mask = _problem()
    with pytest.raises(UsageError, match="entropy that carries gradients"):
        logprobs_and_entropy(trl_helper)(_lazy(head, hidden, mask), targets, entropy_requires_grad=True)
    with pytest.raises(UsageError, match="with a temperature"):
        logprobs_and_entropy(trl_helper)(_lazy(head, hidden, mask), targets, False, temperature=0.7)
