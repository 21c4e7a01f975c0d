"""Packing metadata: how a padded batch maps to one packed row, and back.

A padded batch `input_ids [R, L]` with an `attention_mask` is packed into one row `[1, N]` of its real tokens, whose
`position_ids` restart at 0 for every sequence; the outputs are put back into the padded layout, so everything above
the model (TRL's loss, metrics, token counts) is unchanged. `packed_call` marks a forward as packed in the call
context, for the attention of `attention.py`. Nothing here imports TRL or transformers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from ...call_context import call_entered

__all__ = [
    "PACKING_KEY",
    "PackInfo",
    "pack_rows",
    "packed_call",
    "packing_metadata",
    "unpack_rows",
    "unpack_shifted",
]

#: The batch key under which the padding-free collator hands the packing metadata to the model wrappers. TRL 1.x
#: forwards every batch key except `completion_mask` and `ref_*` into `model(...)` (dpo_trainer.py `_compute_loss`,
#: `compute_ref_log_probs`; checked 1.12.0 and 1.16.0); the wrappers pop it before the model sees its kwargs.
PACKING_KEY = "trl_ext_packing"


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
        """Row-major metadata for the batch, `row_starts` and `row_lengths` (`[rows]` each): accelerate's batch
        dispatching, which concatenates and slices batches along dim 0, keeps each row's metadata with its row."""
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
    indices = mask.reshape(-1).nonzero().squeeze(1)
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
    with call_entered(packed=True, packed_bounds=bounds, packed_cu=None if info is None else info.cu_seq_lens):
        yield
