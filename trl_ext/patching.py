"""The one undo stack through which trl-ext changes anything in TRL (or in a user's model).

Like pytest's `MonkeyPatch`, a patch records the target's *own* `__dict__` entry (or its absence), so undoing restores
exactly what was there (a class that inherited the attribute inherits it again); undo runs newest first, twice is a
no-op. Several patchers may change one attribute of a module or class (overlapping `train()` calls in threads, a run
wrapper over a process-wide one released meanwhile): each change is a process-wide layer (`_LAYERS`), and undoing one
removes it wherever it is, the wrappers above it applied again on what is below. An object's own attributes (a
trainer's methods, a model's `forward`) have one owner and are not registered, so patches keep no trainer alive.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Callable, Iterator
from typing import Any

from .errors import UsageError

__all__ = ["Patcher", "resolve"]

_ABSENT = object()


def resolve(dotted: str) -> Any:
    """Import `"pkg.module.Attr"` (or `"pkg.module"`) and return the object; raise `UsageError` if TRL renamed it."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name or module_name.startswith(f"{exc.name}."):
                continue  # this prefix is not a module: try a shorter one
            raise  # a dependency missing inside an existing module is a real error
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                raise UsageError(_renamed_message(dotted))
            obj = getattr(obj, attr)
        return obj
    raise UsageError(_renamed_message(dotted))


def _renamed_message(dotted: str) -> str:
    from ._compat import SUPPORTED_TRL_SPEC, installed_version

    return (
        f"trl-ext cannot find `{dotted}` in the installed trl=={installed_version('trl')}; TRL has renamed or removed "
        f"it. trl-ext supports trl{SUPPORTED_TRL_SPEC}: install a supported TRL or upgrade trl-ext."
    )


class _Layer:
    """One change of an attribute: a value set, or a wrapper of what is below (`make_wrapper`)."""

    __slots__ = ("make_wrapper", "value")

    def __init__(self, value: Any, make_wrapper: Callable[[Any], Any] | None) -> None:
        self.value, self.make_wrapper = value, make_wrapper


class _Stack:
    """The layers of one attribute: the target (held, so that its id stays its own), the original own entry."""

    def __init__(self, target: Any, own: Any) -> None:
        self.target, self.own, self.layers = target, own, list[_Layer]()


#: (id(target), attr) -> its layers, while any patcher has a change of it in place
_LAYERS: dict[tuple[int, str], _Stack] = {}


def _assign(target: Any, attr: str, value: Any) -> None:
    if isinstance(target, type):
        type.__setattr__(target, attr, value)
    else:
        setattr(target, attr, value)


def _restore_own(target: Any, attr: str, own: Any) -> None:
    if own is _ABSENT:
        try:
            delattr(target, attr)
        except AttributeError:
            pass
    else:
        _assign(target, attr, own)


def _remove(target: Any, attr: str, layer: _Layer | None, own: Any) -> None:
    """Undo `layer` of `target.attr` (`own`: the entry before it, used when no layer registry knows it)."""
    stack = _LAYERS.get((id(target), attr))
    if stack is None or layer not in stack.layers:
        _restore_own(target, attr, own)
        return
    index = stack.layers.index(layer)
    del stack.layers[index]
    if not stack.layers:
        del _LAYERS[(id(target), attr)]
        _restore_own(target, attr, stack.own)
        return
    if index == len(stack.layers):  # the newest layer: what was below it comes back as it was
        _assign(target, attr, stack.layers[-1].value)
        return
    # a layer below others: re-apply the wrappers above it on what is now below them (a value set stops there)
    if index:
        below = stack.layers[index - 1].value
    else:
        _restore_own(target, attr, stack.own)  # what attribute access gave the first wrapper
        below = getattr(target, attr, None)
    for upper in stack.layers[index:]:
        if upper.make_wrapper is None:
            break
        upper.value = upper.make_wrapper(below)
        below = upper.value
    _assign(target, attr, stack.layers[-1].value)


class Patcher:
    """Records `setattr` changes and undoes them newest first (`undo()`, or at the end of a `with` block); `name` is
    shown in error messages."""

    def __init__(self, name: str = "trl-ext") -> None:
        self.name = name
        self._undo: list[tuple[Any, str, Any, Any, Any]] = []  # (target, attr, own entry, layer, value set)

    def __len__(self) -> int:
        return len(self._undo)

    def setattr(self, target: Any, attr: str, value: Any, *, raising: bool = True) -> Any:
        """Set `target.attr = value`, undoably; return the value visible before. With `raising`, a missing attribute
        is an error: TRL renamed what trl-ext patches."""
        if raising and not hasattr(target, attr):
            where = getattr(target, "__qualname__", None) or getattr(target, "__name__", type(target).__name__)
            raise UsageError(_renamed_message(f"{getattr(target, '__module__', '?')}.{where}.{attr}"))
        return self._apply(target, attr, value, None)

    def _apply(self, target: Any, attr: str, value: Any, make_wrapper: Callable[[Any], Any] | None) -> Any:
        previous = getattr(target, attr, None)
        own = target.__dict__.get(attr, _ABSENT) if hasattr(target, "__dict__") else _ABSENT
        if not isinstance(target, (type, types.ModuleType)):  # an object's own attribute: one owner, a plain stack
            _assign(target, attr, value)
            self._undo.append((target, attr, own, None, value))
            return previous
        key = (id(target), attr)
        stack = _LAYERS.get(key)
        if stack is not None and stack.layers and _own(target, attr) is not stack.layers[-1].value:
            stack = None  # changed by something else since: layered from here on
        if stack is None:
            stack = _LAYERS[key] = _Stack(target, own)
        layer = _Layer(value, make_wrapper)
        stack.layers.append(layer)
        _assign(target, attr, value)
        self._undo.append((target, attr, own, layer, value))
        return previous

    def wrap(self, target: Any, attr: str, make_wrapper: Callable[[Any], Any]) -> Any:
        """Replace `target.attr` with `make_wrapper(original)`; the wrapper should use `functools.wraps`."""
        original = getattr(target, attr) if hasattr(target, attr) else None
        if original is None:
            self.setattr(target, attr, None)  # raises the clear "renamed" error
        # A class's own entry may be a staticmethod/classmethod object; wrap what attribute access returns.
        return self._apply(target, attr, make_wrapper(original), make_wrapper)

    def defer(self, fn: Callable[[], None]) -> None:
        """Run `fn()` when this point of the stack is undone: after every change recorded later is undone, before the
        earlier ones (a plugin hands back what it held for TRL while its wrappers were in place)."""
        self._undo.append((None, "", _ABSENT, fn, None))

    def undo(self) -> None:
        """Undo every recorded change, newest first (each removes its own layer). Calling it again does nothing."""
        while self._undo:
            target, attr, own, layer, _ = self._undo.pop()
            if target is None:
                layer()
            else:
                _remove(target, attr, layer, own)

    def __enter__(self) -> Patcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    @contextlib.contextmanager
    def undone_on_error(self) -> Iterator[Patcher]:
        """Undo every recorded change if the block raises (then re-raise): half-applied changes never stay."""
        try:
            yield self
        except BaseException:
            self.undo()
            raise

    @contextlib.contextmanager
    def suspended(self, select: Callable[[Any, str], bool]) -> Iterator[None]:
        """For the duration of the block, put back the original of every attribute this stack changed on a target
        that `select(target, attr)` accepts, then set again what was there. An attribute that something else has
        replaced since this stack last set it (accelerate's autocast wrapper around a model's `forward`) is left
        as it is: what replaced it may call the value set here."""
        first: dict[tuple[int, str], tuple[Any, str, Any]] = {}
        last: dict[tuple[int, str], Any] = {}
        for target, attr, own, _, value in self._undo:
            if target is None:  # a deferred call
                continue
            first.setdefault((id(target), attr), (target, attr, own))
            last[(id(target), attr)] = value
        restore: list[tuple[Any, str, Any]] = []
        try:
            for key, (target, attr, own) in first.items():
                current = _own(target, attr)
                if not select(target, attr) or current is not last[key]:
                    continue
                restore.append((target, attr, current))
                _restore_own(target, attr, own)
            yield
        finally:
            for target, attr, current in reversed(restore):
                _restore_own(target, attr, current)


def _own(target: Any, attr: str) -> Any:
    return target.__dict__.get(attr, _ABSENT) if hasattr(target, "__dict__") else getattr(target, attr, _ABSENT)
