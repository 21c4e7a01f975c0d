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

Only the completion positions are scored (TRL masks every other position right after); the policy's log-prob pass
also stores the entropy, mean logit, argmax (and WPO log-sum-exps) TRL reads next, so its head runs once per chunk.

Packing (padding_free, prompt_sharing). The fused forward is put around each model's forward at the start of each
scoring call, so it is the outermost wrapper, whatever order the plugins wrapped the model in: the packing plugin's
forward inside it runs the packed row, the head passes its input through, and the plugin puts those hidden states
back into the padded `[rows, length, H]` layout as it would the logits; they become the `LazyLogits`.

An evaluation that asks for the logits themselves (`prediction_loss_only=False`) gets them: that call runs stock.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ... import _compat
from ..._logging import get_logger
from ...errors import UsageError
from .lazy import LazyLogits, Root, entropy, selective_logprobs
from .online import FusedState, output_head, run_passing_through

__all__ = ["install_dpo"]

logger = get_logger(__name__)

#: The TRL module whose imported helpers read the logits, and the helpers replaced there.
DPO_MODULE = _compat.DPO_LOGITS_MODULE
_LOGPROBS_HELPER, _ENTROPY_HELPER = _compat.DPO_LOGITS_HELPERS
HELPERS: dict[str, Callable[[Callable], Callable]] = {
    _LOGPROBS_HELPER: selective_logprobs,
    _ENTROPY_HELPER: entropy,
}
#: The trainer methods whose model calls return `LazyLogits`.
SCORING_METHODS = _compat.DPO_SCORING_METHODS


@dataclasses.dataclass
class _Scoring:
    """The scoring call in progress: its completion mask (`[rows, length]`), whether the next fused forward stores
    the statistics TRL's metrics read (`_compute_loss`'s first model call: the policy), and which ones."""

    completion_mask: torch.Tensor
    stats: tuple[str, ...] = ()


#: The scoring call in progress (None outside one).
_SCORING: contextvars.ContextVar[_Scoring | None] = contextvars.ContextVar("trl_ext_fused_dpo", default=None)
#: Statistics `_compute_loss` reads from the policy's logits (TRL 1.10-1.14): its metrics, and with `use_weighting`
#: the log-sum-exps of the WPO weights.
METRIC_STATS = ("entropy", "mean", "argmax")
WPO_STATS = ("lse", "lse2")


@contextlib.contextmanager
def _scoring(scoring: _Scoring, models: dict[str, tuple[Any, torch.nn.Module]], state: FusedState) -> Iterator[None]:
    """Set the scoring call, and wrap each model's forward (as it is now, every plugin's wrapper included) with the
    fused one for the duration of the call: outermost, so that a packing plugin's wrapper inside it has put the
    hidden states back into the padded layout before they become `LazyLogits`."""
    token = _SCORING.set(scoring)
    replaced = []
    try:
        for role, (model, head) in models.items():
            had = "forward" in vars(model)
            previous = vars(model).get("forward")
            model.forward = _fused_forward(model.forward, role, head, state)
            replaced.append((model, had, previous))
        yield
    finally:
        for model, had, previous in reversed(replaced):
            if had:
                model.forward = previous
            else:
                del model.forward
        _SCORING.reset(token)


def _wrap_method(original: Callable, name: str, trainer: Any, state: FusedState, context: Any) -> Callable:
    models = {role: (model, output_head(model, role)) for role, model in context.models().items()}

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
        stats: tuple[str, ...] = ()
        if name == "_compute_loss":
            stats = METRIC_STATS + (WPO_STATS if getattr(trainer, "use_weighting", False) else ())
        with _scoring(_Scoring(inputs["completion_mask"], stats), models, state):
            return original(model, inputs, *args, **kwargs)

    return method


def _fused_forward(original: Callable, role: str, head: torch.nn.Module, state: FusedState) -> Callable:
    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        scoring = _SCORING.get()
        if scoring is None:
            return original(*args, **kwargs)
        outputs, call = run_passing_through(original, role, *args, **kwargs)
        state.fused_calls += 1
        hidden = outputs.logits
        mask = scoring.completion_mask
        if tuple(hidden.shape[:-1]) != tuple(mask.shape):
            raise UsageError(
                f"fused_logprobs: the {role} model returned outputs for {tuple(hidden.shape[:-1])} positions in a "
                f"DPO batch of {tuple(mask.shape)} tokens; train without fused_logprobs."
            )
        # Position p predicts token p + 1: it is scored when that token is a completion token.
        scored = torch.nn.functional.pad(mask[..., 1:].bool(), (0, 1)).reshape(-1)
        root = Root(head, call.autocast_context, state.chunks[role], scored, scoring.stats, torch.is_grad_enabled())
        scoring.stats = ()  # the policy's call only
        outputs.logits = LazyLogits(hidden, root)
        return outputs

    return forward


_HELD = "fused_logprobs_dpo_helpers"
#: `context.state` key: this trainer is patched.
_INSTALLED = "fused_logprobs_dpo"
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
    """Patch a DPOTrainer (TRL < 1.15) for `LazyLogits` scoring, through `context.patcher`. Idempotent: a second call
    (after the self-checks, which set the chunks) only logs."""
    if not context.state.get(_INSTALLED):
        args = getattr(trainer, "args", None)
        if getattr(args, "use_liger_kernel", False):
            raise UsageError(
                "fused_logprobs does not combine with `use_liger_kernel=True` on DPOTrainer (Liger's DPO loss already "
                "avoids the full logits). Keep one of the two."
            )
        module = importlib.import_module(DPO_MODULE)
        missing = [name for name in HELPERS if not hasattr(module, name)]
        if missing:
            raise UsageError(
                f"fused_logprobs: `{DPO_MODULE}` has no {missing} in this TRL; train without fused_logprobs."
            )
        # Module-wide, held while any trainer needs them (they pass every argument but `LazyLogits` to TRL's own).
        context.hold(_HELD, _replace_helpers, _restore_helpers)
        for name in SCORING_METHODS:
            wrapped = _wrap_method(getattr(trainer, name), name, trainer, state, context)
            context.patcher.setattr(trainer, name, wrapped)
        context.state[_INSTALLED] = True
    if state.chunks:
        logger.info(
            "fused_logprobs: DPO scores completions in chunks of %s positions%s",
            state.chunks,
            f", over the outputs of {', '.join(packing)}" if packing else "",
        )
