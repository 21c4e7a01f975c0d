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
state restoration above, and says so at info level once per trainer.

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

import copy
import dataclasses
from contextlib import ExitStack
from typing import Any

from trl_ext._logging import get_logger
from trl_ext.context import unwrap_causal_lm
from trl_ext.errors import UsageError
from trl_ext.hookspecs import hookimpl
from trl_ext.spec import Flag, PluginSpec, Size, boolean, either, non_negative_float, one_of, optional, size

logger = get_logger(__name__)

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
)

#: `PartitionedParameterCoordinator` keeps its limits in name-mangled attributes (deepspeed 0.19.8,
#: `runtime/zero/partitioned_param_coordinator.py:116-122`). `__params_to_release` releases nothing that reappears
#: within the reuse distance; prefetch is bounded by the bucket size and the live-parameter limit (:452-454).
_COORDINATOR_LIMITS = (
    "_PartitionedParameterCoordinator__max_reuse_dist_in_numel",
    "_PartitionedParameterCoordinator__prefetch_bucket_sz",
    "_PartitionedParameterCoordinator__max_n_available_params",
)
#: `__params_to_release` is `functools.lru_cache`d on (coordinator, submodule, step id) (:633-634), so answers
#: computed under the training limits would be reused during generation; the cache is cleared around generation.
_RELEASE_CACHE = "_PartitionedParameterCoordinator__params_to_release"
#: A module id that no DeepSpeed module has (ids count up from 0): while in `ds_active_sub_modules`, the coordinator
#: never releases the parameter (`__release_param` checks `not param.ds_active_sub_modules`, :628).
_PIN = -20_250_616
_ABSENT = object()


# ---------------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------------


@hookimpl
def trl_ext_validate_config(config, trl_version):
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


# ---------------------------------------------------------------------------------------------------------------
# per-trainer state
# ---------------------------------------------------------------------------------------------------------------


class GenerationState:
    """What the plugin decided for one trainer (kept in `context.state["generation"]`).

    Attributes:
        flag: the `ds3_gather_for_generation` value (`True`, `False` or `"auto"`).
        budget: parsed `budget` option, `(kind, value)` or None.
        auto_margin: headroom for `"auto"`.
        auto_gather: the `"auto"` decision, once made.
        plan: the latest budget plan (which decoder layers stay gathered).
        logged: one-time log lines already written.
        generations: number of generation contexts entered (for tests and reports).
    """

    def __init__(self, flag: Any, options: GenerationOptions | dict[str, Any]) -> None:
        if isinstance(options, dict):  # raw options (benchmarks, tests): parsed like the user's
            options = TRL_EXT_PLUGIN.make_options(options, "GenerationState")
        self.flag = flag
        self.budget = (options.budget.kind, options.budget.value) if options.budget is not None else None
        self.auto_margin = _DEFAULT_AUTO_MARGIN if options.auto_margin is None else options.auto_margin
        self.auto_gather: bool | None = None
        self.plan: BudgetPlan | None = None
        self.logged: set[str] = set()
        self.generations = 0

    def log_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self.logged:
            self.logged.add(key)
            logger.info(message, *args)


def _state(context) -> GenerationState:
    state = context.state.get(NAME)
    if state is None:
        state = context.state[NAME] = GenerationState(context.config.ds3_gather_for_generation, context.options(NAME))
    return state


@hookimpl
def trl_ext_trainer_init_start(trainer, context, init_kwargs):
    _state(context)


@hookimpl
def trl_ext_trainer_init_end(trainer, context):
    check_fsdp_generation(_state(context), trainer.accelerator)


# FSDP (issue 18). Self-contained so that it can move with the plugin when this file is split: the one call site is
# `trl_ext_trainer_init_end` above.
def check_fsdp_generation(state: GenerationState, accelerator: Any) -> None:
    """Under FSDP, accept only the flag value that means what FSDP does, and refuse the others (`UsageError`).

    `ds3_gather_for_generation` is a DeepSpeed ZeRO-3 setting. Under FSDP2 nothing is gathered for generation (TRL's
    `unwrap_model_for_generation` only unwraps): each `fully_shard` unit all-gathers its parameters in its own
    forward and, with `reshard_after_forward=True` (accelerate's and transformers' default), frees them after it. A
    rank then holds its shards, the units kept unsharded on purpose (accelerate 1.15 keeps the final norm + lm_head
    unit unsharded after forward) and one more unit at a time, which is what `False` asks for under ZeRO-3
    (measured in tests/scale: at most 53,440 of a 180,800-element 4-layer model, one decoder layer plus norm and
    lm_head). So:

    - `False` is accepted and logged, if units reshard after forward. With `reshard_after_forward=False` every unit
      stays unsharded from its first generation forward to the next backward, so each rank holds the whole model
      (measured: 180,800 of 180,800): `False` would mean nothing, and is refused.
    - `True` and `"auto"` ask to gather the whole model, which this plugin does only for ZeRO-3, and the `budget`
      option keeps ZeRO-3 layers gathered: accepted under FSDP they would do nothing, so they are refused.
    """
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


@hookimpl
def trl_ext_make_generation_context(trainer, context, model, call_kwargs):
    state = _state(context)
    trl_flag = call_kwargs.get("gather_deepspeed3_params")
    if trl_flag is not None and trl_flag != state.flag:
        state.log_once(
            "trl-flag",
            "generation: %s.ds3_gather_for_generation=%r is overridden by trl-ext's ds3_gather_for_generation=%r",
            type(getattr(trainer, "args", None)).__name__,
            trl_flag,
            state.flag,
        )
    return GenerationContext(state, model, call_kwargs["accelerator"], call_kwargs.get("generation_kwargs"))


@hookimpl
def trl_ext_advise_unused(trainer, trainer_class, trl_args):
    # TRL honours its own `ds3_gather_for_generation=False`, but under ZeRO-3 with DeepSpeed's default limits its
    # layer-by-layer fetch keeps every layer resident (19.0 of 19.0 MiB measured on 2 ranks, issue 15).
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    if getattr(trl_args, "ds3_gather_for_generation", True) is False and getattr(plugin, "zero_stage", None) == 3:
        return (
            f"{type(trl_args).__name__}(ds3_gather_for_generation=False) is left to TRL, whose ZeRO-3 generation "
            "keeps the whole model resident with DeepSpeed's default settings; set trl-ext's "
            '`ds3_gather_for_generation=False` (or "auto") for generation within a bounded budget.'
        )
    return None


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3 helpers
# ---------------------------------------------------------------------------------------------------------------


def _is_zero3_engine(model: Any) -> bool:
    stage = getattr(model, "zero_optimization_stage", None)
    return callable(stage) and type(model).__name__ == "DeepSpeedEngine" and stage() == 3


def _zero3_offload(engine: Any) -> Any:
    """The engine's `DeepSpeedZeRoOffload` (owner of the ZeRO-3 module hooks and the parameter coordinator)."""
    optimizer = getattr(engine, "optimizer", None)
    # The ZeRO-3 optimizer holds it as `parameter_offload`; an engine without a client optimizer holds the
    # `DeepSpeedZeRoOffload` itself as `optimizer` (deepspeed 0.19.8 runtime/engine.py; TRL's `remove_hooks` does the
    # same lookup, trl/models/utils.py).
    offload = getattr(optimizer, "parameter_offload", optimizer)
    if offload is None or not hasattr(offload, "param_coordinator") or not hasattr(offload, "forward_hooks"):
        raise UsageError(
            "trl-ext `generation`: the DeepSpeed ZeRO-3 engine has no parameter offload / coordinator (is it an "
            "engine built without ZeRO-3?). Unset `ds3_gather_for_generation` to leave generation to TRL."
        )
    for attr in _COORDINATOR_LIMITS:
        if not hasattr(offload.param_coordinator, attr):
            import deepspeed

            raise UsageError(
                f"trl-ext `generation` cannot find `{attr}` on DeepSpeed {deepspeed.__version__}'s "
                "PartitionedParameterCoordinator (checked on 0.19.8), so it cannot bound generation memory. Install "
                "deepspeed 0.19.x or unset `ds3_gather_for_generation`."
            )
    return offload


def _clear_release_cache() -> None:
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    fn = PartitionedParameterCoordinator.__dict__.get(_RELEASE_CACHE)
    # `instrument_w_nvtx` wraps the lru_cache without `functools.wraps`: the cache is the wrapper's closure cell.
    cells = getattr(fn, "__closure__", None) or ()
    for candidate in (fn, getattr(fn, "__wrapped__", None), *(cell.cell_contents for cell in cells)):
        if hasattr(candidate, "cache_clear"):
            candidate.cache_clear()


def _invalidate_trace(coordinator: Any) -> None:
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()


def param_bytes(param: Any) -> int:
    """Bytes of the full (gathered) parameter, for ZeRO-3 and ordinary parameters alike."""
    return int(getattr(param, "ds_numel", param.numel())) * param.element_size()


def _direct_params(module: Any) -> list[Any]:
    return list(module.parameters(recurse=False))


def _is_available(param: Any) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return getattr(param, "ds_status", None) == ZeroParamStatus.AVAILABLE


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers: the `nn.ModuleList` holding the most parameters (`model.model.layers` for Llama/Qwen2)."""
    import torch

    best, best_bytes = [], 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            size = sum(param_bytes(p) for p in module.parameters())
            if size > best_bytes:
                best, best_bytes = list(module), size
    return best


def external_params(model: Any) -> list[Any]:
    """Parameters DeepSpeed registered as "external" to a module: it keeps them gathered for that module's forward.

    DeepSpeed registers a parameter that a module's forward returns (or that is used outside its owner) on the
    enclosing module (`register_external_parameter`, deepspeed 0.19.8 runtime/zero/parameter_offload.py:380-398). TRL
    1.16's GRPO computes log-probs with `lm_head.weight` directly, so after the first training step `lm_head.weight`
    is external to the root module and stays gathered through every forward, generation included.
    """
    seen: dict[int, Any] = {}
    for module in model.modules():
        for param in getattr(module, "_external_params", {}).values():
            if not getattr(param, "ds_persist", False):
                seen[id(param)] = param
    return list(seen.values())


class BudgetPlan:
    """Which decoder layers stay gathered under a per-rank budget.

    Attributes:
        budget_bytes: the budget in bytes.
        model_bytes: full size of every parameter.
        persistent_bytes: parameters ZeRO-3 keeps gathered anyway (`ds_persist`).
        external_bytes: parameters DeepSpeed keeps gathered for a whole forward (see `external_params`), outside the
            gathered layers.
        gathered_layers: indices of the decoder layers kept gathered.
        gathered_bytes: their size.
        reserve_bytes: the largest module streamed one at a time.
        num_layers: number of decoder layers.
    """

    def __init__(self, model: Any, budget: tuple[str, float]) -> None:
        params = list(model.parameters())
        self.model_bytes = sum(param_bytes(p) for p in params)
        kind, value = budget
        self.budget_bytes = int(value * self.model_bytes) if kind == "fraction" else int(value)
        self.persistent_bytes = sum(param_bytes(p) for p in params if getattr(p, "ds_persist", False))
        external = {id(p): p for p in external_params(model)}
        layers = decoder_layers(model)
        self.num_layers = len(layers)
        layer_ids = [{id(p) for p in layer.parameters()} for layer in layers]
        layer_bytes = [
            sum(param_bytes(p) for p in layer.parameters() if not getattr(p, "ds_persist", False)) for layer in layers
        ]
        modules = [m for m in model.modules() if _direct_params(m)]

        def resident(gathered: set[int]) -> tuple[int, int]:
            # Streaming holds the external parameters for the whole forward, plus one module's own parameters at a
            # time (DeepSpeed fetches and releases per module).
            ext = sum(param_bytes(p) for key, p in external.items() if key not in gathered)
            sizes = [
                sum(param_bytes(p) for p in _direct_params(m) if not getattr(p, "ds_persist", False))
                for m in modules
                if not all(id(p) in gathered or id(p) in external for p in _direct_params(m))
            ]
            return ext, max(sizes, default=0)

        gathered: set[int] = set()
        self.gathered_layers: list[int] = []
        self.gathered_bytes = 0
        self.external_bytes, self.reserve_bytes = resident(gathered)
        minimum = self.persistent_bytes + self.external_bytes + self.reserve_bytes
        if self.budget_bytes < minimum:
            raise UsageError(
                f"`plugins.generation.budget` is {_fmt(self.budget_bytes)} per rank, below the {_fmt(minimum)} that "
                f"streaming alone needs ({_fmt(self.persistent_bytes)} of persistent parameters, "
                f"{_fmt(self.external_bytes)} DeepSpeed keeps for a whole forward, and the largest module, "
                f"{_fmt(self.reserve_bytes)}). Raise the budget, or lower `stage3_param_persistence_threshold`."
            )
        for index, ids in enumerate(layer_ids):
            candidate = gathered | ids
            ext, reserve = resident(candidate)
            if self.persistent_bytes + self.gathered_bytes + layer_bytes[index] + ext + reserve > self.budget_bytes:
                break
            gathered = candidate
            self.gathered_layers.append(index)
            self.gathered_bytes += layer_bytes[index]
            self.external_bytes, self.reserve_bytes = ext, reserve
        self._layers = [layers[i] for i in self.gathered_layers]

    def params(self) -> list[Any]:
        return [p for layer in self._layers for p in layer.parameters() if not getattr(p, "ds_persist", False)]

    def describe(self) -> str:
        return (
            f"budget {_fmt(self.budget_bytes)} per rank keeps {len(self.gathered_layers)} of {self.num_layers} "
            "decoder "
            f"layers gathered ({_fmt(self.gathered_bytes)} of a {_fmt(self.model_bytes)} model) and streams the rest "
            f"one module at a time (largest {_fmt(self.reserve_bytes)}; persistent {_fmt(self.persistent_bytes)}; "
            f"held for a whole forward {_fmt(self.external_bytes)})"
        )


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def free_memory_bytes(device: Any) -> int:
    """Free memory where gathered parameters would live: device memory on an accelerator, available RAM on CPU."""
    import torch

    kind = getattr(device, "type", "cpu")
    if kind == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    if kind == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[0])
    from deepspeed.accelerator import get_accelerator  # other accelerators (XPU, NPU, ...)

    return int(get_accelerator().available_memory(getattr(device, "index", None)))


def _all_ranks_agree(flag: bool, device: Any) -> bool:
    """True only if `flag` is True on every rank (one collective), so every rank takes the same path."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


# ---------------------------------------------------------------------------------------------------------------
# the context manager
# ---------------------------------------------------------------------------------------------------------------


class GenerationContext:
    """Context manager returned in place of TRL's `unwrap_model_for_generation(...)`; yields the unwrapped model.

    A class (not a generator-based `@contextmanager`), so it cannot yield twice or fail to stop. Every change is pushed
    on an `ExitStack` as it is made, so whatever was changed before an exception is undone, newest first.
    """

    def __init__(self, state: GenerationState, model: Any, accelerator: Any, generation_kwargs: dict | None) -> None:
        self.state = state
        self.model = model
        self.accelerator = accelerator
        self.generation_kwargs = generation_kwargs
        self.mode: str | None = None  # "gather", "stream", "budget" or "passthrough", once entered
        self._stack: ExitStack | None = None

    def __enter__(self) -> Any:
        if self._stack is not None:
            raise RuntimeError("trl-ext generation context entered twice; create a new one per generation")
        self._stack = ExitStack()
        try:
            unwrapped = self._enter(self._stack)
        except BaseException:
            self._stack.close()
            raise
        self.state.generations += 1
        return unwrapped

    def __exit__(self, exc_type, exc, tb) -> bool:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(exc_type, exc, tb)
        return False  # never swallow the caller's exception

    # -- steps ------------------------------------------------------------------------------------------------

    def _enter(self, stack: ExitStack) -> Any:
        unwrapped = self.accelerator.unwrap_model(self.model)
        _keep_training_modes(stack, unwrapped)
        _pause_gradient_checkpointing(stack, unwrapped)
        _keep_generation_config(stack, unwrapped, self.generation_kwargs)
        if not _is_zero3_engine(self.model):
            self.mode = "passthrough"
            self.state.log_once(
                "no-zero3",
                "generation: the model is not a DeepSpeed ZeRO-3 engine (single process, DDP, ZeRO-1/2 or FSDP): "
                "nothing to gather or stream; generation only gets trl-ext's exception-safe restore of modes, "
                "gradient checkpointing and generation_config",
            )
            return unwrapped
        offload = _zero3_offload(self.model)
        mode = self._choose_mode(unwrapped)
        self.mode = mode
        if mode == "gather":
            _gather_all(stack, self.model, offload)
        else:
            plan = self.state.plan if mode == "budget" else None
            _stream(stack, unwrapped, offload, plan.params() if plan is not None else [])
        return unwrapped

    def _choose_mode(self, unwrapped: Any) -> str:
        state = self.state
        flag = state.flag
        if flag == "auto":
            if state.auto_gather is None:
                model_bytes = sum(param_bytes(p) for p in unwrapped.parameters())
                free = free_memory_bytes(self.accelerator.device)
                fits = model_bytes * (1 + state.auto_margin) <= free
                state.auto_gather = _all_ranks_agree(fits, self.accelerator.device)
                state.log_once(
                    "auto",
                    'generation: ds3_gather_for_generation="auto": the %s model %s %s free on %s with a %d%% margin; '
                    "generation will %s",
                    _fmt(model_bytes),
                    "fits in" if fits else "does not fit in",
                    _fmt(free),
                    "this rank" if fits == state.auto_gather else "this rank but not on every rank",
                    round(100 * state.auto_margin),
                    "gather the whole model"
                    if state.auto_gather
                    else ("keep layers gathered within the budget" if state.budget else "stream without gathering"),
                )
            if state.auto_gather:
                return "gather"
        elif flag is True:
            return "gather"
        if state.budget is None:
            return "stream"
        # Planned at every generation (cheap next to generating): DeepSpeed may register external parameters during
        # training that change what streaming holds. Logged once per distinct plan.
        state.plan = BudgetPlan(unwrapped, state.budget)
        state.log_once(f"plan{state.plan.gathered_layers}", "generation: %s", state.plan.describe())
        return "budget"


def _keep_training_modes(stack: ExitStack, model: Any) -> None:
    modes = [(m, m.training) for m in model.modules()]

    def restore() -> None:
        for module, training in modes:
            if module.training != training:
                module.training = training

    stack.callback(restore)


def _pause_gradient_checkpointing(stack: ExitStack, model: Any) -> None:
    """Switch gradient checkpointing off for generation and put back the user's exact setting afterwards.

    TRL calls `gradient_checkpointing_disable()` / `gradient_checkpointing_enable()` (trl/models/utils.py), which
    re-creates the checkpoint function without the user's `gradient_checkpointing_kwargs` (B12; OnlineDPO passes none,
    trl 1.16 online_dpo_trainer.py:1032-1036). Here the per-module flags and checkpoint functions are saved and
    restored as they were, so the kwargs survive, and the PEFT input-grad hooks those methods toggle are left alone.
    """
    saved = []
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing"):
            own = vars(module)
            saved.append(
                (
                    module,
                    bool(module.gradient_checkpointing),
                    own.get("gradient_checkpointing", _ABSENT),
                    own.get("_gradient_checkpointing_func", _ABSENT),
                )
            )
    if not any(enabled for _, enabled, _, _ in saved):
        return

    def restore() -> None:
        # Put back each module's own entries exactly (or their absence, so a class default shows through again).
        for module, _, flag, func in saved:
            for attr, value in (("gradient_checkpointing", flag), ("_gradient_checkpointing_func", func)):
                if value is _ABSENT:
                    vars(module).pop(attr, None)
                else:
                    vars(module)[attr] = value

    stack.callback(restore)
    for module, enabled, _, _ in saved:
        if enabled:
            module.gradient_checkpointing = False


def _keep_generation_config(stack: ExitStack, model: Any, generation_kwargs: dict | None) -> None:
    """Give generation a private copy of `generation_config`, so changes made inside the context do not stick.

    OnlineDPO sets `unwrapped_model.generation_config.cache_implementation` inside the context (trl 1.16
    online_dpo_trainer.py:1042-1043); TRL only swaps in a copy on transformers < 5
    (`_override_model_generation_config`, trl/models/utils.py), where it also applies the trainer's
    `generation_kwargs`, as done here.
    """
    base = unwrap_causal_lm(model)
    original = getattr(base, "generation_config", None)
    if original is None:
        return
    import transformers
    from packaging.version import Version

    private = copy.deepcopy(original)
    if generation_kwargs is not None and Version(transformers.__version__) < Version("5.0.0"):
        private.update(**generation_kwargs)
    stack.callback(setattr, base, "generation_config", original)
    base.generation_config = private


def _gather_all(stack: ExitStack, engine: Any, offload: Any) -> None:
    """TRL's gather mode (trl/models/utils.py `_unwrap_model_for_generation`), with the hooks restored in `finally`."""
    import deepspeed

    stack.enter_context(deepspeed.zero.GatheredParameters(engine.parameters()))
    # With everything gathered the per-module fetch/release hooks are pure overhead (and would release the gathered
    # parameters after their first use): remove them, as TRL's `remove_hooks` does, and register them again on exit.
    stack.callback(_add_hooks, offload)
    _remove_hooks(offload)


def _remove_hooks(offload: Any) -> None:
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    for param in iter_params(offload.module, recurse=True):
        param.ds_active_sub_modules.clear()
    for hook in list(offload.forward_hooks) + list(offload.backward_hooks):
        hook.remove()
    offload.forward_hooks = []
    offload.backward_hooks = []


def _add_hooks(offload: Any) -> None:
    if offload.forward_hooks or offload.backward_hooks:
        return  # still registered: nothing was removed
    _invalidate_trace(offload.param_coordinator)
    offload._register_deepspeed_module(offload.module)


def _stream(stack: ExitStack, model: Any, offload: Any, pinned: list[Any]) -> None:
    """Generate with the ZeRO-3 hooks fetching one module at a time, optionally with some parameters kept gathered."""
    import deepspeed
    from deepspeed.runtime.zero import parameter_offload

    coordinator = offload.param_coordinator
    # DeepSpeed's pre-forward hook pushes each module on this global stack and its post-forward hook pops it
    # (runtime/zero/parameter_offload.py:366, :537); an exception in between leaves stale entries behind.
    module_stack = parameter_offload.FWD_MODULE_STACK
    module_stack_depth = len(module_stack)
    params = list(model.parameters())
    available_before = {id(p) for p in params if _is_available(p)}
    active_before = [(p, set(p.ds_active_sub_modules)) for p in params]
    limits = {attr: getattr(coordinator, attr) for attr in _COORDINATOR_LIMITS}

    def restore() -> None:
        # An exception inside a module's forward skips DeepSpeed's post-forward release: wait for in-flight
        # all-gathers, give every parameter back its module bookkeeping, and release what generation left gathered.
        coordinator._clean_inflight_param_registry()
        del module_stack[module_stack_depth:]
        leftovers = []
        for param, active in active_before:
            param.ds_active_sub_modules.clear()
            param.ds_active_sub_modules.update(active)
            if id(param) not in available_before and _is_available(param) and not active:
                leftovers.append(param)
        if leftovers:
            leftovers[0].partition(param_list=leftovers)
        for attr, value in limits.items():
            setattr(coordinator, attr, value)
        _clear_release_cache()
        # The trace recorded during generation must not drive the next training step's prefetching (TRL's
        # `add_hooks` invalidates it for the same reason).
        _invalidate_trace(coordinator)

    stack.callback(restore)
    for attr in _COORDINATOR_LIMITS:
        setattr(coordinator, attr, 0)
    _clear_release_cache()
    _invalidate_trace(coordinator)
    if pinned:
        active_at_entry = {id(p): active for p, active in active_before}
        stack.enter_context(deepspeed.zero.GatheredParameters(pinned))

        def unpin() -> None:
            # Back to the bookkeeping at entry (an exception may have left a module id next to the pin), so that
            # `GatheredParameters.__exit__` may partition them.
            for param in pinned:
                param.ds_active_sub_modules.clear()
                param.ds_active_sub_modules.update(active_at_entry[id(param)])

        stack.callback(unpin)
        for param in pinned:
            param.ds_active_sub_modules.add(_PIN)
