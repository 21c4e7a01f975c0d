"""`trl-ext dpo` and `trl-ext online-dpo`: TRL's own training scripts, run with trl-ext installed.

`trl-ext dpo` accepts everything `trl dpo` accepts (script arguments, `DPOConfig`, `ModelConfig`, dataset mixtures,
a YAML `--config`) plus trl-ext flags, given as `--trl_ext_<flag> VALUE` on the command line or under a `trl_ext:`
key in the YAML recipe (command line > `TRL_EXT_*` environment > YAML). TRL has no Online DPO script, so
`trl-ext online-dpo` runs a small one of ours with the usual setup (policy, optional reference, reward functions or
a reward model, `OnlineDPOConfig`). Both work under `accelerate launch` (`accelerate launch $(which trl-ext) dpo ...`)
with several processes and a DeepSpeed config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import sys
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

from .._logging import get_logger
from ..config import TrlExtConfig, load_config
from ..errors import UsageError

logger = get_logger(__name__)

_PREFIX = "--trl_ext_"
_EXTRA_KEYS = ("config",)  # --trl_ext_config PATH: a trl-ext YAML of its own


def _cli_name(token: str) -> str | None:
    """`--trl_ext_padding_free` and `--trl-ext-padding-free` -> `padding_free`; None for other tokens."""
    head = token.split("=", 1)[0]
    if not (head.startswith("--trl_ext_") or head.startswith("--trl-ext-")):
        return None
    return head[len(_PREFIX) :].replace("-", "_")


def split_argv(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """Take `--trl_ext_<flag> VALUE` / `--trl_ext_<flag>=VALUE` (dashes or underscores) out of `argv`.

    The flags are those the installed plugins declare, plus `--trl_ext_plugins JSON`, `--trl_ext_block A,B` and
    `--trl_ext_config PATH`. A flag given without a value takes its declared `cli_const` (usually `true`).
    """
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
            else:
                value = "true"
        if name not in catalog.flags and name not in (*_EXTRA_KEYS, "plugins", "block"):
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
    try:
        with open(path) as f:
            recipe = yaml.safe_load(f) or {}
    except OSError as exc:
        raise UsageError(f"Cannot read the recipe `--config {path}`: {exc}") from None
    if not isinstance(recipe, dict) or "trl_ext" not in recipe:
        return None, argv, None
    section = recipe.pop("trl_ext") or {}
    fd, stripped = tempfile.mkstemp(prefix="trl-ext-recipe-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(recipe, f)
    argv = [*argv[: index + 1], stripped, *argv[index + 2 :]]
    return section, argv, stripped


def _resolve_config(argv: Sequence[str]) -> tuple[TrlExtConfig, list[str], str | None]:
    flags, rest = split_argv(argv)
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
    return load_config(base, flags=flags, sources=sources), rest, stripped


def _flag_lines() -> list[tuple[str, str]]:
    """`(option, help)` for every trl-ext flag the installed plugins declare, plus the core keys."""
    from ..manager import load_catalog

    catalog = load_catalog(warn=False)[0]
    lines = []
    for name, (flag, owner) in catalog.flags.items():
        value = "[BOOL]" if flag.cli_const is True and flag.default is False else "VALUE"
        lines.append((f"--trl-ext-{name.replace('_', '-')} {value}", f"{flag.help} (plugin `{owner}`)"))
    lines.append(
        ("--trl-ext-plugins JSON", 'Options by plugin name, e.g. \'{"padding_free": {"attention": "dense"}}\'.')
    )
    lines.append(("--trl-ext-block A,B", "Plugins never to load."))
    lines.append(("--trl-ext-config PATH", "A trl-ext YAML of its own (instead of the recipe's `trl_ext:` section)."))
    return lines


class _OneLine:
    """A help entry printed as one line, however long the terminal (argparse would wrap it)."""

    def __init__(self, text: str) -> None:
        self.text = text


def add_trl_ext_help(parser: Any, command: str) -> None:
    """Give `trl-ext <command> --help` a short usage line and a first argument group with one line per trl-ext flag.

    The group is built from the flag table, so a third-party plugin's flags appear too. Its entries are
    documentation only (`split_argv` takes the flags out of the command line before TRL's parser sees it).
    """
    import argparse

    parser.usage = f"%(prog)s [-h] [--config RECIPE.yaml] [--trl-ext-<flag> VALUE ...] [{command} arguments below ...]"
    rows = _flag_lines()
    width = max(len(option) for option, _ in rows) + 2
    group = parser.add_argument_group(
        "trl-ext flags",
        "Also spelled --trl_ext_<flag>; a boolean flag alone means true. The same flags go under `trl_ext:` in the "
        "recipe or in TRL_EXT_<FLAG> variables (command line > environment > recipe). `trl-ext plugins` lists the "
        "plugins' options.",
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
    """On a machine with no accelerator, default to CPU and fp32 (TRL defaults to bf16, which then fails); return
    the defaults chosen (`cpu_note` says so once the arguments are parsed).

    Only arguments the user did not give are defaulted. Under DeepSpeed, `use_cpu` is left alone: it would turn
    DeepSpeed off.
    """
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


def _read_recipe(argv: Sequence[str]) -> dict[str, Any] | None:
    if "--config" not in argv:
        return None
    import yaml

    with open(argv[list(argv).index("--config") + 1]) as f:
        recipe = yaml.safe_load(f)
    return recipe if isinstance(recipe, dict) else None


def parse_job_args(parser: Any, command: str, rest: list[str], deepspeed: bool) -> tuple[Any, ...]:
    """Parse TRL's arguments like `trl <command>` does, with trl-ext's help group and CPU defaults; bad arguments
    give one `UsageError` line naming their source instead of a traceback."""
    import difflib

    add_trl_ext_help(parser, command)

    def error(message: str) -> None:
        raise UsageError(f"{message} (from the command line). `trl-ext {command} --help` lists the arguments.")

    parser.error = error
    helping = any(token in ("-h", "--help") for token in rest)
    cpu_chosen = None if helping else _cpu_defaults(parser, rest, _read_recipe(rest), deepspeed)
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
        close = difflib.get_close_matches(unknown[0].split("=", 1)[0], known, n=1)
        hint = f" Did you mean `{close[0]}`?" if close else ""
        raise UsageError(
            f"Unknown argument `{unknown[0]}` (from the command line).{hint} `trl-ext {command} --help` lists the "
            "arguments."
        )
    if from_recipe:
        keys = [token[2:] for token in from_recipe if token.startswith("--")]
        raise UsageError(
            f"The recipe (--config) sets {keys}, which are no `trl-ext {command}` arguments. (`trl {command}` "
            "passes such keys to `accelerate launch`; with trl-ext, launch yourself: `accelerate launch ... "
            f"$(which trl-ext) {command} ...`.)"
        )
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if cpu_chosen and _is_main_process():
        training_args = next((p for p in parsed if hasattr(p, "bf16")), None)
        print(cpu_note(cpu_chosen, training_args), file=sys.stderr, flush=True)
    return tuple(parsed)


def _deepspeed() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def _prepare_cpu_deepspeed() -> bool:
    """Under a DeepSpeed launch on a machine without CUDA, apply what DeepSpeed needs on CPU; True if it did.

    (1) skip DeepSpeed's g++ build of its shm comm op, which ZeRO does not use; (2) create the gloo state before
    anything else (accelerate otherwise computes no backend for DeepSpeed on CPU and every rank believes it is rank 0),
    and let the trainer reuse it (`accelerator_config.use_configured_state`, set by the caller); (3) the caller ends
    the process with `destroy_process_group()` then `os._exit`, since gloo can abort at interpreter exit.
    """
    if not _deepspeed():
        return False
    import torch

    if torch.cuda.is_available():
        return False
    shm: Any = importlib.import_module("deepspeed.comm.torch")
    shm.build_shm_op = lambda: None
    from accelerate import PartialState

    PartialState(backend="gloo")
    logger.info("trl-ext: DeepSpeed on CPU: gloo backend, configured accelerate state, shm op build skipped")
    return True


def _use_configured_state(parser: Any) -> None:
    """Make the trainer reuse the gloo state. It must be in place before the config is parsed: `TrainingArguments`
    sets up its devices while being built and would otherwise reset the state. A user's own `accelerator_config`
    (recipe or command line) replaces this default and must then say `use_configured_state: true` itself."""
    parser.set_defaults_with_config(accelerator_config={"use_configured_state": True})


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


def _report(installation, trainer_class: str) -> None:
    if not _is_main_process():
        return
    if not installation.records:  # no enabled plugin applies to the job's trainer: trl-ext did not attach to it
        print(f"[trl-ext] {trainer_class} ran with plugins: none", flush=True)
    for record in installation.records:
        plugins = ", ".join(record["plugins"]) or "none"
        print(f"[trl-ext] {record['trainer']} ran with plugins: {plugins}", flush=True)
        for name, summary in record["summaries"].items():
            print(f"[trl-ext]   {name}: {summary}", flush=True)


def run_dpo(argv: Sequence[str]) -> int:
    """`trl-ext dpo ...`: TRL's `trl/scripts/dpo.py` with trl-ext installed."""

    config, rest, stripped = _resolve_config(argv)
    cpu_deepspeed = _prepare_cpu_deepspeed()
    dpo_script = importlib.import_module("trl.scripts.dpo")
    parser = dpo_script.make_parser(prog="trl-ext dpo")
    if cpu_deepspeed:
        _use_configured_state(parser)
    try:
        script_args, training_args, model_args, dataset_args = parse_job_args(parser, "dpo", rest, _deepspeed())
    finally:
        if stripped:
            os.unlink(stripped)
    with _installed_for_job(config, cpu_deepspeed, "DPOTrainer"):
        dpo_script.main(script_args, training_args, model_args, dataset_args)
    return 0


@dataclasses.dataclass
class OnlineDPOScriptArguments:
    """Arguments of `trl-ext online-dpo` besides `OnlineDPOConfig` and `ModelConfig`.

    Args:
        dataset_name (`str`): A dataset `datasets.load_dataset` can open (a local path works) with a `prompt` column.
        dataset_config (`str`, *optional*): Dataset configuration name.
        dataset_train_split (`str`, *optional*, defaults to `"train"`): Split to train on.
        dataset_test_split (`str`, *optional*, defaults to `"test"`): Split to evaluate on.
        ref_model_name_or_path (`str`, *optional*): Reference model; defaults to a copy of the policy.
        reward_funcs (`list[str]`, *optional*): Reward functions as `module:function`, or reward model paths.
    """

    dataset_name: str | None = None
    dataset_config: str | None = None
    dataset_train_split: str = "train"
    dataset_test_split: str = "test"
    ref_model_name_or_path: str | None = None
    reward_funcs: list[str] = dataclasses.field(default_factory=list)


def _load_reward(spec: str) -> Any:
    """`module:function` (modules in the current directory are found, as with `python -m`), or a model path/id."""
    if ":" in spec and not os.path.exists(spec):
        module_name, _, attr = spec.partition(":")
        cwd = os.getcwd()
        added = cwd not in sys.path and "" not in sys.path
        if added:
            sys.path.insert(0, cwd)
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise UsageError(
                f"`--reward_funcs {spec}`: cannot import `{attr}` from `{module_name}` ({exc}). Modules are looked up "
                f"in the current directory ({cwd}) and on the Python path."
            ) from None
        finally:
            if added:
                sys.path.remove(cwd)
    return spec  # a reward model path or id: OnlineDPOTrainer loads it


def run_online_dpo(argv: Sequence[str]) -> int:
    """`trl-ext online-dpo ...`: a minimal Online DPO script (TRL ships none) with trl-ext installed."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import ModelConfig, TrlParser

    with warnings.catch_warnings():
        # We chose the experimental trainer for the user; TRL's warning about importing it is noise here.
        warnings.filterwarnings("ignore", message=".*trl.experimental.*")
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    config, rest, stripped = _resolve_config(argv)
    cpu_deepspeed = _prepare_cpu_deepspeed()
    dataclass_types: Any = (OnlineDPOScriptArguments, OnlineDPOConfig, ModelConfig)
    parser = TrlParser(dataclass_types, prog="trl-ext online-dpo")
    if cpu_deepspeed:
        _use_configured_state(parser)
    try:
        script_args, training_args, model_args = parse_job_args(parser, "online-dpo", rest, _deepspeed())
    finally:
        if stripped:
            os.unlink(stripped)
    if not script_args.dataset_name:
        raise UsageError("`trl-ext online-dpo` needs `--dataset_name` (a dataset with a `prompt` column).")
    if not script_args.reward_funcs:
        raise UsageError("`trl-ext online-dpo` needs `--reward_funcs` (`module:function` or a reward model path).")
    if not model_args.model_name_or_path:
        raise UsageError("`trl-ext online-dpo` needs `--model_name_or_path`.")
    with _installed_for_job(config, cpu_deepspeed, "OnlineDPOTrainer"):
        init_kwargs = dict(dtype=model_args.dtype, attn_implementation=model_args.attn_implementation)
        init_kwargs = {k: v for k, v in init_kwargs.items() if v is not None}
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **init_kwargs)
        ref_path = script_args.ref_model_name_or_path or model_args.model_name_or_path
        ref_model = AutoModelForCausalLM.from_pretrained(ref_path, **init_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
        trainer = OnlineDPOTrainer(
            model=model,
            ref_model=ref_model,
            reward_funcs=[_load_reward(spec) for spec in script_args.reward_funcs],
            args=training_args,
            train_dataset=dataset[script_args.dataset_train_split],
            eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
            processing_class=tokenizer,
        )
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model(training_args.output_dir)
        del trainer
    return 0


@contextlib.contextmanager
def _installed_for_job(config: TrlExtConfig, cpu_deepspeed: bool, trainer_class: str):
    """trl-ext installed for the job (exactly `config`, merged once); afterwards report the plugins each trainer ran
    with, uninstall, and on CPU DeepSpeed end the process the safe way."""
    from ..installation import install_config

    installation = install_config(config)
    installation.keep_records = True
    try:
        yield installation
        _report(installation, trainer_class)
    finally:
        # The job is over: its trainers are detached with the uninstall, so no "trainers keep their plugins" line.
        installation.uninstall(detach=True)
    _exit_distributed(force_exit=cpu_deepspeed)


def _exit_distributed(force_exit: bool = False) -> None:
    """End a successful distributed job cleanly: every rank reaches a barrier, then the process group is destroyed.

    On gloo (CPU ranks) the process then ends with `os._exit(0)`: gloo's worker threads can still be alive when the
    interpreter tears down, and the C++ runtime then aborts the rank ("terminate called without an active exception",
    SIGABRT) after a run that succeeded. NCCL jobs return normally, so `atexit` handlers (loggers, trackers) run.
    """
    import torch.distributed as dist

    gloo = False
    if dist.is_available() and dist.is_initialized():
        gloo = dist.get_backend() == "gloo"
        dist.barrier()
        dist.destroy_process_group()
    if gloo or force_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main_job(command: str, argv: Sequence[str]) -> int:
    try:
        return {"dpo": run_dpo, "online-dpo": run_online_dpo}[command](argv)
    finally:
        sys.stdout.flush()
