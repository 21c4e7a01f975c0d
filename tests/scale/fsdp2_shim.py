"""The test-only shim that lets accelerate run FSDP2 on CPU processes.

accelerate switches `AcceleratorState` to FSDP only for accelerator device types (accelerate 1.15 `state.py`, the
`MULTI_GPU, MULTI_XPU, ...` branch of `AcceleratorState.__init__`): on CPU processes an `fsdp_plugin` is silently
ignored and training runs as plain multi-CPU DDP. `fully_shard` itself works on gloo, so the shim below lets the plugin
through. It lives in tests/ only: trl-ext never changes how accelerate picks an engine.

Every `AcceleratorState()` construction copies the process-level `PartialState` (`MULTI_CPU`) back into the shared
state (`self.__dict__.update(PartialState._shared_state)`), e.g. when accelerate wraps the optimizer, so switching once
is not enough: the shim re-applies the switch after every construction (research/fsdp2_cpu.md saw a switch-once
fixture silently train under DDP). The launched script also checks that the trained model really holds FSDP2 modules.
"""

from __future__ import annotations


def enable_fsdp2_on_cpu() -> None:
    """Make every later `AcceleratorState` on a multi-CPU process use the FSDP plugin it was given (test-only)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_trl_ext_fsdp2_on_cpu", False):
        return
    original = AcceleratorState.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.__dict__.get("fsdp_plugin") is None:
            self.fsdp_plugin = plugin
        if self.__dict__.get("fsdp_plugin") is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP

    __init__._trl_ext_fsdp2_on_cpu = True
    AcceleratorState.__init__ = __init__


def is_fsdp2_model(model) -> bool:
    """True if `model` (or a submodule) was sharded by FSDP2's `fully_shard` (its class becomes `FSDP<name>`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    return any(isinstance(m, FSDPModule) for m in model.modules())
