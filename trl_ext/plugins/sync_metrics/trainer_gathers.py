"""The Trainer's own gathers at a logging step (the training loss in `nested_gather`, the FLOs in `store_flos`), kept
local and carried in sync_metrics' one collective instead."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from trl_ext import _compat
from trl_ext.api import CallSlot

from .capture import SyncMetricsState

if TYPE_CHECKING:  # pragma: no cover
    from trl_ext.api import Call

#: The state of the trainer whose `_maybe_log_save_evaluate` is running (transformers calls the module-level
#: `nested_gather` there, with no reference to the trainer; the call context keeps this per call, not global).
_LOGGING_TRAINER: CallSlot[SyncMetricsState] = CallSlot("sync_metrics.logging_trainer")


def _deferring_nested_gather(original):
    @functools.wraps(original)
    def nested_gather(tensors, *args, **kwargs):
        state = _LOGGING_TRAINER.get()
        if state is None or not state.expect_loss or not isinstance(tensors, torch.Tensor):
            return original(tensors, *args, **kwargs)
        # The loss of this logging step: keep it local (TRL/transformers then log the local value, and
        # `trl_ext_reduce_metrics` replaces it with the global mean from the one collective).
        trainer = state.trainer_ref()
        state.expect_loss = False
        state.pending_loss = tensors.detach().clone().reshape(())  # the caller zeroes `tr_loss` in place next
        state.pending_loss_steps = trainer.state.global_step - getattr(trainer, _compat.TRAINER_LAST_LOGGED_ATTR)
        return state.pending_loss.reshape(1)

    nested_gather.__trl_ext_sync_metrics__ = True
    return nested_gather


def _maybe_log_save_evaluate(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    # transformers gathers the loss only under this condition (trainer.py `_maybe_log_save_evaluate`).
    state.expect_loss = bool(
        trainer.control.should_log and trainer.state.global_step > getattr(trainer, _compat.TRAINER_LAST_LOGGED_ATTR)
    )
    try:
        with _LOGGING_TRAINER.entered(state):
            return call.proceed()
    finally:
        state.expect_loss = False


def _store_flos(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    if state.in_checkpoint:
        # A checkpoint writes `state.total_flos` to disk right after: make it exact now (transformers' gather).
        # allowed write: the FLOs held back since the last log go back to the Trainer's count
        setattr(trainer, _compat.TRAINER_FLOS_ATTR, getattr(trainer, _compat.TRAINER_FLOS_ATTR) + state.pending_flos)
        state.pending_flos = 0.0
        return call.proceed()
    state.pending_flos += float(getattr(trainer, _compat.TRAINER_FLOS_ATTR))
    # allowed write: the FLOs are held back, to be summed across ranks in the next log's one collective
    setattr(trainer, _compat.TRAINER_FLOS_ATTR, 0)
    return None


def _save_checkpoint(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    state.in_checkpoint = True
    try:
        return call.proceed()
    finally:
        state.in_checkpoint = False


def install(context: Any) -> None:
    """The loss gather is the module-level `nested_gather` (no trainer method): wrapped while this trainer runs, it
    acts only inside the `_maybe_log_save_evaluate` of a trainer that has sync_metrics (pass-through elsewhere)."""
    import importlib

    for module_name in _compat.LOSS_GATHER_MODULES:
        module = importlib.import_module(module_name)
        current = getattr(module, "nested_gather", None)
        if current is not None and not getattr(current, "__trl_ext_sync_metrics__", False):
            context.patch("run", lambda patcher, m=module: patcher.wrap(m, "nested_gather", _deferring_nested_gather))


#: `trl_ext_call` handlers, by method name: the logging step, FLO bookkeeping and checkpoints
#: (`_compat.TRAINER_METHODS`, with `get_batch_samples` in `capture`)
CALLS = dict(zip(_compat.TRAINER_METHODS[:3], (_maybe_log_save_evaluate, _store_flos, _save_checkpoint), strict=True))
