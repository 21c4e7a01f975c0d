"""Plugin discovery and registration: a fresh pluggy manager per `install()`, built-ins and entry points alike."""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .config import TrlExtConfig
from .errors import UsageError
from .plugins import BUILTIN_PLUGINS

__all__ = ["ENTRY_POINT_GROUP", "PluginInfo", "TrlExtPluginManager", "call_exclusive", "make_plugin_manager"]

ENTRY_POINT_GROUP = "trl_ext"
_HOOK_PREFIX = "trl_ext_"


@dataclass(frozen=True)
class PluginInfo:
    """What `trl-ext plugins` shows about one plugin."""

    name: str
    builtin: bool
    flags: tuple[str, ...] = ()
    trainers: tuple[str, ...] | None = None  # None: every trainer trl-ext attaches to
    source: str = ""
    summary: str = ""
    hooks: tuple[str, ...] = field(default=())


class TrlExtPluginManager(pluggy.PluginManager):
    """A pluggy manager for the `trl_ext` project.

    Like pytest, every function whose name starts with `trl_ext_` is taken as a hook implementation even without the
    `@trl_ext.hookimpl` marker, so that `check_pending()` catches a misspelled hook name at start-up instead of the
    function being silently ignored.
    """

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(_HOOK_PREFIX):
            method = getattr(plugin, name, None)
            if callable(method) and not isinstance(method, type):
                opts = {}
        return opts


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    seen: dict[str, importlib.metadata.EntryPoint] = {}
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP and ep.name not in seen:
                seen[ep.name] = ep
    return list(seen.values())


def known_plugin_names() -> list[str]:
    return list(BUILTIN_PLUGINS) + [ep.name for ep in _entry_points() if ep.name not in BUILTIN_PLUGINS]


def make_plugin_manager(block: Iterable[str] = ()) -> TrlExtPluginManager:
    """Register the built-in plugins, then the `trl_ext` entry points, except blocked names; validate every hook."""
    block = list(block)
    unknown = [name for name in block if name not in known_plugin_names()]
    if unknown:
        raise UsageError(
            f"`block` names unknown plugin(s) {unknown}; known plugins: {known_plugin_names()}. "
            "Run `trl-ext plugins` to list them."
        )
    pm = TrlExtPluginManager()
    for name in block:
        pm.set_blocked(name)
    for name, module in BUILTIN_PLUGINS.items():
        if not pm.is_blocked(name):
            pm.register(importlib.import_module(module), name=name)
    for ep in _entry_points():
        if pm.is_blocked(ep.name) or pm.get_plugin(ep.name) is not None:
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - the user must see which plugin failed
            raise UsageError(
                f"Could not load trl-ext plugin `{ep.name}` ({ep.value}): {type(exc).__name__}: {exc}. Fix or "
                f"uninstall the package that provides it, or block it with `block: [{ep.name}]`."
            ) from exc
        pm.register(plugin, name=ep.name)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise UsageError(
            f"trl-ext plugin `{pm.get_name(exc.plugin)}` implements a hook that does not exist: {exc}. Hook names are "
            "listed in `trl_ext.hookspecs`."
        ) from exc
    return pm


def plugin_info(pm: pluggy.PluginManager, name: str) -> PluginInfo:
    plugin = pm.get_plugin(name)
    doc = (getattr(plugin, "__doc__", None) or "").strip().splitlines()
    hooks = tuple(sorted(h.name for h in pm.get_hookcallers(plugin) or ()))
    trainers = getattr(plugin, "TRL_EXT_TRAINERS", None)
    return PluginInfo(
        name=name,
        builtin=name in BUILTIN_PLUGINS,
        flags=tuple(getattr(plugin, "TRL_EXT_FLAGS", ())),
        trainers=tuple(trainers) if trainers is not None else None,
        source=getattr(plugin, "__name__", type(plugin).__name__),
        summary=doc[0] if doc else "",
        hooks=hooks,
    )


def flag_owners(pm: pluggy.PluginManager) -> dict[str, str]:
    owners: dict[str, str] = {}
    for name, plugin in pm.list_name_plugin():
        for flag in getattr(plugin, "TRL_EXT_FLAGS", ()):
            if flag in owners:
                raise UsageError(f"Plugins `{owners[flag]}` and `{name}` both claim the flag `{flag}`; block one.")
            owners[flag] = name
    return owners


#: Which plugin owns each built-in flag, for error messages when that plugin is not registered.
BUILTIN_FLAG_OWNERS = {
    "padding_free": "padding_free",
    "precompute_ref_batch_size": "precompute_ref_batch_size",
    "ds3_gather_for_generation": "generation",
    "sync_metrics": "sync_metrics",
}


def check_config_against_plugins(pm: pluggy.PluginManager, config: TrlExtConfig) -> None:
    """Every flag that is set must have a registered owner, and every name in `plugins` must be registered."""
    owners = flag_owners(pm)
    defaults = TrlExtConfig()
    for flag, owner in BUILTIN_FLAG_OWNERS.items():
        if getattr(config, flag) == getattr(defaults, flag) or flag in owners:
            continue
        why = "is blocked" if pm.is_blocked(owner) else "is not available in this trl-ext release"
        raise UsageError(
            f"`{flag}` is set, but the plugin `{owner}` that implements it {why}. Unset `{flag}`"
            + (f" or remove `{owner}` from `block`." if pm.is_blocked(owner) else ".")
        )
    for name in config.plugins:
        if pm.get_plugin(name) is None:
            why = "is blocked" if pm.is_blocked(name) else "is not installed"
            raise UsageError(
                f"`plugins` names `{name}`, which {why}. Installed plugins: {[n for n, _ in pm.list_name_plugin()]}."
            )


def call_exclusive(caller: pluggy.HookCaller, **kwargs: Any) -> Any:
    """Call every implementation of a `firstresult` hook; return the single non-None result.

    Two plugins answering the same call would otherwise be resolved silently by registration order, so that is a
    `UsageError` naming both plugins.
    """
    answers: list[tuple[str, Any]] = []
    for impl in reversed(caller.get_hookimpls()):
        result = impl.function(*[kwargs[arg] for arg in impl.argnames])
        if result is not None:
            answers.append((impl.plugin_name, result))
    if len(answers) > 1:
        names = ", ".join(f"`{name}`" for name, _ in answers)
        raise UsageError(
            f"Enabled plugins {names} all provide `{caller.name}` for the same trainer; only one can. Disable all but "
            "one of them (unset its flag, or add it to `block`)."
        )
    return answers[0][1] if answers else None
