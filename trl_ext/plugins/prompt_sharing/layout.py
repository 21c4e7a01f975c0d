"""The shared layout: how a padded `[rows, length]` batch maps to one row in which every prompt appears once.

Rows whose prompt parts are identical (same tokens from the same column, so at the same positions) form a *group*,
laid out as `prompt[:-1]` (the prefix, once), then per row a branch `(prompt[-1], completion)`; the groups follow each
other in one packed row `[1, N]`. A row whose prompt no other row shares is a group of one branch and no prefix. Each
branch repeats the last prompt token, so the hidden state that predicts its first completion token sits in the branch
and the usual shift of a packed row stays right (Wang & Hegde 2024, arXiv 2410.20305). Positions are the tokens'
columns in the padded batch, as a padded forward without `position_ids` uses. A prefix token attends to the prefix
causally; a branch token to the whole prefix and causally to its own branch. Built on the host, in the data loader
(`PromptSharingCollator`).

In the batch the layout travels as two tensors (`SharedLayout.to_batch`): `prompt_end`, one entry per row, and
`layout`, the whole layout serialized into one 1-D tensor. accelerate's batch dispatching (`dispatch_batches=True`,
iterable datasets) slices every tensor along dim 0: `prompt_end` stays with its rows, a slice of the serialized layout
is recognized, and the forward rebuilds the layout from `input_ids`, `attention_mask` and `prompt_end`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch

from trl_ext.api import UsageError
from trl_ext.toolkit.packing.glue import AnnotatingCollator

__all__ = ["LAYOUT_KEY", "Groups", "PromptSharingCollator", "SharedLayout", "build_layout", "prompt_end_of"]

#: Batch key under which the collator hands the layout to the model wrappers (which pop it), as `metadata.PACKING_KEY`.
LAYOUT_KEY = "trl_ext_prompt_sharing"

#: Groups of a shared row as host ints: `((prefix_start, prefix_end, ((branch_start, branch_end, keys_end), ...)),
#: ...)`, in row order; every token of the row belongs to exactly one prefix or branch. A branch's tokens from
#: `keys_end` on are trailing padding whose outputs the caller reads (Online DPO): they attend to the real tokens
#: only, as in the padded forward, and no token attends to them.
Groups = tuple[tuple[int, int, tuple[tuple[int, int, int], ...]], ...]


@dataclasses.dataclass
class SharedLayout:
    """How a padded `[rows, length]` batch maps to one shared row of `N` tokens.

    Attributes:
        rows (`int`), length (`int`): the padded shape the layout was made for.
        gather (`torch.LongTensor` of shape `(N,)`): for each shared token, its flat position in `rows * length`.
        position_ids (`torch.LongTensor` of shape `(1, N)`): the column of each shared token (its padded position).
        real_flat (`torch.LongTensor` of shape `(M,)`), real_shared (`(M,)`): every real token of the padded batch
            (flat position) and the shared token that stands for it.
        shift_flat (`(K,)`), shift_shared (`(K,)`): every position of a shifted per-token output (flat in
            `rows * (length - 1)`) whose two tokens are real, and the shared position whose hidden state predicts it.
        label_starts (`torch.LongTensor`): shared positions whose label must be -100 (a group's first token, and the
            repeated prompt token of every branch after the first: no shared hidden state predicts them).
        groups (`Groups`): the segments, as host ints, for the attention.
        shared_rows (`int`), unshared_rows (`int`): rows that share their prompt with another row, and the others.
        padded_tokens (`int`): real tokens of the padded batch (`M`).
        prompt_end (`torch.LongTensor` of shape `(rows,)`, on the host): the `prompt_end` built from (-1: none given),
            what the layout is rebuilt from when accelerate's dispatching cut it.
    """

    rows: int
    length: int
    gather: torch.Tensor
    position_ids: torch.Tensor
    real_flat: torch.Tensor
    real_shared: torch.Tensor
    shift_flat: torch.Tensor
    shift_shared: torch.Tensor
    label_starts: torch.Tensor
    groups: Groups
    shared_rows: int
    unshared_rows: int
    padded_tokens: int
    prompt_end: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @property
    def num_tokens(self) -> int:
        return self.gather.numel()

    def to_batch(self) -> dict[str, torch.Tensor]:
        """The layout as batch tensors: `prompt_end` (`[rows]`, row-major) and `layout` (1-D, serialized).

        Only tensors, so accelerate moves, concatenates and slices them like the rest of the batch. The serialized
        layout is longer than `rows` (every row is a branch of three ints), so any dim-0 slice of it is shorter than
        a serialized layout and `from_batch` recognizes it.
        """
        groups: list[int] = []
        for ps, pe, branches in self.groups:
            groups += [ps, pe, len(branches)]
            for branch in branches:
                groups += list(branch)
        sections = (
            self.gather, self.position_ids[0], self.real_flat, self.real_shared, self.shift_flat, self.shift_shared,
            self.label_starts,
        )  # fmt: skip
        header = [_MAGIC, 0, self.rows, self.length, self.shared_rows, self.padded_tokens, len(groups)]
        header += [t.numel() for t in sections]
        header[1] = len(header) + len(groups) + sum(t.numel() for t in sections)
        device = self.gather.device
        flat = torch.cat([torch.tensor(header + groups, dtype=torch.long, device=device), *sections])
        return {"prompt_end": self.prompt_end.to(device), "layout": flat}

    @classmethod
    def from_batch(cls, value: Any, input_ids: torch.Tensor) -> SharedLayout | None:
        """Decode `to_batch()`; None when it does not describe `input_ids` (not a serialized layout, another shape or
        device, or a piece of one cut by accelerate's dispatching): the caller then rebuilds it (`prompt_end_of`)."""
        flat = value.get("layout") if isinstance(value, dict) else None
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.device != input_ids.device:
            return None
        head_len = _HEADER + _SECTIONS
        if flat.numel() < head_len or flat.dtype != torch.long:
            return None
        head = flat[:head_len].tolist()
        magic, total, rows, length, shared_rows, padded_tokens, n_groups = head[:_HEADER]
        sizes = head[_HEADER:]
        if magic != _MAGIC or total != flat.numel() or (rows, length) != tuple(input_ids.shape):
            return None
        if total != head_len + n_groups + sum(sizes):
            return None
        ints = flat[head_len : head_len + n_groups].tolist()
        groups = []
        i = 0
        while i < len(ints):
            ps, pe, nb = ints[i : i + 3]
            branches = tuple(tuple(ints[i + 3 + 3 * b : i + 6 + 3 * b]) for b in range(nb))
            groups.append((ps, pe, branches))
            i += 3 + 3 * nb
        parts = torch.split(flat[head_len + n_groups :], sizes)
        gather, positions, real_flat, real_shared, shift_flat, shift_shared, label_starts = parts
        prompt_end = value.get("prompt_end")
        if not isinstance(prompt_end, torch.Tensor) or tuple(prompt_end.shape) != (rows,):
            prompt_end = torch.full((rows,), -1, dtype=torch.long)
        return cls(
            rows=rows,
            length=length,
            gather=gather,
            position_ids=positions.unsqueeze(0),
            real_flat=real_flat,
            real_shared=real_shared,
            shift_flat=shift_flat,
            shift_shared=shift_shared,
            label_starts=label_starts,
            groups=cast(Groups, tuple(groups)),
            shared_rows=shared_rows,
            unshared_rows=rows - shared_rows,
            padded_tokens=padded_tokens,
            prompt_end=prompt_end,
        )


#: First entry of a serialized layout (`SharedLayout.to_batch`): a value no index, position or count takes.
_MAGIC = 0x7472_6C5F_6578_7450
#: Serialized header: magic, total length, rows, length, shared_rows, padded_tokens, number of group ints; then the
#: sizes of the seven tensor sections.
_HEADER = 7
_SECTIONS = 7


def prompt_end_of(value: Any, input_ids: torch.Tensor) -> torch.Tensor | list[int] | None:
    """The row-major `prompt_end` of a batch's layout entry when it describes `input_ids`'s rows (it survives
    accelerate's dim-0 concatenation and slicing), else None. Entries of -1 (a layout built without prompt ends)
    give None too: nothing is shared."""
    prompt_end = value.get("prompt_end") if isinstance(value, dict) else None
    if not isinstance(prompt_end, torch.Tensor) or tuple(prompt_end.shape) != (input_ids.shape[0],):
        return None
    ends = prompt_end.tolist()
    return None if any(e < 0 for e in ends) else ends


def _row_bounds(attention_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    mask = attention_mask.bool()
    rows, length = mask.shape
    lengths = mask.sum(1)
    cols = torch.arange(length, device=mask.device).expand(rows, length)
    first = torch.where(mask, cols, length).min(1).values
    starts, lens = first.tolist(), lengths.tolist()
    ends = [s + n if n else 0 for s, n in zip(starts, lens, strict=True)]  # an empty row: [0, 0)
    starts = [s if n else 0 for s, n in zip(starts, lens, strict=True)]
    last = torch.where(mask, cols, -1).max(1).values.tolist()
    for r, (e, end) in enumerate(zip(ends, last, strict=True)):
        if lens[r] and end + 1 != e:
            raise UsageError(
                "prompt_sharing needs the real tokens of every row to be contiguous (padding only before or after "
                f"them, as TRL's collators make them); row {r} of the batch has holes in its `attention_mask`."
            )
    return starts, ends


def build_layout(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_end: torch.Tensor | list[int] | None,
    trailing_padding: bool = False,
) -> SharedLayout:
    """The `SharedLayout` of a padded batch `input_ids` (`[rows, length]`, its `attention_mask` 1 on real tokens,
    contiguous in every row), on the device of `input_ids`.

    `prompt_end`: for each row, the column where its completion starts (the row's end without a completion token);
    `None`: nothing is shared (every row one segment).
    `trailing_padding`: also compute the padding after each row's real tokens (queries over the real tokens only, what
    a padded forward gives there): Online DPO logs metrics summed over every completion column, padding included
    (online_dpo_trainer.py `objective/kl`, `objective/entropy`, `objective/non_score_reward`, checked 1.12.0, 1.16.0).
    """
    device = input_ids.device
    rows, length = input_ids.shape
    starts, ends = _row_bounds(attention_mask)
    share = prompt_end is not None
    if prompt_end is None:
        ends_of_prompt = ends
    else:
        ends_of_prompt = prompt_end.tolist() if isinstance(prompt_end, torch.Tensor) else list(prompt_end)
    ids_host = input_ids.detach().cpu() if share else None

    # Group rows by (first column, prompt tokens); a group needs a prefix of at least one token to share anything.
    order: list[list[int]] = []
    prefix_len: list[int] = []
    keys: dict[Any, int] = {}
    for r in range(rows):
        s, e = starts[r], ends[r]
        p_end = min(max(int(ends_of_prompt[r]), s), e)
        if share and p_end - s >= 2:
            assert ids_host is not None
            key = (s, tuple(ids_host[r, s:p_end].tolist()))
            g = keys.get(key)
            if g is not None:
                order[g].append(r)
                continue
            keys[key] = len(order)
            order.append([r])
            prefix_len.append(p_end - s - 1)
        else:
            order.append([r])
            prefix_len.append(0)
    # a prompt that no other row has: one causal segment, no prefix
    groups_rows = [(m, n) if len(m) > 1 else (m, 0) for m, n in zip(order, prefix_len, strict=True)]

    gather: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    real_flat: list[torch.Tensor] = []
    real_shared: list[torch.Tensor] = []
    label_starts: list[int] = []
    groups = []
    shared_rows = 0
    cursor = 0
    for members, n_prefix in groups_rows:
        if len(members) > 1:
            shared_rows += len(members)
        first = members[0]
        s0 = starts[first]
        ps, pe = cursor, cursor + n_prefix
        if n_prefix:
            cols = torch.arange(s0, s0 + n_prefix)
            gather.append(first * length + cols)
            positions.append(cols)
            label_starts.append(ps)
        cursor = pe
        branches = []
        for k, r in enumerate(members):
            s, e = starts[r], ends[r]
            b0 = s + n_prefix
            stop = length if trailing_padding and e > s else e
            cols = torch.arange(b0, stop)
            bs, ke, be = cursor, cursor + (e - b0), cursor + (stop - b0)
            gather.append(r * length + cols)
            positions.append(cols)
            if be > bs and (k > 0 or not n_prefix):
                label_starts.append(bs)
            # every token of row r read back: its prefix part maps to the group's prefix, the rest to its branch
            real_flat.append(r * length + torch.arange(s, stop))
            real_shared.append(torch.cat([torch.arange(ps, pe), torch.arange(bs, be)]))
            branches.append((bs, be, ke))
            cursor = be
        groups.append((ps, pe, tuple(branches)))

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    real_flat_t, real_shared_t = cat(real_flat), cat(real_shared)
    # Shifted outputs: position p of row r predicts token p + 1; it is real when both tokens are, and the shared hidden
    # state of token p predicts it (at a prefix end, the first branch's repeated prompt token is the same token).
    row_of = torch.div(real_flat_t, length, rounding_mode="floor")
    col_of = real_flat_t - row_of * length
    ends_t = torch.tensor(ends, dtype=torch.long)[row_of] if rows else torch.zeros(0, dtype=torch.long)
    has_next = col_of + 1 < ends_t  # padding read back (`trailing_padding`) predicts nothing TRL scores
    shift_flat = row_of[has_next] * (length - 1) + col_of[has_next]
    shift_shared = real_shared_t[has_next]

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=torch.long)

    return SharedLayout(
        rows=rows,
        length=length,
        gather=dev(cat(gather)),
        position_ids=dev(cat(positions)).unsqueeze(0),
        real_flat=dev(real_flat_t),
        real_shared=dev(real_shared_t),
        shift_flat=dev(shift_flat),
        shift_shared=dev(shift_shared),
        label_starts=dev(torch.tensor(label_starts, dtype=torch.long)),
        groups=tuple(groups),
        shared_rows=shared_rows,
        unshared_rows=rows - shared_rows,
        padded_tokens=int(attention_mask.sum()),
        prompt_end=torch.tensor(ends_of_prompt if share else [-1] * rows, dtype=torch.long),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Packing and unpacking
# ---------------------------------------------------------------------------------------------------------------------


def pack(x: torch.Tensor, layout: SharedLayout) -> torch.Tensor:
    """`[rows, length, ...]` -> `[1, N, ...]`."""
    return x.reshape(layout.rows * layout.length, *x.shape[2:]).index_select(0, layout.gather).unsqueeze(0)


def unpack(x: torch.Tensor, layout: SharedLayout) -> torch.Tensor:
    """`[1, N, ...]` -> `[rows, length, ...]`, zeros at padding (differentiable: a shared prompt token's gradient is
    the sum over the rows that read it)."""
    rest = x.shape[2:]
    out = x.new_zeros(layout.rows * layout.length, *rest)
    out = out.index_copy(0, layout.real_flat, x[0].index_select(0, layout.real_shared))
    return out.view(layout.rows, layout.length, *rest)


def unpack_shifted(x: torch.Tensor | None, layout: SharedLayout) -> torch.Tensor | None:
    """A shifted per-token output `[1, N - 1]` -> `[rows, length - 1]`, zeros/False where there is no prediction."""
    if x is None:
        return None
    out = x.new_zeros(layout.rows * (layout.length - 1))
    out = out.index_copy(0, layout.shift_flat, x[0].index_select(0, layout.shift_shared))
    return out.view(layout.rows, layout.length - 1)


def pack_labels(labels: torch.Tensor, layout: SharedLayout) -> torch.Tensor:
    """Labels of the shared row: -100 on every first token that the row's shift would score from another segment."""
    packed = pack(labels, layout).clone()
    return packed.index_fill_(1, layout.label_starts, -100)


def prompt_end_from_completion_mask(completion_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The column where each row's completion starts (its end when it has none), from TRL's `completion_mask`."""
    length = completion_mask.shape[1]
    cols = torch.arange(length, device=completion_mask.device).expand_as(completion_mask)
    first = torch.where(completion_mask.bool(), cols, length).min(1).values
    row_end = torch.where(attention_mask.bool(), cols + 1, 0).max(1).values
    return torch.minimum(first, row_end)


# ---------------------------------------------------------------------------------------------------------------------
# Collator
# ---------------------------------------------------------------------------------------------------------------------


class PromptSharingCollator(AnnotatingCollator):
    """Wraps a preference collator (it must return `input_ids`, a 2D `attention_mask` and a `completion_mask`) and adds
    the shared layout under `trl_ext_prompt_sharing` (see `AnnotatingCollator`)."""

    plugin = "prompt_sharing"
    token_layout = "prompt-shared"

    def annotate(self, batch: dict[str, Any]) -> None:
        ids, mask, completion = batch.get("input_ids"), batch.get("attention_mask"), batch.get("completion_mask")
        if not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (ids, mask, completion)):
            raise UsageError(
                "prompt_sharing needs the collator to return 2D `input_ids`, `attention_mask` and `completion_mask`, "
                f"as TRL's DataCollatorForPreference does; {type(self.collator).__name__} returned "
                f"{sorted(batch)}."
            )
        ids, mask, completion = cast(torch.Tensor, ids), cast(torch.Tensor, mask), cast(torch.Tensor, completion)
        batch[LAYOUT_KEY] = build_layout(ids, mask, prompt_end_from_completion_mask(completion, mask)).to_batch()
