"""Sizing and reference of the packing plugins' self-checks: what training will feed, and the stock forward.

A self-check only sees a locality (a window, a chunk, any mask function) shorter than one of its probe sequences, so
one probe sequence is as long as the longest sequence the trainer will feed (`training_max_length`) and the others are
longer than every locality the config declares (`declared_localities`), capped at that length (a window longer than
every training sequence never acts, stock or packed). The reference is the model's own *stock padded* forward
(`stock_forward`: its original attention, the padded batch with its `attention_mask`, `use_cache=False`, as TRL's
scoring forward calls it), never another trl-ext path.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

from .. import _compat
from ..call_context import call_entered

__all__ = [
    "ProbeRun",
    "declared_localities",
    "dataset_longest_pair",
    "model_probe_lengths",
    "probe_lengths",
    "stock_attention",
    "stock_forward",
    "training_max_length",
]


#: The shortest probe sequences when the config declares no locality (long enough for every mechanism the checks
#: compare: positions, per-token layers, attention over several keys).
_MIN_PROBE = 9


def _configs(config: Any) -> Iterator[Any]:
    """`config` and its sub-configs (text configs of composite models), each once."""
    seen: set[int] = set()
    stack = [config]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for value in vars(current).values():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                stack.append(value)


#: Name fragments of config fields that declare a locality: a window, a chunk, or a compression window of key/value
#: states (DeepSeek-V4's `compress_rates`).
_LOCALITY_NAMES = ("window", "chunk", "compress")


def declared_localities(config: Any) -> dict[str, int]:
    """Every positive length a config declares under a name that says window, chunk or compress (`sliding_window`,
    `attention_chunk_size`, `compress_rates`, ...; a value, list or dict), by attribute name. Deliberately broad: a
    name that is not a locality only makes the probe longer, a missed one would hide a window from the self-check."""
    found: dict[str, int] = {}
    for sub in _configs(config):
        for name, value in vars(sub).items():
            lowered = name.lower()
            if not any(part in lowered for part in _LOCALITY_NAMES):
                continue
            values = list(value.values()) if isinstance(value, dict) else value
            values = values if isinstance(values, (list, tuple)) else [values]
            lengths = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]
            if lengths:
                found[name] = max(max(lengths), found.get(name, 0))
    return found


def dataset_longest_pair(dataset: Any) -> int | None:
    """The longest prompt+completion of a tokenized DPO dataset (map-style, Arrow-backed), or None when it cannot be
    read without iterating (an iterable dataset, another layout)."""
    data = getattr(dataset, "data", None)
    names = getattr(dataset, "column_names", None)
    if data is None or not isinstance(names, list):
        return None
    prompt, chosen, rejected = _compat.DPO_TOKENIZED_COLUMNS
    if not {prompt, chosen, rejected} <= set(names):
        return None
    try:
        import pyarrow.compute as pc

        p, c, r = (pc.list_value_length(data.column(column)) for column in (prompt, chosen, rejected))
        longest = pc.max(pc.max_element_wise(pc.add(p, c), pc.add(p, r))).as_py()
    except Exception:  # noqa: BLE001 - an unexpected layout: the caller falls back to max_length
        return None
    return int(longest) if longest is not None else None


def training_max_length(trainer: Any) -> int | None:
    """The longest sequence `trainer` will feed its models: `args.max_length`, or the longest pair of a tokenized
    training/eval dataset when that is shorter. None when neither is known (no max_length, unreadable dataset)."""
    max_length = getattr(getattr(trainer, "args", None), "max_length", None)
    datasets: list[Any] = []
    for name in ("train_dataset", "eval_dataset"):
        value = getattr(trainer, name, None)
        if isinstance(value, dict):
            datasets.extend(value.values())
        elif value is not None:
            datasets.append(value)
    longest = [dataset_longest_pair(d) for d in datasets]
    if datasets and all(n is not None for n in longest):
        data_max = max(n for n in longest if n is not None)
        return data_max if max_length is None else min(int(max_length), data_max)
    return int(max_length) if max_length is not None else None


def probe_lengths(longest: int, localities: dict[str, int] | None = None, max_positions: int | None = None) -> tuple:
    """Three probe sequence lengths: the first `longest` (the longest training sequence), the others longer than
    every declared locality (capped at `longest`), all within `max_positions`."""
    longest = int(longest)
    if max_positions:
        longest = min(longest, int(max_positions))
    longest = max(longest, 2)
    acting = [w for w in (localities or {}).values() if w < longest]
    other = min(longest, max(w + 1 for w in acting) if acting else _MIN_PROBE)
    return (longest, other, min(longest, other + 2))


#: The longest probe built from a model's position limit when the training length is unknown.
UNKNOWN_LENGTH_LIMIT = 8192


def model_probe_lengths(model: Any, trainer: Any, plugin: str) -> tuple[int, ...]:
    """The probe lengths of `plugin`'s self-check for `model` under `trainer`: one as long as the longest training
    sequence, the others longer than every window or chunk the config declares. Without a known training length,
    the model's position limit (at most `UNKNOWN_LENGTH_LIMIT`); beyond it a `UsageError` asks for `max_length`."""
    from ..errors import UsageError

    config = model.config
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    longest = training_max_length(trainer)
    if longest is None:
        if not max_positions or max_positions > UNKNOWN_LENGTH_LIMIT:
            raise UsageError(
                f"{plugin}'s self-check for the `{getattr(config, 'model_type', None)}` model needs the longest "
                "sequence training will feed, to size its probe: set `max_length` in the trainer's config (the "
                "dataset is not a tokenized map-style dataset whose lengths can be read)."
            )
        longest = int(max_positions)
    return probe_lengths(longest, declared_localities(config), max_positions)


def stock_attention(name: str) -> str:
    """The attention implementation a trl-ext attention (`trl_ext_varlen_sdpa`, `trl_ext_shared_eager`, ...) stands in
    for; any other name is returned as it is."""
    if name.startswith("trl_ext_"):
        return name.rsplit("_", 1)[-1]
    return name


@contextlib.contextmanager
def stock_forward(model: Any, base_impl: str | None = None) -> Iterator[None]:
    """Run `model` as stock transformers would for the block: its attention set back to `base_impl` (default: the one
    its trl-ext attention stands in for), the packing wrappers passing calls through (the call context's `stock`)."""
    config = model.config
    current = config._attn_implementation
    base_impl = base_impl or stock_attention(current)
    switched = current != base_impl
    with call_entered(stock=True):
        try:
            if switched:
                config._attn_implementation_internal = base_impl
            yield
        finally:
            if switched:
                config._attn_implementation_internal = current


class ProbeRun:
    """One run of a packing self-check on `model`: the clock, the model's device and vocabulary, the forwards run so
    far; inside the `with` block the model is in training mode if `training` (else eval), its modes put back after."""

    def __init__(self, model: Any, training: bool) -> None:
        self.start, self.model, self.training, self.forwards = time.perf_counter(), model, training, 0
        self.device = next(model.parameters()).device

    @functools.cached_property
    def vocab(self) -> int:
        """The input vocabulary, read only by the self-checks that draw token ids (fused_logprobs' does not)."""
        return int(self.model.get_input_embeddings().num_embeddings)

    def __enter__(self) -> ProbeRun:
        self._modes = {m: m.training for m in self.model.modules()}
        self.model.train(self.training)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, mode in self._modes.items():
            module.training = mode

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def without_degenerate_rows(self, stock: Any, ids: Any, mask: Any, run: Callable[[Any, Any], Any]) -> Any:
        """`stock` (the stock padded forward's logits of the right-padded `ids`) with each row that is not finite at
        its real tokens (a degenerate padded forward, as the self-checks' docstrings say) replaced by its sequence run
        alone (`run(input_ids, attention_mask)` returns the logits)."""
        import torch

        real = mask.bool()
        for row in range(ids.shape[0]):
            if not torch.isfinite(stock[row][real[row]]).all():
                alone = ids[row : row + 1][:, real[row]]
                stock = stock.clone()
                stock[row, real[row]] = run(alone, torch.ones_like(alone))[0]
                self.forwards += 1
        return stock
