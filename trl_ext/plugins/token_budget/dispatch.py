"""The examples of a batch that accelerate dispatches (`dispatch_batches=True`, or an `IterableDataset` on several
processes), carried as one tensor whose rows follow the batch's.

accelerate's `DataLoaderDispatcher` joins the processes' batches with `concatenate` (tensors only) and gives each
process the rows `[p x n, (p + 1) x n)` of every tensor (`n`: `find_batch_size`). So the examples travel as the
batch's `2B` rows (chosen, then rejected): each row the sequence as the collator truncates it, a token `t` stored as
`4t + kind` (1: prompt, 2: completion, 0: padding), after a header `(batch tag, row, rows)` by which the receiver
checks that it got one whole batch. The width is `max_length` (batches of different lengths join), or without one the
longest row rounded up to `pad_to_multiple_of`; reference log-probs travel in a float tensor of the same rows. A
decoded pair is the truncated pair, so its micro-batches run the inputs stock runs; prompts truncated differently in
the two rows (`truncation_mode="keep_end"`) keep the longer one, of which the other is the end.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from trl_ext.api import InternalError, UsageError

HEADER = 3
PROMPT, COMPLETION = 1, 2


def dispatches(loader: Any) -> bool:
    """Whether accelerate dispatches this loader's batches from process 0."""
    from accelerate.data_loader import DataLoaderDispatcher

    return isinstance(loader, DataLoaderDispatcher)


class Encoder:
    """Encodes the examples of a collated batch for a dispatching loader (`decode` reads them back)."""

    def __init__(self, max_length: int | None, truncation_mode: str, multiple: int | None) -> None:
        self.max_length = max_length
        self.keep_end = truncation_mode == "keep_end"
        self.multiple = multiple

    def _row(self, prompt: Sequence[int], completion: Sequence[int]) -> list[int]:
        row = [4 * t + PROMPT for t in prompt] + [4 * t + COMPLETION for t in completion]
        if self.max_length is not None:
            row = row[-self.max_length :] if self.keep_end else row[: self.max_length]
        return row

    def encode(self, examples: Sequence[Mapping[str, Any]], batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        from accelerate.utils import find_batch_size

        rows = [self._row(e["prompt_ids"], e["chosen_ids"]) for e in examples]
        rows += [self._row(e["prompt_ids"], e["rejected_ids"]) for e in examples]
        if find_batch_size(dict(batch)) != len(rows):
            raise UsageError(
                "`token_budget` with accelerate's batch dispatching (`dispatch_batches=True`, or an IterableDataset "
                "on several processes) needs batches of 2 rows per pair (TRL's padded layout); this collator gave "
                f"{find_batch_size(dict(batch))} rows for {len(examples)} pairs (a packing plugin?). Turn dispatching "
                "off (`accelerator_config={'dispatch_batches': False}`, a map-style dataset) or the packing plugin."
            )
        width = self.max_length or max(len(row) for row in rows)
        if self.max_length is None and self.multiple:
            width = -(-width // self.multiple) * self.multiple
        tag = secrets.randbits(62)  # not Python's or torch's seeded generators: training draws from those
        out = torch.zeros(len(rows), HEADER + width, dtype=torch.int64)
        for i, row in enumerate(rows):
            out[i, :HEADER] = torch.tensor([tag, i, len(rows)])
            out[i, HEADER : HEADER + len(row)] = torch.tensor(row, dtype=torch.int64)
        encoded = {"rows": out}
        if "ref_chosen_logps" in examples[0]:
            refs = [e["ref_chosen_logps"] for e in examples] + [e["ref_rejected_logps"] for e in examples]
            encoded["ref"] = torch.tensor(refs, dtype=torch.float64)
        return encoded


def decode(encoded: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The (truncated) examples of one dispatched batch, as this process received its rows."""
    rows = encoded["rows"].cpu()
    header = rows[:, :HEADER]
    n = rows.size(0)
    if n == 0 or n % 2 or header[:, 0].unique().numel() != 1 or not torch.equal(header[:, 1], torch.arange(n)):
        raise UsageError(
            "token_budget: accelerate's batch dispatching gave this process rows that are not one whole batch (rows "
            f"{header[:, 1].tolist()} of batches {header[:, 0].unique().tolist()}): an uneven last batch? Set "
            "`dataloader_drop_last=True` or turn dispatching off."
        )
    sequences = []
    for row in rows[:, HEADER:].tolist():
        prompt = [v >> 2 for v in row if v & 3 == PROMPT]
        completion = [v >> 2 for v in row if v & 3 == COMPLETION]
        sequences.append((prompt, completion))
    pairs = n // 2
    refs = encoded["ref"].cpu().tolist() if "ref" in encoded else None
    examples = []
    for i in range(pairs):
        (prompt_c, chosen), (prompt_r, rejected) = sequences[i], sequences[pairs + i]
        prompt = max(prompt_c, prompt_r, key=len)
        shorter = min(prompt_c, prompt_r, key=len)
        if shorter and prompt[-len(shorter) :] != shorter and prompt[: len(shorter)] != shorter:
            raise InternalError("token_budget: a dispatched pair's two rows hold different prompts")
        example: dict[str, Any] = {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}
        if refs is not None:
            example.update(ref_chosen_logps=refs[i], ref_rejected_logps=refs[pairs + i])
        examples.append(example)
    return examples


def examples_of(value: Any) -> list[Any]:
    """The examples `KeepExamples` put in a batch: the list itself, or decoded from a dispatched batch."""
    return decode(value) if isinstance(value, Mapping) else list(value)
