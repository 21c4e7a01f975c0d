"""The one lazy module `__getattr__` (PEP 562) of trl-ext: a plugin's declaration stays cheap to import while the
names of its hooks module (which imports torch) resolve on first use; `trl_ext.api`'s torch-backed names too."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(owner: str, names: Mapping[str, str] | None = None, rest: str | None = None) -> Callable[[str], Any]:
    """`__getattr__ = lazy_getattr(__name__, names, rest)`: each of `names` from its (absolute) module, imported on
    first use; any other name from the submodule `rest` of `owner` (`"hooks"`, whose own name returns it). Other names
    and dunders (`copy`, `pickle`, `inspect` probing `__path__`...) are an `AttributeError`, importing nothing."""
    names = dict(names or {})

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {owner!r} has no attribute {name!r}")
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        if rest is not None:
            module = importlib.import_module(f"{owner}.{rest}")
            return module if name == rest else getattr(module, name)
        raise AttributeError(f"module {owner!r} has no attribute {name!r}")

    return __getattr__
