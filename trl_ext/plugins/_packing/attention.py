"""Packed ("padding-free") forward passes for causal LMs: packing metadata, varlen attention, and the wrappers.

A padded batch `input_ids [R, L]` with an `attention_mask` is packed into one row `[1, N]` (N = the number of real
tokens) whose `position_ids` restart at 0 for every sequence. The model then runs on the packed row and its outputs are
put back into the padded layout, so everything above the model (TRL's `_compute_loss`, metrics, token counts) is
unchanged. Two things keep the sequences of a packed row apart:

- with `flash_attention_2/3/4`, the varlen arguments `cu_seq_lens_q/k` and `max_length_q/k` that transformers hands to
  the flash-attention varlen kernels (`transformers/modeling_flash_attention_utils.py`);
- with `sdpa` or `eager` (CPU), either transformers' own block-diagonal mask, built when `position_ids` restart and no
  `attention_mask` is given (`transformers/masking_utils.py::_preprocess_mask_arguments`, "dense"), or the per-segment
  attention of this module ("varlen"), registered in transformers' `AttentionInterface` as `trl_ext_varlen_<base>`.
  The dense mask costs (sum of lengths)^2 per layer, varlen only the sum of the squared lengths.

The varlen attention only acts on packed calls (those that carry `cu_seq_lens_q` and no mask); every other call
(generation, a user's own forward) is handed to the base implementation with the mask transformers builds for it,
so a model switched to varlen attention behaves exactly as before outside packed calls.

What every packing plugin needs around the model lives here too, once: the
attention registration with transformers, the collator base that annotates batches, the trainer refusals (vision,
prompt-learning PEFT), the predicate of a scoring call, and re-padding of the fused LM head outputs.

Nothing here imports TRL; torch and transformers are imported at module level (this module is only imported by those
plugins, after `trl_ext.install()`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import _compat
from ..errors import UsageError
from ._probe import STOCK_CALL

__all__ = [
    "FUSED_FIELDS",
    "PACKING_KEY",
    "VARLEN_BASES",
    "VISION_KEYS",
    "AnnotatingCollator",
    "PackInfo",
    "attention_users",
    "base_attention",
    "check_packable_trainer",
    "pack_rows",
    "packing_metadata",
    "positional_input_ids",
    "register_attention",
    "register_varlen_attention",
    "repad_outputs",
    "scoring_call",
    "skip_mask_while",
    "switch_attention",
    "unregister_attention",
    "unpack_rows",
    "unpack_shifted",
    "unregister_varlen_attention",
    "varlen_attention_name",
]

#: The batch key under which the padding-free collator hands the packing metadata to the model wrappers. TRL 1.x
#: forwards every batch key except `completion_mask` and `ref_*` into `model(...)` (dpo_trainer.py `_compute_loss`,
#: `compute_ref_log_probs`; checked 1.12.0 and 1.16.0); the wrappers pop it before the model sees its kwargs.
PACKING_KEY = "trl_ext_packing"

#: Attention implementations the per-segment varlen attention can stand in for.
VARLEN_BASES = ("sdpa", "eager")
_VARLEN_PREFIX = "trl_ext_varlen_"

# True while a packed forward runs: the mask interface of the varlen implementations then builds no mask at all (the
# attention function splits the row by `cu_seq_lens_q`). A dynamic-scope flag like torch's grad mode, not state.
_PACKED_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("trl_ext_packed_call", default=False)
# The sequence bounds (cumulative lengths) of the packed row being run, for models that do not forward
# `cu_seq_lens_q` to their attention function.
_PACKED_BOUNDS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "trl_ext_packed_bounds", default=None
)


def varlen_attention_name(base: str) -> str:
    """The registered name of the varlen attention that stands in for `base` (`"sdpa"` or `"eager"`)."""
    return f"{_VARLEN_PREFIX}{base}"


# ---------------------------------------------------------------------------------------------------------------------
# Packing metadata
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PackInfo:
    """How a padded `[rows, length]` batch maps to one packed row of `N` real tokens.

    Attributes:
        indices (`torch.LongTensor` of shape `(N,)`): flat positions of the real tokens in the `rows * length` layout.
        position_ids (`torch.LongTensor` of shape `(1, N)`): position of each token in its own sequence (from 0).
        cu_seq_lens (`torch.IntTensor` of shape `(rows + 1,)`): cumulative sequence lengths, starting with 0.
        max_length (`int`): the longest sequence.
        unpack_index (`torch.LongTensor` of shape `(rows, length - 1)`): for each position of a padded *shifted*
            per-token output (`[:, :-1]` predicting `[:, 1:]`), its index in the packed shifted output (`N - 1`
            entries); `N - 1` (one past the end) where the padded layout has no real prediction.
        rows (`int`), length (`int`): the padded shape the metadata was made for.
    """

    indices: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_length: int
    unpack_index: torch.Tensor
    rows: int
    length: int

    @property
    def num_tokens(self) -> int:
        return self.indices.numel()

    def to_batch(self) -> dict[str, Any]:
        """Row-major metadata for the batch: `row_starts` and `row_lengths`, one entry per row (`[rows]` each).

        Every tensor of a batch has the rows on dim 0, so accelerate's `DataLoaderDispatcher` (iterable datasets,
        `dispatch_batches=True`), which concatenates batches and slices them along dim 0, keeps each row's metadata
        with its row. `from_batch` still checks it against the batch's `attention_mask` before using it.
        """
        lengths = self.cu_seq_lens[1:].long() - self.cu_seq_lens[:-1].long()
        starts = self.indices.new_zeros(self.rows)
        if self.num_tokens:
            first_token = self.cu_seq_lens[:-1].long().clamp(max=self.num_tokens - 1)
            starts = torch.where(lengths > 0, self.indices[first_token] % self.length, starts)
        return {"row_starts": starts, "row_lengths": lengths}

    @classmethod
    def from_batch(
        cls, value: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> PackInfo | None:
        """Rebuild from `to_batch()`; None when it does not describe the batch exactly (wrong keys, shapes or device,
        or, given `attention_mask`, real tokens other than the mask's), so that the caller packs from the mask."""
        if not isinstance(value, dict) or set(value) != {"row_starts", "row_lengths"}:
            return None
        starts, lengths = value["row_starts"], value["row_lengths"]
        rows, length = input_ids.shape
        for t in (starts, lengths):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (rows,) or t.device != input_ids.device:
                return None
        cols = torch.arange(length, device=input_ids.device)[None]
        mask = (cols >= starts[:, None]) & (cols < (starts + lengths)[:, None])
        if attention_mask is not None and not torch.equal(mask, attention_mask.bool()):
            return None
        return packing_metadata(mask)

    def flash_kwargs(self) -> dict[str, Any]:
        """The flash-attention varlen arguments (`FlashAttentionKwargs`) of this packing."""
        cu = self.cu_seq_lens.to(torch.int32)
        return {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }


def packing_metadata(attention_mask: torch.Tensor) -> PackInfo:
    """Packing metadata from a 2D `attention_mask` (1 = real token), on the mask's device.

    Each row must hold one sequence whose real tokens are contiguous (right or left padding). Positions restart at 0
    for every sequence, as transformers' flash-attention and packed-mask paths expect.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"packing needs 2D attention masks, got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    rows, length = mask.shape
    device = mask.device
    lengths = mask.sum(dim=1)
    flat = mask.reshape(-1)
    indices = flat.nonzero().squeeze(1)
    num_tokens = indices.numel()
    position_ids = (mask.cumsum(dim=1) - 1).reshape(-1)[indices].unsqueeze(0)
    cu_seq_lens = torch.zeros(rows + 1, dtype=torch.int32, device=device)
    cu_seq_lens[1:] = lengths.cumsum(dim=0)
    max_length = int(lengths.max()) if rows else 0
    # Position p of a row holds the prediction of token p + 1 in the shifted layout; it is real when both tokens are.
    # The packed shifted output j predicts packed token j + 1 from packed token j.
    packed_pos = torch.full((rows * length,), -1, dtype=torch.long, device=device)
    packed_pos[indices] = torch.arange(num_tokens, device=device)
    packed_pos = packed_pos.view(rows, length)
    src, dst = packed_pos[:, :-1], packed_pos[:, 1:]
    valid = (src >= 0) & (dst == src + 1)
    sentinel = max(num_tokens - 1, 0)
    unpack_index = torch.where(valid, src, torch.full_like(src, sentinel))
    return PackInfo(indices, position_ids, cu_seq_lens, max_length, unpack_index, rows, length)


def pack_rows(x: torch.Tensor, info: PackInfo) -> torch.Tensor:
    """`[rows, length, ...]` -> `[1, N, ...]` (the real tokens, in order)."""
    return x.reshape(info.rows * info.length, *x.shape[2:]).index_select(0, info.indices).unsqueeze(0)


def unpack_rows(x: torch.Tensor, info: PackInfo) -> torch.Tensor:
    """`[1, N, ...]` -> `[rows, length, ...]`, zeros at padded positions (differentiable)."""
    out = x.new_zeros(info.rows * info.length, *x.shape[2:])
    return out.index_copy(0, info.indices, x[0]).view(info.rows, info.length, *x.shape[2:])


def unpack_shifted(x: torch.Tensor | None, info: PackInfo) -> torch.Tensor | None:
    """A shifted per-token output `[1, N - 1]` -> `[rows, length - 1]`, zeros/False where there is no prediction."""
    if x is None:
        return None
    flat = torch.cat([x.reshape(-1), x.new_zeros(1)])
    return flat[info.unpack_index]


@contextlib.contextmanager
def packed_call(info: PackInfo | None = None) -> Iterator[None]:
    """Mark the enclosed forward as packed: the varlen mask interface then builds no mask, and the varlen attention
    splits the row at the sequence bounds of `info` (read once here, not once per layer) unless the call passes its
    own `cu_seq_lens_q`."""
    bounds = None if info is None else [int(b) for b in info.cu_seq_lens.tolist()]
    token = _PACKED_CALL.set(True)
    bounds_token = _PACKED_BOUNDS.set(bounds)
    try:
        yield
    finally:
        _PACKED_BOUNDS.reset(bounds_token)
        _PACKED_CALL.reset(token)


# ---------------------------------------------------------------------------------------------------------------------
# Varlen attention (per-segment SDPA) for CPU
# ---------------------------------------------------------------------------------------------------------------------


def base_attention(base: str, module: torch.nn.Module) -> Callable:
    """The attention function a layer would run for `base` (`"sdpa"` or `"eager"`) without trl-ext."""
    if base == "eager":
        # Each modeling file has its own `eager_attention_forward` (softcapping, sinks, ...); the layer's default is
        # the one of its own module, exactly as `ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)`.
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"trl-ext: no eager attention found for {type(module).__name__}")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


def _segment_mask(n: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """Causal (and sliding-window) bool mask `[1, 1, n, n]` of one sequence, as transformers builds it: key kv is
    visible from query q when kv <= q and, with a window, q - sliding_window < kv (`sliding_window_overlay`)."""
    q_idx = torch.arange(n, device=device)[:, None]
    kv_idx = torch.arange(n, device=device)[None, :]
    mask = kv_idx <= q_idx
    if sliding_window is not None:
        mask = mask & (kv_idx > q_idx - sliding_window)
    return mask[None, None]


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
    """Attention of one sequence, `[1, n, heads, head_dim]`: exactly what the base implementation computes for that
    sequence alone (its own eager function with softcapping, sinks, ...), with a plain SDPA fast path. `block` is the
    sequence's bool mask `[1, 1 or heads, n, n]` when the model's mask carries more than causality (a window or chunk
    that only the mask applies)."""
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
    mask = _segment_mask(n, window, query.device)
    if block is not None:
        mask = mask & block
    if base == "eager":
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min
        )
    out, _ = base_attention(base, module)(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return out


def _bounds_from_positions(position_ids: Any, query: torch.Tensor, key: torch.Tensor) -> list[int] | None:
    """Sequence bounds of a packed row read off its `position_ids` (a new sequence wherever the position does not
    continue the previous one), or None if the call is not one packed row without a cache or holds one sequence.

    Gradient checkpointing recomputes a decoder layer during the backward, outside `packed_call`. A layer that drops
    `cu_seq_lens_q` on the way to its attention (StableLM's decoder layer) then has only the packed `position_ids`,
    which restart at every sequence of the packed row: the bounds read here are those of the original
    forward, so the recomputation runs the same attention (transformers reads packed rows off `position_ids` the
    same way when it builds masks)."""
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
        bounds = cu_seq_lens.tolist() if cu_seq_lens is not None else _PACKED_BOUNDS.get()
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
            raise RuntimeError(
                f"packing: varlen attention expects one packed row of {bounds[-1]} tokens and no cache, got "
                f"query {tuple(query.shape)} and key {tuple(key.shape)} in {type(module).__name__}"
            )
        rest = {k: v for k, v in kwargs.items() if k not in _VARLEN_KWARGS}
        outs = [
            _segment_attention(
                base,
                module,
                query[:, :, s:e],
                key[:, :, s:e],
                value[:, :, s:e],
                dropout,
                scaling,
                rest,
                None if blocks is None else _as_bool_mask(blocks[:, :, s:e, s:e]),
            )
            for s, e in zip(bounds[:-1], bounds[1:], strict=True)
            if e > s
        ]
        out = torch.cat(outs, dim=1) if len(outs) != 1 else outs[0]
        return out.contiguous(), None

    varlen_attention_forward.__name__ = f"{_VARLEN_PREFIX}{base}_attention_forward"
    return varlen_attention_forward


# Set on the block-diagonal masks `_packed_mask` builds: the varlen attention then attends per sequence with the
# diagonal blocks (a mask it did not build is used as is).
_BLOCK_DIAGONAL = "_trl_ext_block_diagonal"


def _as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask == 0


def _mask_pattern(kwargs: dict[str, Any], start: int, end: int) -> torch.Tensor:
    """The bool pattern `[1, 1 or heads, n, n]` of the call's mask function (transformers' `(batch_idx, head_idx,
    q_idx, kv_idx)` functions: causal, windows, chunks, a model's own overlays) on the packed sequence
    `[start, end)`, evaluated by transformers' `sdpa_mask` at its row indices. transformers remaps row indices to each
    sequence's own positions when the model hands the packed `position_ids` to its mask creation; otherwise the
    pattern is taken at row indices, which equals the per-sequence pattern for causal masks and sliding windows
    (functions of `q_idx - kv_idx`); chunked masks are accepted only on models of the first kind (inspection)."""
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
        raise RuntimeError("transformers' sdpa_mask returned no mask with allow_is_causal_skip=False")
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
        raise RuntimeError(
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
    causal = [_segment_mask(e - s, None, p.device) for (s, e), p in zip(spans, patterns, strict=True)]
    if not own and all(torch.equal(p, c.expand_as(p)) for p, c in zip(patterns, causal, strict=True)):
        return None
    heads = max(p.shape[1] for p in patterns)
    mask = torch.zeros(1, heads, n, n, dtype=torch.bool, device=device)
    for (s, e), pattern in zip(spans, patterns, strict=True):
        mask[:, :, s:e, s:e] = pattern
    if own or base == "eager":
        dtype = kwargs.get("dtype", torch.float32)
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
    setattr(mask, _BLOCK_DIAGONAL, True)
    return mask


def skip_mask_while(flag: contextvars.ContextVar[bool], name: str, fallback: str | Callable[[], str]) -> Callable:
    """A mask function for `AttentionMaskInterface`: no mask while `flag` is set and the call brings none (the
    attention splits the row itself), else the mask of the implementation `fallback` names (or returns, if a
    function: looked up on each call)."""

    def mask(*args: Any, **kwargs: Any) -> Any:
        model_type = getattr(kwargs.get("config"), "model_type", None)
        if flag.get() and kwargs.get("attention_mask") is None:
            bounds = _PACKED_BOUNDS.get()
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
    # `_attn_implementation` is a property over `_attn_implementation_internal` (transformers 5); the private field is
    # never serialized (configuration_utils.py `_remove_keys_not_serialized`), so checkpoints keep the user's choice.
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
    """Undo `register_attention` (transformers' registries are global), unless a live model still runs `name`
    (its trainer was garbage-collected without being detached): then the registration stays, and False is
    returned."""
    if attention_users(name):
        return False
    _compat.attention_registry(AttentionInterface).pop(name, None)
    _compat.attention_registry(AttentionMaskInterface).pop(name, None)
    return True


def register_varlen_attention() -> None:
    """Register `trl_ext_varlen_sdpa` / `trl_ext_varlen_eager` with transformers (idempotent)."""
    for base in VARLEN_BASES:
        name = varlen_attention_name(base)
        register_attention(name, _make_varlen_attention(base), skip_mask_while(_PACKED_CALL, name, base))


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


# ---------------------------------------------------------------------------------------------------------------------
# What the packing plugins share around the model: batch checks, collator, call predicate
# ---------------------------------------------------------------------------------------------------------------------

#: Batch keys of vision-language collators (DataCollatorForVisionPreference, VLM processors): image features are
#: matched to placeholder tokens per row, which neither packing nor sharing keeps.
VISION_KEYS = (
    "pixel_values",
    "pixel_attention_mask",
    "image_grid_thw",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
)
#: Per-token outputs of TRL's fused LM head (TRL >= 1.15), `[B, L - 1]` each, put back into the padded layout.
FUSED_FIELDS = _compat.FUSED_LM_HEAD_FIELDS


def check_packable_trainer(trainer: Any, plugin: str) -> None:
    """Refuse, with a `UsageError` naming `plugin`, the trainers whose rows cannot be packed: vision-language models
    or datasets, and prompt-learning PEFT (virtual tokens prepended to every row)."""
    if any(getattr(trainer, attr, False) for attr in _compat.TRL_VISION_ATTRS):
        raise UsageError(
            f"{plugin} does not support vision-language models or image datasets: image features are matched to "
            f"placeholder tokens per row. Disable {plugin} for this trainer."
        )
    peft_config = getattr(getattr(trainer, "model", None), "peft_config", None)
    if isinstance(peft_config, dict):
        from peft import PromptLearningConfig

        if any(isinstance(cfg, PromptLearningConfig) for cfg in peft_config.values()):
            raise UsageError(
                f"{plugin} does not support prompt-learning PEFT methods (prompt tuning, prefix tuning, P-tuning): "
                f"they prepend virtual tokens to every row. Use a weight adapter such as LoRA, or disable {plugin}."
            )


class AnnotatingCollator:
    """Wraps a preference collator and adds a plugin's metadata to each batch, computed in the data-loader process.

    The padded batch is kept as it is (TRL reads `completion_mask`, `attention_mask` and the reference columns from
    it); the model wrappers pop the metadata before the model sees its kwargs. Attributes of the wrapped collator
    (`max_length`, `truncation_mode`, `pad_token_id`, read by other plugins) are read through. Subclasses set
    `plugin` and implement `annotate(batch)`.

    Args:
        collator (`Callable`): the collator to wrap (TRL's `DataCollatorForPreference` or a user's).
    """

    plugin = "trl-ext"

    def __init__(self, collator: Callable) -> None:
        self.collator = collator

    def annotate(self, batch: dict[str, Any]) -> None:
        raise NotImplementedError

    def __call__(self, examples: list[dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
        batch = self.collator(examples, *args, **kwargs)
        vision = [k for k in VISION_KEYS if k in batch]
        if vision:
            raise UsageError(f"{self.plugin} cannot pack vision-language batches (keys {vision}); disable it.")
        self.annotate(batch)
        return batch

    def __getattr__(self, name: str) -> Any:
        if name == "collator":  # not set yet (unpickling in a data-loader worker)
            raise AttributeError(name)
        return getattr(self.collator, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.collator!r})"


def positional_input_ids(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """Move a positional `input_ids` (`model(ids, ...)`) into `kwargs`; returns the positional arguments left."""
    if args and isinstance(args[0], torch.Tensor) and "input_ids" not in kwargs:
        kwargs["input_ids"] = args[0]
        return args[1:]
    return args


def scoring_call(kwargs: dict[str, Any], cache_unset_ok: bool = False) -> bool:
    """Whether a model call is a scoring forward on a padded batch that a packed layout reproduces exactly.

    TRL's DPO passes `use_cache=False`; generation and plain calls use a cache. With `cache_unset_ok` a call that
    leaves `use_cache` to the config also qualifies (Online DPO's scoring call: the cache it would build is never
    read).
    """
    if STOCK_CALL.get():  # a self-check's stock reference: every call runs as stock transformers runs it
        return False
    input_ids, attention_mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    use_cache = kwargs.get("use_cache")
    return (
        isinstance(input_ids, torch.Tensor)
        and input_ids.dim() == 2
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.shape == input_ids.shape
        and kwargs.get("inputs_embeds") is None
        and kwargs.get("past_key_values") is None
        and (use_cache is False or (cache_unset_ok and not use_cache))
        and not kwargs.get("output_hidden_states")
        and not kwargs.get("output_attentions")
        and kwargs.get("shift_labels") is None
        and not kwargs.get("logits_to_keep")
        and not any(k in kwargs for k in VISION_KEYS)
    )


def repad_outputs(
    outputs: Any,
    fused: bool,
    unpack: Callable[[torch.Tensor], torch.Tensor],
    unpack_shifted: Callable[[torch.Tensor], torch.Tensor | None],
) -> Any:
    """Put a packed causal-LM output back into the padded layout, in place: the fused LM head's per-token fields
    (`fused`, shifted `[1, N - 1]` -> `[R, L - 1]`) or the logits (`[1, N, V]` -> `[R, L, V]`)."""
    if fused:
        for name in FUSED_FIELDS:
            value = getattr(outputs, name, None)
            if value is not None:
                setattr(outputs, name, unpack_shifted(value))
    elif getattr(outputs, "logits", None) is not None:
        outputs.logits = unpack(outputs.logits)
    return outputs
