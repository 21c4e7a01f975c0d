"""The one undo stack through which trl-ext changes anything in TRL (or in a user's model).

Modelled on pytest's `MonkeyPatch`: a patch records the target's *own* `__dict__` entry (or its absence), so undoing
restores exactly the object that was there, and a class that inherited the attribute gets the inheritance back.
Undo runs in reverse order, and undoing twice is a no-op.
"""

from __future__ import annotations

import contextlib
import importlib
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


class Patcher:
    """Records `setattr` changes and undoes them in reverse order.

    Args:
        name (`str`, *optional*, defaults to `"trl-ext"`):
            Shown in error messages.
    """

    def __init__(self, name: str = "trl-ext") -> None:
        self.name = name
        self._undo: list[tuple[Any, str, Any]] = []
        self._set: list[Any] = []  # the value each entry of `_undo` set

    def __len__(self) -> int:
        return len(self._undo)

    def setattr(self, target: Any, attr: str, value: Any, *, raising: bool = True) -> Any:
        """Set `target.attr = value` and remember how to undo it. Returns the value that was visible before.

        With `raising=True` (the default) a missing attribute is an error: it means TRL renamed what trl-ext patches.
        """
        if raising and not hasattr(target, attr):
            where = getattr(target, "__qualname__", None) or getattr(target, "__name__", type(target).__name__)
            raise UsageError(_renamed_message(f"{getattr(target, '__module__', '?')}.{where}.{attr}"))
        previous = getattr(target, attr, None)
        own = target.__dict__.get(attr, _ABSENT) if hasattr(target, "__dict__") else _ABSENT
        if isinstance(target, type):
            type.__setattr__(target, attr, value)
        else:
            setattr(target, attr, value)
        self._undo.append((target, attr, own))
        self._set.append(value)
        return previous

    def wrap(self, target: Any, attr: str, make_wrapper: Callable[[Any], Any]) -> Any:
        """Replace `target.attr` with `make_wrapper(original)`; the wrapper should use `functools.wraps`."""
        original = getattr(target, attr) if hasattr(target, attr) else None
        if original is None:
            self.setattr(target, attr, None)  # raises the clear "renamed" error
        # A class's own entry may be a staticmethod/classmethod object; wrap what attribute access returns.
        return self.setattr(target, attr, make_wrapper(original))

    def undo(self) -> None:
        """Undo every recorded change, newest first. Calling it again does nothing."""
        while self._undo:
            target, attr, own = self._undo.pop()
            self._set.pop()
            if own is _ABSENT:
                try:
                    delattr(target, attr)
                except AttributeError:
                    pass
            elif isinstance(target, type):
                type.__setattr__(target, attr, own)
            else:
                setattr(target, attr, own)

    @contextlib.contextmanager
    def suspended(self, select: Callable[[Any, str], bool]) -> Iterator[None]:
        """For the duration of the block, put back the original of every attribute this stack changed on a target
        that `select(target, attr)` accepts, then set again what was there. An attribute that something else has
        replaced since this stack last set it (accelerate's autocast wrapper around a model's `forward`) is left
        as it is: what replaced it may call the value set here."""
        first: dict[tuple[int, str], tuple[Any, str, Any]] = {}
        last: dict[tuple[int, str], Any] = {}
        for (target, attr, own), value in zip(self._undo, self._set, strict=True):
            first.setdefault((id(target), attr), (target, attr, own))
            last[(id(target), attr)] = value
        restore: list[tuple[Any, str, Any]] = []
        try:
            for key, (target, attr, own) in first.items():
                current = target.__dict__.get(attr, _ABSENT) if hasattr(target, "__dict__") else _ABSENT
                if not select(target, attr) or current is not last[key]:
                    continue
                restore.append((target, attr, current))
                _put(target, attr, own)
            yield
        finally:
            for target, attr, current in reversed(restore):
                _put(target, attr, current)


def _put(target: Any, attr: str, own: Any) -> None:
    """Make `own` the target's own `attr` (`_ABSENT`: remove the own entry)."""
    if own is _ABSENT:
        with contextlib.suppress(AttributeError):
            delattr(target, attr)
    elif isinstance(target, type):
        type.__setattr__(target, attr, own)
    else:
        setattr(target, attr, own)
