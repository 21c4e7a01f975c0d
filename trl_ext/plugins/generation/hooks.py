"""The hook implementations of `generation` (declared in its package), imported when the plugin is registered."""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from trl_ext import _compat
from trl_ext.api import UsageError, get_logger, hookimpl

from .context import BudgetPlan, GenerationContext

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import Trainer

    from trl_ext.api import TrainerContext, TrlExtConfig

from . import _DEFAULT_AUTO_MARGIN, NAME, TRL_EXT_PLUGIN, GenerationOptions

logger = get_logger(__name__)


@hookimpl
def trl_ext_validate_config(config: TrlExtConfig, trl_version: str) -> None:
    options: GenerationOptions = config.options(NAME)
    flag = config.ds3_gather_for_generation
    if options.budget is not None and flag is True:
        raise UsageError(
            "`plugins.generation.budget` limits what stays gathered, but `ds3_gather_for_generation=True` gathers "
            'the whole model. Use `ds3_gather_for_generation=False` (budget mode) or "auto" with the budget.'
        )
    if options.auto_margin is not None and flag != "auto":
        raise UsageError(
            '`plugins.generation.auto_margin` only applies to `ds3_gather_for_generation="auto"`, but it is '
            f'{flag!r}. Remove the option or set the flag to "auto".'
        )


class GenerationState:
    """What the plugin decided for one trainer (kept in `context.state["generation"]`): the flag, the `budget` option
    as `(kind, value)`, the `"auto"` margin and decision (`auto_gather`, once made), the latest budget `plan`, the
    one-time log lines written, and for tests and reports the generations entered, in all and by mode."""

    def __init__(self, flag: Any, options: GenerationOptions | dict[str, Any]) -> None:
        if isinstance(options, dict):  # raw options (benchmarks, tests): parsed like the user's
            options = TRL_EXT_PLUGIN.make_options(options, "GenerationState")
        assert isinstance(options, GenerationOptions)
        self.flag = flag
        self.budget = (options.budget.kind, options.budget.value) if options.budget is not None else None
        self.auto_margin = _DEFAULT_AUTO_MARGIN if options.auto_margin is None else options.auto_margin
        self.auto_gather: bool | None = None
        self.plan: BudgetPlan | None = None
        self.logged: set[str] = set()
        self.generations = 0
        self.modes: Counter[str] = Counter()

    def summary(self) -> str:
        """What ran, for the end-of-run line (`trl-ext online-dpo`: `[trl-ext]   generation: ...`)."""
        if not self.generations:
            return "did nothing: no generation ran"
        if set(self.modes) == {"passthrough"}:
            return (
                "did nothing: the model is not a DeepSpeed ZeRO-3 engine (single process, DDP, ZeRO-1/2 or FSDP), so "
                f"there was nothing to gather or stream; its {self.generations} generation(s) only got the "
                "exception-safe restore of modes, gradient checkpointing and generation_config"
            )
        return f"{self.generations} generation(s): " + ", ".join(
            f"{n} {mode}" for mode, n in sorted(self.modes.items())
        )

    def log_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self.logged:
            self.logged.add(key)
            logger.info(message, *args)


def check_fsdp_generation(state: GenerationState, accelerator: Any) -> None:
    """Under FSDP, accept only the flag value that means what FSDP does, and refuse the others (`UsageError`).

    Under FSDP2 each `fully_shard` unit is unsharded for its own forward only (TRL's `unwrap_model_for_generation` just
    unwraps), which is what `False` asks for under ZeRO-3 (tests/scale checks the peak; docs/plugins/generation.md,
    "Under FSDP2"): `False` is accepted unless `reshard_after_forward=False` keeps every unit unsharded; `True`,
    `"auto"` and the `budget` option would do nothing and are refused."""
    from accelerate.utils import DistributedType

    state_ = getattr(accelerator, "state", None)
    plugin = getattr(state_, "fsdp_plugin", None)
    if plugin is None or getattr(accelerator, "distributed_type", None) != DistributedType.FSDP:
        return
    version = getattr(plugin, "fsdp_version", 1)
    if state.flag is not False or state.budget is not None:
        setting = "the `budget` option" if state.flag is False else f"ds3_gather_for_generation={state.flag!r}"
        raise UsageError(
            f"trl-ext `generation`: {setting} has no effect under FSDP{version}: the plugin gathers or keeps "
            "parameters gathered only for DeepSpeed ZeRO-3. Under FSDP each fully_shard unit is unsharded in its "
            "own forward (with reshard_after_forward=True, freed after it), so generation already holds one unit "
            "at a time. Set ds3_gather_for_generation=False (and no `budget`), or unset it."
        )
    if plugin.reshard_after_forward is False:
        raise UsageError(
            "trl-ext `generation`: ds3_gather_for_generation=False asks to keep generation memory bounded, but the "
            f"FSDP{version} plugin has reshard_after_forward=False, so every unit stays unsharded after its first "
            "generation forward and each rank holds the whole model. Set fsdp_config "
            '{"reshard_after_forward": true}, or unset ds3_gather_for_generation.'
        )
    state.log_once(
        "fsdp",
        "generation: under FSDP%d with reshard_after_forward=True each unit is unsharded only for its own forward: "
        "ds3_gather_for_generation=False holds what FSDP holds (shards, the unsharded tail and one unit at a time)",
        version,
    )


def _state(context: TrainerContext) -> GenerationState:
    """The trainer's `GenerationState`, made by the first hook that needs it."""
    state = context.state.get(NAME)
    if state is None:
        state = context.state[NAME] = GenerationState(context.config.ds3_gather_for_generation, context.options(NAME))
    return state


@hookimpl
def trl_ext_trainer_init_end(trainer: Trainer, context: TrainerContext) -> None:
    check_fsdp_generation(_state(context), trainer.accelerator)


@hookimpl
def trl_ext_describe(trainer: Trainer, context: TrainerContext) -> str | None:
    state = _state(context)
    text = f"ds3_gather_for_generation={state.flag!r}"
    if state.budget is not None:
        kind, value = state.budget
        text += f", budget {value:.0%} of the model" if kind == "fraction" else f", budget {int(value)} bytes"
    return text


@hookimpl
def trl_ext_advise_unused(trainer: Trainer, trainer_class: str, trl_args: Any) -> str | None:
    # TRL honours its own `ds3_gather_for_generation=False`, but under ZeRO-3 with DeepSpeed's default limits its
    # layer-by-layer fetch keeps every layer resident.
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    if getattr(trl_args, "ds3_gather_for_generation", True) is False and getattr(plugin, "zero_stage", None) == 3:
        return (
            f"{type(trl_args).__name__}(ds3_gather_for_generation=False) is left to TRL, whose ZeRO-3 generation "
            "keeps the whole model resident with DeepSpeed's default settings; set trl-ext's "
            '`ds3_gather_for_generation=False` (or "auto") for generation within a bounded budget.'
        )
    return None


@hookimpl
def trl_ext_make_generation_context(
    trainer: Trainer, context: TrainerContext, model: torch.nn.Module, call_kwargs: dict[str, Any]
) -> AbstractContextManager | None:
    state = _state(context)
    accelerator_param, flag_param = _compat.GENERATION_HELPER_PARAMS
    trl_flag = call_kwargs.get(flag_param)
    if trl_flag is not None and trl_flag != state.flag:
        state.log_once(
            "trl-flag",
            "generation: %s.ds3_gather_for_generation=%r is overridden by trl-ext's ds3_gather_for_generation=%r",
            type(getattr(trainer, "args", None)).__name__,
            trl_flag,
            state.flag,
        )
    return GenerationContext(
        state, model, call_kwargs[accelerator_param], call_kwargs.get(_compat.GENERATION_HELPER_KWARGS_PARAM)
    )
