"""How a plugin declares itself (`TRL_EXT_PLUGIN = PluginSpec(...)`, docs/writing-plugins.md), the parsers that
validate its flags and options from every source (Python values, or strings from the environment, YAML, the CLI), and
their documentation read from the declarations (`SettingDoc`, the options' HF-style `Args:` docstring). This module
imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import UsageError

__all__ = [
    "Flag",
    "Parser",
    "PluginSpec",
    "SettingDoc",
    "Size",
    "boolean",
    "either",
    "non_negative_float",
    "one_of",
    "optional",
    "first_sentence",
    "parse_args_docstring",
    "parse_size",
    "positive_int",
    "size",
    "text",
]


@dataclass(frozen=True, eq=False)
class Parser:
    """`parser(value)` returns the normalised value or raises `ValueError`; `expects` says what a valid value looks
    like, for error messages ("a positive integer")."""

    function: Callable[[Any], Any]
    expects: str

    def __call__(self, value: Any) -> Any:
        return self.function(value)

    def checked(self, value: Any, name: str, source: str) -> Any:
        """`self(value)`; a refused value is a `UsageError` naming the setting `name` and where it came from."""
        try:
            return self.function(value)
        except ValueError:
            try:  # a fraction where a whole number is expected (256.5 for "a positive integer") is named
                number = float(value) if isinstance(value, str) else value
            except ValueError:
                number = None
            fractional = isinstance(number, float) and math.isfinite(number) and not number.is_integer()
            note = " (not a whole number)" if fractional and "integer" in self.expects else ""
            raise UsageError(f"`{name}` must be {self.expects}, got {value!r}{note} (from {source}).") from None

    def __repr__(self) -> str:
        return f"<Parser {self.expects}>"


def _parser(expects: str) -> Callable[[Callable[[Any], Any]], Parser]:
    return lambda function: Parser(function, expects)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"none", "null"}


@_parser("true or false")
def boolean(value: Any) -> bool:
    """`True`/`False`, `1`/`0`, or `"true"/"false"/"1"/"0"/"yes"/"no"/"on"/"off"` in any case."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(value)


@_parser("a positive integer")
def positive_int(value: Any) -> int:
    """An integer > 0 (`8`, `8.0`, `"8"`: an integral float from YAML or a computation is that integer; 8.5 is not)."""
    try:
        number = float(value.strip()) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(value) from None
    if isinstance(number, float) and math.isfinite(number) and number.is_integer() and number < 2**53:
        number = int(number)  # below 2**53 every whole float is exact: "256" and 256.0 are the int 256
    if isinstance(number, int) and not isinstance(number, bool) and number > 0:
        return number
    raise ValueError(value)


@_parser("a number >= 0")
def non_negative_float(value: Any) -> float:
    """A finite number >= 0."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(value) from None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    raise ValueError(value)


@_parser("a non-empty string")
def text(value: Any) -> str:
    """A non-empty string (a path, a name)."""
    if isinstance(value, str) and value.strip():
        return value
    if hasattr(value, "__fspath__"):
        return str(value.__fspath__())
    raise ValueError(value)


def one_of(*choices: str) -> Parser:
    """One of `choices` (case-insensitive), returned in the spelling of `choices`."""

    def parse(value: Any) -> str:
        if isinstance(value, str):
            for choice in choices:
                if value.strip().lower() == choice.lower():
                    return choice
        raise ValueError(value)

    return Parser(parse, " or ".join(f'"{c}"' for c in choices))


def optional(parser: Parser) -> Parser:
    """`None` (or `"none"`, `"null"`), else what `parser` accepts."""

    def parse(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
            return None
        return parser(value)

    expects = parser.expects
    if " or " in expects:  # 'a positive integer or "auto"' -> 'a positive integer, "auto" or None'
        head, _, tail = expects.rpartition(" or ")
        expects = f"{head}, {tail}"
    return Parser(parse, f"{expects} or None")


def either(*parsers: Parser) -> Parser:
    """The first of `parsers` that accepts the value."""

    def parse(value: Any) -> Any:
        for parser in parsers:
            try:
                return parser(value)
            except ValueError:
                continue
        raise ValueError(value)

    return Parser(parse, ", ".join(p.expects for p in parsers[:-1]) + f" or {parsers[-1].expects}")


@dataclass(frozen=True)
class Size:
    """A memory size: `kind` is `"bytes"` (an absolute number of bytes) or `"fraction"` (of a reference amount that
    the option documents, e.g. the available memory)."""

    kind: str
    value: float

    def resolve(self, reference: float) -> float:
        """Bytes: the size itself, or the fraction of `reference`."""
        return self.value if self.kind == "bytes" else self.value * reference

    def __str__(self) -> str:
        return f"{self.value:.0f} bytes" if self.kind == "bytes" else f"{self.value:.0%}"


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_size(value: Any) -> Size:
    """The one size grammar of trl-ext: bytes (an `int` or whole `float` > 1, `4e9`; a string with a unit, `"4GB"`,
    `"512MiB"`, `"1000"`) or a fraction (a `float` in (0, 1], `"0.25"`, `"25%"`); anything else is a `ValueError`."""
    if isinstance(value, bool) or value is None:
        raise ValueError(value)
    if isinstance(value, int):
        if value > 0:
            return Size("bytes", float(value))
        raise ValueError(value)
    if isinstance(value, float):
        if 0 < value <= 1 or (math.isfinite(value) and value.is_integer() and value > 1):
            return Size("fraction" if value <= 1 else "bytes", value)  # 4e9: whole bytes, as the int 4000000000
        raise ValueError(value)
    if isinstance(value, str):
        compact = value.strip().lower().replace(" ", "")
        if compact.endswith("%"):
            try:
                percent = float(compact[:-1])
            except ValueError:
                raise ValueError(value) from None
            if 0 < percent <= 100:
                return Size("fraction", percent / 100)
            raise ValueError(value)
        match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)([a-z]*)", compact)
        if match and match.group(2) in _UNITS:
            number = float(match.group(1))
            if match.group(2) == "" and "." in match.group(1):
                return parse_size(number)  # "0.25" from YAML or the environment: a fraction
            if number > 0:
                return Size("bytes", number * _UNITS[match.group(2)])
    raise ValueError(value)


#: `parse_size` as a parser.
size = Parser(parse_size, 'a size ("4GB", "512MiB", a number of bytes) or a fraction (0.25 or "25%")')


@dataclass(frozen=True)
class SettingDoc:
    """One flag or option (`kind`) of a plugin as `trl-ext plugins` lists it: what it `accepts` (the parser's
    `expects`, or the field's type), its declared `default` and one line of `help`."""

    kind: str
    name: str
    accepts: str
    default: Any
    help: str

    def default_text(self) -> str:
        value = self.default
        if value is None or isinstance(value, bool):
            return {None: "None", True: "true", False: "false"}[value]
        return f'"{value}"' if isinstance(value, str) else str(value)


def first_sentence(text: str) -> str:
    text = " ".join(text.split())
    head, dot, _ = text.partition(". ")
    return head + "." if dot else text


def parse_args_docstring(doc: str) -> dict[str, str]:
    """`{name: description}` from an HF/Google-style `Args:` section."""
    out: dict[str, str] = {}
    lines = doc.expandtabs().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return out
    indent = None
    current = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break
        if depth == indent:
            match = re.match(r"\s*(\w+)\s*(\(.*\))?\s*:\s*(.*)", line)
            if not match:
                break
            current = match.group(1)
            out[current] = match.group(3).strip()
        elif current is not None:
            out[current] = (out[current] + " " + line.strip()).strip()
    return out


@dataclass(frozen=True)
class Flag:
    """A top-level flag owned by one plugin, the same in Python, `TRL_EXT_<NAME>`, YAML and `--trl_ext_<name>`. Any
    value but `default` (a normalised value of `parse`) enables the plugin; `help` is one line for `--help` and
    `trl-ext plugins`; `cli_const` is the value of a bare `--trl_ext_<name>`."""

    name: str
    default: Any
    parse: Parser
    help: str
    cli_const: Any = True


@dataclass(frozen=True)
class PluginSpec:
    """What a plugin is, declared in its own module as `TRL_EXT_PLUGIN = PluginSpec(...)`.

    Args:
        name: the same as its module (built-in) or entry point (third-party), its key under `plugins:`, in log lines.
        summary: one line for `trl-ext plugins`.
        flags: the flags it owns; it is enabled when one is not at its default. Without flags, naming it under
            `plugins:` enables it.
        options: a frozen dataclass, every field with a default, documented in an HF-style `Args:` docstring; a
            field's `metadata["parse"]` validates user values, `__post_init__` may raise `ValueError`/`UsageError`.
        trainers: the stock trainer class names it applies to; `None`: all of them.
        trl_flag: a TRL config field TRL accepts but ignores and this plugin implements (`DPOConfig.padding_free`);
            setting it on a trainer's TRL config enables the plugin for that trainer.
        serves, precedence: exclusive roles it fills (`"packing"`); of the plugins enabled for one trainer serving a
            role, the highest `precedence` is kept and the others are left out (equal precedence: `UsageError`).
        hooks: the module of its hook implementations (`"my_pkg.hooks"`, or `".hooks"` relative to the declaring
            package), imported only at registration so that reading declarations imports nothing heavy.
        calls: the trainer methods its `trl_ext_call` takes part in (`trl_ext.calls`): `"training_step"`,
            `"DPOTrainer._compute_loss"` (one stock class only), `"accelerator.gather"`.
        replaces: the methods whose calls its `trl_ext_call` answers itself; two enabled plugins replacing one method
            of a trainer are a `UsageError`. One answering only in a state of its own lists it under `calls`.
    """

    name: str
    summary: str = ""
    flags: tuple[Flag, ...] = ()
    options: type | None = None
    trainers: tuple[str, ...] | None = None
    trl_flag: str | None = None
    serves: tuple[str, ...] = ()
    precedence: int = 0
    hooks: str | None = None
    calls: tuple[str, ...] = ()
    replaces: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name or ""):
            raise UsageError(f"PluginSpec name {self.name!r} must be a Python identifier (it is a flag/option key).")
        for flag in self.flags:
            if not isinstance(flag, Flag):
                raise UsageError(f"Plugin `{self.name}`: `flags` must hold `trl_ext.spec.Flag` objects, got {flag!r}.")
            try:
                if flag.parse(flag.default) != flag.default:
                    raise ValueError(flag.default)
            except ValueError:
                raise UsageError(
                    f"Plugin `{self.name}`: the default {flag.default!r} of flag `{flag.name}` is not a normalised "
                    f"value of its parser ({flag.parse.expects})."
                ) from None
        if self.options is not None:
            if not (dataclasses.is_dataclass(self.options) and isinstance(self.options, type)):
                raise UsageError(f"Plugin `{self.name}`: `options` must be a dataclass type, got {self.options!r}.")
            if not self.options.__dataclass_params__.frozen:  # type: ignore[attr-defined]
                raise UsageError(
                    f"Plugin `{self.name}`: the options dataclass `{self.options.__name__}` must be frozen."
                )
            for f in dataclasses.fields(self.options):
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise UsageError(
                        f"Plugin `{self.name}`: option `{f.name}` of `{self.options.__name__}` needs a default."
                    )
        if self.trainers is not None and (isinstance(self.trainers, str) or not self.trainers):
            raise UsageError(f"Plugin `{self.name}`: `trainers` must be a non-empty tuple of class names or None.")
        if isinstance(self.serves, str) or not all(isinstance(role, str) and role for role in self.serves):
            raise UsageError(f"Plugin `{self.name}`: `serves` must be a tuple of role names, got {self.serves!r}.")
        module_path = r"\.*[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
        if self.hooks is not None and not re.fullmatch(module_path, self.hooks):
            raise UsageError(f"Plugin `{self.name}`: `hooks` must be a module path, got {self.hooks!r}.")
        for field_name in ("calls", "replaces"):
            names = getattr(self, field_name)
            if isinstance(names, str) or not all(re.fullmatch(module_path[3:], n) for n in names):
                raise UsageError(
                    f"Plugin `{self.name}`: `{field_name}` must be a tuple of method names, got {names!r}."
                )

    @property
    def flag_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.flags)

    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.options)) if self.options is not None else ()

    def docs(self) -> tuple[SettingDoc, ...]:
        """The plugin's flags and options as `trl-ext plugins` prints them."""
        out = [SettingDoc("flag", f.name, f.parse.expects, f.default, first_sentence(f.help)) for f in self.flags]
        if self.options is not None:
            helps = parse_args_docstring(self.options.__doc__ or "")
            for f in dataclasses.fields(self.options):
                parser = f.metadata.get("parse")
                kind = parser.expects if parser is not None else str(getattr(f.type, "__name__", f.type))
                factory: Any = f.default_factory
                default = f.default if f.default is not dataclasses.MISSING else factory()
                out.append(SettingDoc("option", f.name, kind, default, first_sentence(helps.get(f.name, ""))))
        return tuple(out)

    def applies_to(self, trainer_class: str) -> bool:
        return self.trainers is None or trainer_class in self.trainers

    def make_options(self, raw: Mapping[str, Any], source: str) -> Any:
        """Build the options dataclass from user values; every mistake is a `UsageError` naming the option."""
        if self.options is None:
            if raw:
                raise UsageError(
                    f"`plugins.{self.name}` gives options {sorted(raw)} (from {source}), but the plugin `{self.name}` "
                    "has no options. Use `{}`."
                )
            return None
        known = self.option_names()
        unknown = sorted(set(raw) - set(known))
        if unknown:
            import difflib

            hints = [
                f"`{u}` (did you mean `{m[0]}`?)" if (m := difflib.get_close_matches(u, known, 1)) else f"`{u}`"
                for u in unknown
            ]
            raise UsageError(
                f"Unknown option(s) {', '.join(hints)} for the trl-ext plugin `{self.name}` (from {source}). Known "
                f"options: {', '.join(known) or 'none'}."
            )
        values = {}
        fields = {f.name: f for f in dataclasses.fields(self.options)}
        for key, value in raw.items():
            parser = fields[key].metadata.get("parse")
            values[key] = value if parser is None else parser.checked(value, f"plugins.{self.name}.{key}", source)
        try:
            return self.options(**values)
        except UsageError:
            raise
        except (ValueError, TypeError) as exc:
            raise UsageError(f"`plugins.{self.name}`: {exc} (from {source}).") from None
