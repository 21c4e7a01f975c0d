"""The shared forward: run a model on the shared row and hand its outputs back in the padded layout.

Wrapped are the causal LM's `forward` (TRL's fused LM head on TRL >= 1.15, the model's own logits before) and its
backbone's (`model.base_model`). A padded scoring call (`glue.scoring_call`) takes its layout from the batch (the
collator's), or builds it from TRL's DPO labels (-100 exactly outside the completion) or the prompt width Online DPO's
`_forward` announces (`online_forward`); a call with none of these (generation, a user's own forward) runs as it
came. The per-token outputs are scattered back by `index_select`, so a shared prompt token's gradient is the sum of
what both branches send it: the fused head's fields as `[rows, length - 1]`, logits as `[rows, length, vocab]` (zeros
at padding), the backbone's `last_hidden_state` as `[rows, length, hidden]`.

Around the shared call the padded position of each shared token is announced (`toolkit.packing.positions`); a module
that returns the padded layout itself (fused_logprobs' head) says so and its output is returned as it is. Online DPO's
scoring call run by the `_forward` wrapper (`OnlineScore`) returns the completion log-probs taken from the packed
logits, never padded logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from trl_ext.api import CallSlot, InternalError, current_call, get_logger
from trl_ext.toolkit.online_forward import ScoringCall
from trl_ext.toolkit.packing.glue import positional_input_ids, repad_outputs, scoring_call
from trl_ext.toolkit.packing.positions import PackedPositions, packed_positions

from .attention import GROUPS_KWARG, shared_call
from .layout import (
    LAYOUT_KEY,
    SharedLayout,
    build_layout,
    pack,
    pack_labels,
    prompt_end_from_completion_mask,
    prompt_end_of,
    unpack,
    unpack_shifted,
)
from .moe import MoeAuxLoss

logger = get_logger(__name__)

__all__ = [
    "is_trl_online_forward",
    "make_backbone_forward",
    "make_causal_lm_forward",
    "online_forward",
    "shared_kwargs",
]

# Set by the Online DPO `_forward` wrapper: the number of prompt columns of the call it makes (same for every row).
_ONLINE_PROMPT_COLUMNS: CallSlot[int] = CallSlot("prompt_sharing.online_prompt_columns")


@dataclasses.dataclass
class OnlineScore:
    """Online DPO's scoring of one model call, from the shared call's packed logits.

    TRL's `_forward` returns `log_softmax` of the padded logits' columns `[start, end)` gathered at `targets`
    (`[rows, C]`). Here the shared call returns its packed logits `[1, N, vocab]` and records where each padded
    position sits in the packed row (`capture`); the `_forward` wrapper then scores those positions of the logits *as
    the model call returned them* (`finish`), after whatever the layers around the model did (accelerate's mixed
    precision casts a 16-bit output to float32), so the `log_softmax` runs in stock's dtype. `calls` counts the model
    calls that captured it (at most one).
    """

    targets: torch.Tensor
    columns: int
    start: int
    end: int | None
    calls: int = 0
    positions: PackedPositions | None = None

    def accepts(self, outputs: Any, positions: PackedPositions) -> bool:
        """Whether this call is the one to score: the first, of the announced shape, with packed logits."""
        logits = getattr(outputs, "logits", None)
        return (
            self.calls == 0
            and (positions.rows, positions.length) == (self.targets.size(0), self.columns)
            and isinstance(logits, torch.Tensor)
            and logits.dim() == 3
            and logits.size(0) == 1
        )

    def capture(self, positions: PackedPositions) -> None:
        """Record the packed positions of the call whose packed logits `finish` will score."""
        self.calls += 1
        self.positions = positions

    def finish(self, logits: torch.Tensor) -> torch.Tensor:
        """The `[rows, C]` log-probs of the targets from the captured call's packed `[1, N, vocab]` logits.

        Each row's scored positions are usually one run of the packed row (its last prompt token and its completion,
        padding after an end included); the runs are then split off as views (`split`, whose backward writes one
        packed gradient) and no scored logits are copied. Otherwise they are gathered (`index_select`), with zero
        logits where the packed row computes no position."""
        positions = self.positions
        if positions is None or logits.dim() != 3 or logits.size(0) != 1:
            raise InternalError(
                "prompt_sharing: Online DPO's scoring call returned no packed logits "
                f"(got {getattr(logits, 'shape', None)})"
            )
        self.positions = None
        index = positions.index()[:, self.start : self.end]
        starts = _row_runs(index)
        if starts is None:
            missing = index < 0
            picked = logits[0].index_select(0, index.clamp(min=0).reshape(-1)).view(*index.shape, logits.size(-1))
            del logits
            if bool(missing.any()):
                picked = picked.masked_fill(missing.unsqueeze(-1), 0.0)
            log_probs = picked.log_softmax(dim=-1)
            del picked
            return torch.take_along_dim(log_probs, self.targets.unsqueeze(-1), dim=2).squeeze(-1)
        width = index.size(1)
        sizes: list[int] = []
        piece: dict[int, int] = {}
        cursor = 0
        for row in sorted(range(len(starts)), key=starts.__getitem__):
            if starts[row] > cursor:
                sizes.append(starts[row] - cursor)
            piece[row] = len(sizes)
            sizes.append(width)
            cursor = starts[row] + width
        if cursor < logits.size(1):
            sizes.append(logits.size(1) - cursor)
        pieces = logits[0].split(sizes)
        scored = [
            torch.take_along_dim(pieces[piece[row]].log_softmax(dim=-1), self.targets[row].unsqueeze(-1), dim=1)
            for row in range(len(starts))
        ]
        del pieces, logits
        return torch.stack(scored).squeeze(-1)


def _row_runs(index: torch.Tensor) -> list[int] | None:
    """For `[rows, C]` packed positions: the first of each row when every row's positions are one run of the packed
    row and the runs do not overlap; None otherwise."""
    rows, width = index.shape
    if rows == 0 or width == 0:
        return None
    host = index.cpu()
    if bool((host < 0).any()) or (width > 1 and not bool((host[:, 1:] - host[:, :-1] == 1).all())):
        return None
    starts = host[:, 0].tolist()
    ordered = sorted(starts)
    if any(b - a < width for a, b in zip(ordered, ordered[1:], strict=False)):
        return None
    return starts


_ONLINE_SCORE: CallSlot[OnlineScore] = CallSlot("prompt_sharing.online_score")


def _layout_for(kwargs: dict[str, Any], meta: Any, online: int | None) -> SharedLayout | None:
    """The layout of a shareable call, or None when nothing says where its prompts end (not a TRL scoring call:
    generation without a cache, a user's own forward); such calls run as they came."""
    global _REBUILT_WARNED
    input_ids, attention_mask = kwargs["input_ids"], kwargs["attention_mask"]
    layout = SharedLayout.from_batch(meta, input_ids)
    if layout is not None:
        return layout
    prompt_end = prompt_end_of(meta, input_ids)
    if prompt_end is not None:
        # the serialized layout did not survive (accelerate's dispatching slices every batch tensor along dim 0);
        # the row-major prompt ends did
        if not _REBUILT_WARNED:
            _REBUILT_WARNED = True
            logger.warning(
                "prompt_sharing: the shared layout of a %s batch did not match it (accelerate's batch dispatching, "
                "`dispatch_batches=True` or an iterable dataset, slices batches after collation); it is rebuilt in "
                "the forward from the batch's prompt ends (same result, host work in the step; once-only warning).",
                tuple(input_ids.shape),
            )
        return build_layout(input_ids, attention_mask, prompt_end)
    labels = kwargs.get("labels")
    if online is not None:
        # Online DPO reads (and logs metrics over) the logits of the completion padding too
        return build_layout(input_ids, attention_mask, [online] * input_ids.shape[0], trailing_padding=True)
    if isinstance(labels, torch.Tensor) and labels.shape == input_ids.shape:
        return build_layout(input_ids, attention_mask, prompt_end_from_completion_mask(labels != -100, attention_mask))
    return None


_REBUILT_WARNED = False


def shared_kwargs(kwargs: dict[str, Any], layout: SharedLayout) -> dict[str, Any]:
    """The keyword arguments of the shared call for a padded call's `kwargs`."""
    packed = dict(kwargs)
    packed["input_ids"] = pack(kwargs["input_ids"], layout)
    packed["attention_mask"] = None
    position_ids = kwargs.get("position_ids")
    packed["position_ids"] = layout.position_ids if position_ids is None else pack(position_ids, layout)
    packed["use_cache"] = False
    labels = kwargs.get("labels")
    if labels is not None:
        packed["labels"] = pack_labels(labels, layout)
    packed[GROUPS_KWARG] = layout.groups
    return packed


def _call_layout(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, Any, int | None, SharedLayout | None]:
    """Pop the batch's layout and move a positional `input_ids` into `kwargs`; returns the positional arguments left,
    the popped layout, the announced Online DPO prompt width, and the layout to run the call with (None: unshared)."""
    meta = kwargs.pop(LAYOUT_KEY, None)
    args = positional_input_ids(args, kwargs)
    online = _ONLINE_PROMPT_COLUMNS.get()
    shareable = not args and scoring_call(kwargs, cache_unset_ok=online is not None)
    return args, meta, online, _layout_for(kwargs, meta, online) if shareable else None


def make_causal_lm_forward(original: Callable, state: Any, aux_loss: MoeAuxLoss | None = None) -> Callable:
    """Causal-LM forward: run the shared row, return outputs in the padded layout. `aux_loss` (MoE models whose
    auxiliary loss is on, `moe.MoeAuxLoss`) captures the router logits of the shared call and recomputes the auxiliary
    loss in the padded layout."""

    def run(kwargs: dict[str, Any], layout: SharedLayout) -> Any:
        # announced to the modules inside (fused_logprobs' output head scores padded positions from the shared row)
        positions = PackedPositions(layout.rows, layout.length, layout.real_flat, layout.real_shared)
        with shared_call(), packed_positions(positions):
            with aux_loss.capture() if aux_loss is not None else contextlib.nullcontext():
                outputs = original(**shared_kwargs(kwargs, layout))
        if aux_loss is not None:
            aux_loss.apply(outputs, layout, kwargs["attention_mask"])
        if positions.padded_output:  # a module inside returned the padded layout already
            return outputs
        score = _ONLINE_SCORE.get()
        if score is not None and not kwargs.get("fused_lm_head") and score.accepts(outputs, positions):
            score.capture(positions)  # Online DPO's `_forward` scores the packed logits (never padded ones)
            return outputs
        fused = bool(kwargs.get("fused_lm_head"))
        return repad_outputs(outputs, fused, lambda x: unpack(x, layout), lambda x: unpack_shifted(x, layout))

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        args, meta, online, layout = _call_layout(args, kwargs)
        if layout is None:
            traced = meta is not None or online is not None or kwargs.get("labels") is not None
            if traced and not current_call().stock:
                # A TRL scoring call that sharing cannot reproduce (e.g. `output_hidden_states`): it runs as it
                # came, which is correct; say so once instead of hiding it. (A stock reference is not one.)
                state.unshared_calls += 1
                if state.unshared_calls == 1:
                    logger.warning("prompt_sharing: a forward with %s ran unshared (not shareable)", sorted(kwargs))
            return original(*args, **kwargs)
        outputs = run(kwargs, layout)
        state.record(layout)
        return outputs

    return forward


def make_backbone_forward(original: Callable, state: Any) -> Callable:
    """Backbone (`model.base_model`) forward: share a padded batch, scatter `last_hidden_state` back."""

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        args, meta, online, layout = _call_layout(args, kwargs)
        if layout is None:
            return original(*args, **kwargs)
        with shared_call():
            outputs = original(**shared_kwargs(kwargs, layout))
        state.record(layout)
        outputs.last_hidden_state = unpack(outputs.last_hidden_state, layout)
        return outputs

    return forward


def is_trl_online_forward(method: Callable) -> bool:
    """Whether `method` is TRL's own `OnlineDPOTrainer._forward` (not a subclass's, nor another plugin's)."""
    function = getattr(method, "__func__", None)
    return getattr(function, "__qualname__", None) == "OnlineDPOTrainer._forward" and str(
        getattr(function, "__module__", "")
    ).startswith("trl.")


def online_forward(call: Any, own: bool, max_length: int | None) -> Any:
    """One call of `OnlineDPOTrainer._forward` (`trl_ext_call`): the model call inside learns how many of its columns
    are prompt (after TRL's left truncation to `max_length`).

    When the rest of the chain is TRL's own `_forward` (`own`) and the call carries no images, TRL's steps
    (`toolkit.online_forward.ScoringCall`) run here, the last three by the shared call on its packed logits
    (`OnlineScore`), so the padded `[rows, P + C, vocab]` logits are never built; a call that does not share returns
    padded logits, finished here as TRL does. Otherwise (fused_logprobs', a subclass's `_forward`) the rest of the
    chain runs as it is."""

    def _forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *args, **kwargs):
        vision_inputs = args[0] if args else kwargs.get("vision_inputs")
        if vision_inputs is not None:
            return call.proceed()
        scoring = ScoringCall.build(prompt_ids, prompt_mask, completion_ids, completion_mask, max_length)
        if not own:
            with _ONLINE_PROMPT_COLUMNS.entered(scoring.prompt_columns):
                return call.proceed()
        score = OnlineScore(completion_ids, scoring.ids.size(1), scoring.start, scoring.end)
        with _ONLINE_SCORE.entered(score), _ONLINE_PROMPT_COLUMNS.entered(scoring.prompt_columns):
            output = model(scoring.ids, attention_mask=scoring.mask)
        if score.calls:
            return score.finish(output.logits)
        return scoring.log_probs(output.logits)

    return _forward(*call.args, **call.kwargs)
