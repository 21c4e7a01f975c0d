"""The command line of `trl-ext dpo` and `trl-ext online-dpo`: trl-ext flags taken out of `argv` and the recipe,
merged once (command line > `TRL_EXT_*` environment > recipe), the `--help` group listing them, and TRL's own
arguments parsed like `trl <command>` does, with CPU defaults on a machine without an accelerator."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

from .._logging import is_main_process
from ..config import VERIFY_HELP, TrlExtConfig, check_section_key, load_config
from ..errors import UsageError, did_you_mean
from ..manager import CORE_KEYS

__all__ = [
    "add_trl_ext_help",
    "cpu_note",
    "parse_job_args",
    "recipe_path",
    "resolve_config",
    "split_argv",
    "split_yaml_config",
]

_PREFIX = "--trl_ext_"
_EXTRA_KEYS = ("config",)  # --trl_ext_config PATH: a trl-ext YAML of its own
#: What the core keys take: given without a value, they are refused (they are no booleans).
_VALUE_OF = {
    "plugins": 'options by plugin name as JSON (`--trl-ext-plugins \'{"padding_free": {"attention": "dense"}}\'`), '
    "or a comma list of plugin names",
    "block": "a comma list of plugin names never to load (`--trl-ext-block name,other`)",
    "config": "the path of a trl-ext YAML file",
}


def _cli_name(token: str) -> str | None:
    """`--trl_ext_padding_free` and `--trl-ext-padding-free` -> `padding_free`; None for other tokens."""
    head = token.split("=", 1)[0]
    if not (head.startswith("--trl_ext_") or head.startswith("--trl-ext-")):
        return None
    return head[len(_PREFIX) :].replace("-", "_")


def split_argv(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """Take `--trl_ext_<flag> VALUE` / `--trl_ext_<flag>=VALUE` (dashes or underscores; the installed plugins' flags
    and the core keys) out of `argv`. A flag given without a value takes its declared `cli_const` (usually `true`)."""
    from ..manager import load_catalog

    catalog = load_catalog(warn=False)[0]  # broken plugins are reported once, when the configuration is loaded
    flags: dict[str, Any] = {}
    rest: list[str] = []
    argv = list(argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        name = _cli_name(token)
        if name is None:
            rest.append(token)
            i += 1
            continue
        _, eq, value = token.partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            elif name in catalog.flags:
                value = catalog.flags[name][0].cli_const
            elif name in _VALUE_OF:
                raise UsageError(f"`{token}` needs a value: {_VALUE_OF[name]}.")
            else:
                value = "true"  # an unknown flag: refused below, with a "did you mean"
        if name not in catalog.flags and name not in (*_EXTRA_KEYS, *CORE_KEYS):
            from ..config import unknown_flag_message

            raise UsageError(unknown_flag_message(catalog, name, f"the command line ({token.split('=', 1)[0]})"))
        flags[name] = value
        i += 1
    return flags, rest


def split_yaml_config(argv: list[str]) -> tuple[dict[str, Any] | None, list[str], str | None]:
    """Pull the `trl_ext:` section out of the `--config` YAML recipe; TRL gets a copy without it."""
    if "--config" not in argv:
        return None, argv, None
    import yaml

    index = argv.index("--config")
    if index + 1 >= len(argv):
        raise UsageError("`--config` needs the path of a YAML recipe.")
    path = argv[index + 1]
    recipe = _read_recipe(path)
    if isinstance(recipe, dict):
        check_section_key(recipe, f"The recipe {path}")
    if not isinstance(recipe, dict) or "trl_ext" not in recipe:
        return None, argv, None
    section = recipe.pop("trl_ext") or {}
    fd, stripped = tempfile.mkstemp(prefix="trl-ext-recipe-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(recipe, f)
    argv = [*argv[: index + 1], stripped, *argv[index + 2 :]]
    return section, argv, stripped


def _read_recipe(path: str) -> Any:
    """The YAML recipe at `path` (`{}` when empty); a recipe that cannot be read or parsed is a `UsageError`."""
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f) or {}
    except OSError as exc:
        raise UsageError(f"Cannot read the recipe `--config {path}`: {exc}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"The recipe `--config {path}` is not valid YAML: {exc}") from None


def recipe_path(argv: Sequence[str]) -> str | None:
    argv = list(argv)
    return argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None


def resolve_config(argv: Sequence[str]) -> tuple[TrlExtConfig, list[str], str | None]:
    flags, rest = split_argv(argv)
    recipe = recipe_path(rest)
    section, rest, stripped = split_yaml_config(rest)
    own_file = flags.pop("config", None)
    base: Any = section
    if own_file is not None:
        if section:
            raise UsageError("Give trl-ext flags either in the recipe's `trl_ext:` section or in `--trl_ext_config`.")
        base = own_file
    sources = {name: f"the command line (--trl_ext_{name})" for name in flags}
    # The one merge of the job's sources: command line > TRL_EXT_* environment > recipe > defaults. The result is
    # installed as it is (`install_config`), so the environment is not applied a second time over the command line.
    where = f"the `trl_ext:` section of the recipe {recipe}" if section is not None else None
    try:
        return load_config(base, flags=flags, sources=sources, config_source=where), rest, stripped
    except BaseException:
        if stripped:
            os.unlink(stripped)
        raise


def _flag_lines() -> list[tuple[str, str]]:
    """`(option, help)` for every trl-ext flag the installed plugins declare, plus the core keys."""
    from ..manager import load_catalog
    from ..spec import SettingDoc

    catalog = load_catalog(warn=False)[0]
    lines = []
    for name, (flag, owner) in catalog.flags.items():
        value = "[BOOL]" if flag.cli_const is True and flag.default is False else "VALUE"
        default = SettingDoc("flag", name, flag.parse.expects, flag.default, flag.help).default_text()
        what = f"{flag.help.rstrip('.')}. Accepts {flag.parse.expects}; default {default} (plugin `{owner}`)."
        lines.append((f"--trl-ext-{name.replace('_', '-')} {value}", what))
    lines.append(
        ("--trl-ext-plugins JSON", 'Options by plugin name, e.g. \'{"padding_free": {"attention": "dense"}}\'.')
    )
    lines.append(("--trl-ext-block A,B", "Plugins never to load."))
    lines.append(("--trl-ext-verify VALUE", f"{VERIFY_HELP} Default true."))
    lines.append(("--trl-ext-config PATH", "A trl-ext YAML of its own (instead of the recipe's `trl_ext:` section)."))
    return lines


def add_trl_ext_help(parser: Any, command: str) -> None:
    """Give `trl-ext <command> --help` a short usage line and a first argument group with one line per trl-ext flag
    (from the flag table, third-party plugins' included; documentation only: `split_argv` takes the flags out)."""
    import argparse

    parser.usage = f"%(prog)s [-h] [--config RECIPE.yaml] [--trl-ext-<flag> VALUE ...] [{command} arguments below ...]"
    rows = _flag_lines()
    width = max(len(option) for option, _ in rows) + 2
    group = parser.add_argument_group(
        "trl-ext flags",
        "Also spelled --trl_ext_<flag>; a boolean flag alone means true. The same flags go under `trl_ext:` in the "
        "recipe or in TRL_EXT_<FLAG> variables (command line > environment > recipe). `trl-ext plugins` lists the "
        "plugins' options; `trl-ext plugins NAME` shows one plugin's page.",
    )
    for option, help_text in rows:
        action = group.add_argument(
            f"--trl-ext-help-{len(group._group_actions)}", help=argparse.SUPPRESS, default=argparse.SUPPRESS
        )
        action.trl_ext_line = f"  {option.ljust(width)}{help_text}"
    # argparse lists groups in creation order: put ours first, above TRL's hundreds of options.
    parser._action_groups.remove(group)
    parser._action_groups.insert(0, group)
    base: Any = parser.formatter_class

    class Formatter(base):
        def add_argument(self, action):
            line = getattr(action, "trl_ext_line", None)
            if line is not None:
                self._add_item(lambda: line + "\n", [])
            else:
                super().add_argument(action)

    parser.formatter_class = Formatter


def _explicit_keys(argv: Sequence[str], recipe: dict[str, Any] | None) -> set[str]:
    """Names of the TRL arguments the user gave on the command line or in the recipe."""
    keys = set(recipe or ())
    for token in argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            keys.add(name[3:] if name.startswith("no_") else name)
    return keys


def _has_accelerator() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    for backend in ("mps", "xpu", "npu"):
        module = getattr(torch, backend, None) or getattr(torch.backends, backend, None)
        available = getattr(module, "is_available", None)
        if available is not None and available():
            return True
    return False


def _cpu_defaults(
    parser: Any, argv: Sequence[str], recipe: dict[str, Any] | None, deepspeed: bool
) -> dict[str, Any] | None:
    """On a machine with no accelerator, default the arguments the user did not give to CPU and fp32 (TRL defaults to
    bf16, which then fails; under DeepSpeed `use_cpu` is left alone: it would turn DeepSpeed off); the defaults chosen
    (`cpu_note` says so once the arguments are parsed)."""
    if _has_accelerator():
        return None
    wanted = {"bf16": False} if deepspeed else {"use_cpu": True, "bf16": False}
    explicit = _explicit_keys(argv, recipe)
    chosen = {key: value for key, value in wanted.items() if key not in explicit}
    if not chosen:
        return None
    parser.set_defaults_with_config(**chosen)
    return chosen


def cpu_note(chosen: dict[str, Any], training_args: Any) -> str:
    """The line that says what the job chose on a machine without an accelerator, with the precision it trains in
    (the user's `--bf16 true` / `--fp16 true` included)."""
    precision = "fp32"
    if getattr(training_args, "bf16", False) or getattr(training_args, "fp16", False):
        precision = "bf16" if training_args.bf16 else "fp16"
    said = ", ".join(f"--{key} {str(value).lower()}" for key, value in chosen.items())
    return f"[trl-ext] no accelerator found: training on CPU in {precision} ({said}; give them yourself to choose)"


def parse_job_args(
    parser: Any, command: str, rest: list[str], deepspeed: bool, recipe: str | None = None
) -> tuple[Any, ...]:
    """Parse TRL's arguments like `trl <command>` does, with trl-ext's help group and CPU defaults; bad arguments
    give one `UsageError` line naming their source (`recipe`: the user's recipe path) instead of a traceback."""
    add_trl_ext_help(parser, command)

    path = recipe_path(rest)
    recipe_values = _read_recipe(path) if path else None
    recipe_values = recipe_values if isinstance(recipe_values, dict) else None
    recipe_keys = set(recipe_values or ())

    def error(message: str) -> None:
        # argparse names the argument ("argument --learning_rate/--learning-rate: invalid float value"); a value the
        # command line does not give came from the recipe.
        named = {n.replace("-", "_") for n in re.findall(r"--([\w-]+)", message.split(":", 1)[0])}
        source = "the command line"
        if named & recipe_keys and not named & _explicit_keys(rest, None):
            source = f"the recipe {recipe or recipe_path(rest)}"
        raise UsageError(f"{message} (from {source}). `trl-ext {command} --help` lists the arguments.")

    parser.error = error
    helping = any(token in ("-h", "--help") for token in rest)
    cpu_chosen = None if helping else _cpu_defaults(parser, rest, recipe_values, deepspeed)
    # Warnings raised while the configs are built (e.g. transformers' deprecations) are shown only if the arguments
    # are good: a bad argument gets one error line.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            *parsed, from_recipe, from_cli = parser.parse_args_and_config(
                rest, return_remaining_strings=True, separate_remaining_strings=True
            )
        except UsageError:
            raise
        except ValueError as exc:
            raise UsageError(f"`trl-ext {command}`: {exc}") from None
    if from_cli:
        known = [option for action in parser._actions for option in action.option_strings]
        unknown = [token for token in from_cli if token.startswith("-")] or from_cli
        hint = did_you_mean(unknown[0].split("=", 1)[0], known)
        raise UsageError(
            f"Unknown argument `{unknown[0]}` (from the command line).{hint} `trl-ext {command} --help` lists the "
            "arguments."
        )
    if from_recipe:
        keys = [token[2:] for token in from_recipe if token.startswith("--")]
        hint = did_you_mean(keys[0], [action.dest for action in parser._actions]) if keys else ""
        raise UsageError(
            f"The recipe {recipe or recipe_path(rest)} sets {keys}, which are no `trl-ext {command}` arguments.{hint} "
            f"(`trl {command}` "
            "passes such keys to `accelerate launch`; with trl-ext, launch yourself: `accelerate launch ... "
            f"$(which trl-ext) {command} ...`.)"
        )
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if cpu_chosen and is_main_process():
        training_args = next((p for p in parsed if hasattr(p, "bf16")), None)
        print(cpu_note(cpu_chosen, training_args), file=sys.stderr, flush=True)
    return tuple(parsed)
