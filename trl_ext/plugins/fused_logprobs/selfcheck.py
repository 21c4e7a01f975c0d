"""The self-check of `fused_logprobs`: before the first step, measure on a probe batch that the model's stock logits
are its output head applied to the hidden states the head receives, and that the fused log-probs equal the stock
`log_softmax`.

Both trainers score inside the head's call: the head's output is recorded inside the model's forward and compared
with the model's logits, then the model's output in a scoring call (the log-probs the head computed, passed through
the rest of the model's forward) is compared with the stock log-probs. Every head call runs inside the model's
forward, so the check runs under FSDP2 and ZeRO-3 too (the same calls on every rank).

What is compared is the model's last step (head and anything after it), so the probe does not need training-length
sequences: its rows are sized from the training lengths (`_probe.model_probe_lengths`) but capped at `PROBE_CAP`
tokens (a 150k-vocabulary probe of training length would itself build the large logits). Rows are right-padded as
Online DPO's completions are. The model runs in eval mode for the probe (dropout off), without gradients.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from ...context import unwrap_causal_lm
from .._probe import model_probe_lengths, stock_forward
from .chunked import accumulation_dtype
from .online import ScoreCall, run_scoring

__all__ = ["HEAD_MECHANISMS", "SelfCheckResult", "head_mechanism", "self_check"]

#: Config attributes of transformers models that change the logits after the output head, and the value at which
#: they do nothing: final logit softcapping (Gemma 2/3), logit scaling (Cohere `logit_scale`, Granite
#: `logits_scaling`).
HEAD_MECHANISMS = {
    "final_logit_softcapping": (None, 0, 0.0),
    "logit_scale": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
}
PROBE_CAP = 32
#: Relative tolerance of the log-prob comparison, by accumulation dtype.
LOGPROB_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


@dataclasses.dataclass
class SelfCheckResult:
    lengths: tuple[int, ...]
    head_error: float
    logprob_error: float
    tolerance: float
    seconds: float
    failure: str | None = None


def head_mechanism(model: Any) -> str | None:
    """The first config attribute (of the model's config or a sub-config) that acts after the output head."""
    config = unwrap_causal_lm(model).config
    configs = [config] + [v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
    for sub in configs:
        for name, inactive in HEAD_MECHANISMS.items():
            value = getattr(sub, name, None)
            if value not in inactive:
                return f"`{name}={value}`"
    return None


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() or 1.0
    return (a - b).abs().max().item() / scale


def self_check(model: Any, trainer: Any, role: str, chunk: int) -> SelfCheckResult:
    """Compare the fused path (scoring inside the head's call) with `model`'s stock forward on a probe; `failure` says
    what differs."""
    started = time.perf_counter()
    causal_lm = unwrap_causal_lm(model)
    lengths = tuple(min(n, PROBE_CAP) for n in model_probe_lengths(causal_lm, trainer, "fused_logprobs"))
    width = max(lengths)
    vocab = int(causal_lm.config.get_text_config().vocab_size)
    g = torch.Generator().manual_seed(0)
    device = next(causal_lm.parameters()).device
    ids = torch.randint(0, vocab, (len(lengths), width), generator=g).to(device)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long().to(device)
    was_training = causal_lm.training
    causal_lm.eval()
    kwargs = dict(input_ids=ids, attention_mask=mask, use_cache=False)
    targets = torch.randint(0, vocab, ids.shape, generator=g).to(device)
    try:
        with torch.no_grad():
            with stock_forward(causal_lm):
                stock = causal_lm(**kwargs).logits
            record = ScoreCall(role)  # the head runs as stock and keeps its output
            with stock_forward(causal_lm):  # a packing plugin's wrapper passes the probe through as well
                run_scoring(causal_lm, record, **kwargs)
            applied = record.output
            request = ScoreCall(role, targets, None, width, 0, None, chunk)
            with stock_forward(causal_lm):
                fused = run_scoring(causal_lm, request, **kwargs).logits
    finally:
        causal_lm.train(was_training)
    acc = accumulation_dtype(stock.dtype)
    want = torch.take_along_dim(stock.to(acc).log_softmax(-1), targets.unsqueeze(-1), dim=2).squeeze(-1)
    result = SelfCheckResult(lengths, 0.0, 0.0, LOGPROB_RTOL[acc], 0.0)
    head_tol = 0.0 if stock.dtype == torch.float64 else 4 * torch.finfo(stock.dtype).eps
    if applied is None:
        result.failure = "its forward did not call its output head module"
    elif stock.shape != applied.shape:
        result.failure = (
            f"its logits have shape {tuple(stock.shape)} but its output head gives {tuple(applied.shape)} on the "
            "hidden states it passes to the head"
        )
    elif fused.shape != want.shape:
        result.failure = (
            f"its fused log-probs have shape {tuple(fused.shape)}, not {tuple(want.shape)}: its forward changes the "
            "output head's result on the way out"
        )
    else:
        result.head_error = _relative(applied.to(acc), stock.to(acc))
        result.logprob_error = _relative(fused, want)
        if result.head_error > head_tol:
            result.failure = (
                "its logits are not its output head applied to its last hidden states (max relative difference "
                f"{result.head_error:.2g}): something acts after or instead of the head (final logit softcapping, a "
                "logit scale, ...)"
            )
        elif result.logprob_error > result.tolerance:
            result.failure = (
                f"the fused log-probs differ from the stock log_softmax by {result.logprob_error:.2g} (relative) > "
                f"{result.tolerance:g}"
            )
    result.seconds = time.perf_counter() - started
    return result
