"""Plugin discovery and registration (the public modules of `trl_ext.plugins` and the `trl_ext` entry points, by
the same code; nothing here names a plugin): the catalog of their declarations (the flag table, what `trl-ext plugins`
shows), and the exclusive roles and hooks resolved among them."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import os
import pkgutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import pluggy

from . import hookspecs
from ._logging import get_logger
from .errors import UsageError, did_you_mean
from .spec import Flag, PluginSpec

__all__ = [
    "CORE_KEYS",
    "ENTRY_POINT_GROUP",
    "SPEC_ATTR",
    "Catalog",
    "TrlExtPluginManager",
    "builtin_plugin_modules",
    "block_advice",
    "call_exclusive",
    "load_catalog",
    "make_plugin_manager",
    "resolve_roles",
]

ENTRY_POINT_GROUP = "trl_ext"
#: The module attribute through which a plugin declares itself.
SPEC_ATTR = "TRL_EXT_PLUGIN"
_HOOK_PREFIX = "trl_ext_"
_LEGACY_ATTRS = ("TRL_EXT_FLAGS", "TRL_EXT_TRAINERS")

logger = get_logger(__name__)


#: Top-level configuration keys that are not plugin flags (`verify`: `trl_ext.config.VERIFY_PARSER`).
CORE_KEYS = ("plugins", "block", "verify")


def block_advice(name: str, block: Iterable[str] = ()) -> str:
    """The exact settings that block `name` (with the names already blocked)."""
    names = sorted({*block, name})
    return f"`TRL_EXT_BLOCK={','.join(names)}` (or `block: [{', '.join(names)}]` in YAML, `block=[...]` in Python)"


@dataclass
class Catalog:
    """The declarations of the available plugins (`load_catalog` builds it; nothing here imports a plugin): `specs`
    of the registered (not blocked) ones in registration order and their declaring `plugins`, which are `builtin`, the
    `blocked` names (`blocked_specs`: those of blocked built-ins, for error messages), the `broken` third-party
    plugins with the reason and what to do, and `broken_flags` (`{flag: plugin}` for those whose declaration could be
    read). `flags` is the flag table: `{flag: (Flag, owner)}`."""

    blocked: set[str] = field(default_factory=set)
    specs: dict[str, PluginSpec] = field(default_factory=dict)
    plugins: dict[str, Any] = field(default_factory=dict)
    builtin: set[str] = field(default_factory=set)
    blocked_specs: dict[str, PluginSpec] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)
    broken_flags: dict[str, str] = field(default_factory=dict)
    flags: dict[str, tuple[Flag, str]] = field(default_factory=dict)

    def add(self, name: str, plugin: Any, spec: PluginSpec, *, builtin: bool) -> str | None:
        """Register a plugin's declaration, or return why not: it declares a core key or another plugin's flag."""
        for flag in spec.flags:
            if flag.name in CORE_KEYS:
                return f"it declares the flag `{flag.name}`, a reserved trl-ext key"
            if flag.name in self.flags:
                owner = self.flags[flag.name][1]
                return f"it declares the flag `{flag.name}`, which the plugin `{owner}` declares too"
        self.specs[name], self.plugins[name] = spec, plugin
        self.flags.update({flag.name: (flag, name) for flag in spec.flags})
        if builtin:
            self.builtin.add(name)
        return None

    def defaults(self) -> dict[str, Any]:
        return {name: flag.default for name, (flag, _) in self.flags.items()}

    def broken_message(self, name: str) -> str:
        """Why the broken plugin `name` cannot be used, and the two ways out (fix it, or block it)."""
        return (
            f"The trl-ext plugin `{name}` cannot be used: {self.broken[name]}. Or, if you do not need it, block it: "
            f"{block_advice(name, self.blocked)}."
        )


class TrlExtPluginManager(pluggy.PluginManager):
    """A pluggy manager for the `trl_ext` project, with the `catalog` of the registered plugins' declarations.

    Like pytest, every function named `trl_ext_*` is a hook implementation even without `@trl_ext.hookimpl`, so that
    `check_pending()` catches a misspelled hook name instead of the function being silently ignored.
    """

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.catalog = Catalog()

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(_HOOK_PREFIX):
            method = getattr(plugin, name, None)
            if callable(method) and not isinstance(method, type):
                opts = cast("pluggy.HookimplOpts", {})
        return opts


@dataclass(frozen=True)
class _Source:
    name: str
    origin: str  # module path, or the entry point's target
    builtin: bool
    load: Callable[[], Any]
    dist: str | None = None  # the distribution that provides a third-party plugin


def builtin_plugin_modules() -> dict[str, str]:
    """`{name: module}` of the built-in plugins: every public module or subpackage of `trl_ext.plugins`."""
    from . import plugins

    return {
        info.name: f"{plugins.__name__}.{info.name}"
        for info in sorted(pkgutil.iter_modules(plugins.__path__), key=lambda i: i.name)
        if not info.name.startswith("_")
    }


#: The last answer of `_sources`, and the path it was read from.
_READ: dict[str, Any] = {}


def _sources() -> tuple[list[_Source], dict[str, str]]:
    """Every plugin source, and `{name: why it cannot be used}` for names two sources claim. A distribution found
    twice on the path (editable and regular) counts once: the first, the one imported. Read again only when the path
    changed: `sys.path`, the modification time of one of its folders (installing or removing a package changes its
    folder; `importlib.metadata` keeps its folder listings by the same rule), the finders of `sys.meta_path` (which
    find distributions too) or `importlib.metadata.distributions`."""
    path: list[Any] = [importlib.metadata.distributions, *sys.meta_path]
    for entry in map(os.path.abspath, sys.path):
        with contextlib.suppress(OSError):
            path.append((entry, os.stat(entry).st_mtime_ns))
    if _READ.get("path") == path:
        return _READ["sources"]
    builtins = builtin_plugin_modules()
    sources = [
        _Source(name, module, True, functools.partial(importlib.import_module, module))
        for name, module in builtins.items()
    ]
    seen_dists: set[str] = set()
    found: dict[str, list[tuple[importlib.metadata.EntryPoint, str]]] = {}
    for dist in importlib.metadata.distributions():
        eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        if not eps:
            continue
        dist_name = str((getattr(dist, "metadata", None) or {}).get("Name") or getattr(dist, "name", None) or "?")
        key = dist_name.lower().replace("_", "-").replace(".", "-")
        if key in seen_dists:
            continue
        seen_dists.add(key)
        for ep in eps:
            found.setdefault(ep.name, []).append((ep, dist_name))
    clashes: dict[str, str] = {}
    for name, providers in found.items():
        if len(providers) > 1:
            clashes[name] = (
                f"the packages {', '.join(f'`{d}`' for _, d in providers)} each provide a trl-ext plugin named "
                f"`{name}`, so which one runs would depend on the install order. Uninstall all but one of them "
                "(`pip uninstall ...`)"
            )
    for ep, provider in sorted((providers[0] for providers in found.values()), key=lambda pair: pair[0].name):
        if ep.name in builtins:
            if provider == "trl-ext":
                continue  # trl-ext's own metadata, should it ever list its built-ins
            clashes[ep.name] = (
                f"the package `{provider}` provides a trl-ext plugin named `{ep.name}`, the name of a built-in "
                "plugin. Rename its entry point, or uninstall it"
            )
            continue
        sources.append(_Source(ep.name, ep.value, False, ep.load, provider))
    _READ.update(path=path, sources=(sources, clashes))
    return sources, clashes


def _load(source: _Source) -> Any:
    try:
        return source.load()
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user must see which plugin failed
        raise UsageError(
            f"Could not load trl-ext plugin `{source.name}` ({source.origin}): {type(exc).__name__}: {exc}. Fix or "
            f"uninstall the package that provides it, or block it with `block: [{source.name}]`."
        ) from exc


#: Broken plugins already reported in this process (one warning each).
_WARNED: set[tuple[str, str]] = set()


def spec_of(name: str, plugin: Any) -> PluginSpec:
    """The plugin's declaration, checked against the name it is registered under."""
    spec = getattr(plugin, SPEC_ATTR, None)
    if spec is None:
        legacy = [attr for attr in _LEGACY_ATTRS if hasattr(plugin, attr)]
        if legacy:
            raise UsageError(
                f"trl-ext plugin `{name}` declares {', '.join(legacy)}, which trl-ext no longer reads. Declare the "
                f"plugin with `{SPEC_ATTR} = trl_ext.PluginSpec(name={name!r}, flags=..., trainers=...)` instead."
            )
        doc = (getattr(plugin, "__doc__", None) or "").strip().splitlines()
        return PluginSpec(name=name, summary=doc[0] if doc else "")
    if not isinstance(spec, PluginSpec):
        raise UsageError(f"trl-ext plugin `{name}`: `{SPEC_ATTR}` must be a `trl_ext.PluginSpec`, got {spec!r}.")
    if spec.name != name:
        raise UsageError(
            f"trl-ext plugin registered as `{name}` declares the name `{spec.name}`. A plugin's name is the same "
            "everywhere: rename its module or entry point, or its `PluginSpec.name`."
        )
    return spec


def load_catalog(block: Iterable[str] = (), *, warn: bool = True) -> tuple[Catalog, dict[str, Any]]:
    """Load every available plugin except blocked ones; return the catalog and `{name: plugin object}`. A built-in
    plugin that fails raises; a third-party one is *broken* (docs/writing-plugins.md): skipped, with one warning per
    process if `warn`."""
    block = set(block)
    sources, clashes = _sources()
    known = list(dict.fromkeys(s.name for s in sources))
    unknown = sorted(block - set(known) - set(clashes))
    if unknown:
        hint = did_you_mean(unknown[0], known)
        raise UsageError(
            f"`block` names unknown plugin(s) {unknown}.{hint} Known plugins: {known}. Run `trl-ext plugins` to list "
            "them."
        )
    catalog = Catalog(blocked=block)
    broken = catalog.broken
    for source in sources:
        if source.name in block:
            if source.builtin:  # our own modules are safe to import, and their flags make better messages
                catalog.blocked_specs[source.name] = spec_of(source.name, _load(source))
            continue
        if source.name in clashes:
            broken[source.name] = clashes[source.name]
            if source.builtin:
                flags = spec_of(source.name, _load(source)).flag_names
                catalog.broken_flags.update(dict.fromkeys(flags, source.name))
            continue
        if source.builtin:
            plugin = _load(source)
            clash = catalog.add(source.name, plugin, spec_of(source.name, plugin), builtin=True)
            if clash is not None:
                raise UsageError(f"trl-ext plugin `{source.name}`: {clash}.")
            continue
        try:
            plugin = source.load()
        except Exception as exc:  # noqa: BLE001 - reported with the plugin's name, never raised for all
            broken[source.name] = (
                f"importing `{source.origin}` (package `{source.dist}`) failed with {type(exc).__name__}: {exc}. "
                "Fix or uninstall that package"
            )
            continue
        spec: PluginSpec | None = None
        try:
            spec = spec_of(source.name, plugin)
            if spec.hooks is None:  # hooks in a separate module are checked when the plugin is registered
                scratch = TrlExtPluginManager()  # a hook name or signature that does not match the specs raises
                _register(scratch, source.name, plugin)
                _check_pending(scratch)
        except UsageError as exc:
            broken[source.name] = f"{exc}".rstrip(".") + f" (package `{source.dist}`)"
        else:
            clash = catalog.add(source.name, plugin, spec, builtin=False)
            if clash is not None:
                broken[source.name] = f"{clash} (package `{source.dist}`); only one plugin can own a flag"
        if source.name in broken and spec is not None:
            catalog.broken_flags.update({f: source.name for f in spec.flag_names if f not in catalog.flags})
    if warn:
        for name in sorted(broken):
            key = (name, broken[name])
            if key not in _WARNED:
                _WARNED.add(key)
                logger.warning(
                    "trl-ext: the plugin `%s` is skipped: %s. Nothing else is affected; enabling it is an error. To "
                    "skip it without this warning: %s.",
                    name,
                    broken[name],
                    block_advice(name, block),
                )
    return catalog, catalog.plugins


def make_plugin_manager(block: Iterable[str] = (), *, catalog: Catalog | None = None) -> TrlExtPluginManager:
    """A fresh manager with every available plugin but the blocked and broken ones registered and validated, from
    `catalog` when given (`block` is then ignored); this is where a `PluginSpec.hooks` module is imported."""
    if catalog is None:
        catalog = load_catalog(block)[0]
    pm = TrlExtPluginManager()
    for name in catalog.blocked:
        pm.set_blocked(name)
    for name, plugin in catalog.plugins.items():
        hooks = catalog.specs[name].hooks  # the module of its hook implementations, else the declaring object
        if hooks is not None:
            package = getattr(plugin, "__package__", None) or getattr(plugin, "__name__", None)
            try:
                plugin = importlib.import_module(hooks, package if hooks.startswith(".") else None)
            except Exception as exc:  # noqa: BLE001 - the user must see which plugin failed
                raise UsageError(
                    f"Could not import the hook implementations of trl-ext plugin `{name}` (`{hooks}`): "
                    f"{type(exc).__name__}: {exc}. Fix or uninstall the package that provides it, or block it: "
                    f"{block_advice(name, catalog.blocked)}."
                ) from exc
        _register(pm, name, plugin)
    _check_pending(pm)
    pm.catalog = catalog
    return pm


def _check_pending(pm: TrlExtPluginManager) -> None:
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise UsageError(
            f"trl-ext plugin `{pm.get_name(exc.plugin)}` implements a hook that does not exist: {exc}. Hook names are "
            "listed in `trl_ext.hookspecs`."
        ) from exc


def _register(pm: TrlExtPluginManager, name: str, plugin: Any) -> None:
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise UsageError(
            f"trl-ext plugin `{name}` has a hook implementation that does not match its spec: "
            f"{'; '.join(str(exc).splitlines())}. See the "
            "signatures in `trl_ext.hookspecs`."
        ) from exc
    except ValueError as exc:  # pluggy: the plugin (or its name) is already registered
        raise UsageError(f"trl-ext plugin `{name}` could not be registered: {exc}.") from exc


def resolve_roles(specs: dict[str, PluginSpec], enabled: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """Keep, for each role that enabled plugins serve (`PluginSpec.serves`), the one of highest precedence.

    Returns the plugins kept, in order, and `{left out: kept instead}`. Two of equal precedence are a `UsageError`.
    """
    enabled = list(enabled)
    superseded: dict[str, str] = {}
    roles = sorted({role for name in enabled for role in specs[name].serves})
    for role in roles:
        serving = sorted((n for n in enabled if role in specs[n].serves), key=lambda n: -specs[n].precedence)
        if len(serving) > 1 and specs[serving[0]].precedence == specs[serving[1]].precedence:
            names = ", ".join(f"`{n}`" for n in serving)
            raise UsageError(
                f"The enabled plugins {names} all serve `{role}` for this trainer, with the same precedence; only "
                "one can. Disable all but one of them (unset its flag, or add it to `block`)."
            )
        for name in serving[1:]:
            superseded.setdefault(name, serving[0])
    return [n for n in enabled if n not in superseded], superseded


def call_exclusive(caller: pluggy.HookCaller, **kwargs: Any) -> Any:
    """Call an exclusive hook through pluggy (wrappers and monitoring included); return its single answer, or None.
    Two answers would otherwise be resolved silently by registration order: a `UsageError` naming the implementers."""
    results = caller(**kwargs)
    if len(results) > 1:
        implementers = [impl.plugin_name for impl in caller.get_hookimpls() if not (impl.wrapper or impl.hookwrapper)]
        names = ", ".join(f"`{name}`" for name in implementers)
        raise UsageError(
            f"{len(results)} enabled plugins ({names} implement it) answered `{caller.name}` for the same trainer; "
            "only one can. Disable all but one of them (unset its flag, or add it to `block`)."
        )
    return results[0] if results else None
