"""trl-ext's configuration: one dataclass, filled from code, a YAML file and `TRL_EXT_*` environment variables.

Precedence, highest first (each source only overrides the keys it sets):

1. keyword flags passed to `trl_ext.install(**flags)`;
2. `TRL_EXT_<FLAG>` environment variables (read here and nowhere else);
3. the `config` argument of `install()`: a `TrlExtConfig`, a mapping, or the path of a YAML file; when it is `None`,
   the YAML file named by `TRL_EXT_CONFIG`, if set;
4. the defaults below.

A YAML file holds the same keys at its top level, or under a top-level `trl_ext:` key so that the flags can sit in
a TRL recipe next to `DPOConfig` fields.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import UsageError

__all__ = ["ENV_PREFIX", "TrlExtConfig", "load_config"]

ENV_PREFIX = "TRL_EXT_"
#: Environment variables that are not flags.
ENV_CONFIG_FILE = "TRL_EXT_CONFIG"
_ENV_NON_FLAGS = {ENV_CONFIG_FILE, "TRL_EXT_LOG_LEVEL"}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass
class TrlExtConfig:
    """Flags of trl-ext's built-in plugins and options of any plugin.

    Where TRL has a flag of its own, the trl-ext flag has the same name and meaning.

    Args:
        padding_free (`bool`, *optional*, defaults to `False`):
            Pack DPO sequences so that no compute is spent on padding (plugin `padding_free`). Also enabled per
            trainer by `DPOConfig(padding_free=True)`, which TRL >= 0.29 ignores.
        precompute_ref_batch_size (`int`, `"auto"` or `None`, *optional*, defaults to `None`):
            Pairs per batch for the reference log-prob precompute (plugin `precompute_ref_batch_size`). `"auto"`
            probes for the largest batch that fits. `None` leaves the precompute to TRL.
        ds3_gather_for_generation (`bool`, `"auto"` or `None`, *optional*, defaults to `None`):
            Whether to gather ZeRO-3 parameters for generation (plugin `generation`). `None` leaves generation to TRL.
        sync_metrics (`bool`, *optional*, defaults to `False`):
            Log exact global metrics with one collective per logging step (plugin `sync_metrics`).
        plugins (`dict[str, dict]`, *optional*, defaults to `{}`):
            Options by plugin name. Naming a third-party plugin here enables it (use `{}` for no options); for a
            built-in plugin it only sets options, its flag enables it.
        block (`list[str]`, *optional*, defaults to `[]`):
            Plugin names never to load, built-in or third-party (like pytest's `-p no:NAME`).
    """

    padding_free: bool = False
    precompute_ref_batch_size: int | Literal["auto"] | None = None
    ds3_gather_for_generation: bool | Literal["auto"] | None = None
    sync_metrics: bool = False
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)
    block: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name), "TrlExtConfig"))

    @classmethod
    def flag_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _bool(name: str, value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise UsageError(f"`{name}` must be true or false, got {value!r} (from {source}).")


def _coerce(name: str, value: Any, source: str) -> Any:
    """Validate and normalise one flag value; strings (from YAML or the environment) are parsed."""
    if name in ("padding_free", "sync_metrics"):
        return _bool(name, value, source)
    if name == "precompute_ref_batch_size":
        if isinstance(value, str):
            text = value.strip().lower()
            if text in ("", "none", "null"):
                return None
            if text == "auto":
                return "auto"
            try:
                value = int(text)
            except ValueError:
                pass
        if value is None or value == "auto":
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        raise UsageError(
            f'`precompute_ref_batch_size` must be a positive integer, "auto" or None, got {value!r} (from {source}).'
        )
    if name == "ds3_gather_for_generation":
        if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
            return None
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return None if value is None else "auto"
        try:
            return _bool(name, value, source)
        except UsageError:
            raise UsageError(
                f'`ds3_gather_for_generation` must be true, false, "auto" or None, got {value!r} (from {source}).'
            ) from None
    if name == "plugins":
        if isinstance(value, str):
            value = _parse_plugins_env(value, source)
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
    if name == "block":
        if isinstance(value, str):
            value = [v for v in (p.strip() for p in value.split(",")) if v]
        if not isinstance(value, (list, tuple, set)) or not all(isinstance(v, str) for v in value):
            raise UsageError(f"`block` must be a list of plugin names, got {value!r} (from {source}).")
        return list(value)
    raise UsageError(_unknown_flag_message(name, source))


def _parse_plugins_env(value: str, source: str) -> Any:
    text = value.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"`plugins` from {source} is not valid JSON: {exc}.") from None
    return [v for v in (p.strip() for p in text.split(",")) if v]


def _unknown_flag_message(name: str, source: str) -> str:
    import difflib

    known = TrlExtConfig.flag_names()
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    return (
        f"Unknown trl-ext flag `{name}` (from {source}).{hint} Known flags: {', '.join(known)}. Options of a plugin "
        f"go under `plugins: {{<plugin name>: {{...}}}}`."
    )


def _check_keys(mapping: Mapping[str, Any], source: str) -> dict[str, Any]:
    out = {}
    for key, value in mapping.items():
        if key not in TrlExtConfig.flag_names():
            raise UsageError(_unknown_flag_message(str(key), source))
        out[key] = _coerce(key, value, source)
    return out


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read trl-ext flags from a YAML file (top level, or under a `trl_ext:` key)."""
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
    if "trl_ext" in data:
        data = data["trl_ext"] or {}
        if not isinstance(data, Mapping):
            raise UsageError(f"`trl_ext:` in {str(path)!r} must hold a mapping of flags.")
    return _check_keys(data, f"config file {str(path)!r}")


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Read `TRL_EXT_<FLAG>` variables. An unknown `TRL_EXT_*` variable is an error, so a typo never goes unseen."""
    out = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key in _ENV_NON_FLAGS:
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in TrlExtConfig.flag_names():
            raise UsageError(_unknown_flag_message(name, f"environment variable ${key}"))
        out[name] = _coerce(name, value, f"environment variable ${key}")
    return out


def load_config(
    config: TrlExtConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> TrlExtConfig:
    """Merge the sources in the documented precedence and return a validated `TrlExtConfig`."""
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    if config is None and environ.get(ENV_CONFIG_FILE):
        config = environ[ENV_CONFIG_FILE]
    if isinstance(config, TrlExtConfig):
        defaults = TrlExtConfig().to_dict()
        merged.update({k: v for k, v in config.to_dict().items() if v != defaults[k]})
    elif isinstance(config, Mapping):
        merged.update(_check_keys(config, "the `config` mapping"))
    elif isinstance(config, (str, os.PathLike)):
        merged.update(read_yaml(config))
    elif config is not None:
        raise UsageError(
            f"`config` must be a TrlExtConfig, a mapping or the path of a YAML file, got {type(config).__name__}."
        )
    merged.update(read_env(environ))
    merged.update(_check_keys(flags or {}, "keyword flags of install()"))
    return TrlExtConfig(**merged)
