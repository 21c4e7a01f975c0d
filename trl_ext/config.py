"""trl-ext's configuration: the flags the available plugins declare, their options, and the core keys, merged from
the sources in the precedence docs/configuration.md gives (keyword flags, the `TRL_EXT_<FLAG>` variables, read here
and nowhere else, the `config` argument, the defaults), each overriding only the keys it sets; `plugins:` per plugin.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import UsageError, did_you_mean
from .manager import CORE_KEYS, load_catalog
from .spec import Parser, boolean, either, positive_int

if TYPE_CHECKING:  # pragma: no cover
    from .manager import Catalog

__all__ = ["ENV_PREFIX", "TrlExtConfig", "load_config"]

ENV_PREFIX = "TRL_EXT_"
#: Environment variables that are not flags.
ENV_CONFIG_FILE = "TRL_EXT_CONFIG"
ENV_LOG_LEVEL = "TRL_EXT_LOG_LEVEL"
_ENV_NON_FLAGS = {ENV_CONFIG_FILE, ENV_LOG_LEVEL}
#: `verify` (`trl_ext.verify`): how many optimizer steps, from the first, are checked against stock; 0 is off.
VERIFY_DEFAULT = 1
VERIFY_PARSER = Parser(lambda v: int(either(boolean, positive_int)(v)), "true, false or a number of steps")
VERIFY_HELP = (
    "Check the first N training steps of a plugin that changes the math against stock TRL on the same batch "
    "(true: 1, false: off)."
)


class TrlExtConfig:
    """The flags of the available plugins (`TrlExtConfig(padding_free=True)`, read back as `config.padding_free` or
    in `config.flags`; `trl-ext plugins` lists them), `plugins` (options by plugin name; naming a plugin without
    flags enables it), `block` (plugin names never to load) and `verify` (`VERIFY_PARSER`), validated on the way in.
    """

    def __init__(
        self,
        *,
        plugins: Mapping[str, Any] | list[str] | str | None = None,
        block: list[str] | str | None = None,
        verify: bool | int | str = VERIFY_DEFAULT,
        _source: str = "TrlExtConfig",
        _catalog_: Catalog | None = None,
        _sources: Mapping[str, str] | None = None,
        **flags: Any,
    ) -> None:
        self.block: list[str] = _parse_block(block if block is not None else [], _source)
        self.verify: int = VERIFY_PARSER.checked(verify, "verify", _source)
        catalog = _catalog_ if _catalog_ is not None else load_catalog(self.block)[0]
        self.catalog = catalog
        values = catalog.defaults()
        for name, value in flags.items():
            values[name] = _parse_flag(catalog, name, value, (_sources or {}).get(name, _source))
        self.flags: dict[str, Any] = values
        #: `{flag: where it came from}` for the flags given explicitly (a `false` included), for error messages.
        self.given: dict[str, str] = {name: (_sources or {}).get(name, _source) for name in flags}
        self.plugins: dict[str, dict[str, Any]] = _parse_plugins(plugins if plugins is not None else {}, _source)
        self._options: dict[str, Any] = {}
        for name, raw in self.plugins.items():
            spec = catalog.specs.get(name)
            if spec is None:
                if name in catalog.broken:
                    raise UsageError(f"`plugins` names `{name}` (from {_source}). {catalog.broken_message(name)}")
                why = "is blocked" if name in catalog.blocked else "is not installed"
                hint = "" if name in catalog.blocked else did_you_mean(name, catalog.specs)
                raise UsageError(
                    f"`plugins` names `{name}` (from {_source}), which {why}.{hint} Available plugins: "
                    f"{', '.join(catalog.specs) or 'none'}."
                )
            self._options[name] = spec.make_options(raw, _source)

    def __getattr__(self, name: str) -> Any:
        flags = self.__dict__.get("flags")
        if flags is not None and name in flags:
            return flags[name]
        raise AttributeError(f"TrlExtConfig has no flag `{name}`. Known flags: {', '.join(flags or ())}.")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrlExtConfig):
            return NotImplemented
        mine = (self.flags, self.plugins, sorted(self.block), self.verify)
        return mine == (other.flags, other.plugins, sorted(other.block), other.verify)

    def __repr__(self) -> str:
        return f"TrlExtConfig({', '.join(f'{k}={v!r}' for k, v in self.changed().items())})"

    def to_dict(self) -> dict[str, Any]:
        plugins = {k: dict(v) for k, v in self.plugins.items()}
        return {**self.flags, "plugins": plugins, "block": list(self.block), "verify": self.verify}

    def changed(self) -> dict[str, Any]:
        """The keys that differ from the defaults (what a user set), as accepted by `TrlExtConfig(**...)`."""
        defaults = self.catalog.defaults()
        out: dict[str, Any] = {k: v for k, v in self.flags.items() if v != defaults.get(k)}
        if self.plugins:
            out["plugins"] = {k: dict(v) for k, v in self.plugins.items()}
        if self.block:
            out["block"] = list(self.block)
        if self.verify != VERIFY_DEFAULT:
            out["verify"] = self.verify
        return out

    def options(self, plugin: str) -> Any:
        """The parsed options of `plugin`: an instance of its options dataclass (its defaults if none were given)."""
        if plugin in self._options:
            return self._options[plugin]
        spec = self.catalog.specs.get(plugin)
        if spec is None:
            raise UsageError(
                f"No trl-ext plugin `{plugin}` is registered; available: {', '.join(self.catalog.specs)}."
            )
        self._options[plugin] = spec.make_options({}, "defaults")
        return self._options[plugin]

    def flag_is_set(self, plugin: str) -> bool:
        """Whether one of `plugin`'s flags is not at its default."""
        spec = self.catalog.specs[plugin]
        return any(self.flags[f.name] != f.default for f in spec.flags)

    def unused_options_message(
        self, plugin: str, trainer_class: str | None = None, trl_config: str | None = None
    ) -> str:
        """Why the `plugins:` entry of `plugin`, whose flags are off, does nothing (for `trainer_class`, built with a
        `trl_config`), and what to do."""
        spec = self.catalog.specs[plugin]
        flags = " or ".join(f"`{f}`" for f in spec.flag_names)
        options = self.plugins[plugin]
        what = f"sets {sorted(options)}" if options else "is given"
        where = f" for this {trainer_class}" if trainer_class else ""
        how = flags
        if spec.trl_flag:
            how += f" (trl-ext), or `{spec.trl_flag}=True` in the {trl_config or 'TRL config'}"
        return (
            f"`plugins.{plugin}` {what}, but {flags} is not set, so the plugin `{plugin}` is off{where} and its "
            f"options would do nothing (naming a plugin under `plugins:` gives its options; its flag enables it). Set "
            f"{how}, or remove `plugins.{plugin}`."
        )


def _parse_flag(catalog: Catalog, name: str, value: Any, source: str) -> Any:
    if name not in catalog.flags:
        raise UsageError(unknown_flag_message(catalog, name, source))
    return catalog.flags[name][0].parse.checked(value, name, source)


def _parse_block(value: Any, source: str) -> list[str]:
    if isinstance(value, str):
        value = [v for v in (p.strip() for p in value.split(",")) if v]
    if not isinstance(value, (list, tuple, set)) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"`block` must be a list of plugin names, got {value!r} (from {source}).")
    return list(value)


def _parse_plugins(value: Any, source: str) -> dict[str, dict[str, Any]]:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise UsageError(f"`plugins` from {source} is not valid JSON: {exc}.") from None
        else:
            value = [v for v in (p.strip() for p in text.split(",")) if v]
    if isinstance(value, (list, tuple)):
        value = {str(v): {} for v in value}
    if not isinstance(value, Mapping):
        raise UsageError(f"`plugins` must map plugin names to option mappings, got {value!r} (from {source}).")
    out: dict[str, dict[str, Any]] = {}
    for plugin, options in value.items():
        if options is None or options is True:
            options = {}
        if not isinstance(options, Mapping):
            raise UsageError(
                f"`plugins.{plugin}` must be a mapping of options (use {{}} for none), got {options!r} "
                f"(from {source})."
            )
        out[str(plugin)] = dict(options)
    return out


def unknown_flag_message(catalog: Catalog, name: str, source: str) -> str:
    broken = catalog.broken_flags.get(name)
    if broken is not None:
        return f"`{name}` is set (from {source}), but its plugin cannot be loaded. {catalog.broken_message(broken)}"
    owner = next((plugin for plugin, spec in catalog.blocked_specs.items() if name in spec.flag_names), None)
    if owner is not None:
        return (
            f"`{name}` is set (from {source}), but the plugin `{owner}` that implements it is blocked. Unset `{name}` "
            f"or remove `{owner}` from `block`."
        )
    known = [*catalog.flags, *CORE_KEYS]
    hint = did_you_mean(name, known)
    note = ""
    if catalog.broken:
        names = ", ".join(f"`{b}`" for b in sorted(catalog.broken))
        note = f" (Plugins that could not be loaded, whose flags are unknown: {names}; see the warning above.)"
    return (
        f"Unknown trl-ext flag `{name}` (from {source}).{hint} Known flags: {', '.join(known)}. Options of a plugin "
        f"go under `plugins: {{<plugin name>: {{...}}}}`; `trl-ext plugins` lists every flag and option.{note}"
    )


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the raw trl-ext keys of a YAML file (top level, or under a `trl_ext:` key)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"trl-ext config file {str(path)!r} does not exist (check `config=` or ${ENV_CONFIG_FILE}).")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"trl-ext config file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise UsageError(f"trl-ext config file {str(path)!r} must hold a mapping of flags.")
    check_section_key(data, f"trl-ext config file {str(path)!r}")
    if "trl_ext" in data:
        data = data["trl_ext"] or {}
        if not isinstance(data, Mapping):
            raise UsageError(f"`trl_ext:` in {str(path)!r} must hold a mapping of flags.")
    return dict(data)


def check_section_key(data: Mapping[str, Any], where: str) -> None:
    """A key that is a misspelling of `trl_ext` (`trl-ext:`, `TRL_EXT:`, `trlext:`) is a `UsageError` that names the
    file and the right spelling: the section would otherwise be passed on (to TRL's parser) or read as a flag."""
    import difflib

    if "trl_ext" in data:
        return
    for key in data:
        if isinstance(key, str) and difflib.get_close_matches(key.lower().replace("-", "_"), ["trl_ext"], 1, 0.8):
            raise UsageError(f"{where} has a key `{key}:`. Did you mean `trl_ext:`? (trl-ext reads its flags there.)")


def load_config(
    config: TrlExtConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    sources: Mapping[str, str] | None = None,
    config_source: str | None = None,
) -> TrlExtConfig:
    """Merge `config` < `environ` (default `os.environ`) < `flags` and return a validated `TrlExtConfig`; `sources`
    (`{key: where}` for `flags`) and `config_source` (for a mapping `config`) name the sources in error messages."""
    environ = os.environ if environ is None else environ
    entries: list[tuple[str, Any, str]] = []  # (key, raw value, where it came from), lowest precedence first
    if config is None and environ.get(ENV_CONFIG_FILE):
        config = environ[ENV_CONFIG_FILE]
    if isinstance(config, TrlExtConfig):
        given = {k: config.flags[k] for k in config.given}  # an explicit `false` stays explicit
        entries += [(k, v, "the `config` TrlExtConfig") for k, v in {**config.changed(), **given}.items()]
    elif isinstance(config, Mapping):
        entries += [(k, v, config_source or "the `config` mapping") for k, v in config.items()]
    elif isinstance(config, (str, os.PathLike)):
        entries += [(k, v, f"config file {str(config)!r}") for k, v in read_yaml(config).items()]
    elif config is not None:
        raise UsageError(
            f"`config` must be a TrlExtConfig, a mapping or the path of a YAML file, got {type(config).__name__}."
        )
    for var, value in environ.items():
        if var.startswith(ENV_PREFIX) and var not in _ENV_NON_FLAGS:
            entries.append((var[len(ENV_PREFIX) :].lower(), value, f"environment variable ${var}"))
    entries += [(k, v, (sources or {}).get(k, "keyword flags of install()")) for k, v in (flags or {}).items()]
    # `block` first: it decides which plugins (and so which flags) exist.
    block: list[str] = []
    for key, value, source in entries:
        if key == "block":
            block = _parse_block(value, source)
    catalog = load_catalog(block)[0]
    merged: dict[str, Any] = {}
    merged_sources: dict[str, str] = {}
    plugins: dict[str, dict[str, Any]] = {}
    verify = VERIFY_DEFAULT
    for key, value, source in entries:
        if key == "verify":
            verify = VERIFY_PARSER.checked(value, "verify", source)
        elif key == "plugins":
            for name, options in _parse_plugins(value, source).items():
                plugins[name] = options
                TrlExtConfig(plugins={name: options}, block=block, _source=source, _catalog_=catalog)
        elif key != "block":
            merged[key] = _parse_flag(catalog, key, value, source)
            merged_sources[key] = source
    return TrlExtConfig(
        plugins=plugins, block=block, verify=verify, _catalog_=catalog, _sources=merged_sources, **merged
    )
