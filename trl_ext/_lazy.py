"""Names a module hands out on first use: the one lazy module `__getattr__` (PEP 562) of trl-ext.

A plugin's declaration (`trl_ext/plugins/<name>/__init__.py`) must stay cheap to import, so the names of its hooks
module (which imports torch) resolve on first use; `trl_ext.api` resolves its torch-backed names the same way. Both
assign what this module builds: `__getattr__ = lazy_getattr(__name__, ...)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(owner: str, names: Mapping[str, str] | None = None, rest: str | None = None) -> Callable[[str], Any]:
    """A module-level `__getattr__` for the module `owner` (its `__name__`).

    Args:
        owner (`str`): the module the function is installed in.
        names (`Mapping[str, str]`, *optional*): the name -> the (absolute) name of the module that holds it; that
            module is imported on first use of one of its names.
        rest (`str`, *optional*): a submodule of `owner` (e.g. `"hooks"`) that answers every other name; the name of
            the submodule itself returns it.

    A name that neither covers is an `AttributeError`, as without a `__getattr__`; so are dunder names, so that
    `copy`, `pickle` and `inspect` probing for `__path__`, `__wrapped__`... import nothing.
    """
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
