"""The one undo stack through which trl-ext changes anything in TRL (or in a user's model).

Modelled on pytest's `MonkeyPatch`: a patch records the target's *own* `__dict__` entry (or its absence), so undoing
restores exactly the object that was there, and a class that inherited the attribute gets the inheritance back.
Undo runs in reverse order, and undoing twice is a no-op.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
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
            if own is _ABSENT:
                try:
                    delattr(target, attr)
                except AttributeError:
                    pass
            elif isinstance(target, type):
                type.__setattr__(target, attr, own)
            else:
                setattr(target, attr, own)
