"""Online DPO's scoring forward with fused log-probs, and the output-head patch it relies on.

`make_fused_forward` returns what `OnlineDPOTrainer._forward` returns (TRL 1.12 and 1.16, its steps are
`toolkit.online_forward`'s) from the same model call, through every wrapper (DDP, DeepSpeed, FSDP2, PEFT, another
plugin's forward). The head's `forward` is replaced once per model (`trl_ext_make_head_forward`); around one model call
a `ScoreCall` tells it what to do: score the completion columns of the hidden states it receives chunk by chunk
(`chunked.token_logprobs`) inside its own call, so that ZeRO-3's and FSDP2's gathered parameters are in place, from the
packed row through the announced positions inside a packed call (`toolkit.packing.positions`); the same over every
position of a DPO batch (`dpo.DpoScoreCall`); or, without targets (the self-check), run as stock and keep its output.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from trl_ext import _compat
from trl_ext.api import CallSlot, UsageError, size_text, unwrap_causal_lm
from trl_ext.toolkit.online_forward import ScoringCall
from trl_ext.toolkit.packing.positions import current_packed_positions

from .chunked import auto_chunk, token_logprobs

__all__ = [
    "FusedState",
    "ScoreCall",
    "head_chunk",
    "head_forward",
    "make_fused_forward",
    "output_head",
    "run_scoring",
    "scoring",
]


def head_chunk(forward: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """One chunk of logits: the head's original `forward` on `[n, H]` rows (in forward, and again in backward)."""
    return forward(hidden)


@dataclasses.dataclass
class ScoreCall:
    """A scoring request for the next output-head call: the log-probs of `targets` at the head input's columns
    `[start, end)`, `chunk` positions at a time, `scored` (bool, like `targets`) with gradients; inside a packed call
    the columns are read from the packed row through the announced positions. Without `targets` the head runs as
    stock and keeps its `output` (the self-check)."""

    role: str
    targets: torch.Tensor | None = None
    scored: torch.Tensor | None = None
    columns: int = 0
    start: int = 0
    end: int | None = None
    chunk: int = 1
    calls: int = 0
    output: torch.Tensor | None = None
    #: recording: `reference(head, hidden)` (`selfcheck.float32_head`) runs inside the head's call, into `referenced`
    reference: Callable[[torch.nn.Module, torch.Tensor], Any] | None = None
    referenced: Any = None
    #: scoring: `(rows, positions, vocab, dtype)` of stock's logits for this request (vocab and dtype: `head_of`)
    stock_logits: tuple[int, int, int, torch.dtype] | None = None
    _chunk_out: tuple[int, torch.dtype] | None = None
    #: what the head's input should hold, in a refusal (`scored_columns`)
    batch_text = "the {rows} rows of {columns} positions scored; the fused path cannot tell which positions it holds"

    def head_of(self, forward: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
        """The head's original `forward` as the chunked passes call it (`head_chunk`), noting the vocabulary and dtype
        of its logits (those of stock's full logits)."""

        def chunk(hidden: torch.Tensor) -> torch.Tensor:
            out = head_chunk(forward, hidden)
            self._chunk_out = (out.size(-1), out.dtype)
            return out

        return chunk

    def note_stock_logits(self, forward: Callable, hidden: torch.Tensor, rows: int, positions: int) -> None:
        """Set `stock_logits` for stock's `[rows, positions, vocab]` logits; a call whose chunks computed nothing
        (no position scored) runs the head on one row, without gradients, to read them."""
        if self._chunk_out is None and hidden.numel():
            with torch.no_grad():
                out = head_chunk(forward, hidden.reshape(-1, hidden.size(-1))[:1])
            self._chunk_out = (out.size(-1), out.dtype)
        if self._chunk_out is not None:
            vocab, dtype = self._chunk_out
            self.stock_logits = (rows, positions, vocab, dtype)

    def refuse_arguments(self, head: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if args or kwargs:
            raise UsageError(
                f"fused_logprobs: the {self.role} model calls its output head ({type(head).__name__}) with more than "
                "the hidden states; the fused path cannot reproduce that call. Train it without fused_logprobs."
            )

    def run(self, head: torch.nn.Module, forward: Callable, hidden: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        if self.targets is None:
            self.output = forward(hidden, *args, **kwargs)
            if self.reference is not None and not args and not kwargs:
                self.referenced = self.reference(head, hidden)
            return self.output
        self.refuse_arguments(head, args, kwargs)
        columns, missing = self.scored_columns(hidden)
        if missing is None:
            return self._score(head, forward, columns, self.scored, hidden)
        scored = ~missing if self.scored is None else self.scored.bool() & ~missing
        values = self._score(head, forward, columns, scored, columns)
        if bool(missing.any()):
            # a column the packed row does not compute (a row without tokens there): the packing plugin gives it zero
            # logits, whose log_softmax is -log(vocab)
            with torch.no_grad():
                vocab = head_chunk(forward, hidden[0, :1]).size(-1)
            values = values.masked_fill(missing, -math.log(vocab))
        return values

    def scored_columns(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hidden states of the columns `[start, end)` (`[rows, C, H]`) and None; inside a packed call, gathered
        from the packed row through the announced positions (the output then marked padded), and where the packed row
        computes no position (bool `[rows, C]`)."""
        assert self.targets is not None
        rows = self.targets.size(0)
        packed = current_packed_positions()
        if packed is None:
            if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (rows, self.columns):
                raise UsageError(
                    f"fused_logprobs: the {self.role} model passed its output head a {tuple(hidden.shape)} tensor, "
                    f"not the hidden states of its {rows} rows of {self.columns} positions; the fused path cannot "
                    "tell which positions it holds. Train it without fused_logprobs."
                )
            return hidden[:, self.start : self.end], None
        if hidden.dim() != 3 or hidden.size(0) != 1 or (packed.rows, packed.length) != (rows, self.columns):
            raise UsageError(
                f"fused_logprobs: the {self.role} model ran a packed call for {packed.rows} rows of {packed.length} "
                f"positions and passed its output head a {tuple(hidden.shape)} tensor, not one packed row of hidden "
                f"states for {self.batch_text.format(rows=rows, columns=self.columns)}. Train it without "
                "fused_logprobs or without the packing plugin."
            )
        index = packed.index()[:, self.start : self.end]  # [rows, C] packed position of each scored column
        packed.padded_output = True
        gathered = hidden[0].index_select(0, index.clamp(min=0).reshape(-1)).view(*index.shape, hidden.size(-1))
        return gathered, index < 0

    def _score(
        self, head: torch.nn.Module, forward: Callable, hidden: torch.Tensor, scored: Any, full: torch.Tensor
    ) -> torch.Tensor:
        """`token_logprobs` of the targets at `hidden` (the scored columns' hidden states, `full` the head's input)."""
        assert self.targets is not None
        values = token_logprobs(
            hidden, self.targets, self.head_of(forward), chunk=self.chunk, scored=scored, parameters=head.parameters()
        )
        self.note_stock_logits(forward, full, self.targets.size(0), self.columns)
        return values


#: While set, the patched output head runs the request (once) and returns what it computes.
_SCORE: CallSlot[ScoreCall] = CallSlot("fused_logprobs.head_score")


@dataclasses.dataclass
class FusedState:
    """Per-trainer state of the plugin (`context.state["fused_logprobs"]`)."""

    chunk: str | int = "auto"
    #: the chunk each model scores with, by role
    chunks: dict[str, int] = dataclasses.field(default_factory=dict)
    #: self-check results by role
    self_checks: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: fused scoring calls (the policy's and the reference's)
    fused_calls: int = 0
    #: DPO calls that asked for the logits themselves (an evaluation with `prediction_loss_only=False`): run stock
    stock_logits_calls: int = 0
    #: a DPOTrainer that scores with TRL's own fused LM head (TRL >= 1.15): the plugin left it as it is
    left_to_trl: bool = False
    #: `{role: (model, output head)}` of a DPOTrainer, found at its first scoring call
    heads: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Online DPO's `_forward` in TRL's place (`make_fused_forward`), built when the models are ready
    online_forward: Any = None
    #: `(rows, positions, vocab, dtype)` of the largest logits tensor stock would have built in one scoring call
    largest_logits: tuple[int, int, int, torch.dtype] | None = None

    def count_call(self, request: ScoreCall) -> None:
        """One fused scoring call, and the logits stock's model call would have returned for it."""
        self.fused_calls += 1
        shape = request.stock_logits
        if shape is not None and (
            self.largest_logits is None or logits_bytes(shape) > logits_bytes(self.largest_logits)
        ):
            self.largest_logits = shape

    def summary(self) -> str:
        """What ran, for the end-of-run line (`trl-ext dpo`: `[trl-ext]   fused_logprobs: ...`)."""
        if self.left_to_trl:
            return (
                "did nothing: left TRL's own fused LM head in place (this TRL's DPOTrainer already scores without "
                "the full-vocabulary logits)"
            )
        chunks = ", ".join(f"{role} {chunk}" for role, chunk in self.chunks.items())
        text = f"{self.fused_calls} scoring forwards fused (chunk: {chunks or '-'})"
        if self.largest_logits is not None:
            rows, positions, vocab, dtype = self.largest_logits
            size = size_text(logits_bytes(self.largest_logits))
            text += (
                f"; largest logits tensor not built (one scoring forward): {size} ({rows} x {positions} x {vocab} "
                f"{str(dtype).removeprefix('torch.')})"
            )
        return text


def logits_bytes(shape: tuple[int, int, int, torch.dtype]) -> int:
    """Bytes of a `[rows, positions, vocab]` logits tensor of `dtype`."""
    rows, positions, vocab, dtype = shape
    return rows * positions * vocab * dtype.itemsize


def output_head(model: Any, role: str = "model") -> torch.nn.Module:
    """The output head module of a (wrapped) causal LM, or a `UsageError` naming what is missing."""
    causal_lm = unwrap_causal_lm(model)
    getter = getattr(causal_lm, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, torch.nn.Module):
        raise UsageError(
            f"fused_logprobs needs the output head of the {role} model ({type(causal_lm).__name__}) as a module "
            "(`get_output_embeddings()` returned "
            f"{type(head).__name__}); this model computes its logits another way. Train it without fused_logprobs."
        )
    return head


def head_forward(head: torch.nn.Module) -> Callable:
    """The output head's `forward` for `trl_ext_make_head_forward`: the scoring request (`scoring()`) on its first
    call in such a block, else as before (patched twice, by two trainers, the outer patch consumes the request)."""
    original = head.forward

    @functools.wraps(original)
    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        score = _SCORE.get()
        if score is not None and score.calls == 0:
            score.calls += 1
            return score.run(head, original, hidden_states, args, kwargs)
        return original(hidden_states, *args, **kwargs)

    return forward


#: `with scoring(request):` the patched heads run `request` on the first head call of the block.
scoring = _SCORE.entered


def run_scoring(model: Any, request: ScoreCall, *args: Any, **kwargs: Any) -> Any:
    """`model(*args, **kwargs)` with its output head running `request`; a `UsageError` if the head was not called."""
    with scoring(request):
        outputs = model(*args, **kwargs)
    if request.calls != 1:
        raise UsageError(
            f"fused_logprobs: the {request.role} model ({type(unwrap_causal_lm(model)).__name__}) did not call its "
            "output head module in its forward; it computes its logits another way. Train it without fused_logprobs."
        )
    return outputs


def resolve_chunk(state: FusedState, head: torch.nn.Module, dtype: torch.dtype) -> int:
    if state.chunk != "auto":
        return int(state.chunk)
    weight = getattr(head, "weight", None)
    vocab = getattr(head, "out_features", None) or getattr(weight, "shape", (0,))[0]
    hidden = getattr(head, "in_features", None) or getattr(weight, "shape", (0, 0))[-1]
    device = weight.device if isinstance(weight, torch.Tensor) else None
    return auto_chunk(int(vocab), dtype, device, int(hidden))


def make_fused_forward(trainer: Any, state: FusedState, roles: Callable[[Any], str]) -> Callable:
    """The replacement of `trainer._forward` (through `trl_ext_call`): same arguments, same `[rows, C]`
    log-probs, no full logits. TRL's steps around the model call are `toolkit.online_forward.ScoringCall`'s, verified
    against the trainer's own `_forward` (`toolkit.online_forward.verify_against_trl`) before the first step."""

    def _forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None):
        role = roles(model)
        if vision_inputs is not None:
            raise UsageError(
                "fused_logprobs does not score vision-language batches (image inputs reached Online DPO's scoring "
                "forward). Train without fused_logprobs."
            )
        max_length = getattr(trainer, _compat.ONLINE_DPO_MAX_LENGTH_ATTR)
        call = ScoringCall.build(prompt_ids, prompt_mask, completion_ids, completion_mask, max_length)
        head = output_head(model, role)
        chunk = state.chunks.get(role) or resolve_chunk(state, head, next(unwrap_causal_lm(model).parameters()).dtype)
        # The completion tokens carry gradients; the positions after an end are computed without (TRL masks them in
        # the loss and sums them into its KL and entropy metrics).
        scored = completion_mask.bool()
        request = ScoreCall(role, completion_ids, scored, call.ids.size(1), call.start, call.end, chunk)
        logprobs = run_scoring(model, request, call.ids, attention_mask=call.mask).logits
        state.count_call(request)
        return logprobs

    return _forward
