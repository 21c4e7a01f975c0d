"""Bounded-memory, exception-safe generation under DeepSpeed ZeRO-3 (`OnlineDPOTrainer`, `GRPOTrainer`, `RLOOTrainer`).

Replaces TRL's `unwrap_model_for_generation` context: gather (as TRL, exception-safe), stream one module at a time,
keep whole layers within a memory `budget`, or `"auto"`; every mode restores the model's state on every path.

See docs/plugins/generation.md.
"""

from __future__ import annotations

import dataclasses

from trl_ext.api import (
    Flag,
    PluginSpec,
    Size,
    boolean,
    either,
    lazy_getattr,
    non_negative_float,
    one_of,
    optional,
    size,
)

NAME = "generation"
_DEFAULT_AUTO_MARGIN = 0.25


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    """Options of the `generation` plugin (`plugins: {generation: {...}}`).

    Args:
        budget (`str`, `int` or `float`, *optional*):
            Per-rank budget for full-size (gathered) parameters during generation, for `False` and for `"auto"` when
            the model does not fit: a size (`"8GB"`, `"512MiB"`, an `int` number of bytes) or a fraction of the
            model's parameter bytes (`0.5` or `"50%"`).
        auto_margin (`float`, *optional*, defaults to `0.25`):
            In `"auto"` mode the model is gathered only if `model bytes * (1 + auto_margin)` is free on every rank.
    """

    budget: Size | None = dataclasses.field(default=None, metadata={"parse": size})
    auto_margin: float | None = dataclasses.field(default=None, metadata={"parse": non_negative_float})


TRL_EXT_PLUGIN = PluginSpec(
    name=NAME,
    summary="Bounded, exception-safe ZeRO-3 generation (gather, stream, a memory budget, or auto).",
    flags=(
        Flag(
            "ds3_gather_for_generation",
            default=None,
            parse=optional(either(boolean, one_of("auto"))),
            help='Gather ZeRO-3 parameters for generation: true, false (stream, bounded) or "auto".',
        ),
    ),
    options=GenerationOptions,
    trainers=("OnlineDPOTrainer", "GRPOTrainer", "RLOOTrainer"),
    hooks=".hooks",
)


#: the implementation's names, imported on first use: the memory arithmetic from `.context`, the rest from `.hooks`
_CONTEXT_NAMES = ("BudgetPlan", "GenerationContext", "decoder_layers", "external_params", "param_bytes")
__getattr__ = lazy_getattr(__name__, dict.fromkeys(_CONTEXT_NAMES, f"{__name__}.context"), rest="hooks")
