"""`DPOTrainer` on TRL < 1.15 (no fused LM head there): its scoring forwards return `LazyLogits` instead of logits.

TRL's `_compute_loss` and `compute_ref_log_probs` (1.10-1.14, each checked by tests/versions) read
`outputs.logits[..., :-1, :]` only through the reductions `lazy.py` lists. While one of them runs, each causal LM's
forward is wrapped (outermost, so that a packing plugin's forward inside it has put its outputs back in the padded
layout) and announces to the patched head (`DpoScoreCall`) the shifted targets, the positions TRL keeps and, for the
policy's `_compute_loss` call, the statistics its metrics read; the head runs one chunked pass inside its own call and
returns the `[rows, length]` log-probs, wrapped in a `LazyLogits` that computes nothing more. The helpers TRL imports
into `trl.trainer.dpo_trainer` (those this TRL has) are replaced by versions that read a `LazyLogits`; the loss code
is TRL's, unchanged. How it combines with packing and ZeRO-3 / FSDP2: docs/plugins/fused_logprobs.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from trl_ext import _compat
from trl_ext.api import CallSlot, Patcher, UsageError, get_logger

from .lazy import LazyLogits, Root, entropy, logprobs_and_entropy, selective_logprobs
from .online import FusedState, ScoreCall, output_head
from .online import scoring as scoring_head

__all__ = ["install_dpo", "score"]

logger = get_logger(__name__)

#: The TRL module whose imported helpers read the logits, and what replaces each helper this TRL has there (which:
#: probed, `_compat.dpo_logits_helpers`).
DPO_MODULE = _compat.DPO_LOGITS_MODULE
_ENTROPY, _LOGPROBS_AND_ENTROPY = _compat.DPO_ENTROPY_HELPERS
HELPERS: dict[str, Callable[[Callable], Callable]] = {
    _compat.DPO_LOGPROBS_HELPER: selective_logprobs,
    _ENTROPY: entropy,  # TRL 1.10-1.13
    _LOGPROBS_AND_ENTROPY: logprobs_and_entropy,  # TRL 1.14
}


@dataclasses.dataclass
class _Scoring:
    """The scoring call in progress: its completion mask (`[rows, length]`), whether the next fused forward stores
    the statistics TRL's metrics read (`_compute_loss`'s first model call: the policy), and which ones."""

    completion_mask: torch.Tensor
    stats: tuple[str, ...] = ()


#: The scoring call in progress (None outside one).
_SCORING: CallSlot[_Scoring] = CallSlot("fused_logprobs.dpo_scoring")
#: Statistics `_compute_loss` reads from the policy's logits (TRL 1.10-1.14): its metrics, and with `use_weighting`
#: the log-sum-exps of the WPO weights.
METRIC_STATS = ("entropy", "mean", "argmax")
WPO_STATS = ("lse", "lse2")


def score(call: Any, trainer: Any, state: FusedState, context: Any) -> Any:
    """One call of one of `SCORING_METHODS` (`trl_ext_call`): the rest of the chain (TRL's method last), run with each
    model's forward returning `LazyLogits`."""
    name = call.name

    def method(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        return_outputs = kwargs.get("return_outputs", args[0] if args else False)
        if name == "_compute_loss" and return_outputs:
            if not state.stock_logits_calls:
                logger.warning(
                    "fused_logprobs: an evaluation asked DPOTrainer for its logits (prediction_loss_only=False); "
                    "those calls build the full logits, as stock (once-only warning)"
                )
            state.stock_logits_calls += 1
            return call.proceed()
        stats: tuple[str, ...] = ()
        if name == "_compute_loss":
            stats = METRIC_STATS + (WPO_STATS if getattr(trainer, _compat.DPO_USE_WEIGHTING_ATTR) else ())
        if not state.heads:  # the trainer's models, found once (after `trl_ext_trainer_models_ready` checked them)
            state.heads.update({role: (m, output_head(m, role)) for role, m in context.models().items()})
        # each model's forward (as it is now, every plugin's wrapper included) wrapped with the fused one for the call,
        # through an undo stack of its own: outermost, so that a packing plugin's wrapper inside it has put the hidden
        # states back into the padded layout before they become `LazyLogits`
        scoring = _Scoring(inputs["completion_mask"], stats)
        with _SCORING.entered(scoring), Patcher("fused_logprobs: one DPO scoring call") as patcher:
            for role, (lm, head) in state.heads.items():
                patcher.setattr(lm, "forward", _fused_forward(lm.forward, role, head, state))
            return call.proceed()

    return method(*call.args, **call.kwargs)


@dataclasses.dataclass
class DpoScoreCall(ScoreCall):
    """The DPO scoring request for the next output-head call: inside its call the head scores `targets` (the next
    token of each position, `[rows, length]`) at the `scored` positions with its original `forward`, one chunk pass
    that also stores the statistics `stats` (`Root.cache`), and returns the `[rows, length]` log-probs (0 elsewhere).
    Inside a packed call (`toolkit.packing.positions`) it reads the hidden states of the padded positions from the
    packed row and returns the padded layout itself."""

    stats: tuple[str, ...] = ()
    vocab: int | None = None
    root: Root | None = None
    batch_text = "the DPO batch of {rows} rows of {columns} positions"

    def run(self, head: torch.nn.Module, forward: Callable, hidden: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        assert self.targets is not None and self.scored is not None
        self.refuse_arguments(head, args, kwargs)
        rows, length = self.targets.shape
        hidden, missing = self.scored_columns(hidden)
        if missing is not None and bool((missing & self.scored).any()):
            raise UsageError(
                f"fused_logprobs: the packed call of the {self.role} model does not compute every completion "
                "position of the DPO batch; train without fused_logprobs or without the packing plugin."
            )
        self.root = root = Root(
            self.head_of(forward),  # `online.head_chunk` looked up per chunk (the scale matrix counts it)
            contextlib.nullcontext,  # inside the head's call: the model's autocast state is the current one
            self.chunk,
            self.scored.reshape(-1),
            self.stats,
            torch.is_grad_enabled(),
            vocab=self.vocab,
            parameters=head.parameters(),
        )
        values = LazyLogits(hidden, root).logprobs(self.targets)
        self.note_stock_logits(forward, hidden, rows, length)
        return values


def _fused_forward(original: Callable, role: str, head: torch.nn.Module, state: FusedState) -> Callable:
    vocab = getattr(head, "out_features", None) or getattr(head, "weight").shape[0]  # noqa: B009

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        scoring = _SCORING.get()
        if scoring is None:
            return original(*args, **kwargs)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = scoring.completion_mask
        if not isinstance(input_ids, torch.Tensor) or tuple(input_ids.shape) != tuple(mask.shape):
            raise UsageError(
                f"fused_logprobs: the {role} model was called with input_ids of shape "
                f"{tuple(getattr(input_ids, 'shape', ()))} in a DPO batch of {tuple(mask.shape)} tokens; train "
                "without fused_logprobs."
            )
        # Position p predicts token p + 1: it is scored when that token is a completion token.
        targets = torch.nn.functional.pad(input_ids[..., 1:], (0, 1))
        scored = torch.nn.functional.pad(mask[..., 1:].bool(), (0, 1))
        request = DpoScoreCall(
            role, targets, scored, mask.size(1), chunk=state.chunks[role], stats=scoring.stats, vocab=vocab
        )
        scoring.stats = ()  # the policy's call only
        with scoring_head(request):
            outputs = original(*args, **kwargs)
        if request.calls != 1:
            raise UsageError(
                f"fused_logprobs: the {role} model did not call its output head module in its forward; it computes "
                "its logits another way. Train it without fused_logprobs."
            )
        state.count_call(request)
        values, root = outputs.logits, request.root
        if root is None or not isinstance(values, torch.Tensor) or tuple(values.shape) != tuple(mask.shape):
            raise UsageError(
                f"fused_logprobs: the {role} model's forward changed its output head's result on the way out "
                f"({tuple(getattr(values, 'shape', ()))} for a DPO batch of {tuple(mask.shape)} tokens); train "
                "without fused_logprobs."
            )
        # The log-probs TRL reads are the model's output itself (under ZeRO-3 its backward hook gathers the head's
        # weight before the chunks are recomputed); nothing else is computed after the forward.
        root.cache["logprobs"] = values.reshape(-1)
        root.precomputed = True
        ids = torch.arange(values.numel(), device=values.device).view(values.shape)
        outputs.logits = LazyLogits(values.new_empty(*values.shape, 0), root, ids)
        return outputs

    return forward


_HELD = "fused_logprobs_dpo_helpers"
#: `context.state` key: this trainer is patched.
_INSTALLED = "fused_logprobs_dpo"


def _replace_helpers(patcher: Patcher) -> None:
    """Wrap the helpers this TRL imports into its DPO module (`context.patch("process")`: undone, each original
    restored, when the last trainer holding them is detached)."""
    module = importlib.import_module(DPO_MODULE)
    for name in _compat.dpo_logits_helpers():
        patcher.wrap(module, name, HELPERS[name])


def install_dpo(trainer: Any, context: Any, state: FusedState, packing: tuple[str, ...]) -> None:
    """Refuse what a DPOTrainer (TRL < 1.15) cannot score with `LazyLogits`, and hold the helper replacements (its
    scoring methods go through `score`). Idempotent: a second call (after the self-checks,
    which set the chunks) only logs."""
    if not context.state.get(_INSTALLED):
        args = getattr(trainer, "args", None)
        if getattr(args, "use_liger_kernel", False):
            raise UsageError(
                "fused_logprobs does not combine with `use_liger_kernel=True` on DPOTrainer (Liger's DPO loss already "
                "avoids the full logits). Keep one of the two."
            )
        if not _compat.dpo_logits_helpers():
            raise UsageError(_compat.DPO_UNKNOWN_LOGITS_HELPERS.refusal("fused_logprobs cannot score this DPOTrainer"))
        # Module-wide, held while any trainer needs them (they pass every argument but `LazyLogits` to TRL's own).
        context.patch("process", _replace_helpers, key=_HELD)
        context.state[_INSTALLED] = True
    if state.chunks:
        logger.info(
            "fused_logprobs: DPO scores completions in chunks of %s positions%s",
            state.chunks,
            f", over the outputs of {', '.join(packing)}" if packing else "",
        )
