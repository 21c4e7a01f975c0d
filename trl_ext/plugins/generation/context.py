"""`GenerationContext`: the context manager returned in place of TRL's `unwrap_model_for_generation(...)`, the state
it restores on every path (training modes, gradient checkpointing, `generation_config`), and the memory arithmetic of
its modes: full parameter sizes, the decoder layers, DeepSpeed's "external" parameters and the `BudgetPlan` (which
decoder layers stay gathered under a per-rank budget); and the DeepSpeed ZeRO-3 internals it uses: the engine's offload
and parameter coordinator, TRL's gather mode with the hooks restored, and streaming with the coordinator's limits
lowered and everything put back (`_compat.DS_*`)."""

from __future__ import annotations

import copy
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Literal

from trl_ext import _compat
from trl_ext.api import InternalError, Ranks, UsageError, free_memory_bytes, unwrap_causal_lm
from trl_ext.api import size_text as fmt

if TYPE_CHECKING:
    from .hooks import GenerationState

_ABSENT = object()


def param_bytes(param: Any) -> int:
    """Bytes of the full (gathered) parameter, for ZeRO-3 and ordinary parameters alike."""
    return int(getattr(param, "ds_numel", param.numel())) * param.element_size()


def _direct_params(module: Any) -> list[Any]:
    return list(module.parameters(recurse=False))


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
        for param in getattr(module, _compat.DS_EXTERNAL_PARAMS_ATTR, {}).values():
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
                f"`plugins.generation.budget` is {fmt(self.budget_bytes)} per rank, below the {fmt(minimum)} that "
                f"streaming alone needs ({fmt(self.persistent_bytes)} of persistent parameters, "
                f"{fmt(self.external_bytes)} DeepSpeed keeps for a whole forward, and the largest module, "
                f"{fmt(self.reserve_bytes)}). Raise the budget, or lower `stage3_param_persistence_threshold`."
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
            f"budget {fmt(self.budget_bytes)} per rank keeps {len(self.gathered_layers)} of {self.num_layers} decoder "
            f"layers gathered ({fmt(self.gathered_bytes)} of a {fmt(self.model_bytes)} model) and streams the rest "
            f"one module at a time (largest {fmt(self.reserve_bytes)}; persistent {fmt(self.persistent_bytes)}; "
            f"held for a whole forward {fmt(self.external_bytes)})"
        )


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
            raise InternalError("generation: a generation context was entered twice (trl-ext makes one per call)")
        self._stack = ExitStack()
        try:
            unwrapped = self._enter(self._stack)
        except BaseException:
            self._stack.close()
            raise
        self.state.generations += 1
        self.state.modes[self.mode or "passthrough"] += 1
        return unwrapped

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
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
        if not is_zero3_engine(self.model):
            self.mode = "passthrough"
            self.state.log_once(
                "no-zero3",
                "generation: the model is not a DeepSpeed ZeRO-3 engine (single process, DDP, ZeRO-1/2 or FSDP): "
                "nothing to gather or stream; generation only gets trl-ext's exception-safe restore of modes, "
                "gradient checkpointing and generation_config",
            )
            return unwrapped
        offload = zero3_offload(self.model)
        mode = self._choose_mode(unwrapped)
        self.mode = mode
        if mode == "gather":
            gather_all(stack, self.model, offload)
        else:
            plan = self.state.plan if mode == "budget" else None
            stream(stack, unwrapped, offload, plan.params() if plan is not None else [])
        return unwrapped

    def _choose_mode(self, unwrapped: Any) -> str:
        state = self.state
        flag = state.flag
        if flag == "auto":
            if state.auto_gather is None:
                model_bytes = sum(param_bytes(p) for p in unwrapped.parameters())
                free = free_memory_bytes(self.accelerator.device)
                fits = model_bytes * (1 + state.auto_margin) <= free
                state.auto_gather = Ranks.of(self.accelerator).all_true(fits, self.accelerator.device)
                state.log_once(
                    "auto",
                    'generation: ds3_gather_for_generation="auto": the %s model %s %s free on %s with a %d%% margin; '
                    "generation will %s",
                    fmt(model_bytes),
                    "fits in" if fits else "does not fit in",
                    fmt(free),
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
    re-creates the checkpoint function without the user's `gradient_checkpointing_kwargs` (OnlineDPO passes none).
    Here the per-module flag and checkpoint function (`_compat.GRADIENT_CHECKPOINTING_ATTRS`) are saved and restored
    as they were, so the kwargs survive, and the PEFT input-grad hooks those methods toggle are left alone.
    """
    flag_attr, func_attr = _compat.GRADIENT_CHECKPOINTING_ATTRS
    saved = []
    for module in model.modules():
        if hasattr(module, flag_attr):
            own = vars(module)
            saved.append(
                (module, bool(getattr(module, flag_attr)), own.get(flag_attr, _ABSENT), own.get(func_attr, _ABSENT))
            )
    if not any(enabled for _, enabled, _, _ in saved):
        return

    def restore() -> None:
        # Put back each module's own entries exactly (or their absence, so a class default shows through again).
        for module, _, flag, func in saved:
            for attr, value in ((flag_attr, flag), (func_attr, func)):
                if value is _ABSENT:
                    vars(module).pop(attr, None)
                else:
                    vars(module)[attr] = value

    stack.callback(restore)
    for module, enabled, _, _ in saved:
        if enabled:
            setattr(module, flag_attr, False)


def _keep_generation_config(stack: ExitStack, model: Any, generation_kwargs: dict | None) -> None:
    """Give generation a private copy of `generation_config`, so changes made inside the context (OnlineDPO sets
    `cache_implementation`) do not stick; the trainer's `generation_kwargs` are applied to it on the versions where TRL
    applies them (`_compat.TRL_GENERATION_CONFIG_OVERRIDE`)."""
    base = unwrap_causal_lm(model)
    original = getattr(base, "generation_config", None)
    if original is None:
        return
    private = copy.deepcopy(original)
    if generation_kwargs is not None and _compat.trl_applies_generation_kwargs():
        private.update(**generation_kwargs)
    stack.callback(setattr, base, "generation_config", original)
    base.generation_config = private


#: A module id that no DeepSpeed module has (ids count up from 0): while in `ds_active_sub_modules`, the coordinator
#: never releases the parameter (`__release_param` checks `not param.ds_active_sub_modules`, deepspeed 0.19.8 :628).
_PIN = -20_250_616


def is_zero3_engine(model: Any) -> bool:
    stage = getattr(model, "zero_optimization_stage", None)
    return callable(stage) and type(model).__name__ == "DeepSpeedEngine" and stage() == 3


def zero3_offload(engine: Any) -> Any:
    """The engine's `DeepSpeedZeRoOffload` (owner of the ZeRO-3 module hooks and the parameter coordinator)."""
    optimizer = getattr(engine, "optimizer", None)
    # The ZeRO-3 optimizer holds it as `parameter_offload`; an engine without a client optimizer holds the
    # `DeepSpeedZeRoOffload` itself as `optimizer` (deepspeed 0.19.8 runtime/engine.py; TRL's `remove_hooks` does the
    # same lookup, trl/models/utils.py).
    offload = getattr(optimizer, _compat.DS_OPTIMIZER_OFFLOAD_ATTR, optimizer)
    if offload is None or not hasattr(offload, "param_coordinator") or not hasattr(offload, "forward_hooks"):
        raise UsageError(
            "trl-ext `generation`: the DeepSpeed ZeRO-3 engine has no parameter offload / coordinator (is it an "
            "engine built without ZeRO-3?). Unset `ds3_gather_for_generation` to leave generation to TRL."
        )
    for attr in _compat.DS_COORDINATOR_LIMITS:
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

    fn = PartitionedParameterCoordinator.__dict__.get(_compat.DS_RELEASE_CACHE)
    # `instrument_w_nvtx` wraps the lru_cache without `functools.wraps`: the cache is the wrapper's closure cell.
    cells = getattr(fn, "__closure__", None) or ()
    for candidate in (fn, getattr(fn, "__wrapped__", None), *(cell.cell_contents for cell in cells)):
        if hasattr(candidate, "cache_clear"):
            candidate.cache_clear()


def _invalidate_trace(coordinator: Any) -> None:
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()


def _is_available(param: Any) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return getattr(param, "ds_status", None) == ZeroParamStatus.AVAILABLE


def gather_all(stack: ExitStack, engine: Any, offload: Any) -> None:
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


def stream(stack: ExitStack, model: Any, offload: Any, pinned: list[Any]) -> None:
    """Generate with the ZeRO-3 hooks fetching one module at a time, optionally with some parameters kept gathered."""
    import deepspeed

    coordinator = offload.param_coordinator
    # DeepSpeed's pre-forward hook pushes each module on this global stack and its post-forward hook pops it
    # (runtime/zero/parameter_offload.py:366, :537); an exception in between leaves stale entries behind.
    module_stack = _compat.import_object(*_compat.DS_FWD_MODULE_STACK)
    module_stack_depth = len(module_stack)
    params = list(model.parameters())
    available_before = {id(p) for p in params if _is_available(p)}
    active_before = [(p, set(p.ds_active_sub_modules)) for p in params]
    limits = {attr: getattr(coordinator, attr) for attr in _compat.DS_COORDINATOR_LIMITS}

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
    for attr in _compat.DS_COORDINATOR_LIMITS:
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
