"""A third-party plugin written as its author would, every definition annotated with trl-ext's public types.

`tests/test_house.py` runs mypy on it against the package (`--disallow-untyped-defs`), and on a copy with one wrong
annotation (the line marked `WRONG`), which mypy must reject: proof that mypy reads trl-ext's types (`py.typed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trl_ext
from trl_ext import Flag, Installation, PluginSpec, TrainerContext, TrlExtConfig, UsageError
from trl_ext.api import PACKING, boolean, positive_int

if TYPE_CHECKING:
    from transformers import Trainer


@dataclass(frozen=True)
class CounterOptions:
    """Options of the `typed_counter` plugin.

    Args:
        every (`int`, *optional*, defaults to `1`):
            Count one logging step in `every`.
    """

    every: int = field(default=1, metadata={"parse": positive_int})


TRL_EXT_PLUGIN: PluginSpec = PluginSpec(
    name="typed_counter",
    summary="Counts logging steps.",
    flags=(Flag("typed_counter", default=False, parse=boolean, help="Count logging steps."),),
    options=CounterOptions,
    trainers=("DPOTrainer",),
)


@dataclass
class CounterState:
    """What the plugin keeps for one trainer."""

    every: int
    seen: int = 0

    def summary(self) -> str:
        return f"{self.seen} logging steps"


def _options(config: TrlExtConfig) -> CounterOptions:
    options = config.options(TRL_EXT_PLUGIN.name)
    assert isinstance(options, CounterOptions)
    return options


@trl_ext.hookimpl
def trl_ext_validate_config(config: TrlExtConfig, trl_version: str) -> None:
    if config.flag_is_set(TRL_EXT_PLUGIN.name) and _options(config).every > 1000:
        raise UsageError("`plugins.typed_counter.every` must be at most 1000.")


@trl_ext.hookimpl
def trl_ext_trainer_init_end(trainer: Trainer, context: TrainerContext) -> None:
    context.state[TRL_EXT_PLUGIN.name] = CounterState(every=_options(context.config).every)


@trl_ext.hookimpl
def trl_ext_describe(trainer: Trainer, context: TrainerContext) -> str | None:
    roles: tuple[str, ...] = context.plugins_serving(PACKING)  # WRONG: list[str]
    return f"every {_options(context.config).every} logging steps; packing by {', '.join(roles) or 'none'}"


@trl_ext.hookimpl
def trl_ext_reduce_metrics(
    trainer: Trainer, context: TrainerContext, logs: dict[str, float]
) -> dict[str, float] | None:
    state = context.state[TRL_EXT_PLUGIN.name]
    assert isinstance(state, CounterState)
    state.seen += 1
    return None


@trl_ext.hookimpl
def trl_ext_uninstall(installation: Installation) -> None:
    enabled: bool = installation.installed
    del enabled
