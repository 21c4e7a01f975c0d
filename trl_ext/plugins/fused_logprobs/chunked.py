"""Per-token log-probs of scored tokens without the `[rows, length, vocab]` logits.

`token_logprobs(hidden, targets, head, chunk=...)` equals `head(hidden).log_softmax(-1).gather(-1, targets[...,
None])[..., 0]` but holds at most `chunk` rows of logits at a time, with the log-sum-exp in float32 (float64 stays
float64). Each chunk is a non-reentrant checkpoint of a call of `head` itself (docs/plugins/fused_logprobs.md: what
that keeps working); `_TargetLogprobs` writes the gradient of the target log-probs by hand (one `[n, V]` buffer instead
of autograd's five, bitwise the same) and the recompute reuses the forward's log-sum-exp. Head matmuls per chunk
(`tests/plugins/test_fused_logprobs_matmuls.py`):
- a trainable head: one in the forward; the recomputed logits, d(hidden) and d(weight) in the backward (stock: 3);
- a frozen head on hidden states that need a gradient: the logits and d(hidden) for a unit gradient, both in the
  forward, no checkpoint; the backward scales that d(hidden) per row (`frozen_head_chunk`; stock: 2);
- nothing needs a gradient: plain chunks, one each, nothing saved.

With gradients on, only the `scored` positions go through the checkpointed chunks; the others are computed without
gradients (`rest="detach"`: stock's values, zero gradient as under a stock mask) or filled with 0 (`rest="skip"`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = [
    "accumulation_dtype",
    "auto_chunk",
    "chunk_for_memory",
    "frozen_head_chunk",
    "target_logprobs",
    "token_logprobs",
]

#: Bytes of logits (in the accumulation dtype) one chunk may hold when `chunk` is chosen automatically.
AUTO_CHUNK_BYTES = 64 * 2**20
#: Bounds of an automatically chosen chunk (positions).
AUTO_CHUNK_RANGE = (16, 4096)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the log-sum-exp: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: On CUDA: the share of the free device memory (at attach) one chunk's transient tensors may take, at most
#: `AUTO_CHUNK_CUDA_BYTES`, and the bounds of the chunk (positions). The cap keeps the step's peak near the fixed
#: 64 MiB chunk's (whose backward held about as much in autograd's five `[n, V]` gradient tensors) while doubling the
#: rows of each head matmul; more free memory alone is no reason for larger chunks (the peak is what the plugin saves).
AUTO_CHUNK_CUDA_FRACTION = 1 / 8
AUTO_CHUNK_CUDA_BYTES = 512 * 2**20
AUTO_CHUNK_CUDA_RANGE = (16, 8192)


def auto_chunk(
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    hidden_size: int = 0,
) -> int:
    """Positions per chunk. On CPU (and without `device`): one chunk of logits holds about `AUTO_CHUNK_BYTES`. On
    CUDA: `chunk_for_memory` of the device's free memory now (the driver's free memory plus what PyTorch's allocator
    holds unused), so a larger GPU runs fewer, larger head matmuls."""
    if device is not None and torch.device(device).type == "cuda":
        return chunk_for_memory(cuda_free_bytes(torch.device(device)), vocab_size, dtype, hidden_size)
    low, high = AUTO_CHUNK_RANGE
    return int(min(high, max(low, AUTO_CHUNK_BYTES // max(1, vocab_size * accumulation_dtype(dtype).itemsize))))


def chunk_for_memory(free_bytes: int, vocab_size: int, dtype: torch.dtype, hidden_size: int) -> int:
    """Positions per chunk whose transient tensors take at most `AUTO_CHUNK_CUDA_FRACTION` of `free_bytes` and
    `AUTO_CHUNK_CUDA_BYTES`, within `AUTO_CHUNK_CUDA_RANGE`.

    Per position the backward of a chunk holds at once: the recomputed logits and their gradient in the model's
    `dtype`, their upcast and the gradient buffer in the accumulation dtype (`_TargetLogprobs.backward`), and the
    chunk's hidden states with their gradient (`hidden_size`, twice for slack).
    """
    model, wide = dtype.itemsize, accumulation_dtype(dtype).itemsize
    per_position = vocab_size * 2 * (model + wide) + 4 * hidden_size * model
    budget = min(int(free_bytes * AUTO_CHUNK_CUDA_FRACTION), AUTO_CHUNK_CUDA_BYTES)
    low, high = AUTO_CHUNK_CUDA_RANGE
    return int(min(high, max(low, budget // max(1, per_position))))


def cuda_free_bytes(device: torch.device) -> int:
    """Bytes a new allocation on `device` can take: free in the driver plus reserved but unallocated by PyTorch."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


class _TargetLogprobs(torch.autograd.Function):
    """`(logits.gather(targets) - logsumexp(logits), logsumexp(logits))` of `[n, V]` logits in the accumulation dtype,
    the logits upcast inside (not kept as a second copy), the log-sum-exp without gradient.

    Autograd's backward of the same expression allocates five `[n, V]` tensors per chunk (the softmax, its product with
    the gradient, a zero tensor for the gather, their sum, the cast back); this one computes `exp(logits - lse) * -g`,
    adds `g` at the targets in place and casts once: autograd's operations in its order per element (its
    `logsumexp_backward`, then the sum), so the gradient is bitwise the same (`test_target_logprobs_gradient_bitwise`).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, known: torch.Tensor | None):  # type: ignore[override]
        wide_dtype = accumulation_dtype(logits.dtype)
        lse = torch.logsumexp(logits.to(wide_dtype), dim=-1) if known is None else known
        target = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        values = target.to(wide_dtype) - lse
        ctx.save_for_backward(logits, targets, lse)
        ctx.mark_non_differentiable(lse)
        return values, lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_lse: torch.Tensor):  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors
        wide = logits.to(lse.dtype)
        out = (wide - lse.unsqueeze(-1)).exp_() if wide is logits else wide.sub_(lse.unsqueeze(-1)).exp_()
        out.mul_(grad.neg().unsqueeze(-1))
        out.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1))
        return out.to(logits.dtype), None, None


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, known: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log_softmax(logits)[targets], logsumexp(logits))` over the last dimension, in the accumulation dtype; the
    log-probs carry gradients to `logits` (`_TargetLogprobs`), the log-sum-exp does not.

    `known`: the log-sum-exp of these very logits, computed before. A checkpointed chunk passes the one its forward
    computed when the backward recomputes it (the recomputed logits are the forward's, which the checkpoint
    requires): the recompute then runs the head and no log-sum-exp pass over `[n, V]`.
    """
    if not (torch.is_grad_enabled() and logits.requires_grad):
        wide = logits.to(accumulation_dtype(logits.dtype))
        lse = torch.logsumexp(wide, dim=-1) if known is None else known
        return wide.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse, lse
    values, lse = _TargetLogprobs.apply(logits, targets, known)
    return values, lse


class _ScaledGradient(torch.autograd.Function):
    """`values`, whose gradient to `hidden` is `grad[:, None] * unit` (`unit`: the gradient of `values.sum()`)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, values: torch.Tensor, unit: torch.Tensor):  # type: ignore[override]
        ctx.save_for_backward(unit)
        return values.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (unit,) = ctx.saved_tensors
        return (unit * grad.unsqueeze(-1)).to(unit.dtype), None, None


def frozen_head_chunk(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """A chunk through a head none of whose parameters needs a gradient, the hidden states needing one.

    Each log-prob depends on its own row of hidden states only, so its gradient is `g_i * d(value_i)/d(hidden_i)`: the
    forward computes `d(value_i)/d(hidden_i)` for every row at once (`[n, H]`, the size of what a checkpoint keeps) and
    the backward scales it by the incoming gradient: two head matmuls per chunk, both in the forward, as stock's logits
    and d(hidden). Equal to the checkpointed path up to the order of one multiplication by `g_i` (float64: 1e-15
    relative; `test_frozen_head_no_backward_matmul`). `observe(logits, lse)` sees the chunk's logits (detached) and
    log-sum-exp, without gradients (`lazy.py` stores its statistics from them).
    """
    with torch.enable_grad():
        leaf = hidden.detach().requires_grad_()
        logits = head(leaf)
        values, lse = target_logprobs(logits, targets)
        if observe is not None:
            with torch.no_grad():
                observe(logits.detach(), lse)
        (unit,) = torch.autograd.grad(values, leaf, torch.ones_like(values))
    return _ScaledGradient.apply(hidden, values.detach(), unit)


class _ChunkLogprobs:
    """The function each chunk runs (checkpointed with gradients): the head, then `target_logprobs`; the
    log-sum-exp of chunk `index` kept from its forward for the backward's recompute. `observe(index, logits, lse)`
    sees each run's logits (the backward's recompute too)."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], observe: Callable | None = None) -> None:
        self.head, self.observe = head, observe
        self.lse: dict[int, torch.Tensor] = {}

    def __call__(self, index: int, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        values, lse = target_logprobs(logits, targets, self.lse.get(index))
        self.lse.setdefault(index, lse.detach())
        if self.observe is not None:
            self.observe(index, logits, lse)
        return values


def _chunked(
    head,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    recompute: bool,
    frozen: bool = False,
    observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    parts = []
    one = _ChunkLogprobs(head, observe)
    for index, start in enumerate(range(0, hidden.size(0), chunk)):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if recompute and frozen:
            parts.append(frozen_head_chunk(head, h, t, None if observe is None else functools.partial(observe, index)))
        elif recompute:
            parts.append(checkpoint(one, index, h, t, use_reentrant=False))
        else:
            parts.append(one(index, h, t))
    if not parts:
        return hidden.new_zeros(0, dtype=accumulation_dtype(hidden.dtype))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk: int,
    scored: torch.Tensor | None = None,
    rest: str = "detach",
    parameters: Iterable[torch.Tensor] | None = None,
) -> torch.Tensor:
    """`[...]` log-probs (float32; float64 for float64 logits) of `targets` (`[...]` token ids) under
    `log_softmax(head(hidden))` (`hidden`: `[..., H]`; `head`: a module or its forward, `[n, H]` -> `[n, V]`), `chunk`
    positions of logits at a time.

    `scored`: bool mask shaped like `targets`, the positions whose log-probs carry gradients (`None`: every one); the
    others are computed without gradients (`rest="detach"`) or filled with 0 (`"skip"`). `parameters`: the head's
    (default: `head.parameters()` of a module); when none needs a gradient the chunks take the frozen-head path
    (`frozen_head_chunk`). The head must read no other tensor that needs a gradient.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of positions, got {chunk}")
    if rest not in ("detach", "skip"):
        raise ValueError(f'rest must be "detach" or "skip", got {rest!r}')
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    flat_targets = targets.reshape(-1)
    params = _params(head) if parameters is None else list(parameters)
    trainable = any(p.requires_grad for p in params)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or trainable)
    frozen = not trainable  # with `grad`: only the hidden states need a gradient
    if scored is None:
        return _chunked(head, flat_hidden, flat_targets, chunk, grad, frozen).reshape(shape)
    flat_scored = scored.reshape(-1).bool()
    dtype = accumulation_dtype(hidden.dtype)
    out = torch.zeros(flat_targets.numel(), dtype=dtype, device=hidden.device)
    live = flat_scored.nonzero().squeeze(1)
    live_hidden, live_targets = flat_hidden.index_select(0, live), flat_targets.index_select(0, live)
    values = _chunked(head, live_hidden, live_targets, chunk, grad, frozen)
    out = out.index_copy(0, live, values.to(dtype))
    if rest == "detach" and bool((~flat_scored).any()):
        idle = (~flat_scored).nonzero().squeeze(1)
        with torch.no_grad():
            idle_hidden, idle_targets = flat_hidden.index_select(0, idle), flat_targets.index_select(0, idle)
            idle_values = _chunked(head, idle_hidden, idle_targets, chunk, False)
        out = out.index_copy(0, idle, idle_values.to(dtype))
    return out.reshape(shape)


def _params(head) -> list[torch.Tensor]:
    parameters = getattr(head, "parameters", None)
    return list(parameters()) if callable(parameters) else []
