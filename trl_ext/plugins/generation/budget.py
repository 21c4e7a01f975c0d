"""The memory arithmetic of generation: full parameter sizes, the decoder layers, DeepSpeed's "external" parameters
and the `BudgetPlan` (which decoder layers stay gathered under a per-rank budget)."""

from __future__ import annotations

from typing import Any

from trl_ext import _compat
from trl_ext.api import UsageError
from trl_ext.api import size_text as fmt


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
