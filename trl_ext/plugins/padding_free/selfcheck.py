"""The padding_free self-check: does a model's packed forward equal its stock padded forward? Decided by measurement
on a probe sized from what training will feed (`trl_ext.toolkit.probe`), without gradients, in the model's dtype and
the mode it runs in (docs/plugins/padding_free.md, "Self-check", has the rules and tolerances):

1. isolation: the middle sequence's tokens are replaced; the packed logits of the two others must stay bit-identical.
   A leak names the first module, in execution order, whose output at the other sequences' tokens changed.
2. stock: the packed logits must equal the stock padded forward's at every real token, to the round-off of the lowest
   precision the stock forward computes in (`_LowestFloat`; MPT, 512 wide, 256-token probe: 6.2e-7 where float32
   allows 1e-4); a position or window bug is order 1e-1. A row where the padded forward itself is degenerate (NaN from
   eager attention over a window of only padding, stock TRL included) is compared with the sequence run alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trl_ext.toolkit.probe import ProbeRun, stock_forward
from trl_ext.toolkit.randomness import describe_draws

#: The probe of a model whose training lengths are unknown (no `max_length`, no readable dataset).
PROBE_LENGTHS = (9, 6, 11)
_TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4}
_HALF_TOLERANCE = 5e-2


class _LowestFloat(torch.overrides.TorchFunctionMode):
    """The lowest floating precision any operation of a forward returns (float64 models may compute in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.lowest: torch.dtype | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                if self.lowest is None or torch.finfo(tensor.dtype).eps > torch.finfo(self.lowest).eps:
                    self.lowest = tensor.dtype
        return out


@dataclasses.dataclass
class SelfCheckResult:
    """Outcome of `self_check`: `leak` is None when the model passed, else what leaked."""

    leak: str | None
    max_position_error: float
    tolerance: float
    seconds: float
    forwards: int
    lengths: tuple[int, ...] = PROBE_LENGTHS


def _probe(vocab: int, device: torch.device, seed: int, lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    low = min(3, vocab - 1)
    for i, n in enumerate(lengths):
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
    model: torch.nn.Module,
    packed_forward: Callable,
    lengths: Sequence[int] = PROBE_LENGTHS,
    moe: bool = False,
    autocast: torch.dtype | None = None,
    training: bool = False,
) -> SelfCheckResult:
    """Measure whether `packed_forward` (the model's wrapped forward) keeps packed sequences apart and equals the
    model's stock padded forward (`trl_ext.toolkit.probe.stock_forward`) on probe sequences of `lengths`.

    `moe`: the model routes tokens to experts, so changing one sequence changes how many tokens each expert multiplies
    at once, and a matmul kernel may round another token's row differently: the isolation check then allows 16 units
    of the dtype's round-off (relative to the largest logit) instead of bit-identity (a smaller leak, possible only in
    16 bits, would pass). `autocast`: the 16-bit dtype training autocasts a float32 model to; the probe runs under it.
    """
    lengths = tuple(int(n) for n in lengths)
    run = ProbeRun(model, training)
    device, vocab = run.device, run.vocab
    dtype = autocast or next(model.parameters()).dtype
    tolerance = _TOLERANCE.get(dtype, _HALF_TOLERANCE)
    ids, mask = _probe(vocab, device, 0, lengths)
    changed = ids.clone()
    middle = 1
    n = lengths[middle]
    changed[middle, :n] = (ids[middle, :n] + 1 + torch.arange(n, device=device) % 5) % vocab

    def result(leak: str | None, worst: float = float("nan")) -> SelfCheckResult:
        return SelfCheckResult(leak, worst, tolerance, run.seconds, run.forwards, lengths)

    autocasting = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with run:
        with torch.no_grad(), autocasting:
            recorder = _Recorder(model, sum(lengths))
            try:
                base = packed_forward(input_ids=ids, attention_mask=mask, use_cache=False).logits
                before, recorder.outputs = recorder.outputs, []
                after = packed_forward(input_ids=changed, attention_mask=mask, use_cache=False).logits
                run.forwards += 2
            except Exception as exc:  # noqa: BLE001 - a model that cannot run packed is refused, with the cause
                return result(f"its packed forward raised {type(exc).__name__}: {exc}")
            finally:
                recorder.close()
            others = [i for i in range(len(lengths)) if i != middle]
            real = mask.bool()
            for i in others:
                change = (base[i][real[i]].double() - after[i][real[i]].double()).abs().max()
                allowed = 16 * torch.finfo(base.dtype).eps * base[i][real[i]].double().abs().max() if moe else 0.0
                if change > allowed:
                    starts = torch.tensor([0, *lengths]).cumsum(0)
                    rows = torch.cat([torch.arange(int(starts[j]), int(starts[j + 1])) for j in others]).to(device)
                    return result(
                        f"the logits of probe sequence {i} changed when only the tokens of another sequence in the "
                        f"packed row changed (max change {(base[i] - after[i]).abs().max().item():.3g}); the first "
                        f"layer whose output changed is `{_first_change(before, recorder.outputs, rows)}`"
                    )
            try:
                with stock_forward(model):
                    with _LowestFloat() as observed:
                        stock = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                    run.forwards += 1
                    if dtype == torch.float64 and observed.lowest not in (None, torch.float64):
                        tolerance = _TOLERANCE.get(observed.lowest, _HALF_TOLERANCE)
                        dtype = observed.lowest  # what the message names
                    stock = run.without_degenerate_rows(
                        stock, ids, mask, lambda i, m: model(input_ids=i, attention_mask=m, use_cache=False).logits
                    )
            except Exception as exc:  # noqa: BLE001 - no stock reference, no verdict: refuse with the cause
                return result(f"its stock padded forward (the reference) raised {type(exc).__name__}: {exc}")
            worst = 0.0
            for i, length in enumerate(lengths):
                got = base[i, :length].to(torch.float64)
                ref = stock[i, :length].to(torch.float64)
                error = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
                worst = error if error != error else max(worst, error)  # NaN propagates: no verdict is a refusal
            if not worst <= tolerance:
                return result(
                    f"the packed logits differ from the stock padded forward by {worst:.3g} (relative to the largest "
                    f"logit; {str(dtype).replace('torch.', '')} round-off allows {tolerance:g}) on probe sequences of "
                    f"{list(lengths)} tokens: "
                    "positions do not restart per sequence, or a window, chunk or mask that the padded forward "
                    "applies is lost in the packed row",
                    worst,
                )
            return result(None, worst)


def random_draws_notice(role: str, model: torch.nn.Module, draws: Sequence[Any]) -> str:
    """The one notice padding_free gives for a model whose forward draws random numbers in training mode
    (`trl_ext.toolkit.randomness`): which layers, what is equal to stock TRL and what is not."""
    kind = (
        "dropout"
        if all(d.dropout for d in draws)
        else "a layer that samples in training, as PhiMoE's router samples experts, or dropout applied in `forward`"
    )
    return (
        f"the {role} model ({type(model).__name__}, `{getattr(model.config, 'model_type', None)}`) draws random "
        f"numbers in its forward in training mode, in {describe_draws(list(draws))} ({kind}). A packed row draws "
        "them on other tensor shapes than TRL's padded batch, so packed training takes other random samples than "
        "stock TRL: its losses and gradients are not equal to stock's step for step, only drawn from the same "
        "distributions where the layer draws per token (dropout, PhiMoE's expert sampling). The forward without "
        "random draws (eval mode: evaluation, a separate reference model) is equal to stock. For step-for-step "
        "equality with stock, train without padding_free."
    )
