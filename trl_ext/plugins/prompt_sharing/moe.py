"""The MoE router auxiliary loss of a shared forward, computed as the padded forward computes it.

A shared row routes each prompt once, so the shared forward's own auxiliary loss (`_compat.MOE_AUX_LOSS`, a
mask-weighted mean over the batch's tokens) counts a prompt once where the padded batch counts it once per response.
Routing is per token, so the router logits of the shared row scattered back to the padded layout are exactly the
padded batch's: the loss function applied to them with the padded `attention_mask` gives the padded value, and its
gradient reaches each shared prompt token as the sum over the rows that read it.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trl_ext import _compat
from trl_ext.api import UsageError

from .layout import SharedLayout, unpack

__all__ = ["MoeAuxLoss"]


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The `*ForCausalLM` module of `model` (itself, or the one inside a PEFT wrapper)."""
    for module in model.modules():
        if type(module).__name__.endswith("ForCausalLM"):
            return module
    return model


class MoeAuxLoss:
    """Captures the router logits of a shared call (a forward hook on the backbone, for the duration of the call) and
    replaces the outputs' `aux_loss` (and its share of `loss`) with the padded layout's."""

    def __init__(self, lm: torch.nn.Module, balance: Callable, num_experts: int, top_k: int, coef: float) -> None:
        self.lm, self.balance, self.num_experts, self.top_k, self.coef = lm, balance, num_experts, top_k, coef
        self._router_logits: Any = None

    @classmethod
    def of(cls, model: torch.nn.Module) -> MoeAuxLoss | None:
        """The recomputation for a MoE model (a config with `output_router_logits`); None for any other model.

        Raises `UsageError` for a MoE model whose loss cannot be reproduced (no number of experts or top-k)."""
        config = model.config
        if not hasattr(config, "output_router_logits"):
            return None
        lm = _causal_lm(model)
        module_name, function = _compat.MOE_AUX_LOSS
        balance = getattr(sys.modules.get(type(lm).__module__), function, None)
        if not callable(balance):
            balance = getattr(importlib.import_module(module_name), function)
        text_config = getattr(config, "text_config", None) or config
        num_experts = getattr(lm, "num_experts", None) or getattr(text_config, "num_experts", None)
        num_experts = num_experts or getattr(text_config, "num_local_experts", None)
        top_k = getattr(lm, "num_experts_per_tok", None) or getattr(text_config, "num_experts_per_tok", None)
        if not isinstance(num_experts, int) or not isinstance(top_k, int):
            raise UsageError(
                f"prompt_sharing cannot reproduce the router auxiliary loss of {type(lm).__name__}: it names no "
                "number of experts and top-k (`num_experts`, `num_experts_per_tok`). Disable prompt_sharing for this "
                "model."
            )
        coef: Any = getattr(lm, "router_aux_loss_coef", None)
        coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
        return cls(lm, balance, num_experts, top_k, float(coef or 0.0))

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the router logits of the backbone call made inside (the model's own forward and TRL's fused LM head
        both call the backbone, which returns them when asked)."""

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._router_logits = getattr(output, "router_logits", None)

        self._router_logits = None
        backbone: torch.nn.Module = getattr(self.lm, "base_model", self.lm)
        handle = backbone.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def apply(self, outputs: Any, layout: SharedLayout, attention_mask: torch.Tensor) -> None:
        """Replace `outputs.aux_loss` (and `loss`, which includes `coef * aux_loss`) with the padded layout's."""
        router_logits, self._router_logits = self._router_logits, None
        shared_aux = getattr(outputs, "aux_loss", None)
        if shared_aux is None:
            return  # the call asked for no router logits: no auxiliary loss to reproduce
        if not isinstance(router_logits, tuple) or not router_logits:
            raise UsageError(
                f"prompt_sharing: {type(self.lm).__name__} returned an auxiliary loss but its backbone returned no "
                "router logits to recompute it in the padded layout; disable prompt_sharing for this model."
            )
        flat = layout.rows * layout.length
        padded = tuple(unpack(r.reshape(1, -1, r.shape[-1]), layout).reshape(flat, r.shape[-1]) for r in router_logits)
        aux = self.balance(padded, self.num_experts, self.top_k, attention_mask)
        loss = getattr(outputs, "loss", None)
        if loss is not None:
            outputs.loss = loss + self.coef * (aux - shared_aux).to(loss.device)
        outputs.aux_loss = aux
        if getattr(outputs, "router_logits", None) is not None:
            outputs.router_logits = padded
