"""The prompt_sharing self-check: does a model's shared forward equal its stock padded forward? Decided by measurement.

Run before the first step for every model outside the verified table (every model with `self_check: true`), on a
probe sized from what training will feed (`trl_ext.toolkit.probe`): three pairs of random sequences, a chosen and a
rejected row each, with the same prompt (half the sequence) and different completions. The shared forward and the
stock padded forward (`stock_forward`) run without gradients, in the training dtype and mode (a policy that draws
random numbers in training is refused before: `setup.refuse_random_draws`); the logits of every real token must agree
to the dtype's round-off relative to the sequence's largest logit (`TOLERANCES`). A row where the padded forward itself
is degenerate (NaN from eager attention over a window of only padding) is compared with the sequence run alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trl_ext.toolkit.probe import ProbeRun, stock_forward

from .layout import LAYOUT_KEY, build_layout

__all__ = ["SelfCheckResult", "TOLERANCES", "probe_pairs", "self_check"]

#: Per-token tolerance, relative to the largest logit of the sequence, by the training dtype.
TOLERANCES = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


@dataclasses.dataclass
class SelfCheckResult:
    """Outcome of `self_check`: `failure` is None when the shared forward equals the stock padded forward, else
    what differed (and where)."""

    failure: str | None
    max_error: float
    tolerance: float
    seconds: float
    forwards: int
    lengths: tuple[int, ...]


def probe_pairs(
    vocab: int, lengths: Sequence[int], device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A right-padded DPO probe: for each length `n`, a chosen row and a rejected row of `n` tokens that share a
    prompt of `n // 2` tokens (at least 2) and differ from their first completion token on (chosen rows first, as
    TRL's collator orders them). Returns `input_ids`, `attention_mask` and each row's prompt end."""
    g = torch.Generator().manual_seed(seed)
    low = min(3, vocab - 1)
    pairs = len(lengths)
    width = max(lengths)
    ids = torch.zeros(2 * pairs, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    prompt_end = [0] * (2 * pairs)
    for i, n in enumerate(lengths):
        p = min(max(2, n // 2), n - 1)
        prompt = torch.randint(low, vocab, (p,), generator=g)
        chosen = torch.randint(low, vocab, (n - p,), generator=g)
        rejected = torch.randint(low, vocab, (n - p,), generator=g)
        rejected[0] = low + (chosen[0] - low + 1) % (vocab - low)  # the completions differ from their first token
        for row, completion in ((i, chosen), (pairs + i, rejected)):
            ids[row, :n] = torch.cat([prompt, completion])
            mask[row, :n] = 1
            prompt_end[row] = p
    return ids.to(device), mask.to(device), prompt_end


def self_check(
    model: torch.nn.Module,
    shared_forward: Callable,
    lengths: Sequence[int],
    dtype: torch.dtype | None = None,
    training: bool = False,
    autocast: Callable[[], Any] | None = None,
) -> SelfCheckResult:
    """Measure whether `shared_forward` (the model's wrapped forward) equals the model's stock padded forward on a
    probe of prompt-sharing pairs of `lengths` tokens (`trl_ext.toolkit.probe.probe_lengths`).

    `dtype`: the training dtype (sets the tolerance; default: the parameters' dtype). `training`: run the probe in
    training mode (the policy) instead of eval mode. `autocast`: a context-manager factory for the trainer's mixed
    precision (e.g. `trainer.accelerator.autocast`).
    """
    lengths = tuple(max(3, int(n)) for n in lengths)
    run = ProbeRun(model, training)
    dtype = dtype or next(model.parameters()).dtype
    tolerance = TOLERANCES.get(dtype, 5e-2)
    ids, mask, prompt_end = probe_pairs(run.vocab, lengths, run.device)
    layout = build_layout(ids, mask, prompt_end)
    pairs = len(lengths)

    def result(failure: str | None, worst: float = float("nan")) -> SelfCheckResult:
        return SelfCheckResult(failure, worst, tolerance, run.seconds, run.forwards, lengths)

    def amp() -> Any:
        return autocast() if autocast is not None else contextlib.nullcontext()

    def stock(input_ids: torch.Tensor = ids, attention_mask: torch.Tensor = mask) -> torch.Tensor:
        with stock_forward(model), amp():
            return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    with run:
        with torch.no_grad():
            try:
                with amp():
                    got = shared_forward(
                        input_ids=ids, attention_mask=mask, use_cache=False, **{LAYOUT_KEY: layout.to_batch()}
                    ).logits
                run.forwards += 1
            except Exception as exc:  # noqa: BLE001 - a model that cannot run shared is refused, with the cause
                return result(f"its shared forward raised {type(exc).__name__}: {exc}")
            try:
                want = stock()
                run.forwards += 1
                real = mask.bool()
                want = run.without_degenerate_rows(want, ids, mask, stock)
            except Exception as exc:  # noqa: BLE001 - no stock reference, no verdict: refuse with the cause
                return result(f"its stock padded forward (the reference) raised {type(exc).__name__}: {exc}")
            worst, at, token_at = 0.0, 0, 0
            for row in range(ids.shape[0]):
                ref = want[row][real[row]].double()
                error = (got[row][real[row]].double() - ref).abs().amax(-1) / ref.abs().max().clamp(min=1e-30)
                error = error.nan_to_num(float("inf"))
                token = int(error.argmax())
                if error[token].item() > worst:
                    worst, at, token_at = error[token].item(), row, token
            if worst <= tolerance:
                return result(None, worst)
            side = "chosen" if at < pairs else "rejected"
            part = "prompt" if token_at < prompt_end[at] else "completion"
            return result(
                f"the shared forward's `logits` differ from the stock padded forward by {worst:.3g} (relative to the "
                f"sequence's largest logit; {dtype} round-off allows {tolerance:g}) at "
                f"probe row {at} (the {side} sequence of pair {at % pairs}), token {token_at} (in the {part}), on "
                f"{pairs} prompt-sharing pairs of {list(lengths)} tokens: a "
                "response sees the other, positions do not continue from the prompt, or a window, chunk or mask "
                "that the padded forward applies is lost in the shared row",
                worst,
            )
