"""`LazyLogits`: stands for `head(hidden)` (`[..., V]`) without computing it; each reduction TRL applies to the logits
runs chunk by chunk.

TRL's DPO scoring (TRL < 1.15) reads its logits only through a few operations, each a per-position reduction over
the vocabulary: slicing and boolean selection of positions, `detach`, `chunk` over rows, `selective_log_softmax`,
`entropy_from_logits`, `.mean(-1)`, `.argmax(-1)`, `torch.logsumexp(x, -1)`, `2.0 * x`, `F.cross_entropy`. Those
are given here; any other operation raises a `UsageError` naming it (a TRL that reads its logits another way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...errors import UsageError
from .chunked import accumulation_dtype, token_logprobs

__all__ = ["LazyLogits", "entropy", "selective_logprobs"]


def _unsupported(what: str) -> UsageError:
    return UsageError(
        f"fused_logprobs: TRL applied `{what}` to the model's logits, which the fused path does not provide (this TRL "
        "reads its logits in a way fused_logprobs does not know). Train without fused_logprobs and report it."
    )


#: `F.cross_entropy` keywords and their defaults: the plain mean of -log-probs is all the fused path gives.
_CROSS_ENTROPY_DEFAULTS = {
    "weight": None,
    "size_average": None,
    "ignore_index": -100,
    "reduce": None,
    "reduction": "mean",
    "label_smoothing": 0.0,
}


class LazyLogits:
    """`scale * head(hidden)` over the leading dimensions of `hidden`, never materialised as a whole.

    Args:
        hidden (`torch.Tensor`): `[..., H]` hidden states (the head's input).
        head (`Callable`): the output head module.
        autocast (`Callable`): returns the autocast context the head ran under in the model's forward.
        chunk (`int`): positions per chunk.
        scale (`float`, *optional*, defaults to `1.0`): a factor applied to the logits.
    """

    def __init__(self, hidden: torch.Tensor, head: Callable, autocast: Callable[[], Any], chunk: int, scale=1.0):
        self.hidden, self.head, self.autocast, self.positions, self.scale = hidden, head, autocast, chunk, scale

    def _like(self, hidden: torch.Tensor, scale: float | None = None) -> LazyLogits:
        return LazyLogits(hidden, self.head, self.autocast, self.positions, self.scale if scale is None else scale)

    @property
    def shape(self) -> torch.Size:
        vocab = getattr(self.head, "out_features", None) or getattr(self.head, "weight").shape[0]  # noqa: B009
        return torch.Size((*self.hidden.shape[:-1], vocab))

    def dim(self) -> int:
        return self.hidden.dim()

    ndim = property(dim)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def __getitem__(self, index: Any) -> LazyLogits:
        if isinstance(index, tuple) and index and index[-1] == slice(None) and Ellipsis in index:
            return self._like(self.hidden[index])  # `[..., a:b, :]`: the last dimension kept whole
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.dim() == self.hidden.dim() - 1:
            return self._like(self.hidden[index])  # boolean selection of positions
        raise _unsupported(f"logits[{index!r}]")

    def detach(self) -> LazyLogits:
        return self._like(self.hidden.detach())

    def chunk(self, chunks: int, dim: int = 0) -> tuple[LazyLogits, ...]:
        if dim < 0 and dim + self.dim() == self.dim() - 1:
            raise _unsupported("chunk over the vocabulary")
        return tuple(self._like(h) for h in self.hidden.chunk(chunks, dim))

    def __mul__(self, other: Any) -> LazyLogits:
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return self._like(self.hidden, self.scale * other)
        raise _unsupported(f"logits * {type(other).__name__}")

    __rmul__ = __mul__

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            logits = self.head(hidden)
        logits = logits.to(accumulation_dtype(logits.dtype))
        return logits * self.scale if self.scale != 1.0 else logits

    def reduce(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`fn(logits)` (a reduction over the last dimension), chunk by chunk; with gradients, each chunk is
        recomputed in backward."""
        flat = self.hidden.reshape(-1, self.hidden.size(-1))
        grad = torch.is_grad_enabled() and flat.requires_grad

        def one(h: torch.Tensor) -> torch.Tensor:
            return fn(self._logits(h))

        parts = [
            checkpoint(one, flat[s : s + self.positions], use_reentrant=False)
            if grad
            else one(flat[s : s + self.positions])
            for s in range(0, flat.size(0), self.positions)
        ]
        out = torch.cat(parts) if parts else flat.new_zeros(0)
        return out.reshape(self.hidden.shape[:-1])

    def mean(self, dim: int = -1) -> torch.Tensor:
        if dim not in (-1, self.dim() - 1):
            raise _unsupported(f"mean(dim={dim})")
        return self.reduce(lambda logits: logits.mean(-1))

    def argmax(self, dim: int = -1) -> torch.Tensor:
        if dim not in (-1, self.dim() - 1):
            raise _unsupported(f"argmax(dim={dim})")
        with torch.no_grad():
            return self.reduce(lambda logits: logits.argmax(-1))

    def logprobs(self, targets: torch.Tensor, scored: torch.Tensor | None = None) -> torch.Tensor:
        """Per-position log-probs of `targets` (`chunked.token_logprobs`); positions outside `scored` are 0."""
        if self.scale != 1.0:
            raise _unsupported("log-probs of scaled logits")
        with self.autocast():
            return token_logprobs(self.hidden, targets, self.head, chunk=self.positions, scored=scored, rest="skip")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.logsumexp:
            logits, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
            if isinstance(logits, LazyLogits) and dim in (-1, logits.dim() - 1) and not kwargs.get("keepdim"):
                return logits.reduce(lambda x: torch.logsumexp(x, dim=-1))
        if func is F.cross_entropy:
            logits, target = args[0], kwargs.get("target", args[1] if len(args) > 1 else None)
            extra = {k: v for k, v in kwargs.items() if k != "target" and _CROSS_ENTROPY_DEFAULTS.get(k, v) != v}
            unknown = set(kwargs) - set(_CROSS_ENTROPY_DEFAULTS) - {"target"}
            plain = isinstance(target, torch.Tensor) and not extra and not unknown and len(args) <= 2
            if plain and isinstance(target, torch.Tensor) and bool((target == -100).any()):
                plain = False  # ignored targets: not what TRL passes (it selects the completion tokens)
            if isinstance(logits, LazyLogits) and isinstance(target, torch.Tensor) and logits.dim() == 2 and plain:
                return -logits.logprobs(target).mean()
        raise _unsupported(getattr(func, "__name__", str(func)))


def selective_logprobs(original: Callable, scored: Callable[[LazyLogits], torch.Tensor | None]) -> Callable:
    """A `selective_log_softmax(logits, index)` that scores `LazyLogits` chunk by chunk (only the positions
    `scored(logits)` names, the others 0, as TRL masks them next) and passes any other call to `original`."""

    def selective_log_softmax(logits: Any, index: torch.Tensor) -> torch.Tensor:
        if not isinstance(logits, LazyLogits):
            return original(logits, index)
        if index.dim() != logits.dim() - 1:
            raise _unsupported("selective_log_softmax with several indices per position")
        return logits.logprobs(index, scored(logits))

    return selective_log_softmax


def entropy(original: Callable) -> Callable:
    """An `entropy_from_logits(logits, chunk_size=...)` that reduces `LazyLogits` chunk by chunk (the entropy of
    `softmax(logits)` in nats) and passes any other call to `original`."""

    def entropy_from_logits(logits: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(logits, LazyLogits):
            return original(logits, *args, **kwargs)

        def one(x: torch.Tensor) -> torch.Tensor:
            logps = F.log_softmax(x, dim=-1)
            return -(torch.exp(logps) * logps).sum(-1)

        with torch.no_grad():
            return logits.reduce(one)

    return entropy_from_logits
