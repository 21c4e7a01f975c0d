"""DeepSpeed ZeRO-3 internals of generation: the engine's offload and parameter coordinator, TRL's gather mode with
the hooks restored, and streaming with the coordinator's limits lowered and everything put back (`_compat.DS_*`)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from trl_ext import _compat
from trl_ext.api import UsageError

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
