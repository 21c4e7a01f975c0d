"""Re-cutting the pairs of one optimizer step into micro-batches of at most `token_budget` tokens: the examples the
trainer's collator received, each micro-batch collated by that collator (TRL's, or a packing plugin's).

Several processes: the cut of every rank's pairs, balanced, and the same number of micro-batches on every rank
(TRL's gathers, DDP's reduction and ZeRO-3/FSDP2's parameter gathers need as many forwards and backwards on each): a
rank with fewer runs its smallest again with loss weight 0 (`Padding`: no gradient, its metrics not recorded).

The examples of a batch that accelerate dispatches (`dispatch_batches=True`, or an `IterableDataset` on several
processes) are carried as one tensor whose rows follow the batch's (`Encoder`, `decode`): accelerate's
`DataLoaderDispatcher` joins the processes' batches with `concatenate` (tensors only) and gives each process the rows
`[p x n, (p + 1) x n)` of every tensor (`n`: `find_batch_size`). So the examples travel as the batch's `2B` rows
(chosen, then rejected): each row the sequence as the collator truncates it, a token `t` stored as `4t + kind` (1:
prompt, 2: completion, 0: padding), after a header `(batch tag, row, rows)` by which the receiver checks that it got
one whole batch. The width is `max_length` (batches of different lengths join), or without one the longest row rounded
up to `pad_to_multiple_of`; reference log-probs travel in a float tensor of the same rows. A decoded pair is the
truncated pair, so its micro-batches run the inputs stock runs; prompts truncated differently in the two rows
(`truncation_mode="keep_end"`) keep the longer one, of which the other is the end.
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from trl_ext.api import InternalError, UsageError

#: The batch key under which the training loader hands the plugin the examples of each stock micro-batch.
EXAMPLES_KEY = "trl_ext_token_budget_examples"
#: The example fields the cut understands (DPOTrainer's text signature columns, trl/trainer/dpo_trainer.py).
TEXT_FIELDS = ("prompt_ids", "chosen_ids", "rejected_ids")
OPTIONAL_FIELDS = ("ref_chosen_logps", "ref_rejected_logps")


class Layout(str, enum.Enum):
    """How the trainer's collator lays out a micro-batch, so what the budget counts (`pair_length`): `padded` (no
    packing plugin), `packed` (padding_free), `prompt-shared` (prompt_sharing). Truthy when the collator packs, so it
    stands where a "packed" flag is expected."""

    PADDED = "padded"
    PACKED = "packed"
    PROMPT_SHARED = "prompt-shared"

    def __bool__(self) -> bool:
        return self is not Layout.PADDED

    def __str__(self) -> str:
        return self.value


def layout(collator: Any | None) -> Layout:
    """The layout of the packing collator that collates the micro-batches (None: no packing plugin, padded), from the
    `token_layout` it declares (`toolkit.packing.glue.AnnotatingCollator`; `"packed"` when it declares none)."""
    if collator is None:
        return Layout.PADDED
    value = getattr(collator, "token_layout", Layout.PACKED.value)
    try:
        return Layout(value)
    except ValueError:
        raise UsageError(
            f"`token_budget` cannot count the tokens of {type(collator).__name__}: it declares `token_layout` "
            f"{value!r}, not one of {[kind.value for kind in Layout if kind is not Layout.PADDED]}."
        ) from None


def as_layout(packed: bool | Layout) -> Layout:
    """A `Layout`, also from the older boolean ("packed" or not)."""
    if isinstance(packed, Layout):
        return packed
    return Layout.PACKED if packed else Layout.PADDED


class KeepExamples:
    """A collator that also returns, under `EXAMPLES_KEY`, the examples it collated: as they are, or, for a loader
    that dispatches batches (`encoder` set), encoded in one tensor whose rows follow the batch's."""

    def __init__(self, collator: Callable[[list[Any]], Any]) -> None:
        self.collator = collator
        #: `Encoder` when accelerate dispatches this loader's batches (set once the loader is built)
        self.encoder: Any = None

    def __call__(self, examples: list[Any]) -> Any:
        batch = self.collator(examples)
        batch[EXAMPLES_KEY] = list(examples) if self.encoder is None else self.encoder.encode(examples, batch)
        return batch


@dataclasses.dataclass(frozen=True)
class Pair:
    """One pair of a step: where it sits in the stock micro-batches, and the tokens it costs."""

    batch: int  #: index of the stock micro-batch in the step
    row: int  #: index of the pair inside that micro-batch
    #: padded: its longer sequence (prompt + completion); packed: both sequences together; prompt-shared: the prompt
    #: once and both completions
    length: int


@dataclasses.dataclass
class MicroBatch:
    """A micro-batch cut by the budget: its pairs (in step order), its collated inputs and its loss weight."""

    pairs: list[Pair]
    inputs: Any
    #: the weight of this micro-batch's mean loss in the step: the sum over its pairs of the weight stock gives each
    #: pair (`1 / (pairs in the pair's stock micro-batch * stock micro-batches in the step)`)
    weight: float
    #: tokens it holds by the budget's count (`tokens`)
    tokens: int
    #: with `loss_type` "sft": per pair, the weight stock gives each of its chosen completion tokens (`1 / (chosen
    #: tokens of the pair's stock micro-batch x stock micro-batches in the step)`; `metrics.assign_sft_scales`)
    sft_scales: list[float] | None = None


def check_example(example: Mapping[str, Any]) -> None:
    """Refuse examples the cut cannot measure (vision pairs, untokenized text, unknown fields)."""
    unknown = sorted(set(example) - set(TEXT_FIELDS) - set(OPTIONAL_FIELDS))
    missing = [field for field in TEXT_FIELDS if field not in example]
    if unknown or missing:
        raise UsageError(
            f"`token_budget` cuts tokenized text pairs ({', '.join(TEXT_FIELDS)}); these examples have fields "
            f"{unknown} / lack {missing} (a vision dataset?). Disable `token_budget` for this trainer."
        )


def pair_length(
    example: Mapping[str, Any], packed: bool | Layout, max_length: int | None, multiple: int | None = None
) -> int:
    """The tokens one pair costs in `packed`'s layout (`Layout`): padded, its longer sequence rounded up to the
    collator's `pad_to_multiple_of` (`multiple`; a micro-batch costs `2 x pairs x longest`); packed, both sequences;
    prompt-shared, both less the prompt's second copy. Sequences are capped at `max_length`; a truncated pair counts
    as packed under prompt sharing (with `truncation_mode="keep_end"` its two prompts may differ: it runs unshared)."""
    kind = as_layout(packed)
    prompt = len(example["prompt_ids"])
    lengths = [prompt + len(example["chosen_ids"]), prompt + len(example["rejected_ids"])]
    truncated = max_length is not None and max(lengths) > max_length
    if max_length is not None:
        lengths = [min(length, max_length) for length in lengths]
    if kind is Layout.PADDED:
        return -(-max(lengths) // multiple) * multiple if multiple else max(lengths)
    if kind is Layout.PROMPT_SHARED and not truncated and prompt > 0:
        # The shared row holds the prompt less its last token once, then each completion after a copy of that token.
        return sum(lengths) - (prompt - 1)
    return sum(lengths)


def padded_multiple(collator: Any, packed: bool | Layout) -> int | None:
    """The `pad_to_multiple_of` the collator pads the padded layout to (`DataCollatorForPreference` has the field; a
    collator without it pads to the longest sequence); None under a packing collator, whose rows are packed."""
    return None if packed else getattr(collator, "pad_to_multiple_of", None)


def tokens(pairs: Sequence[Pair], packed: bool | Layout) -> int:
    """Tokens of a micro-batch of `pairs` by the budget's count."""
    return sum(p.length for p in pairs) if packed else 2 * len(pairs) * max(p.length for p in pairs)


def plan(
    pairs: Sequence[Pair], batch_sizes: Sequence[int], budget: int, packed: bool | Layout = False
) -> list[list[Pair]]:
    """Cut `pairs` (in order) into runs of at most `budget` tokens (`tokens`).

    A pair over the budget forms a run of its own. Pairs of stock micro-batches of different sizes weigh differently
    in the stock loss (the short last batch of an epoch), so they are never put in one run.
    """
    runs: list[list[Pair]] = []
    current: list[Pair] = []
    for pair in pairs:
        same_weight = bool(current) and batch_sizes[current[0].batch] == batch_sizes[pair.batch]
        if same_weight and tokens([*current, pair], packed) <= budget:
            current.append(pair)
            continue
        if current:
            runs.append(current)
        current = [pair]
    if current:
        runs.append(current)
    return runs


def cut_step(
    examples: Sequence[Sequence[Mapping[str, Any]]],
    budget: int,
    collate: Callable[[list[Any]], Any],
    packed: bool | Layout = False,
    max_length: int | None = None,
    multiple: int | None = None,
) -> tuple[list[MicroBatch], int]:
    """Re-cut one step (the examples of each stock micro-batch, in order) by `budget` in `packed`'s layout
    (`Layout`, or a boolean: packed or padded), collating each micro-batch with `collate`. Returns the micro-batches
    and how many pairs exceed the budget on their own. `multiple`: the padded layout's `pad_to_multiple_of`."""
    pairs, sizes = global_pairs([examples], packed, max_length, multiple)
    micro_batches = []
    for run in plan(pairs, sizes, budget, packed):
        weight = len(run) / (sizes[run[0].batch] * len(examples))
        inputs = collate([examples[p.batch][p.row] for p in run])
        micro_batches.append(MicroBatch(run, inputs, weight, tokens(run, packed)))
    over = sum(1 for p in pairs if tokens([p], packed) > budget)
    return micro_batches, over


def spread(count: int, slots: int) -> list[range]:
    """Indices of `count` micro-batches spread over `slots` stock positions, in order; the last slot is never empty
    (when `count > 0`), so the Trainer's gradient synchronisation on its last micro-step still happens."""
    return [range(i * count // slots, (i + 1) * count // slots) for i in range(slots)]


@dataclasses.dataclass
class Padding(MicroBatch):
    """A micro-batch run only to keep the ranks in step: weight 0, metrics and tokens not counted."""


def pad_to(micro_batches: Sequence[MicroBatch], count: int, smallest: MicroBatch | None = None) -> list[MicroBatch]:
    """`micro_batches` followed by `count - len(micro_batches)` zero-weight copies of `smallest`, by default the
    smallest of them (fewest tokens, the first of equals)."""
    if count < len(micro_batches):
        raise ValueError(f"cannot pad {len(micro_batches)} micro-batches to {count}")
    if smallest is None:
        if not micro_batches:
            raise ValueError("no micro-batch to repeat")
        smallest = min(micro_batches, key=lambda mb: mb.tokens)
    extra = [Padding(smallest.pairs, smallest.inputs, 0.0, smallest.tokens) for _ in range(count - len(micro_batches))]
    return [*micro_batches, *extra]


def global_pairs(
    examples: Sequence[Sequence[Sequence[Mapping[str, Any]]]],
    packed: bool | Layout,
    max_length: int | None,
    multiple: int | None = None,
) -> tuple[list[Pair], list[int]]:
    """The pairs of one step on every rank (`examples[rank][slot]`: the examples of that rank's stock micro-batch),
    as `Pair`s whose `batch` is `rank * slots + slot`, and the size of each such stock micro-batch."""
    slots = {len(part) for part in examples}
    if len(slots) != 1:
        raise InternalError(f"token_budget: ranks fetched different numbers of stock micro-batches in a step: {slots}")
    pairs = []
    sizes = []
    for r, rank in enumerate(examples):
        for i, batch in enumerate(rank):
            sizes.append(len(batch))
            for j, example in enumerate(batch):
                check_example(example)
                pairs.append(Pair(r * len(rank) + i, j, pair_length(example, packed, max_length, multiple)))
    return pairs, sizes


def balanced_plan(
    pairs: Sequence[Pair], sizes: Sequence[int], budget: int, packed: bool | Layout, ranks: int
) -> tuple[list[list[Pair]], list[int]]:
    """Cut a step's pairs of every rank (`global_pairs`) into micro-batches of at most `budget` tokens, by stock weight
    then length (similar lengths share one), and give each, most tokens first, to the least-loaded rank; the same on
    every rank (deterministic). Returns the micro-batches and their ranks."""
    order = sorted(pairs, key=lambda p: (sizes[p.batch], -p.length, p.batch, p.row))
    runs = plan(order, sizes, budget, packed)
    load = [0] * ranks
    count = [0] * ranks
    owner = [0] * len(runs)
    for k in sorted(range(len(runs)), key=lambda k: (-tokens(runs[k], packed), k)):
        r = min(range(ranks), key=lambda r: (load[r], count[r], r))
        owner[k] = r
        load[r] += tokens(runs[k], packed)
        count[r] += 1
    return runs, owner


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
