"""`LazyLogits`: stands for `head(hidden)` (`[..., V]`) without computing it; each reduction TRL applies to the logits
runs chunk by chunk, on the scored positions only.

TRL's DPO scoring (TRL < 1.15) reads its logits only through: slicing and boolean selection of positions, `detach`,
`chunk` over rows, `selective_log_softmax` (every loss type), `entropy_from_logits` (1.10-1.13) or
`selective_log_softmax_and_entropy` (1.14), `.mean(-1)` (`logits/chosen|rejected`), `.argmax(-1)`
(`mean_token_accuracy`), `torch.logsumexp(x, -1)` and `2.0 * x` (WPO weights), `F.cross_entropy` (the `sft` loss).
Those are given here; any other operation raises a `UsageError` naming it.

Every reduction computes the scored positions (the shifted completion mask) only and gives 0 elsewhere, which TRL's
masking turns into the stock values. Derived `LazyLogits` (slices, chunks, selections) track their positions as
indices into the model output, whose per-position results are kept (`Root.cache`): the policy's log-prob pass also
stores, without gradients, the statistics TRL asks for next, so the head runs once per chunk in the forward (and once
more in the backward's recompute). Built inside the head's call (`dpo.DpoScoreCall`), a root holds only those results
(`Root.precomputed`): no hidden states, and a reduction it does not hold is refused.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from trl_ext.api import UsageError

from .chunked import _chunked, _params, accumulation_dtype

__all__ = ["STATS", "LazyLogits", "Root", "entropy", "logprobs_and_entropy", "selective_logprobs"]

#: The per-position statistics a log-prob pass can store on the way: name -> function of (logits, log-sum-exp).
STATS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "entropy": lambda logits, lse: -(torch.exp(logits - lse[:, None]) * (logits - lse[:, None])).sum(-1),
    "mean": lambda logits, lse: logits.mean(-1),
    "argmax": lambda logits, lse: logits.argmax(-1),
    "lse": lambda logits, lse: lse,
    "lse2": lambda logits, lse: torch.logsumexp(2.0 * logits, dim=-1),
}


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


class Root:
    """What the `LazyLogits` derived from one model output share: the `head`, a factory of the `autocast` context it
    ran under, the `chunk`, the `scored` positions (a flat bool mask over the output's positions: those TRL keeps), the
    `STATS` to store during the first log-prob pass, whether the model's forward ran with gradients (`grad`: the
    reference's under `no_grad` carries none), the `vocab` size and the head's `parameters` (default: read from
    `head`), and the per-position results computed so far (`cache`)."""

    def __init__(
        self,
        head: Callable,
        autocast: Callable[[], Any],
        chunk: int,
        scored: torch.Tensor,
        stats: Iterable[str] = (),
        grad: bool = True,
        vocab: int | None = None,
        parameters: Iterable[torch.Tensor] | None = None,
    ) -> None:
        self.head, self.autocast, self.chunk, self.scored, self.grad = head, autocast, chunk, scored, grad
        self.stats = tuple(stats)
        self.vocab = vocab
        self.parameters = list(_params(head) if parameters is None else parameters)
        #: every result was computed inside the head's call (`precompute`): the hidden states are not kept, and a
        #: reduction whose result is not stored is refused
        self.precomputed = False
        self.scored_count = int(scored.sum())
        self.cache: dict[str, torch.Tensor] = {}
        #: head passes over chunks (forward, without the recompute of the backward): for tests and logs
        self.passes = 0


class LazyLogits:
    """`scale * head(hidden)` over the leading dimensions of `hidden` (`[..., H]`), never materialised as a whole;
    `ids` (`hidden.shape[:-1]`) are these positions among the `root`'s (default: all, in order: a model output)."""

    def __init__(self, hidden: torch.Tensor, root: Root, ids: torch.Tensor | None = None, scale: float = 1.0) -> None:
        if ids is None:
            ids = torch.arange(hidden[..., 0].numel(), device=hidden.device).reshape(hidden.shape[:-1])
        self.hidden, self.root, self.ids, self.scale = hidden, root, ids, scale

    def _like(self, hidden: torch.Tensor, ids: torch.Tensor, scale: float | None = None) -> LazyLogits:
        return LazyLogits(hidden, self.root, ids, self.scale if scale is None else scale)

    @property
    def shape(self) -> torch.Size:
        head = self.root.head
        vocab = self.root.vocab or getattr(head, "out_features", None) or getattr(head, "weight").shape[0]  # noqa: B009
        return torch.Size((*self.hidden.shape[:-1], vocab))

    def dim(self) -> int:
        return self.hidden.dim()

    ndim = property(dim)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, index: Any) -> LazyLogits:
        if isinstance(index, tuple) and index and index[-1] == slice(None) and Ellipsis in index:
            return self._like(self.hidden[index], self.ids[index[:-1]])  # `[..., a:b, :]`: vocabulary kept whole
        if (
            isinstance(index, tuple)
            and len(index) == self.dim()
            and index[-1] == slice(None)
            and all(isinstance(i, (slice, int)) and not isinstance(i, bool) for i in index)
        ):  # `[:n, :-1, :]`: positions sliced, vocabulary kept whole
            return self._like(self.hidden[index], self.ids[index[:-1]])
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.dim() == self.hidden.dim() - 1:
            return self._like(self.hidden[index], self.ids[index])  # boolean selection of positions
        raise _unsupported(f"logits[{index!r}]")

    def detach(self) -> LazyLogits:
        return self._like(self.hidden.detach(), self.ids)

    def chunk(self, chunks: int, dim: int = 0) -> tuple[LazyLogits, ...]:
        if dim % self.dim() == self.dim() - 1:
            raise _unsupported("chunk over the vocabulary")
        pairs = zip(self.hidden.chunk(chunks, dim), self.ids.chunk(chunks, dim), strict=True)
        return tuple(self._like(h, i) for h, i in pairs)

    def __mul__(self, other: Any) -> LazyLogits:
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return self._like(self.hidden, self.ids, self.scale * other)
        raise _unsupported(f"logits * {type(other).__name__}")

    __rmul__ = __mul__

    # -----------------------------------------------------------------------------------------------------------------
    # Chunked evaluation
    # -----------------------------------------------------------------------------------------------------------------

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.root.autocast():
            logits = self.root.head(hidden)
        return logits.to(accumulation_dtype(logits.dtype))

    def _live(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat hidden states, flat root ids, and the flat local indices of the scored positions."""
        flat_ids = self.ids.reshape(-1)
        live = self.root.scored[flat_ids].nonzero().squeeze(1)
        return self.hidden.reshape(-1, self.hidden.size(-1)), flat_ids, live

    def _spread(self, values: torch.Tensor, live: torch.Tensor, flat_ids: torch.Tensor) -> torch.Tensor:
        """`values` of the scored positions -> `[...]` over these positions, 0 elsewhere."""
        out = values.new_zeros(flat_ids.numel())
        return out.index_copy(0, live, values).reshape(self.ids.shape)

    def _cached(self, name: str) -> torch.Tensor | None:
        """The stored `name` of these positions (0 outside the scored ones), if every scored one has it."""
        value = self.root.cache.get(name)
        return None if value is None else value[self.ids]

    def _store(self, name: str, values: torch.Tensor, live: torch.Tensor, flat_ids: torch.Tensor) -> None:
        size = self.root.scored.numel()
        self.root.cache[name] = values.new_zeros(size).index_copy(0, flat_ids.index_select(0, live), values)

    def reduce(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`fn(logits)` (a reduction over the last dimension, without gradients) on the scored positions, chunk by
        chunk, 0 elsewhere; read from the root's results when the log-prob pass stored `name`."""
        if self.scale == 1.0:
            cached = self._cached(name)
            if cached is not None:
                return cached
        self._check_computable(name or "logsumexp")
        flat, flat_ids, live = self._live()
        rows = flat.index_select(0, live)
        chunk = self.root.chunk
        with torch.no_grad():
            parts = [fn(self._logits(rows[s : s + chunk]) * self.scale) for s in range(0, len(rows), chunk)]
        if not parts:
            return torch.zeros(self.ids.shape, dtype=accumulation_dtype(flat.dtype), device=flat.device)
        return self._spread(torch.cat(parts), live, flat_ids)

    def mean(self, dim: int = -1) -> torch.Tensor:
        if dim % self.dim() != self.dim() - 1:
            raise _unsupported(f"mean(dim={dim})")
        return self.reduce("mean", lambda logits: logits.mean(-1))

    def argmax(self, dim: int = -1) -> torch.Tensor:
        if dim % self.dim() != self.dim() - 1:
            raise _unsupported(f"argmax(dim={dim})")
        return self.reduce("argmax", lambda logits: logits.argmax(-1))

    def logsumexp(self) -> torch.Tensor:
        """`torch.logsumexp(self, -1)` (of `2.0 * logits` as well: the WPO weights' second term)."""
        if self.scale == 2.0:
            cached = self._cached("lse2")
            if cached is not None:
                return cached
        return self.reduce("lse" if self.scale == 1.0 else "", lambda logits: torch.logsumexp(logits, dim=-1))

    def entropy(self) -> torch.Tensor:
        return self.reduce("entropy", lambda logits: STATS["entropy"](logits, torch.logsumexp(logits, dim=-1)))

    def logprobs(self, targets: torch.Tensor) -> torch.Tensor:
        """Per-position log-probs of `targets` on the scored positions (with gradients where the hidden states have
        them: each chunk recomputed in the backward), 0 elsewhere. The first pass of a root stores its `stats`."""
        if self.scale != 1.0:
            raise _unsupported("log-probs of scaled logits")
        cached, known = self._cached("logprobs"), self._cached("targets")
        if cached is not None and known is not None and torch.equal(known, self._spread_targets(targets)):
            return cached
        self._check_computable("log-probs of other targets")
        flat, flat_ids, live = self._live()
        rows, goals = flat.index_select(0, live), targets.reshape(-1).index_select(0, live)
        grad = self.root.grad and torch.is_grad_enabled()
        trainable = any(p.requires_grad for p in self.root.parameters)
        grad = grad and (rows.requires_grad or trainable)
        stats = [s for s in self.root.stats if s not in self.root.cache]
        passes = len(range(0, len(rows), self.root.chunk))
        self.root.passes += passes
        if not passes:
            return torch.zeros(self.ids.shape, dtype=accumulation_dtype(flat.dtype), device=flat.device)
        collected: dict[int, dict[str, torch.Tensor]] = {}

        def head(h: torch.Tensor) -> torch.Tensor:
            with self.root.autocast():
                return self.root.head(h)

        def observe(index: int, logits: torch.Tensor, lse: torch.Tensor) -> None:
            if stats and index not in collected:  # the first run, not the backward's recompute
                with torch.no_grad():
                    wide = logits.detach().to(accumulation_dtype(logits.dtype))
                    collected[index] = {s: STATS[s](wide, lse) for s in stats}

        # a frozen head: d(hidden) in the forward, no recompute; else checkpointed chunks (the recompute reuses the
        # forward's log-sum-exp), or plain chunks without gradients
        with torch.set_grad_enabled(grad):
            values = _chunked(head, rows, goals, self.root.chunk, grad, not trainable, observe)
        if live.numel() == self.root.scored_count:  # every scored position of the output: kept for what follows
            for name in stats:
                self._store(name, torch.cat([collected[i][name] for i in range(passes)]), live, flat_ids)
            if "logprobs" not in self.root.cache:
                self._store("logprobs", values, live, flat_ids)
                self._store("targets", goals, live, flat_ids)
        return self._spread(values, live, flat_ids)

    def _check_computable(self, what: str) -> None:
        if self.root.precomputed:
            raise _unsupported(f"{what} (not computed inside the output head's call)")

    def _spread_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """`targets` with 0 outside the scored positions (as the stored ones)."""
        return targets * self.root.scored[self.ids].to(targets.dtype)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.logsumexp:
            logits, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
            if isinstance(logits, LazyLogits) and dim in (-1, logits.dim() - 1) and not kwargs.get("keepdim"):
                return logits.logsumexp()
        if func is F.cross_entropy:
            logits, target = args[0], kwargs.get("target", args[1] if len(args) > 1 else None)
            extra = {k: v for k, v in kwargs.items() if k != "target" and _CROSS_ENTROPY_DEFAULTS.get(k, v) != v}
            unknown = set(kwargs) - set(_CROSS_ENTROPY_DEFAULTS) - {"target"}
            plain = isinstance(target, torch.Tensor) and not extra and not unknown and len(args) <= 2
            if plain and isinstance(target, torch.Tensor) and bool((target == -100).any()):
                plain = False  # ignored targets: not what TRL passes (it selects the completion tokens)
            if isinstance(logits, LazyLogits) and isinstance(target, torch.Tensor) and logits.dim() == 2 and plain:
                if not bool(logits.root.scored[logits.ids].all()):
                    raise _unsupported("cross_entropy over positions outside the completion")
                return -logits.logprobs(target).mean()
        raise _unsupported(getattr(func, "__name__", str(func)))


def _arguments(original: Callable, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The arguments of a call of TRL's helper `original`, by name, defaults included (its signature varies: 1.14 adds
    `temperature` and `row_mask`)."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _plain(arguments: dict[str, Any], helper: str) -> torch.Tensor | None:
    """The `row_mask` of a helper call (None without one); other non-default options are refused."""
    if arguments.get("temperature", 1.0) != 1.0:
        raise _unsupported(f"{helper} with a temperature")
    return arguments.get("row_mask")


def _zero_outside(values: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor:
    """TRL 1.14's `row_mask`: 0 where it is 0 (the scored positions are those already; kept for any other mask)."""
    return values if row_mask is None else values.masked_fill(row_mask == 0, 0.0)


def selective_logprobs(original: Callable) -> Callable:
    """A `selective_log_softmax(logits, index[, temperature, row_mask])` that scores `LazyLogits` chunk by chunk (only
    their scored positions, the others 0, as TRL masks them next) and passes any other call to `original`."""

    @functools.wraps(original)
    def selective_log_softmax(logits: Any, index: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(logits, LazyLogits):
            return original(logits, index, *args, **kwargs)
        row_mask = _plain(_arguments(original, logits, index, *args, **kwargs), "selective_log_softmax")
        if index.dim() != logits.dim() - 1:
            raise _unsupported("selective_log_softmax with several indices per position")
        return _zero_outside(logits.logprobs(index), row_mask)

    return selective_log_softmax


def entropy(original: Callable) -> Callable:
    """An `entropy_from_logits(logits, chunk_size=...)` that reduces `LazyLogits` chunk by chunk (on the scored
    positions, 0 elsewhere) and passes any other call to `original`."""

    @functools.wraps(original)
    def entropy_from_logits(logits: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(logits, LazyLogits):
            return original(logits, *args, **kwargs)
        if logits.scale != 1.0:
            raise _unsupported("entropy of scaled logits")
        return logits.entropy()

    return entropy_from_logits


def logprobs_and_entropy(original: Callable) -> Callable:
    """A `selective_log_softmax_and_entropy(logits, index, entropy_requires_grad, temperature, row_mask)` (TRL 1.14)
    that answers `LazyLogits` from the same chunk pass as the two helpers above (the entropy without gradients, as TRL
    asks) and passes any other call to `original`."""

    @functools.wraps(original)
    def selective_log_softmax_and_entropy(logits: Any, index: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(logits, LazyLogits):
            return original(logits, index, *args, **kwargs)
        arguments = _arguments(original, logits, index, *args, **kwargs)
        row_mask = _plain(arguments, "selective_log_softmax_and_entropy")
        if arguments.get("entropy_requires_grad", True):
            raise _unsupported("selective_log_softmax_and_entropy with an entropy that carries gradients")
        if index.dim() != logits.dim() - 1 or logits.scale != 1.0:
            raise _unsupported("selective_log_softmax_and_entropy of scaled logits or several indices per position")
        logprobs = logits.logprobs(index)
        return _zero_outside(logprobs, row_mask), _zero_outside(logits.entropy(), row_mask)

    return selective_log_softmax_and_entropy
