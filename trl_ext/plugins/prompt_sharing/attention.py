"""Shared-prompt attention: each branch attends to its group's prefix and to itself, never to another branch.

Registered in transformers' `AttentionInterface` as `trl_ext_shared_sdpa` / `trl_ext_shared_eager`; a model with
prompt_sharing enabled is switched to it (for as long as trl-ext is installed). It acts only on calls that carry the
layout's segments (the `trl_ext_shared_groups` keyword, which transformers hands through the model to every attention
call, also when gradient checkpointing re-runs a layer); every other call goes to the shared varlen attention of
`_packing.attention` when that is registered (it runs packed calls), else to the model's own attention with the mask
transformers builds for it, so generation and plain forwards are unchanged.

CPU (sdpa / eager): one attention call per segment (SDPA for plain SDPA layers; the layer's own attention function,
with an explicit mask, for eager layers and for softcapping or attention sinks). The prefix attends to itself
causally; a branch's queries run against the prefix's keys/values followed by its own, with a bottom-right causal
mask (every prefix key visible, the branch causal), so the cost is `P^2 + sum_b B_b (P + B_b)` per group, the cost
of the shared layout, not of a dense mask over the row. Sliding windows are applied by position (a key at `j` is
visible from `i` when `i - window < j <= i`), as transformers' `sliding_window_overlay` does.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ...errors import UsageError
from .._packing.attention import (
    VARLEN_BASES,
    base_attention,
    packed_or_base_attention,
    packed_or_base_mask,
    register_attention,
    skip_mask_while,
    unregister_attention,
    varlen_attention_name,
)

__all__ = [
    "GROUPS_KWARG",
    "SHARED_BASES",
    "register_shared_attention",
    "shared_attention_name",
    "shared_call",
    "unregister_shared_attention",
]

#: The keyword that carries the layout's groups (`layout.Groups`) from the model call down to the attention.
GROUPS_KWARG = "trl_ext_shared_groups"
#: Attention implementations the shared attention stands in for (those `_packing.attention`'s varlen covers).
SHARED_BASES = VARLEN_BASES
_PREFIX = "trl_ext_shared_"

# True while a shared forward runs: the mask interface then builds no mask (the attention uses the segments).
_SHARED_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("trl_ext_shared_call", default=False)


def shared_attention_name(base: str) -> str:
    """The registered name of the shared attention that stands in for `base` (`"sdpa"` or `"eager"`)."""
    return f"{_PREFIX}{base}"


def base_of(impl: str) -> str | None:
    """`"sdpa"`/`"eager"` for a base, varlen or shared implementation name; None for anything else."""
    for base in SHARED_BASES:
        if impl in (base, varlen_attention_name(base), shared_attention_name(base)):
            return base
    return None


@contextlib.contextmanager
def shared_call() -> Iterator[None]:
    """Mark the enclosed forward as a shared call (the mask interface of the shared attention then builds no mask)."""
    token = _SHARED_CALL.set(True)
    try:
        yield
    finally:
        _SHARED_CALL.reset(token)


def _visible(
    q: int, k: int, offset: int, sliding_window: int | None, valid_keys: int | None, device: torch.device
) -> torch.Tensor:
    """Bool mask `[q, k]` of `q` queries at positions `offset..offset+q-1` over `k` keys at `0..k-1`: causal, within
    the window, and none from `valid_keys` on."""
    q_pos = torch.arange(offset, offset + q, device=device)[:, None]
    k_pos = torch.arange(k, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None and k > sliding_window:
        mask = mask & (k_pos > q_pos - sliding_window)
    if valid_keys is not None and valid_keys < k:
        mask = mask & (k_pos < valid_keys)
    return mask


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
    over the rest, and none from `valid_keys` on (trailing padding that is read back but never attended to).

    Plain SDPA models run `F.scaled_dot_product_attention` directly; every other layer (eager, softcapping, attention
    sinks) runs the attention function it would run without trl-ext, with this mask, so whatever that function does
    per key (softcap, sink logits, its own softmax precision) is done exactly as in the padded forward."""
    q, k = query.shape[2], key.shape[2]
    sliding_window = kwargs.get("sliding_window")
    plain = base == "sdpa" and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
    simple = offset == 0 and not (sliding_window is not None and k > sliding_window)
    simple = simple and not (valid_keys is not None and valid_keys < k)
    if plain and simple:
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )  # fmt: skip
    mask = _visible(q, k, offset, sliding_window, valid_keys, query.device)[None, None]
    if plain:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )  # fmt: skip
    if base == "eager":
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min
        )
    out, _ = base_attention(base, module)(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return out.transpose(1, 2)


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
            raise RuntimeError(
                "prompt_sharing: the shared attention expects one shared row, no mask and no cache, got query "
                f"{tuple(query.shape)}, key {tuple(key.shape)}, mask "
                f"{None if attention_mask is None else tuple(attention_mask.shape)}"
            )
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


def register_shared_attention() -> None:
    """Register `trl_ext_shared_sdpa` / `trl_ext_shared_eager` with transformers (idempotent)."""
    for base in SHARED_BASES:
        name = shared_attention_name(base)
        mask = skip_mask_while(_SHARED_CALL, name, functools.partial(packed_or_base_mask, base))
        register_attention(name, _make_shared_attention(base), mask)


def unregister_shared_attention() -> None:
    """Remove the registrations of `register_shared_attention`."""
    for base in SHARED_BASES:
        unregister_attention(shared_attention_name(base))
