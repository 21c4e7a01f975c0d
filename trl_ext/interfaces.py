"""What the hooks receive, as the hook specs name it: a protocol for each object a hook is given.

`trl_ext.hookspecs` annotates its hooks with these protocols, and the core's classes satisfy them (`TrainerContext`,
`Call`, `TrlExtConfig`, `Installation` of `trl_ext.api`; mypy checks each against its protocol where the class is
defined). A plugin annotates its hooks with those classes, from `trl_ext.api`; the protocols list what a plugin may
rely on, nothing more.

This module is a leaf: it imports nothing of trl-ext, so that the hook specs, which the plugin manager imports, do not
depend on the modules that build trainers (which use the manager).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import pluggy

__all__ = ["Call", "Installation", "Patcher", "TrainerContext", "TrlExtConfig"]


class Patcher(Protocol):
    """An undo stack (`trl_ext.api.Patcher`): changes recorded, and undone newest first."""

    def setattr(self, target: Any, attr: str, value: Any, *, raising: bool = True) -> Any: ...

    def wrap(self, target: Any, attr: str, make_wrapper: Callable[[Any], Any]) -> Any: ...

    def defer(self, fn: Callable[[], None]) -> None: ...

    def undo(self) -> None: ...


class TrlExtConfig(Protocol):
    """The merged configuration (`trl_ext.api.TrlExtConfig`): flags read as attributes, options by plugin."""

    flags: dict[str, Any]
    plugins: dict[str, dict[str, Any]]
    block: list[str]
    verify: int

    def __getattr__(self, name: str) -> Any: ...

    def options(self, plugin: str) -> Any: ...

    def flag_is_set(self, plugin: str) -> bool: ...

    def to_dict(self) -> dict[str, Any]: ...

    def changed(self) -> dict[str, Any]: ...


class Call(Protocol):
    """One call of a wrapped trainer method, as a `trl_ext_call` implementation sees it (`trl_ext.api.Call`)."""

    name: str
    args: tuple
    kwargs: dict
    original: Callable
    last: bool

    def proceed(self, *args: Any, **kwargs: Any) -> Any: ...


class TrainerContext(Protocol):
    """trl-ext's view of one trainer (`trl_ext.api.TrainerContext`): its plugins, their state, its undo stack."""

    trainer_class: str
    enabled: tuple[str, ...]
    trl_args: Any
    state: dict[str, Any]
    attached: bool
    math_plugins: list[str]
    stock_methods: dict[str, Callable[..., Any]]
    calls: dict[str, tuple[str, ...]]

    @property
    def installation(self) -> Installation: ...

    @property
    def patcher(self) -> Patcher: ...

    @property
    def hook(self) -> Any: ...

    @property
    def trainer(self) -> Any: ...

    @property
    def config(self) -> TrlExtConfig: ...

    def options(self, plugin: str) -> Any: ...

    def is_enabled(self, plugin: str) -> bool: ...

    def plugins_serving(self, role: str) -> tuple[str, ...]: ...

    def call_exclusive(self, hook_name: str, **kwargs: Any) -> Any: ...

    def call_math(self, hook_name: str, **kwargs: Any) -> Any: ...

    def patch(self, scope: str, apply: Callable[[Patcher], None], *, key: str | None = None) -> None: ...

    def running(self) -> AbstractContextManager[None]: ...

    def models(self) -> dict[str, Any]: ...


class Installation(Protocol):
    """An active trl-ext installation (`trl_ext.api.Installation`)."""

    trl_version: str
    keep_records: bool

    @property
    def config(self) -> TrlExtConfig: ...

    @property
    def plugin_manager(self) -> pluggy.PluginManager: ...

    @property
    def installed(self) -> bool: ...

    @property
    def records(self) -> list[dict[str, Any]]: ...

    def enabled_plugins(self, trainer: str | type | Any, trl_args: Any = None) -> list[str]: ...

    def contexts(self) -> Sequence[TrainerContext]: ...

    def detach(self, trainer: Any = None) -> None: ...

    def uninstall(self, *, detach: bool = False) -> None: ...
