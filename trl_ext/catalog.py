"""The catalog of the available plugins: the flag table built from their declarations, and what `trl-ext plugins`
shows about each. Nothing here imports a plugin; `trl_ext.manager.load_catalog` builds the catalog."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .errors import UsageError
from .spec import Flag, PluginSpec, SettingDoc

__all__ = ["CORE_KEYS", "Catalog", "PluginInfo", "block_advice", "flag_clash", "plugin_info"]

#: Top-level configuration keys that are not plugin flags (`verify`: `trl_ext.config.VERIFY_PARSER`).
CORE_KEYS = ("plugins", "block", "verify")


def block_advice(name: str, block: Iterable[str] = ()) -> str:
    """The exact settings that block `name` (with the names already blocked)."""
    names = sorted({*block, name})
    return f"`TRL_EXT_BLOCK={','.join(names)}` (or `block: [{', '.join(names)}]` in YAML, `block=[...]` in Python)"


class Catalog:
    """The declarations of the available plugins: `specs` of the registered (not blocked) ones in registration order,
    which are `builtin`, their declaring `plugins`, the `blocked` names (`blocked_specs`: those of blocked built-ins,
    for error messages), the `broken` third-party plugins with the reason and what to do, and `broken_flags`
    (`{flag: plugin}` for those whose declaration could be read). `flags` is the flag table: `{flag: (Flag, owner)}`.
    """

    def __init__(
        self,
        specs: dict[str, PluginSpec],
        builtin: set[str],
        blocked: set[str],
        blocked_specs: dict[str, PluginSpec] | None = None,
        broken: dict[str, str] | None = None,
        broken_flags: dict[str, str] | None = None,
        plugins: dict[str, Any] | None = None,
    ) -> None:
        self.specs = dict(specs)
        self.plugins = dict(plugins or {})
        self.builtin = set(builtin)
        self.blocked = set(blocked)
        self.blocked_specs = dict(blocked_specs or {})
        self.broken = dict(broken or {})
        self.broken_flags = dict(broken_flags or {})
        self.flags: dict[str, tuple[Flag, str]] = {}
        for name, spec in self.specs.items():
            clash = flag_clash(self.flags, name, spec)
            if clash is not None:
                raise UsageError(f"trl-ext plugin `{name}`: {clash}.")
            for flag in spec.flags:
                self.flags[flag.name] = (flag, name)

    def flag_names(self) -> tuple[str, ...]:
        return tuple(self.flags)

    def defaults(self) -> dict[str, Any]:
        return {name: flag.default for name, (flag, _) in self.flags.items()}

    def trl_flag_owners(self) -> dict[str, str]:
        """`{TRL config field: plugin}` for plugins that serve a TRL flag TRL ignores."""
        return {spec.trl_flag: name for name, spec in self.specs.items() if spec.trl_flag}

    def blocked_owner(self, flag: str) -> str | None:
        for name, spec in self.blocked_specs.items():
            if flag in spec.flag_names:
                return name
        return None

    def broken_message(self, name: str) -> str:
        """Why the broken plugin `name` cannot be used, and the two ways out (fix it, or block it)."""
        return (
            f"The trl-ext plugin `{name}` cannot be used: {self.broken[name]}. Or, if you do not need it, block it: "
            f"{block_advice(name, self.blocked)}."
        )


def flag_clash(owned: dict[str, tuple[Flag, str]], name: str, spec: PluginSpec) -> str | None:
    for flag in spec.flags:
        if flag.name in CORE_KEYS:
            return f"it declares the flag `{flag.name}`, a reserved trl-ext key"
        if flag.name in owned:
            return f"it declares the flag `{flag.name}`, which the plugin `{owned[flag.name][1]}` declares too"
    return None


@dataclass(frozen=True)
class PluginInfo:
    """What `trl-ext plugins` shows about one plugin."""

    name: str
    builtin: bool
    flags: tuple[str, ...]
    options: tuple[str, ...]
    trainers: tuple[str, ...] | None  # None: every trainer trl-ext attaches to
    trl_flag: str | None
    source: str
    summary: str
    settings: tuple[SettingDoc, ...] = ()


def plugin_info(catalog: Catalog, name: str) -> PluginInfo:
    """What `trl-ext plugins` shows about `name`, from its declaration alone (nothing else is imported)."""
    plugin = catalog.plugins[name]
    spec = catalog.specs[name]
    return PluginInfo(
        name=name,
        builtin=name in catalog.builtin,
        flags=spec.flag_names,
        options=spec.option_names(),
        trainers=spec.trainers,
        trl_flag=spec.trl_flag,
        source=getattr(plugin, "__name__", type(plugin).__name__),
        summary=spec.summary,
        settings=spec.docs(),
    )
