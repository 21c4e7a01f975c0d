"""Per-token log-probs of scored tokens without the `[rows, length, vocab]` logits.

`token_logprobs(hidden, targets, head, chunk=...)` equals
`head(hidden).log_softmax(-1).gather(-1, targets[..., None])[..., 0]` but never holds more than `chunk` rows of
logits: the positions are flattened, the LM head is applied `chunk` positions at a time, the log-sum-exp runs in
float32 (float64 stays float64) and only the target token's log-prob is kept.

Backward: each chunk is a non-reentrant `torch.utils.checkpoint` of a function that calls `head`. Its forward keeps
only the chunk's hidden states; its backward recomputes the chunk's logits, so one chunk of logits (and its gradient)
is alive at a time. Calling the head's own code, rather than a hand-written gradient of `hidden @ weight.T`, keeps
whatever it does on the way: a bias, a PEFT adapter or `modules_to_save` copy on the head. `head` is either the head
module or (Online DPO, `online.py`) its original `forward`, called from inside the module's own call so that the
parameters DeepSpeed ZeRO-3 or FSDP2 gather for that call are in place, in forward and in the recomputation.

Positions: `scored` (a bool mask shaped like `targets`) names the positions whose log-probs take part in the loss. With
gradients on, only they go through the checkpointed chunks; the other positions are computed without gradients
(`rest="detach"`, their values as stock, their gradient zero as under a stock mask) or not at all and filled with 0
(`rest="skip"`). Without gradients every computed position runs in plain chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["accumulation_dtype", "auto_chunk", "token_logprobs"]

#: Bytes of logits (in the accumulation dtype) one chunk may hold when `chunk` is chosen automatically.
AUTO_CHUNK_BYTES = 64 * 2**20
#: Bounds of an automatically chosen chunk (positions).
AUTO_CHUNK_RANGE = (16, 4096)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the log-sum-exp: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def auto_chunk(vocab_size: int, dtype: torch.dtype = torch.float32) -> int:
    """Positions per chunk so that one chunk of logits holds about `AUTO_CHUNK_BYTES`."""
    itemsize = torch.empty((), dtype=accumulation_dtype(dtype)).element_size()
    low, high = AUTO_CHUNK_RANGE
    return int(min(high, max(low, AUTO_CHUNK_BYTES // max(1, vocab_size * itemsize))))


def _chunk_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor):
    logits = head(hidden)
    logits = logits.to(accumulation_dtype(logits.dtype))
    target = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return target - torch.logsumexp(logits, dim=-1)


def _chunked(head, hidden: torch.Tensor, targets: torch.Tensor, chunk: int, recompute: bool) -> torch.Tensor:
    parts = []
    for start in range(0, hidden.size(0), chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if recompute:
            parts.append(checkpoint(_chunk_logprobs, head, h, t, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, h, t))
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
    """Log-probs of `targets` under `log_softmax(head(hidden))`, `chunk` positions of logits at a time.

    Args:
        hidden (`torch.Tensor`): `[..., H]` hidden states (the head's input) of the positions to score.
        targets (`torch.Tensor`): `[...]` token ids, one per position.
        head (`Callable`): the output head (a module or its forward, called on `[n, H]` rows), returning `[n, V]`
            logits.
        chunk (`int`): positions per chunk (at most `chunk * V` logits are alive at once).
        scored (`torch.Tensor`, *optional*): bool mask shaped like `targets`; the positions whose log-probs carry
            gradients. `None`: every position.
        rest (`str`, *optional*, defaults to `"detach"`): the positions outside `scored`: `"detach"` computes them
            without gradients, `"skip"` fills them with 0 without computing them.
        parameters (`Iterable[torch.Tensor]`, *optional*): the head's parameters (whether any needs a gradient);
            `None`: `head.parameters()` where `head` is a module.

    Returns:
        `torch.Tensor`: `[...]` log-probs, float32 (float64 for float64 logits).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of positions, got {chunk}")
    if rest not in ("detach", "skip"):
        raise ValueError(f'rest must be "detach" or "skip", got {rest!r}')
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    flat_targets = targets.reshape(-1)
    params = _params(head) if parameters is None else list(parameters)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params))
    if scored is None:
        return _chunked(head, flat_hidden, flat_targets, chunk, grad).reshape(shape)
    flat_scored = scored.reshape(-1).bool()
    dtype = accumulation_dtype(hidden.dtype)
    out = torch.zeros(flat_targets.numel(), dtype=dtype, device=hidden.device)
    live = flat_scored.nonzero().squeeze(1)
    values = _chunked(head, flat_hidden.index_select(0, live), flat_targets.index_select(0, live), chunk, grad)
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
