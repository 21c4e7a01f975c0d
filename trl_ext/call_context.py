"""The call context: what is in effect for the running call, in one object for the core and every plugin
(docs/writing-plugins.md, "The plugin API"). A layer that runs a model call its own way (`verify` or a self-check
running the stock reference, the kernel probe, a packed or shared-prompt forward) enters it for a block, `with
call_entered(stock=True):`, and code called inside reads `current_call()`.

`CallContext` is immutable; `call_entered(**changes)` puts a changed copy in effect for the block and restores the one
before on exit, also on an error. One `contextvars.ContextVar` holds it, so it follows the call into threads and tasks
started inside as a context variable does. A plugin's own per-call state is a typed `CallSlot`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CallContext", "CallSlot", "call_entered", "current_call"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class CallContext:
    """What is in effect for the running call (all fields off by default).

    Attributes:
        stock (`bool`): a stock reference runs (`verify`, a self-check, `toolkit.probe.stock_forward`): the plugins'
            forwards and attention pass every call through, as stock transformers runs it.
        probing (`bool`): the kernel probe (`toolkit.packing.probe`) calls the attention, not the model.
        packed (`bool`): a packed forward runs (`toolkit.packing.packed_call`): the varlen mask function builds no mask
            (the attention splits the row itself).
        packed_bounds (`list[int]` or `None`): the packed row's sequence bounds (cumulative lengths), read once per
            forward, for models that do not pass `cu_seq_lens_q` to their attention.
        packed_cu (`torch.Tensor` or `None`): the device tensor those bounds were read from: a layer that receives this
            very tensor as `cu_seq_lens_q` takes the host bounds instead of reading the device again.
        packed_positions (`toolkit.packing.PackedPositions` or `None`): the packed call's positions, for modules that
            index per token.
        slots (`Mapping[CallSlot, object]`): the plugins' own entries (`CallSlot`).
    """

    stock: bool = False
    probing: bool = False
    packed: bool = False
    packed_bounds: list[int] | None = None
    packed_cu: torch.Tensor | None = None
    packed_positions: Any = None
    slots: Mapping[CallSlot[Any], object] = dataclasses.field(default_factory=lambda: MappingProxyType({}))


# The default is immutable (a frozen dataclass, its `slots` a read-only mapping), so sharing it is safe.
_CURRENT: contextvars.ContextVar[CallContext] = contextvars.ContextVar(
    "trl_ext_call_context",
    default=CallContext(),  # noqa: B039
)


def current_call() -> CallContext:
    """The call context in effect."""
    return _CURRENT.get()


@contextlib.contextmanager
def call_entered(**changes: Any) -> Iterator[CallContext]:
    """Put `current_call()` with `changes` in effect for the block; the context before is back on exit."""
    token = _CURRENT.set(dataclasses.replace(_CURRENT.get(), **changes))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


class CallSlot(Generic[T]):
    """A plugin's own entry in the call context, holding values of type `T` (None where not entered)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"CallSlot({self.name!r})"

    def get(self, call: CallContext | None = None) -> T | None:
        """The value entered by the innermost enclosing `entered` (in `call`, default `current_call()`), or None."""
        return cast("T | None", (call or _CURRENT.get()).slots.get(self))

    @contextlib.contextmanager
    def entered(self, value: T | None) -> Iterator[T | None]:
        """Hold `value` in this slot for the block."""
        with call_entered(slots=MappingProxyType({**_CURRENT.get().slots, self: value})):
            yield value
