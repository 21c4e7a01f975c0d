"""Bounded-memory, exception-safe generation under DeepSpeed ZeRO-3 (`OnlineDPOTrainer`, `GRPOTrainer`, `RLOOTrainer`).

TRL's online trainers generate inside `unwrap_model_for_generation` (`trl/models/utils.py`). Under ZeRO-3 that context
either gathers the whole model onto every rank (`ds3_gather_for_generation=True`, out of memory once the model is
bigger than one device, TRL #2250) or does not gather (`False`). With DeepSpeed's default ZeRO-3 settings (prefetch
bucket, `stage3_max_reuse_distance`, `stage3_max_live_parameters`) the `False` mode still ends up holding the whole
model on every rank: the parameter coordinator prefetches and keeps what its recorded trace says comes again soon. The
context also has no `try/finally` (TRL #6659): an exception during generation leaves the ZeRO-3 hooks removed and
gradient checkpointing off, and on the normal path OnlineDPO gets gradient checkpointing back without the user's
`gradient_checkpointing_kwargs` (B12).

This plugin replaces that context:

- `ds3_gather_for_generation=True`: gather every parameter for generation, as TRL does, but exception-safe.
- `ds3_gather_for_generation=False`: do not gather, and really bound what each rank holds. For the duration of
  generation the ZeRO-3 parameter coordinator's reuse distance, prefetch bucket and live-parameter limit are set to 0
  (its trace is invalidated and its release cache cleared), so each rank holds its own shard, the persistent
  parameters (`stage3_param_persistence_threshold`), the parameters DeepSpeed registered as "external" to an
  enclosing module (held for that module's whole forward; TRL 1.16's GRPO makes `lm_head.weight` one), and one
  module's parameters at a time. The user's settings come back after generation. Every module is all-gathered again
  at every decoding step, so this is slower than gathering.
- `ds3_gather_for_generation=False` with the `budget` option: the middle ground. As many whole decoder layers as the
  budget allows stay gathered for the whole generation; the rest is streamed as in the `False` mode.
- `ds3_gather_for_generation="auto"`: gather only if the full model fits in free memory with a margin (device memory
  on GPU, available system memory on CPU). Decided once per trainer, identically on every rank (one collective),
  and logged. When it does not fit, generation streams (within the `budget`, if one is given).

In every mode, whether generation ends normally or raises, the context restores the ZeRO-3 hooks, coordinator
settings and parameter bookkeeping, the training/eval mode of every module, the model's `generation_config` (TRL and
callers may change it inside the context), and gradient checkpointing exactly as the user enabled it (the same
checkpoint function, so the same `gradient_checkpointing_kwargs`). It is a class-based context manager, so it yields
exactly once on every path (TRL #2639, "generator didn't stop").

Without DeepSpeed ZeRO-3 (one process, DDP, ZeRO-1/2) there is nothing to gather or stream: the context only does the
state restoration above, says so at info level once per trainer, and the end-of-run line of `trl-ext online-dpo`
says it did nothing.

Enable:

```python
import trl_ext

with trl_ext.install(ds3_gather_for_generation=False, plugins={"generation": {"budget": "8GB"}}):
    trainer = OnlineDPOTrainer(model, args=OnlineDPOConfig(..., deepspeed="ds_z3.json"), ...)
    trainer.train()
```

or `TRL_EXT_DS3_GATHER_FOR_GENERATION=auto` in the environment, or `ds3_gather_for_generation: auto` in a trl-ext YAML
file. While the plugin is enabled, the trl-ext flag decides; the trainer config's own `ds3_gather_for_generation` is
ignored (logged once when it differs).

Options (`plugins: {generation: {...}}`):

- `budget` (`str`, `int` or `float`, *optional*): per-rank budget for full-size (gathered) parameters during
  generation, for `False` and for `"auto"` when the model does not fit. A size (`"8GB"` = 8e9 bytes, `"512MiB"`, an
  `int` number of bytes) or a fraction of the model's parameter bytes (`0 < x <= 1`). It covers the persistent and
  external parameters, the gathered layers and one streamed module; not the local shard, KV cache or activations.
- `auto_margin` (`float`, *optional*, defaults to `0.25`): in `"auto"` mode the model is gathered only if
  `model bytes * (1 + auto_margin)` is free on every rank.

Refuses (`trl_ext.UsageError`): unknown options, a malformed `budget`, `budget` together with
`ds3_gather_for_generation=True`, `auto_margin` without `"auto"`, options without the flag, a `budget` below what
streaming alone needs (persistent and external parameters plus the largest module; raised at the first generation,
on every rank), and a DeepSpeed whose parameter coordinator no longer has the settings this plugin lowers (checked on
DeepSpeed 0.19.8).
"""

from __future__ import annotations

import dataclasses

from ..._lazy import lazy_getattr
from ..._shared import free_memory_bytes
from ...spec import Flag, PluginSpec, Size, boolean, either, non_negative_float, one_of, optional, size
from .budget import BudgetPlan, decoder_layers, external_params, param_bytes
from .context import GenerationContext
from .fsdp import check_fsdp_generation

__all__ = [
    "NAME",
    "TRL_EXT_PLUGIN",
    "BudgetPlan",
    "GenerationContext",
    "GenerationOptions",
    "check_fsdp_generation",
    "decoder_layers",
    "external_params",
    "free_memory_bytes",
    "param_bytes",
]

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


__getattr__ = lazy_getattr(__name__, rest="hooks")  # the implementation's names, imported on first use only
