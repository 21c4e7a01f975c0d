"""`trl-ext dpo` (TRL's own DPO script) and `trl-ext online-dpo` (a small one of ours: TRL has none), run with trl-ext
installed, also under `accelerate launch` with several processes and a DeepSpeed config (docs/configuration.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from .._logging import get_logger, is_main_process
from .._shared import PeakMemory
from ..config import TrlExtConfig
from ..errors import UsageError
from .job_args import parse_job_args, recipe_path, resolve_config
from .job_checks import check_dataset, check_output_dir, check_path, load_job_dataset

logger = get_logger(__name__)


def _deepspeed() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def _prepare_cpu_deepspeed() -> bool:
    """Under a DeepSpeed launch without CUDA, skip DeepSpeed's g++ build of its shm comm op (ZeRO does not use it) and
    create the gloo state first (accelerate otherwise computes no backend for DeepSpeed on CPU and every rank believes
    it is rank 0), for the trainer to reuse; True if it did. Such a job ends with `os._exit` (`_exit_distributed`)."""
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


def _job_args(argv: Sequence[str], command: str, make_parser: Any) -> tuple[TrlExtConfig, bool, tuple[Any, ...]]:
    """The job's trl-ext configuration (merged once), whether it runs DeepSpeed on CPU, and TRL's parsed arguments."""
    config, rest, stripped = resolve_config(argv)
    cpu_deepspeed = _prepare_cpu_deepspeed()
    parser = make_parser()
    if cpu_deepspeed:
        # The trainer reuses the gloo state. It must be in place before the config is parsed: `TrainingArguments`
        # sets up its devices while being built and would otherwise reset the state. A user's own
        # `accelerator_config` replaces this default and must then say `use_configured_state: true` itself.
        parser.set_defaults_with_config(accelerator_config={"use_configured_state": True})
    try:
        return config, cpu_deepspeed, parse_job_args(parser, command, rest, _deepspeed(), recipe_path(argv))
    finally:
        if stripped:
            os.unlink(stripped)


def _report(installation, trainer_class: str, peak: PeakMemory) -> None:
    """One line per trainer of the job's class: the plugins it ran with, then each plugin's summary. The peak memory
    is said once: in the line each trainer logs when `train()` returns (`trl_ext.build`), or, for a job trl-ext did
    not attach to (no plugin applies), here, measured over the whole job (`peak`)."""
    if not is_main_process():
        return
    records = installation.records
    if not any(r["trainer"] == trainer_class for r in records):
        # no enabled plugin applies to the job's trainer: trl-ext did not attach to it
        records = [{"trainer": trainer_class, "plugins": [], "summaries": {}}, *records]
    for record in records:
        plugins = ", ".join(record["plugins"]) or "none"
        memory = ""
        if record["trainer"] == trainer_class and not record["plugins"]:  # no `train()` line said its peak
            memory = f"; {peak.text()} during the job (model loading included)"
        print(f"[trl-ext] {record['trainer']} ran with plugins: {plugins}{memory}", flush=True)
        for name, summary in record["summaries"].items():
            print(f"[trl-ext]   {name}: {summary}", flush=True)


def run_dpo(argv: Sequence[str]) -> int:
    """`trl-ext dpo ...`: TRL's `trl/scripts/dpo.py` with trl-ext installed."""

    # TRL's script is imported once the DeepSpeed-on-CPU state is in place (`_prepare_cpu_deepspeed`).
    config, cpu_deepspeed, parsed = _job_args(
        argv, "dpo", lambda: importlib.import_module("trl.scripts.dpo").make_parser(prog="trl-ext dpo")
    )
    script_args, training_args, model_args, dataset_args = parsed
    _check_job(config, "DPOTrainer", training_args, model_args.model_name_or_path, "dpo")
    dataset = None
    if script_args.dataset_name and not dataset_args.datasets:
        dataset = _job_dataset(script_args, training_args, "dpo", getattr(script_args, "dataset_streaming", False))
    with (
        _installed_for_job(config, cpu_deepspeed, "DPOTrainer", _job_device(training_args)),
        _handed_to_trl(dataset, script_args.dataset_name),
    ):
        importlib.import_module("trl.scripts.dpo").main(script_args, training_args, model_args, dataset_args)
    return 0


def _check_job(config: TrlExtConfig, trainer_class: str, training_args: Any, model: str | None, command: str) -> None:
    """Before a model is loaded, a path or settings mistake is one line that names the fix: the model and output
    folder, and what the job's trainer would refuse for its settings when built (options of a plugin that stays off,
    a plugin flag given off against the TRL flag it serves)."""
    from ..build import check_trainer_settings

    if not model:
        raise UsageError(f"`trl-ext {command}` needs `--model_name_or_path` (a model folder or a Hub id).")
    check_path(model, "--model_name_or_path", "model")
    check_output_dir(training_args.output_dir)
    check_trainer_settings(config, trainer_class, training_args)


def _job_dataset(script_args: Any, training_args: Any, command: str, streaming: bool = False) -> Any:
    """`--dataset_name` loaded (a `save_to_disk` folder included) and checked: splits, rows, columns."""
    name, train = script_args.dataset_name, script_args.dataset_train_split
    dataset = load_job_dataset(name, script_args.dataset_config, train, streaming)
    test = script_args.dataset_test_split if training_args.eval_strategy != "no" else None
    check_dataset(dataset, command, name, train, test)
    return dataset


@contextlib.contextmanager
def _handed_to_trl(dataset: Any, name: str | None):
    """TRL's script calls `datasets.load_dataset(--dataset_name ...)`: it gets the dataset loaded and checked here."""
    if dataset is None:
        yield
        return
    import datasets

    original = datasets.load_dataset

    def load_dataset(path: Any, *args: Any, **kwargs: Any) -> Any:
        return dataset if path == name else original(path, *args, **kwargs)

    datasets.load_dataset = load_dataset
    try:
        yield
    finally:
        datasets.load_dataset = original


@dataclasses.dataclass
class OnlineDPOScriptArguments:
    """Arguments of `trl-ext online-dpo` besides `OnlineDPOConfig` and `ModelConfig`.

    Args:
        dataset_name (`str`): A dataset with a `prompt` column: a Hub id, a local folder `datasets.load_dataset` can
            open, or a folder written by `save_to_disk`.
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
    check_path(spec if ":" not in spec else None, "--reward_funcs", "reward model")
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
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import ModelConfig, TrlParser

    with warnings.catch_warnings():
        # We chose the experimental trainer for the user; TRL's warning about importing it is noise here.
        warnings.filterwarnings("ignore", message=".*trl.experimental.*")
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    dataclass_types: Any = (OnlineDPOScriptArguments, OnlineDPOConfig, ModelConfig)
    config, cpu_deepspeed, parsed = _job_args(
        argv, "online-dpo", lambda: TrlParser(dataclass_types, prog="trl-ext online-dpo")
    )
    script_args, training_args, model_args = parsed
    if not script_args.dataset_name:
        raise UsageError("`trl-ext online-dpo` needs `--dataset_name` (a dataset with a `prompt` column).")
    if not script_args.reward_funcs:
        raise UsageError("`trl-ext online-dpo` needs `--reward_funcs` (`module:function` or a reward model path).")
    _check_job(config, "OnlineDPOTrainer", training_args, model_args.model_name_or_path, "online-dpo")
    check_path(script_args.ref_model_name_or_path, "--ref_model_name_or_path", "model")
    reward_funcs = [_load_reward(spec) for spec in script_args.reward_funcs]
    dataset = _job_dataset(script_args, training_args, "online-dpo")
    with _installed_for_job(config, cpu_deepspeed, "OnlineDPOTrainer", _job_device(training_args)):
        init_kwargs = dict(dtype=model_args.dtype, attn_implementation=model_args.attn_implementation)
        init_kwargs = {k: v for k, v in init_kwargs.items() if v is not None}
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **init_kwargs)
        ref_path = script_args.ref_model_name_or_path or model_args.model_name_or_path
        ref_model = AutoModelForCausalLM.from_pretrained(ref_path, **init_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
        trainer = OnlineDPOTrainer(
            model=model,
            ref_model=ref_model,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=dataset[script_args.dataset_train_split],
            eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
            processing_class=tokenizer,
        )
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model(training_args.output_dir)
        del trainer
    return 0


def _job_device(training_args: Any) -> Any:
    """The device the job trains on, without `training_args.device` (which would set up the distributed state before
    TRL's script does): the CUDA device of this process's local rank, or the CPU."""
    import torch

    if torch.cuda.is_available() and not training_args.use_cpu:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@contextlib.contextmanager
def _installed_for_job(config: TrlExtConfig, cpu_deepspeed: bool, trainer_class: str, device: Any = None):
    """trl-ext installed for the job (exactly `config`, merged once); afterwards report the plugins each trainer ran
    with (and the job's peak memory on `device`, the CPU's when None), uninstall, and on CPU DeepSpeed end the process
    the safe way."""
    from ..installation import install_config

    installation = install_config(config)
    installation.keep_records = True
    try:
        with PeakMemory(device) as peak:
            yield installation
        _report(installation, trainer_class, peak)
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
