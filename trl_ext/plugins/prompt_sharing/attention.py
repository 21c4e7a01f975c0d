"""Shared-prompt attention: each branch attends to its group's prefix and to itself, never to another branch.

Registered in transformers' `AttentionInterface` as `trl_ext_shared_sdpa` / `trl_ext_shared_eager`. It acts only on
calls that carry the layout's segments (the `trl_ext_shared_groups` keyword, which transformers hands through the model
to every attention call, also when gradient checkpointing re-runs a layer); every other call goes to the varlen
attention of `toolkit.packing.attention` when that is registered, else to the model's own attention with its mask.

Per segment (CPU, or what the kernels lack): the prefix attends to itself causally; a branch's queries run against the
prefix's keys/values followed by its own, with a bottom-right causal mask, so the cost is `P^2 + sum_b B_b (P + B_b)`
per group. Sliding windows are applied by position, as transformers' `sliding_window_overlay` does.

Fused (CUDA, bf16/fp16, plain sdpa; chosen by `toolkit/packing/kernels.py`): one varlen kernel call per layer whose
segments are every prefix and every branch (the prefix's keys then its own; the kernels' bottom-right causal alignment
is exactly "the whole prefix, then causal", windows included), built once per batch and cached (`shared_segments`).
Online DPO's trailing padding is a second, non-causal call, merged back by position.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from trl_ext.api import CallSlot, InternalError, UsageError
from trl_ext.toolkit.packing import kernels, segments
from trl_ext.toolkit.packing.attention import (
    VARLEN_BASES,
    additive_mask,
    base_attention,
    fused_kernel,
    packed_or_base_attention,
    packed_or_base_mask,
    register_attention,
    skip_mask_while,
    unregister_attention,
    varlen_attention_name,
    visible_keys,
)

from .layout import Groups

__all__ = [
    "GROUPS_KWARG",
    "register_shared_attention",
    "shared_attention_name",
    "shared_call",
    "unregister_shared_attention",
]

#: The keyword that carries the layout's groups (`layout.Groups`) from the model call down to the attention.
GROUPS_KWARG = "trl_ext_shared_groups"
_PREFIX = "trl_ext_shared_"

# True while a shared forward runs: the mask interface then builds no mask (the attention uses the segments).
_SHARED_CALL: CallSlot[bool] = CallSlot("prompt_sharing.shared_call")


def shared_attention_name(base: str) -> str:
    """The registered name of the shared attention that stands in for `base` (`"sdpa"` or `"eager"`)."""
    return f"{_PREFIX}{base}"


def base_of(impl: str) -> str | None:
    """`"sdpa"`/`"eager"` for a base, varlen or shared implementation name; None for anything else."""
    for base in VARLEN_BASES:
        if impl in (base, varlen_attention_name(base), shared_attention_name(base)):
            return base
    return None


#: `with shared_call():` marks the enclosed forward as a shared call (the shared attention's mask interface then
#: builds no mask).
shared_call = functools.partial(_SHARED_CALL.entered, True)


def _attend(
    base: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    offset: int,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
    valid_keys: int | None = None,
) -> torch.Tensor:
    """Attention `[1, heads, q, head_dim]` of `q` queries over `offset + q` keys: all of the first `offset`, causal
    over the rest, and none from `valid_keys` on (trailing padding that is read back but never attended to). Layers
    other than plain SDPA (eager, softcapping, sinks) run the attention function they run without trl-ext, with this
    mask, so whatever it does per key is done exactly as in the padded forward."""
    q, k = query.shape[2], key.shape[2]
    sliding_window = kwargs.get("sliding_window")
    window = sliding_window if sliding_window is not None and k > sliding_window else None
    plain = base == "sdpa" and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
    causal = offset == 0 and window is None and not (valid_keys is not None and valid_keys < k)
    if plain:  # SDPA's own causal mask where that is the whole pattern
        mask = None if causal else visible_keys(q, k, query.device, offset, window, valid_keys)[None, None]
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )  # fmt: skip
    mask = visible_keys(q, k, query.device, offset, window, valid_keys)[None, None]
    if base == "eager":
        mask = additive_mask(mask, query.dtype)
    out, _ = base_attention(base, module)(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return out.transpose(1, 2)


@dataclasses.dataclass(frozen=True)
class SharedSegments:
    """The kernel calls of one shared row, built once per batch from its groups (`layout.Groups`, host ints): `main`,
    every prefix (its own keys) and every branch's real tokens (the prefix's keys then its own), causal aligned to the
    bottom right; `tail`, branches' trailing padding (Online DPO reads it) over the prefix's and the branch's real
    keys, not causal; `inverse`, where each row token's output is in `cat(main, tail)` (None: in order)."""

    main: segments.Segments
    tail: segments.Segments | None
    inverse: torch.Tensor | None


def shared_segments(groups: Groups, device: torch.device, sliding_window: int | None) -> SharedSegments | None:
    """The kernel calls of the shared row of `groups` (cached: built once per batch), or None when a branch's
    trailing padding has no key to attend to, or a sliding window would cut its keys (those run per segment)."""
    key = ("shared", groups, sliding_window)
    try:
        return segments.cached_segments(key, device, lambda: _build_shared(groups, device, sliding_window))
    except _PerSegment:
        return None


class _PerSegment(Exception):
    """A shared row whose trailing padding the kernels cannot attend as the padded forward does."""


def _calls(q_ranges: list[range], k_ranges: list[list[range]], device: torch.device) -> segments.Segments:
    cu_q, cu_k, kv = [0], [0], list[int]()
    for q, ks in zip(q_ranges, k_ranges, strict=True):
        cu_q.append(cu_q[-1] + len(q))
        for k in ks:
            kv.extend(k)
        cu_k.append(len(kv))
    queries = [i for q in q_ranges for i in q]
    identity = lambda xs: xs == list(range(len(xs)))  # noqa: E731
    return segments.Segments(
        segments.to_device(cu_q, device, torch.int32),
        segments.to_device(cu_k, device, torch.int32),
        max((len(q) for q in q_ranges), default=0),
        max((b - a for a, b in zip(cu_k[:-1], cu_k[1:], strict=True)), default=0),
        None if identity(kv) else segments.to_device(kv, device, torch.long),
        None if identity(queries) else segments.to_device(queries, device, torch.long),
    )


def _build_shared(groups: Groups, device: torch.device, sliding_window: int | None) -> SharedSegments:
    main_q: list[range] = []
    main_k: list[list[range]] = []
    tail_q: list[range] = []
    tail_k: list[list[range]] = []
    for ps, pe, branches in groups:
        prefix = range(ps, pe)
        if pe > ps:
            main_q.append(prefix)
            main_k.append([prefix])
        for bs, be, ke in branches:
            if ke > bs:
                main_q.append(range(bs, ke))
                main_k.append([prefix, range(bs, ke)])
            if be > ke:
                if pe - ps + ke - bs == 0:
                    raise _PerSegment
                if sliding_window is not None and pe - ps + be - bs > sliding_window:
                    raise _PerSegment
                tail_q.append(range(ke, be))
                tail_k.append([prefix, range(bs, ke)])
    main = _calls(main_q, main_k, device)
    if not tail_q:
        return SharedSegments(main, None, None)
    order = [i for q in main_q + tail_q for i in q]
    inverse = [0] * len(order)
    for position, token in enumerate(order):
        inverse[token] = position
    return SharedSegments(main, _calls(tail_q, tail_k, device), segments.to_device(inverse, device, torch.long))


def _kernel_call(
    kernel: kernels.Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: segments.Segments,
    causal: bool,
    window: int | None,
    scaling: float | None,
) -> torch.Tensor:
    if segments.q_index is not None:
        q = q.index_select(0, segments.q_index)
    if segments.kv_index is not None:
        k, v = k.index_select(0, segments.kv_index), v.index_select(0, segments.kv_index)
    cu_q, cu_k, max_q, max_k = segments.cu_q, segments.cu_k, segments.max_q, segments.max_k
    return kernel.call(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window=window, scale=scaling)


def run_shared(
    kernel: kernels.Kernel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: SharedSegments,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Shared attention of one row in one kernel call (two with trailing padding): `[1, H, T, D]` -> `[1, T, H, D]`."""
    q, k, v = kernels.kernel_inputs(kernel, query, key, value)
    window = None if sliding_window is None else int(sliding_window) - 1
    out = _kernel_call(kernel, q, k, v, plan.main, True, window, scaling)
    if plan.tail is not None and plan.inverse is not None:
        tail = _kernel_call(kernel, q, k, v, plan.tail, False, None, scaling)
        out = torch.cat([out, tail]).index_select(0, plan.inverse)
    return out.unsqueeze(0)


def _make_shared_attention(base: str) -> Callable:
    def shared_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        groups = kwargs.pop(GROUPS_KWARG, None)
        if groups is None and _SHARED_CALL.get():
            # The layer dropped the keyword arguments the model was called with (e.g. StableLM's decoder layer): run
            # as is, the row would be one causal sequence, responses seeing each other.
            raise UsageError(
                f"prompt_sharing: {type(module).__name__} was called without the shared layout's segments (its layer "
                "does not pass attention keyword arguments through), so it cannot keep responses apart. Disable "
                "prompt_sharing for this model."
            )
        if groups is None:
            return packed_or_base_attention(base, module)(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
            raise InternalError(
                "prompt_sharing: the shared attention expects one shared row, no mask and no cache, got query "
                f"{tuple(query.shape)}, key {tuple(key.shape)}, mask "
                f"{None if attention_mask is None else tuple(attention_mask.shape)}"
            )
        kernel = fused_kernel(module, (query, key, value), dropout, scaling, kwargs, shared=True)
        plan = shared_segments(groups, query.device, kwargs.get("sliding_window")) if kernel is not None else None
        if kernel is not None and plan is not None:
            return run_shared(kernel, query, key, value, plan, scaling, kwargs.get("sliding_window")), None
        outs = []
        for ps, pe, branches in groups:
            if pe > ps:
                outs.append(
                    _attend(base, module, query[:, :, ps:pe], key[:, :, ps:pe], value[:, :, ps:pe], 0, dropout,
                            scaling, kwargs)
                )  # fmt: skip
            for bs, be, ke in branches:
                if be == bs:
                    continue
                if pe > ps:
                    k = torch.cat([key[:, :, ps:pe], key[:, :, bs:be]], dim=2)
                    v = torch.cat([value[:, :, ps:pe], value[:, :, bs:be]], dim=2)
                else:
                    k, v = key[:, :, bs:be], value[:, :, bs:be]
                offset = pe - ps
                outs.append(
                    _attend(base, module, query[:, :, bs:be], k, v, offset, dropout, scaling, kwargs, offset + ke - bs)
                )
        out = torch.cat(outs, dim=2) if len(outs) != 1 else outs[0]
        return out.transpose(1, 2).contiguous(), None

    shared_attention_forward.__name__ = f"{_PREFIX}{base}_attention_forward"
    return shared_attention_forward


def register_shared_attention(patcher: Any = None) -> None:
    """Register `trl_ext_shared_sdpa` / `trl_ext_shared_eager` with transformers (idempotent); removed again when
    `patcher` (if given) is undone."""
    for base in VARLEN_BASES:
        name = shared_attention_name(base)
        mask = skip_mask_while(_SHARED_CALL.get, name, functools.partial(packed_or_base_mask, base))
        register_attention(name, _make_shared_attention(base), mask)
    if patcher is not None:
        patcher.defer(unregister_shared_attention)


def unregister_shared_attention() -> None:
    """Remove the registrations of `register_shared_attention`."""
    for base in VARLEN_BASES:
        unregister_attention(shared_attention_name(base))
