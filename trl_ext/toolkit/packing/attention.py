"""Per-segment ("varlen") attention for packed rows, and the attention registrations with transformers.

flash_attention_2/3/4 models keep packed sequences apart with the varlen arguments `cu_seq_lens_q/k`, `max_length_q/k`
(`transformers/modeling_flash_attention_utils.py`). `sdpa`/`eager` models use either transformers' block-diagonal mask
(built when `position_ids` restart and no `attention_mask` is given; "dense", (sum of lengths)^2 per layer) or the
attention of this module, registered as `trl_ext_varlen_<base>` ("varlen", the sum of the squared lengths): one fused
varlen kernel call per layer where `kernels.py` chose one (CUDA, bf16/fp16; a sliding window is the kernel's
`window_size`, also where only the mask applies it: `_packed_mask` marks such a mask), else per segment.

It acts only on packed calls (those that carry `cu_seq_lens_q` and no mask, or run inside `metadata.packed_call`);
every other call goes to the base implementation with the mask transformers builds for it. The registry helpers
(`register_attention`, `switch_attention`, `attention_users`, `unregister_attention`) serve every trl-ext attention.
"""

from __future__ import annotations

import operator
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ... import _compat
from ...call_context import CallContext, current_call
from ...errors import InternalError, UsageError
from . import kernels
from .kernels import run_packed
from .probe import checked_kernel
from .segments import packed_segments

__all__ = [
    "VARLEN_BASES",
    "additive_mask",
    "attention_users",
    "base_attention",
    "fused_kernel",
    "packed_or_base_attention",
    "packed_or_base_mask",
    "register_attention",
    "register_varlen_attention",
    "skip_mask_while",
    "switch_attention",
    "unregister_attention",
    "unregister_varlen_attention",
    "varlen_attention_name",
    "visible_keys",
]

#: Attention implementations the per-segment varlen attention can stand in for.
VARLEN_BASES = ("sdpa", "eager")
_VARLEN_PREFIX = "trl_ext_varlen_"


def varlen_attention_name(base: str) -> str:
    """The registered name of the varlen attention that stands in for `base` (`"sdpa"` or `"eager"`)."""
    return f"{_VARLEN_PREFIX}{base}"


def base_attention(base: str, module: torch.nn.Module) -> Callable:
    """The attention function a layer would run for `base` (`"sdpa"` or `"eager"`) without trl-ext."""
    if base == "eager":
        # Each modeling file has its own `eager_attention_forward` (softcapping, sinks, ...); the layer's default is
        # the one of its own module, exactly as `ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)`.
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise UsageError(
                f"packing: {type(module).__name__} runs `eager` attention but its modeling module defines no "
                "`eager_attention_forward` for the packed call to run; load the model with "
                '`attn_implementation="sdpa"`, or disable padding_free / prompt_sharing.'
            )
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


def visible_keys(
    q: int,
    k: int,
    device: torch.device,
    offset: int = 0,
    sliding_window: int | None = None,
    valid_keys: int | None = None,
) -> torch.Tensor:
    """Bool mask `[q, k]` of queries at positions `offset..offset+q-1` over keys at `0..k-1`, as transformers builds
    it: key j is visible from query i when j <= i and, with a window, i - sliding_window < j
    (`sliding_window_overlay`); none from `valid_keys` on."""
    q_pos = torch.arange(offset, offset + q, device=device)[:, None]
    k_pos = torch.arange(k, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask = mask & (k_pos > q_pos - sliding_window)
    if valid_keys is not None and valid_keys < k:
        mask = mask & (k_pos < valid_keys)
    return mask


def _segment_attention(
    base: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
    block: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one sequence, `[1, n, heads, head_dim]`: what the base implementation computes for it alone (its
    own eager function with softcapping, sinks, ...), with a plain SDPA fast path; `block`: the sequence's bool mask
    `[1, 1 or heads, n, n]` where the model's mask carries more than causality (a mask-only window or chunk)."""
    n = query.shape[2]
    sliding_window = kwargs.get("sliding_window")
    window = sliding_window if sliding_window is not None and n > sliding_window else None
    plain = base == "sdpa" and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
    if plain and window is None and block is None:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=dropout,
            is_causal=n > 1,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2)
    mask = visible_keys(n, n, query.device, sliding_window=window)[None, None]
    if block is not None:
        mask = mask & block
    if base == "eager":
        mask = additive_mask(mask, query.dtype)
    out, _ = base_attention(base, module)(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return out


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as eager attention adds it: 0 where visible, the lowest `dtype` value elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def _bounds_from_positions(position_ids: Any, query: torch.Tensor, key: torch.Tensor) -> list[int] | None:
    """Sequence bounds of a packed row read off its `position_ids` (a new sequence wherever the position does not
    continue the previous one), or None if the call is not one packed row without a cache or holds one sequence:
    what a layer recomputed by gradient checkpointing (outside `packed_call`) that dropped `cu_seq_lens_q` on the way
    to its attention (StableLM's) has, as transformers reads packed rows when it builds masks."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    n = position_ids.shape[1]
    if query.shape[0] != 1 or query.shape[2] != n or key.shape[2] != n or n < 2:
        return None
    starts = (position_ids[0, 1:] != position_ids[0, :-1] + 1).nonzero().flatten() + 1
    if starts.numel() == 0:
        return None
    return [0, *starts.tolist(), n]


_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids")


def _window(kwargs: dict[str, Any]) -> int | None:
    """The kernel's window (earlier keys a query sees) for transformers' `sliding_window` (keys `q - w < k <= q`)."""
    window = kwargs.get("sliding_window")
    return None if window is None else int(window) - 1


def fused_kernel(
    module: torch.nn.Module,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
    shared: bool = False,
) -> kernels.Kernel | None:
    """The fused kernel chosen for this layer's model (`kernels.choice_for`) when this call can run it (its tensors,
    nothing the kernel lacks, a pattern it passed its probe on: `probe.checked_kernel`); None: it runs per segment."""
    choice = kernels.choice_for(module)
    kernel = kernels.runs_fused(choice, qkv[0])
    if kernel is None or choice is None or dropout or kwargs.get("softcap") is not None:
        return None
    if kwargs.get("s_aux") is not None or (kwargs.get("sliding_window") is not None and not kernel.windows):
        return None
    return checked_kernel(choice, kernel, *qkv, _window(kwargs), scaling, shared)


def _make_varlen_attention(base: str) -> Callable:
    def varlen_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        cu_seq_lens = kwargs.get("cu_seq_lens_q")
        # A fused kernel runs calls without a mask, and those whose block-diagonal mask is the config's window.
        mask_window = getattr(attention_mask, _WINDOW, None)
        fused_kwargs = kwargs if mask_window is None else {**kwargs, "sliding_window": mask_window}
        no_mask = attention_mask is None or mask_window is not None
        kernel = fused_kernel(module, (query, key, value), dropout, scaling, fused_kwargs) if no_mask else None
        max_length, window = kwargs.get("max_length_q"), _window(fused_kwargs)
        if kernel is not None and cu_seq_lens is not None and isinstance(max_length, int) and query.shape[0] == 1:
            # One kernel call with the batch's device `cu_seq_lens` (built once per batch): no host work per layer.
            return run_packed(kernel, query, key, value, cu_seq_lens, max_length, scaling, window), None
        # the host bounds of the batch (read once per batch by `packed_call`), not a device read per layer
        call = current_call()
        bounds = call.packed_bounds
        if cu_seq_lens is not None and (bounds is None or cu_seq_lens is not call.packed_cu):
            bounds = cu_seq_lens.tolist()
        if cu_seq_lens is None and attention_mask is None:
            from_positions = _bounds_from_positions(kwargs.get("position_ids"), query, key)
            if bounds is None:
                # a layer recomputed by gradient checkpointing (outside `packed_call`) that dropped `cu_seq_lens_q`
                bounds = from_positions
            elif (
                module.training
                and isinstance(kwargs.get("position_ids"), torch.Tensor)
                and (from_positions or [0, bounds[-1]]) != sorted(set(bounds))
            ):
                # The recomputation above would split the row elsewhere than this forward does: refuse now.
                raise UsageError(
                    f"packing: {type(module).__name__} does not receive the packed sequence bounds, and the "
                    "position_ids the model got do not restart at every packed sequence, so a layer recomputed by "
                    "gradient checkpointing could not tell the sequences apart. Pass position_ids that restart at 0 "
                    "for every sequence, or none (packing builds them)."
                )
        blocks = attention_mask if getattr(attention_mask, _BLOCK_DIAGONAL, False) else None
        if bounds is None or (attention_mask is not None and blocks is None):
            # Not a packed call (generation, a user's own forward), or a model that built its own mask inside a
            # packed call (a dense mask, used as is): exactly what the base implementation does.
            return base_attention(base, module)(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        if query.shape[0] != 1 or query.shape[2] != key.shape[2] or query.shape[2] != bounds[-1]:
            raise InternalError(
                f"packing: varlen attention expects one packed row of {bounds[-1]} tokens and no cache, got "
                f"query {tuple(query.shape)} and key {tuple(key.shape)} in {type(module).__name__}"
            )
        if kernel is not None:  # no mask, or the block-diagonal mask of the config's window
            segments = packed_segments(bounds, query.device)
            return run_packed(kernel, query, key, value, segments.cu_q, segments.max_q, scaling, window), None
        rest = {k: v for k, v in kwargs.items() if k not in _VARLEN_KWARGS}
        outs = []
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            if e > s:
                q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
                block = None if blocks is None else _as_bool(blocks[:, :, s:e, s:e])
                outs.append(_segment_attention(base, module, q, k, v, dropout, scaling, rest, block))
        out = torch.cat(outs, dim=1) if len(outs) != 1 else outs[0]
        return out.contiguous(), None

    varlen_attention_forward.__name__ = f"{_VARLEN_PREFIX}{base}_attention_forward"
    return varlen_attention_forward


# Set on the block-diagonal masks `_packed_mask` builds: the varlen attention then attends per sequence with the
# diagonal blocks (a mask it did not build is used as is).
_BLOCK_DIAGONAL = "_trl_ext_block_diagonal"
# Set on those whose every block is causal within the config's `sliding_window` (its value): what a fused kernel with
# that window computes.
_WINDOW = "_trl_ext_sliding_window"


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask == 0


def _mask_pattern(kwargs: dict[str, Any], start: int, end: int) -> torch.Tensor:
    """The bool pattern `[1, 1 or heads, n, n]` of the call's mask function (causal, windows, chunks, a model's own
    overlays) on the packed sequence `[start, end)`, by transformers' `sdpa_mask` at its row indices: remapped to the
    sequence's own positions where the model hands the packed `position_ids` to its mask creation, else equal to the
    per-sequence pattern for functions of `q_idx - kv_idx` (chunked masks: only the first kind, by inspection)."""
    n = end - start
    pattern = sdpa_mask(
        batch_size=1,
        q_length=n,
        kv_length=n,
        q_offset=start,
        kv_offset=start,
        mask_function=kwargs["mask_function"],
        attention_mask=None,
        allow_is_causal_skip=False,
        use_vmap=bool(kwargs.get("use_vmap", False)),
        device=kwargs.get("device", "cpu"),
    )
    if pattern is None:  # not returned with allow_is_causal_skip=False; kept for the type checker
        raise InternalError("transformers' sdpa_mask returned no mask with allow_is_causal_skip=False")
    return pattern.bool()


def _packed_mask(kwargs: dict[str, Any], bounds: list[int] | None, base: str) -> torch.Tensor | None:
    """The mask of a packed call (no 2D mask): None when the model's mask is plain causal on every sequence (the
    varlen attention splits the row itself); otherwise the block-diagonal mask `[1, 1, N, N]` of the model's mask
    pattern on each sequence (a sliding window or chunk, whether or not the layers also receive it), in the format of
    `base`, whose diagonal blocks the varlen attention applies per sequence. Models that compute attention in their
    own modules (`_compat.OWN_ATTENTION_MODEL_TYPES`) always get it, as an additive float mask."""
    config = kwargs.get("config")
    own = getattr(config, "model_type", None) in _compat.OWN_ATTENTION_MODEL_TYPES
    n, kv = kwargs.get("q_length"), kwargs.get("kv_length")
    if bounds is None or n != bounds[-1] or kv != n or kwargs.get("q_offset", 0) or kwargs.get("kv_offset", 0):
        raise InternalError(
            f"packing: a packed forward of {type(config).__name__} builds a mask for {n} x {kv} tokens, not for "
            f"the packed row of {None if bounds is None else bounds[-1]} tokens"
        )
    mpt = getattr(config, "model_type", None) == "mpt"
    table = getattr(config, _compat.MPT_ALIBI_TABLE_ATTR, None) if mpt else None
    if isinstance(table, int) and n > table:
        raise UsageError(
            f"packing: a packed row of {n} tokens is longer than this model's ALiBi bias table "
            f"(`{_compat.MPT_ALIBI_TABLE_ATTR}={table}`), which covers one row. Lower per_device_train_batch_size or "
            f"max_length so that a batch holds at most {table} tokens, or train without packing."
        )
    device = kwargs.get("device", "cpu")
    spans = [(s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True) if e > s]
    patterns = [_mask_pattern(kwargs, s, e) for s, e in spans]
    if not own and _causal(spans, patterns, None):
        return None
    window = getattr(config, "sliding_window", None)
    windowed = isinstance(window, int) and not own and _causal(spans, patterns, window)
    heads = max(p.shape[1] for p in patterns)
    mask = torch.zeros(1, heads, n, n, dtype=torch.bool, device=device)
    for (s, e), pattern in zip(spans, patterns, strict=True):
        mask[:, :, s:e, s:e] = pattern
    if own or base == "eager":
        dtype = kwargs.get("dtype", torch.float32)
        mask = additive_mask(mask, dtype)
    setattr(mask, _BLOCK_DIAGONAL, True)
    if windowed:  # causal within the config's window on every sequence: a fused kernel applies it itself
        setattr(mask, _WINDOW, window)
    return mask


def _causal(spans: list[tuple[int, int]], patterns: list[torch.Tensor], window: int | None) -> bool:
    """Whether every sequence's pattern is causal (within `window`): one host synchronisation per row, where a
    `torch.equal` per sequence costs one each on a GPU (16 per forward in the first H200 profile)."""
    same = [
        (p == visible_keys(e - s, e - s, p.device, sliding_window=window)[None, None]).all()
        for (s, e), p in zip(spans, patterns, strict=True)
    ]
    return bool(torch.stack(same).all()) if same else True


def skip_mask_while(flag: Callable[[CallContext], object], name: str, fallback: str | Callable[[], str]) -> Callable:
    """A mask function for `AttentionMaskInterface`: no mask while `flag(current_call())` holds and the call brings
    none (the attention splits the row itself), else the mask of the implementation `fallback` names (or returns, if a
    function: looked up on each call)."""

    def mask(*args: Any, **kwargs: Any) -> Any:
        model_type = getattr(kwargs.get("config"), "model_type", None)
        call = current_call()
        if flag(call) and kwargs.get("attention_mask") is None:
            bounds = call.packed_bounds
            if bounds is None and model_type not in _compat.OWN_ATTENTION_MODEL_TYPES:
                return None
            return _packed_mask(kwargs, bounds, fallback if isinstance(fallback, str) else fallback())
        other = fallback if isinstance(fallback, str) else fallback()
        if model_type in _compat.OWN_ATTENTION_MODEL_TYPES:
            other = "eager"  # their attention adds a float mask unless the implementation is named plain "sdpa"
        return ALL_MASK_ATTENTION_FUNCTIONS[other](*args, **kwargs)

    mask.__name__ = f"{name}_mask"
    return mask


def register_attention(name: str, forward: Callable, mask: Callable) -> None:
    """Register an attention implementation and its mask function with transformers under `name` (idempotent)."""
    if name not in _compat.attention_registry(AttentionInterface):
        AttentionInterface.register(name, forward)
    if name not in _compat.attention_registry(AttentionMaskInterface):
        AttentionMaskInterface.register(name, mask)


# The configs switched to a trl-ext attention (by `switch_attention`), weakly: a registration stays while a live model
# still names it, so a model that outlives its trainer (garbage-collected, never detached) keeps a valid attention.
_SWITCHED: dict[int, weakref.ref] = {}


def switch_attention(patcher: Any, config: Any, name: str) -> None:
    """Switch `config` to the registered attention `name` through `patcher` (undone when the trainer is detached),
    and remember the config so that `unregister_attention(name)` leaves the registration while it still uses it."""
    patcher.setattr(config, _compat.ATTN_IMPLEMENTATION_FIELD, name)
    _SWITCHED[id(config)] = weakref.ref(config)


def attention_users(name: str) -> int:
    """How many live model configs run the attention registered as `name` (switched by `switch_attention`)."""
    users = 0
    for key, ref in list(_SWITCHED.items()):
        config = ref()
        if config is None:
            _SWITCHED.pop(key, None)
        elif config.__dict__.get(_compat.ATTN_IMPLEMENTATION_FIELD) == name:
            users += 1
    return users


def unregister_attention(name: str) -> bool:
    """Undo `register_attention` (transformers' registries are global), unless a live model still runs `name` (its
    trainer was garbage-collected without being detached): then the registration stays, and False is returned."""
    if attention_users(name):
        return False
    _compat.attention_registry(AttentionInterface).pop(name, None)
    _compat.attention_registry(AttentionMaskInterface).pop(name, None)
    return True


def register_varlen_attention(patcher: Any = None) -> None:
    """Register `trl_ext_varlen_sdpa` / `trl_ext_varlen_eager` with transformers (idempotent); removed again when
    `patcher` (if given) is undone."""
    for base in VARLEN_BASES:
        name = varlen_attention_name(base)
        mask = skip_mask_while(operator.attrgetter("packed"), name, base)
        register_attention(name, _make_varlen_attention(base), mask)
    if patcher is not None:
        patcher.defer(unregister_varlen_attention)


def unregister_varlen_attention() -> None:
    """Remove the registrations of `register_varlen_attention`."""
    for base in VARLEN_BASES:
        unregister_attention(varlen_attention_name(base))


def packed_or_base_attention(base: str, module: torch.nn.Module) -> Callable:
    """What a model switched to another trl-ext attention runs for a call that attention does not handle: the varlen
    attention when it is registered (it runs packed calls and hands the rest to `base`), else `base`'s own."""
    varlen = varlen_attention_name(base)
    if varlen in _compat.attention_registry(AttentionInterface):
        return ALL_ATTENTION_FUNCTIONS[varlen]
    return base_attention(base, module)


def packed_or_base_mask(base: str) -> str:
    """The mask implementation that goes with `packed_or_base_attention(base, ...)`."""
    varlen = varlen_attention_name(base)
    return varlen if varlen in _compat.attention_registry(AttentionMaskInterface) else base
