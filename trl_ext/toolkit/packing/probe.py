"""The kernel probe: a fused varlen kernel is measured on the training device before it computes anything that trains.

The first time a model's attention would run a call pattern (`Pattern`) through a fused kernel, `checked_kernel` runs
the same kernel call on random inputs of those shapes, forward and backward, against a float64 reference on the same
rounded inputs (`reference_attention`, the flash kernels' documented semantics); the verdict is kept on the model's
`kernels.Choice` (docs/plugins/padding_free.md, "The kernel probe": the log lines, the fallback, `attention: fused`).
The tolerance is 4 machine epsilons of the dtype relative to the largest entry: a correct kernel's round-off is about
1 epsilon, every fault the tests plant moves a result by 24 times it or more, and emulated right kernels of every
release measure at most 0.24 of it (tests/plugins/test_varlen_releases.py). The probe shortens a window to at most
`PROBE_WINDOW` keys so that it acts on the short segments: the kernel's window arithmetic is the same for every width.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..._logging import get_logger
from ...call_context import call_entered
from ...errors import UsageError
from .kernels import FUSED_DTYPES, Choice, Kernel, call_dtype, installed_kernels

__all__ = [
    "PROBE_WINDOW",
    "TOLERANCES",
    "Pattern",
    "ProbeResult",
    "checked_kernel",
    "probe",
    "probe_installed_kernels",
    "reference_attention",
]

logger = get_logger(__name__)

#: The tolerance of each dtype, relative to the largest entry of the reference (output and each gradient).
TOLERANCES: dict[torch.dtype, float] = {
    torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps,
    torch.float16: 4 * torch.finfo(torch.float16).eps,
    torch.float32: 1e-5,
    torch.float64: 1e-10,
}
#: The widest window the probe uses (earlier keys a query sees besides its own).
PROBE_WINDOW = 8

# (query length, key length) per segment. Packed: equal. Shared: a prompt alone, then responses over a prompt's keys
# and their own; the tail: trailing padding over real keys, not causal. One query segment over 128 tokens: torch
# 2.14/2.15 send such calls to cuDNN where they qualify.
_PACKED = ((1, 1), (9, 9), (40, 40), (150, 150))
_SHARED = ((12, 12), (7, 19), (1, 13), (40, 52), (150, 162))
_TAIL = ((5, 19), (2, 13), (140, 162))


@dataclasses.dataclass(frozen=True)
class Pattern:
    """One kind of kernel call: what the probe reproduces."""

    device: str
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    key_dim: int
    value_dim: int
    window: int | None
    scale: float | None
    shared: bool

    def describe(self) -> str:
        dims = (
            f"head dim {self.head_dim}"
            if self.head_dim == self.key_dim == self.value_dim
            else f"head dims q {self.head_dim} / k {self.key_dim} / v {self.value_dim}"
        )
        window = "" if self.window is None else f", window {self.window}"
        scale = "default scale" if self.scale is None else f"scale {self.scale:.4g}"
        kind = "shared-prompt calls" if self.shared else "packed causal"
        dtype = str(self.dtype).replace("torch.", "")
        return f"{self.device}, {dtype}, {kind}, heads {self.heads}/{self.kv_heads}, {dims}{window}, {scale}"


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """The probe's verdict on one pattern: `error` relative to the largest entry (None when the call raised or could
    not be made), `reason` None when the kernel passed."""

    pattern: Pattern
    error: float | None
    tolerance: float
    reason: str | None = None

    @property
    def passed(self) -> bool:
        return self.reason is None

    def as_dict(self, kernel: str) -> dict[str, Any]:
        return {
            "kernel": kernel,
            "dtype": str(self.pattern.dtype).replace("torch.", ""),
            "pattern": self.pattern.describe(),
            "error": self.error,
            "tolerance": self.tolerance,
            "passed": self.passed,
            "exception": None if self.passed or self.error is not None else self.reason,
        }


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: Sequence[tuple[int, int]],
    *,
    causal: bool,
    window: int | None,
    scale: float | None,
) -> torch.Tensor:
    """Varlen attention in float64, per segment, as the flash kernels define it: query `i` of `n` over `m` keys sits at
    key position `i + m - n` (bottom right); causal: keys up to it; a window `w`: also no key before `i + m - n - w`.
    `q [T_q, H, D]`, `k`/`v` `[T_k, H_kv, D]` (grouped-query heads: query head `h` reads key head `h // group`)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    if group != 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs, qs, ks = [], 0, 0
    for n, m in lengths:
        scores = torch.einsum("qhd,khd->hqk", q[qs : qs + n], k[ks : ks + m]) * scale
        at = torch.arange(n, device=q.device)[:, None] + (m - n)
        j = torch.arange(m, device=q.device)[None, :]
        visible = j <= at if causal or window is not None else torch.ones_like(j <= at)
        if window is not None:
            visible = visible & (j >= at - window)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", weights, v[ks : ks + m]))
        qs, ks = qs + n, ks + m
    return torch.cat(outs)


@contextlib.contextmanager
def _isolated(device: torch.device) -> Iterator[None]:
    """Autograd on, autocast off, no saved-tensor hooks of an enclosing activation checkpoint (the probe runs inside a
    model's forward as if alone), and the call context's `probing` set (for a test's recording kernel)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(call_entered(probing=True))
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch.autocast(device.type, enabled=False))
        with contextlib.suppress(RuntimeError):  # hooks disabled here: none to shadow
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        yield


def _cu(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _one_call(kernel: Kernel, pattern: Pattern, lengths, causal: bool, window, same_cu: bool, seed: int) -> float:
    """One kernel call on random inputs, forward and backward: the largest error of the output and of each gradient
    against the float64 reference, relative to that tensor's largest entry."""
    device = torch.device(pattern.device)
    gen = torch.Generator().manual_seed(seed)  # never the global generators: training draws stay as they were
    total_q, total_k = sum(n for n, _ in lengths), sum(m for _, m in lengths)

    def rand(rows: int, heads: int, dim: int) -> torch.Tensor:
        return torch.randn(rows, heads, dim, generator=gen).to(device=device, dtype=pattern.dtype)

    q = rand(total_q, pattern.heads, pattern.head_dim)
    k = rand(total_k, pattern.kv_heads, pattern.key_dim)
    v = rand(total_k, pattern.kv_heads, pattern.value_dim)
    grad = rand(total_q, pattern.heads, pattern.value_dim)
    cu_q = _cu([n for n, _ in lengths], device)
    cu_k = cu_q if same_cu else _cu([m for _, m in lengths], device)
    max_q, max_k = max(n for n, _ in lengths), max(m for _, m in lengths)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out = kernel.call(*inputs, cu_q, cu_k, max_q, max_k, causal=causal, window=window, scale=pattern.scale)
    grads = torch.autograd.grad(out, inputs, grad)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference_attention(
        exact[0], exact[1], exact[2], lengths, causal=causal, window=window, scale=pattern.scale
    )
    want_grads = torch.autograd.grad(want, exact, grad.double())
    error = 0.0
    for got, ref in zip((out, *grads), (want, *want_grads), strict=True):
        if got.shape != ref.shape:
            raise ValueError(f"the kernel returned shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
        largest = ref.abs().max().item() or 1.0
        error = max(error, (got.detach().double() - ref).abs().max().item() / largest)
    return error if math.isfinite(error) else math.inf


@torch.compiler.disable
def probe(kernel: Kernel, pattern: Pattern) -> ProbeResult:
    """Measure `kernel` on `pattern` (see the module docstring)."""
    tolerance = TOLERANCES.get(pattern.dtype, 1e-5)
    dims = (pattern.head_dim, pattern.key_dim, pattern.value_dim)
    if len(set(dims)) != 1:
        reason = f"query/key/value head dims {'/'.join(map(str, dims))} differ (the kernel takes one head dim)"
        return ProbeResult(pattern, None, tolerance, reason)
    window = None if pattern.window is None else min(pattern.window, PROBE_WINDOW)
    if pattern.shared:
        calls = [(_SHARED, True, window, False), (_TAIL, False, None, False)]
    else:
        calls = [(_PACKED, True, window, True)]
    error = 0.0
    try:
        with _isolated(torch.device(pattern.device)):
            for seed, (lengths, causal, call_window, same_cu) in enumerate(calls):
                error = max(error, _one_call(kernel, pattern, lengths, causal, call_window, same_cu, seed))
    except Exception as exc:  # the kernel refused the call: the loop runs it
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ProbeResult(pattern, None, tolerance, f"the call raised {type(exc).__name__}: {first[:300]}")
    if error > tolerance:
        return ProbeResult(
            pattern, error, tolerance, f"error {error:.2e} of the largest entry > tolerance {tolerance:.1e}"
        )
    return ProbeResult(pattern, error, tolerance)


def checked_kernel(
    choice: Choice,
    kernel: Kernel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window: int | None,
    scale: float | None,
    shared: bool,
) -> Kernel | None:
    """`kernel` for this call (transformers' `[1, H, T, D]` query/key/value) when the probe passed its pattern on this
    device, else None (the call runs per segment); probes the pattern on first use."""
    dtype = call_dtype(kernel, query)
    if dtype is None:
        return None
    pattern = Pattern(
        str(query.device), dtype, query.shape[1], key.shape[1], query.shape[-1], key.shape[-1], value.shape[-1],
        window, None if scale is None else float(scale), shared,
    )  # fmt: skip
    result = choice.verdicts.get(pattern)
    if result is None:
        result = choice.verdicts[pattern] = probe(kernel, pattern)
        _report(choice, kernel, result)
    return kernel if result.passed else None


def _report(choice: Choice, kernel: Kernel, result: ProbeResult) -> None:
    where = result.pattern.describe()
    if result.passed:
        logger.info(
            "%s: %s passed its probe (%s): error %.1e of the largest entry, tolerance %.1e",
            choice.plugin, kernel.name, where, result.error, result.tolerance,
        )  # fmt: skip
        return
    if choice.requested == "fused":
        raise UsageError(
            f"{choice.plugin}: `attention: fused` asks for {kernel.name}, which failed its probe on this device "
            f"({where}): {result.reason}. Set `attention: auto` (such calls then run per segment, exactly) or "
            "`attention: segments`."
        )
    logger.warning(
        "%s: %s failed its probe (%s): %s; these calls run per segment (exact) instead",
        choice.plugin, kernel.name, where, result.reason,
    )  # fmt: skip


def probe_installed_kernels(device: str = "cuda") -> list[dict[str, Any]]:
    """Every installed fused kernel on `device`, in bf16 and fp16, on the patterns the plugins use (packed causal, a
    window, grouped-query heads, shared prompts, a non-default scale; kernels that run on `device`'s type): one
    JSON-able dict per kernel and pattern
    (`kernel`, `dtype`, `pattern`, `error`, `tolerance`, `passed`, `exception`), for the GPU proof's record."""
    found = []
    for name, kernel in installed_kernels().items():
        if torch.device(device).type not in kernel.devices:
            continue
        for dtype in FUSED_DTYPES:
            for shared in (False, True):
                for heads, kv_heads, window, scale in ((16, 16, None, None), (32, 8, 63, 0.0625), (8, 2, None, 0.1)):
                    pattern = Pattern(device, dtype, heads, kv_heads, 128, 128, 128, window, scale, shared)
                    found.append(probe(kernel, pattern).as_dict(name))
    return found
