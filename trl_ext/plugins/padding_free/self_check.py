"""The padding_free self-check: does a model keep the sequences of a packed row apart? Decided by measurement.

On a probe of three random sequences (lengths 9, 6 and 11), run through the model's *packed* forward in eval mode
without gradients:

1. isolation: the tokens of the middle sequence are replaced; the logits of the two other sequences must stay
   bit-identical. A packed row runs every per-token operation row by row and attention per sequence, so nothing
   else can change them, in any dtype (bf16 included); any change is a leak. The leaking layer is named: the first
   module (in execution order) whose output at the other sequences' tokens changed.
2. positions: each sequence alone, through the model's ordinary (unpacked) forward, must give the same logits as in
   the packed row, to the dtype's round-off (relative to the largest logit: 1e-9 in float64, 1e-4 in float32, 5e-2 in
   16-bit). This catches positions that do not restart per sequence. MoE models in float64 are allowed 1e-6: their
   routers often compute in float32 inside a float64 model (GLM4-MoE casts the router matmul to float32), and a float32
   matmul over a sequence alone may round differently from the same rows in the packed row (seen: 2.7e-8 on an AMD EPYC
   CPU, exact on others). A position bug moves logits by far more (order 1e-1).

Cost: three packed forwards of 26 tokens and three unpacked forwards of at most 11 tokens (timed and logged).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, cast

import torch

PROBE_LENGTHS = (9, 6, 11)
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_HALF_TOLERANCE = 5e-2
#: MoE models in float64: float32 routers round per kernel choice (see the module docstring)
_MOE_FLOAT64_TOLERANCE = 1e-6


@dataclasses.dataclass
class SelfCheckResult:
    """Outcome of `self_check`: `leak` is None when the model passed, else what leaked."""

    leak: str | None
    max_position_error: float
    tolerance: float
    seconds: float
    forwards: int


def _probe(vocab: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    length = max(PROBE_LENGTHS)
    ids = torch.zeros(len(PROBE_LENGTHS), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    low = min(3, vocab - 1)
    for i, n in enumerate(PROBE_LENGTHS):
        ids[i, :n] = torch.randint(low, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids.to(device), mask.to(device)


class _Recorder:
    """Records the outputs of every module that returns per-token tensors of the packed row, in execution order."""

    def __init__(self, model: torch.nn.Module, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.outputs: list[tuple[str, torch.Tensor]] = []
        self.handles = [
            module.register_forward_hook(self._hook(name)) for name, module in model.named_modules() if name
        ]

    def _hook(self, name: str) -> Callable:
        def hook(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(out, torch.Tensor) and out.dim() >= 2:
                if out.shape[0] == 1 and out.shape[1] == self.num_tokens:
                    self.outputs.append((f"{name} ({type(module).__name__})", out[0].detach().clone()))
                elif out.shape[0] == self.num_tokens:
                    self.outputs.append((f"{name} ({type(module).__name__})", out.detach().clone()))

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _first_change(before: list, after: list, rows: torch.Tensor) -> str:
    for (name, a), (_, b) in zip(before, after, strict=False):
        if a.shape == b.shape and not torch.equal(a[rows], b[rows]):
            return name
    return "the model's output (no single module found)"


def self_check(
    model: torch.nn.Module, packed_forward: Callable, dtype: torch.dtype | None = None, moe: bool = False
) -> SelfCheckResult:
    """Measure whether `packed_forward` (the model's wrapped forward) keeps packed sequences apart.

    `moe`: the model routes tokens to experts. Changing one sequence's tokens then changes how many tokens each expert
    multiplies at once, and a matmul kernel may round another token's row differently (seen: PhiMoE in float64, 7e-16).
    For MoE models the isolation check therefore allows 16 units of round-off of the dtype (relative to the largest
    logit) instead of bit-identity; a leak smaller than that (possible only in 16-bit dtypes) would pass. In float64
    their position check allows 1e-6 instead of 1e-9 (float32 routers; module docstring).
    """
    start = time.perf_counter()
    device = next(model.parameters()).device
    embeddings: Any = cast(Any, model).get_input_embeddings()  # a PreTrainedModel method: an nn.Embedding
    vocab: int = embeddings.num_embeddings
    dtype = dtype or next(model.parameters()).dtype
    tolerance = _TOLERANCE.get(dtype, _HALF_TOLERANCE)
    if moe and dtype == torch.float64:
        tolerance = _MOE_FLOAT64_TOLERANCE
    ids, mask = _probe(vocab, device, seed=0)
    changed = ids.clone()
    middle = 1
    n = PROBE_LENGTHS[middle]
    changed[middle, :n] = (ids[middle, :n] + 1 + torch.arange(n, device=device) % 5) % vocab
    modes = {m: m.training for m in model.modules()}
    model.eval()
    forwards = 0
    try:
        with torch.no_grad():
            num_tokens = sum(PROBE_LENGTHS)
            recorder = _Recorder(model, num_tokens)
            try:
                base = packed_forward(input_ids=ids, attention_mask=mask, use_cache=False).logits
                before, recorder.outputs = recorder.outputs, []
                after = packed_forward(input_ids=changed, attention_mask=mask, use_cache=False).logits
                forwards += 2
            except Exception as exc:  # noqa: BLE001 - a model that cannot run packed is refused, with the cause
                raised = f"its packed forward raised {type(exc).__name__}: {exc}"
                return SelfCheckResult(raised, float("nan"), tolerance, time.perf_counter() - start, forwards)
            finally:
                recorder.close()
            others = [i for i in range(len(PROBE_LENGTHS)) if i != middle]
            real = mask.bool()
            leak: str | None = None
            for i in others:
                change = (base[i][real[i]].double() - after[i][real[i]].double()).abs().max()
                allowed = 16 * torch.finfo(base.dtype).eps * base[i][real[i]].double().abs().max() if moe else 0.0
                if change > allowed:
                    starts = torch.tensor([0, *PROBE_LENGTHS]).cumsum(0)
                    rows = torch.cat([torch.arange(int(starts[j]), int(starts[j + 1])) for j in others]).to(device)
                    leak = (
                        f"the logits of probe sequence {i} changed when only the tokens of another sequence in the "
                        f"packed row changed (max change {(base[i] - after[i]).abs().max().item():.3g}); the first "
                        f"layer whose output changed is `{_first_change(before, recorder.outputs, rows)}`"
                    )
                    break
            worst = 0.0
            if leak is None:
                try:
                    for i, length in enumerate(PROBE_LENGTHS):
                        # `use_cache=True` is never packed: the model's ordinary forward on the sequence alone
                        ref = packed_forward(input_ids=ids[i : i + 1, :length], use_cache=True).logits[0]
                        ref = ref.to(torch.float64)
                        forwards += 1
                        got = base[i, :length].to(torch.float64)
                        worst = max(worst, ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item())
                except Exception as exc:  # noqa: BLE001 - no unpacked reference, no verdict: refuse with the cause
                    leak = f"its unpacked forward (the reference) raised {type(exc).__name__}: {exc}"
                if leak is None and not worst <= tolerance:
                    leak = (
                        f"the packed logits differ from each sequence run alone by {worst:.3g} (relative to the "
                        f"largest logit; {dtype} round-off allows {tolerance:g}): positions do not restart per "
                        "sequence or a layer depends on where a sequence sits in the row"
                    )
    finally:
        for module, mode in modes.items():
            module.training = mode
    return SelfCheckResult(leak, worst, tolerance, time.perf_counter() - start, forwards)
