"""`DPOTrainer` on TRL < 1.15 (no fused LM head there): its scoring forwards return `LazyLogits` instead of logits.

TRL's `_compute_loss` and `compute_ref_log_probs` (checked 1.10-1.14 layout, verified on 1.12) run
`outputs = model(**model_kwargs)`, slice `outputs.logits[..., :-1, :]` and read it through
`selective_log_softmax` (every loss type's log-probs), `F.cross_entropy` (the `sft` loss), `torch.logsumexp` of the
logits and of `2.0 *` the logits (WPO weights, `use_weighting`), `entropy_from_logits` (`entropy`), `.mean(-1)` over
boolean-selected positions (`logits/chosen`, `logits/rejected`) and `.argmax(-1)` (`mean_token_accuracy`). While one of
those two methods runs, each causal LM's forward returns its hidden states (the head passes through) wrapped in a
`LazyLogits`, and the two helpers TRL imports into `trl.trainer.dpo_trainer` are replaced by versions that reduce a
`LazyLogits` chunk by chunk (any other argument goes to TRL's own). The loss code itself is TRL's, unchanged: every
loss type, `loss_weights`, `ld_alpha`, `use_weighting`.

Only the completion positions are scored (TRL sets the other log-probs to 0 right after). An evaluation that asks
for the logits themselves (`prediction_loss_only=False`) gets them: that call runs stock.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ... import _compat
from ..._logging import get_logger
from ...errors import UsageError
from .lazy import LazyLogits, entropy, selective_logprobs
from .online import FusedState, output_head, run_passing_through

__all__ = ["install_dpo"]

logger = get_logger(__name__)

#: The TRL module whose imported helpers read the logits, and the helpers replaced there.
DPO_MODULE = _compat.DPO_LOGITS_MODULE
_LOGPROBS_HELPER, _ENTROPY_HELPER = _compat.DPO_LOGITS_HELPERS
HELPERS: dict[str, Callable[[Callable], Callable]] = {
    _LOGPROBS_HELPER: lambda original: selective_logprobs(original, _scored),
    _ENTROPY_HELPER: entropy,
}
#: The trainer methods whose model calls return `LazyLogits`.
SCORING_METHODS = _compat.DPO_SCORING_METHODS

#: The shifted completion mask of the scoring call in progress (None outside one).
_SCORING: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("trl_ext_fused_dpo", default=None)


@contextlib.contextmanager
def _scoring(mask: torch.Tensor) -> Iterator[None]:
    token = _SCORING.set(mask)
    try:
        yield
    finally:
        _SCORING.reset(token)


def _scored(logits: LazyLogits) -> torch.Tensor | None:
    mask = _SCORING.get()
    if mask is None or tuple(mask.shape) != tuple(logits.shape[:-1]):
        return None
    return mask.bool()


def _wrap_method(original: Callable, name: str, state: FusedState) -> Callable:
    @functools.wraps(original)
    def method(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        return_outputs = kwargs.get("return_outputs", args[0] if args else False)
        if name == "_compute_loss" and return_outputs:
            if not state.stock_logits_calls:
                logger.warning(
                    "fused_logprobs: an evaluation asked DPOTrainer for its logits (prediction_loss_only=False); "
                    "those calls build the full logits, as stock (once-only warning)"
                )
            state.stock_logits_calls += 1
            return original(model, inputs, *args, **kwargs)
        mask = inputs["completion_mask"][..., 1:]
        with _scoring(mask):
            return original(model, inputs, *args, **kwargs)

    return method


def _wrap_forward(original: Callable, role: str, head: torch.nn.Module, state: FusedState) -> Callable:
    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if _SCORING.get() is None:
            return original(*args, **kwargs)
        outputs, call = run_passing_through(original, role, *args, **kwargs)
        state.fused_calls += 1
        outputs.logits = LazyLogits(outputs.logits, head, call.autocast_context, state.chunks[role])
        return outputs

    return forward


_HELD = "fused_logprobs_dpo_helpers"
_ORIGINALS: dict[str, Callable] = {}


def _replace_helpers() -> None:
    if _ORIGINALS:
        return
    module = importlib.import_module(DPO_MODULE)
    for name, make in HELPERS.items():
        _ORIGINALS[name] = getattr(module, name)
        setattr(module, name, make(_ORIGINALS[name]))


def _restore_helpers() -> None:
    module = importlib.import_module(DPO_MODULE)
    for name, original in _ORIGINALS.items():
        setattr(module, name, original)
    _ORIGINALS.clear()


def install_dpo(trainer: Any, context: Any, state: FusedState, packing: tuple[str, ...]) -> None:
    """Patch a DPOTrainer (TRL < 1.15) for `LazyLogits` scoring, through `context.patcher`."""
    args = getattr(trainer, "args", None)
    if getattr(args, "use_liger_kernel", False):
        raise UsageError(
            "fused_logprobs does not combine with `use_liger_kernel=True` on DPOTrainer (Liger's DPO loss already "
            "avoids the full logits). Keep one of the two."
        )
    if packing:
        raise UsageError(
            "fused_logprobs on DPOTrainer with this TRL (< 1.15) does not combine with packing "
            f"({', '.join(packing)}) yet. Train with one of them."
        )
    module = importlib.import_module(DPO_MODULE)
    missing = [name for name in HELPERS if not hasattr(module, name)]
    if missing:
        raise UsageError(f"fused_logprobs: `{DPO_MODULE}` has no {missing} in this TRL; train without fused_logprobs.")
    # Module-wide, held while any trainer needs them (they pass every argument but `LazyLogits` to TRL's own).
    context.hold(_HELD, _replace_helpers, _restore_helpers)
    for name in SCORING_METHODS:
        context.patcher.setattr(trainer, name, _wrap_method(getattr(trainer, name), name, state))
    for role, model in context.models().items():
        head = output_head(model, role)
        context.patcher.setattr(model, "forward", _wrap_forward(model.forward, role, head, state))
    logger.info("fused_logprobs: DPO scores completions in chunks of %s positions", state.chunks)
