"""The per-batch metadata of the fused varlen kernels (`kernels.py`): the query/key segments of one packed or shared
row, built once per batch on the host, copied to the device once, and reused by every layer, the reference forward of
the same batch and the layers gradient checkpointing recomputes."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

__all__ = ["BUILDS", "Segments", "cached_segments", "packed_segments", "to_device"]


@dataclasses.dataclass(frozen=True)
class Segments:
    """The kernel arguments of one packed or shared row: cumulative query / key lengths (`cu_q`, `cu_k`, int32,
    `(S + 1,)`), the longest query / key segment, and the row positions of the keys (segment after segment) and of the
    queries (`kv_index`, `q_index`; None: the row itself, in order)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    kv_index: torch.Tensor | None = None
    q_index: torch.Tensor | None = None


#: How many `Segments` were built (a test counts them across the layers of one forward).
BUILDS = collections.Counter[str]()
_CACHE: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
_T = TypeVar("_T")
_CACHE_SIZE = 8


def cached_segments(key: tuple, device: torch.device, build: Callable[[], _T]) -> _T:
    """The segments of `key` (host ints that describe the row) on `device`, built once by `build()`."""
    full = (key, str(device))
    if full in _CACHE:
        _CACHE.move_to_end(full)
        return _CACHE[full]
    BUILDS[key[0]] += 1
    built = _CACHE[full] = build()
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return built


def to_device(values: Sequence[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A host list as a device tensor (one copy, pinned first on CUDA so that it does not wait for the device)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def packed_segments(bounds: Sequence[int], device: torch.device) -> Segments:
    """The segments of a packed row split at `bounds` (cumulative lengths, host ints)."""

    def build() -> Segments:
        cu = to_device(list(bounds), device, torch.int32)
        longest = max((e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)), default=0)
        return Segments(cu, cu, longest, longest)

    return cached_segments(("packed", *bounds), device, build)
