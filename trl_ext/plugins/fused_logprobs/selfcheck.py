"""The self-check of `fused_logprobs`: before the first step, measure on a probe batch that the model's stock logits
are its output head applied to the hidden states the head receives (recorded inside the model's forward), and that the
fused log-probs (a scoring call, through the rest of the model's forward) equal the stock `log_softmax`. Every head
call runs inside the model's forward, so the check runs under FSDP2 and ZeRO-3 too (the same calls on every rank).

Only the model's last step is compared, so the probe rows, sized from the training lengths
(`toolkit.probe.model_probe_lengths`), are capped at `PROBE_CAP` tokens (a 150k-vocabulary probe of training length
would itself build the large logits); they are right-padded as Online DPO's completions, run in eval mode (dropout
off), without gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from trl_ext.api import unwrap_causal_lm
from trl_ext.toolkit.probe import ProbeRun, model_probe_lengths, stock_forward

from .chunked import accumulation_dtype
from .online import ScoreCall, run_scoring

__all__ = [
    "HEAD_MECHANISMS",
    "SelfCheckResult",
    "float32_head",
    "head_mechanism",
    "self_check",
    "sixteen_bit_tolerance",
]

#: Config attributes of transformers models that change the logits after the output head, and the value at which
#: they do nothing: final logit softcapping (Gemma 2/3), logit scaling (Cohere `logit_scale`, Granite
#: `logits_scaling`).
HEAD_MECHANISMS = {
    "final_logit_softcapping": (None, 0, 0.0),
    "logit_scale": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
}
PROBE_CAP = 32
#: Relative tolerance of the log-prob comparison, by accumulation dtype (heads computing in float32 or float64).
LOGPROB_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}
#: A 16-bit head (bf16/fp16 logits): the chunked matmuls may round a logit one ulp away from the full matmul's (about
#: 1e-3 on a bf16 logit, far above `LOGPROB_RTOL`), so the tolerance, relative to the largest stock log-prob, is
#: `ROUNDOFF_MARGIN` times stock's own round-off (its 16-bit log-probs against the same head in float32 on the same
#: hidden states, `float32_head`), at least `ROUNDOFF_FLOOR_UNITS` unit round-offs of the dtype times the largest logit
#: (a correct chunked path is at most one ulp off on the target's logit and one through the log-sum-exp: 4 units).
#: Measured on the tests' sharpened Llama (tests/plugins/test_fused_logprobs_16bit.py): stock's round-off 2.0e-3 (bf16)
#: / 2.1e-4 (fp16), tolerance 2.7e-2 / 3.3e-3 (the floor), every chunk logit one ulp off 4.9e-3 / 6.0e-4; a wrong head
#: row, a shifted target, a 0.9 logit scale on the chunks: 0.38, 0.62, 0.08 in both. Below the floor a systematic
#: change cannot be told from round-off (bf16: a logit scale within about 3 %).
ROUNDOFF_MARGIN = 4.0
ROUNDOFF_FLOOR_UNITS = 8.0
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
#: `float32_head` computes this many vocabulary rows at a time (a float32 copy of the whole head is not made)
FLOAT32_HEAD_ROWS = 8192


@dataclasses.dataclass
class SelfCheckResult:
    lengths: tuple[int, ...]
    head_error: float
    logprob_error: float
    tolerance: float
    seconds: float
    failure: str | None = None
    #: 16-bit heads: stock's own round-off on the probe (relative, like `tolerance`; None where not measured) and how
    #: the tolerance was derived, for the log line
    roundoff: float | None = None
    basis: str = ""


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


def float32_head(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """The logits of a plain `torch.nn.Linear` head that computes in 16 bits (weights or autocast), computed in float32
    (autocast off, `FLOAT32_HEAD_ROWS` vocabulary rows at a time) from the hidden states it received, inside its call
    (`ScoreCall.reference`); None otherwise, and for any other head (its float32 computation is not known here)."""
    if type(head) is not torch.nn.Linear:
        return None
    weight, bias = head.weight, head.bias
    device = hidden.device.type
    if weight.dtype not in SIXTEEN_BIT and not torch.is_autocast_enabled(device):
        return None
    h = hidden.detach().float()
    parts = []
    with torch.autocast(device, enabled=False):
        for start in range(0, weight.size(0), FLOAT32_HEAD_ROWS):
            rows = slice(start, start + FLOAT32_HEAD_ROWS)
            b = None if bias is None else bias[rows].float()
            parts.append(torch.nn.functional.linear(h, weight[rows].float(), b))
    return torch.cat(parts, dim=-1)


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.take_along_dim(logits.to(dtype).log_softmax(-1), targets.unsqueeze(-1), dim=2).squeeze(-1)


def sixteen_bit_tolerance(
    applied: torch.Tensor, float32_logits: torch.Tensor | None, targets: torch.Tensor, want: torch.Tensor
) -> tuple[float, float | None, str]:
    """The relative log-prob tolerance for a head whose logits `applied` are 16-bit: (tolerance, stock's round-off or
    None, how it was derived). See `ROUNDOFF_MARGIN`."""
    unit = torch.finfo(applied.dtype).eps / 2
    scale = want.abs().max().item() or 1.0
    floor = ROUNDOFF_FLOOR_UNITS * unit * applied.float().abs().max().item() / scale
    name = str(applied.dtype).removeprefix("torch.")
    floor_text = f"at least {ROUNDOFF_FLOOR_UNITS:g} {name} unit round-offs of the largest logit"
    if float32_logits is None or float32_logits.shape != applied.shape:
        return floor, None, f"{floor_text} (the head is not a plain Linear: its float32 round-off is not measured)"
    stock16 = _target_logprobs(applied, targets, torch.float32)
    stock32 = _target_logprobs(float32_logits, targets, torch.float32)
    roundoff = (stock16 - stock32).abs().max().item() / scale
    basis = f"{ROUNDOFF_MARGIN:g}x stock's own {name}-vs-float32 round-off {roundoff:.2g}, {floor_text}"
    return max(ROUNDOFF_MARGIN * roundoff, floor), roundoff, basis


def self_check(model: Any, trainer: Any, role: str, chunk: int) -> SelfCheckResult:
    """Compare the fused path (scoring inside the head's call) with `model`'s stock forward on a probe (`failure`)."""
    causal_lm = unwrap_causal_lm(model)
    run = ProbeRun(causal_lm, training=False)
    lengths = tuple(min(n, PROBE_CAP) for n in model_probe_lengths(causal_lm, trainer, "fused_logprobs"))
    width = max(lengths)
    vocab = int(causal_lm.config.get_text_config().vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=g).to(run.device)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long().to(run.device)
    kwargs = dict(input_ids=ids, attention_mask=mask, use_cache=False)
    targets = torch.randint(0, vocab, ids.shape, generator=g).to(run.device)
    with run, torch.no_grad(), stock_forward(causal_lm):  # a packing plugin's wrapper passes the probe through
        stock = causal_lm(**kwargs).logits
        # the head runs as stock and keeps its output (and, for a 16-bit head, the same head in float32)
        record = ScoreCall(role, reference=float32_head)
        run_scoring(causal_lm, record, **kwargs)
        applied = record.output
        request = ScoreCall(role, targets, None, width, 0, None, chunk)
        fused = run_scoring(causal_lm, request, **kwargs).logits
    acc = accumulation_dtype(stock.dtype)
    want = _target_logprobs(stock, targets, acc)
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
        if applied.dtype in SIXTEEN_BIT:  # whatever the model does with the logits after its head
            result.tolerance, result.roundoff, result.basis = sixteen_bit_tolerance(
                applied, record.referenced, targets, want
            )
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
                f"{result.tolerance:.2g}" + (f" ({result.basis})" if result.basis else "")
            )
    result.seconds = run.seconds
    return result
