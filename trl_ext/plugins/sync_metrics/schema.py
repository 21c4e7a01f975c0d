"""The fixed metric schema of a trainer, the packed vector it describes, and the local window of sums and counts."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Metric:
    """One logged metric: `sum / count` over all ranks (`reduce="mean"`), or the min/max over ranks of per-rank
    values whose count is > 0 (`reduce="max"` / `"min"`)."""

    name: str
    reduce: str = "mean"


class Schema:
    """A fixed, sorted list of metrics, identical on every rank, and the layout of the packed vector.

    Layout: `[sum_0, count_0, sum_1, count_1, ..., calls, tokens, loss, loss_count, flos]`. `calls` counts loss calls
    in the window (DPO logs `num_tokens` only after one), `tokens` the attention-mask tokens of real training pairs
    (folded into every collective so that `num_tokens` is exact at evaluation points too); `loss`/`loss_count` carry
    the Trainer's accumulated training loss and `flos` its FLOs, which transformers would otherwise gather in two more
    collectives per logging step.
    """

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = sorted(metrics, key=lambda m: m.name)
        self.index = {m.name: i for i, m in enumerate(self.metrics)}
        self.calls = 2 * len(self.metrics)
        self.tokens = self.calls + 1
        self.loss = self.calls + 2
        self.loss_count = self.calls + 3
        self.flos = self.calls + 4
        self.size = self.calls + 5

    def sum_slot(self, name: str) -> int:
        return 2 * self.index[name]

    def count_slot(self, name: str) -> int:
        return 2 * self.index[name] + 1

    def reduce(self, rows: torch.Tensor) -> tuple[dict[str, float], list[float]]:
        """Reduce the gathered `[world, size]` matrix. Returns (metrics with a count > 0, column sums)."""
        rows = rows.double().cpu()
        total = rows.sum(dim=0).tolist()
        out = {}
        for i, metric in enumerate(self.metrics):
            count = total[2 * i + 1]
            if count <= 0:
                continue  # no rank saw this metric in the window: not logged, like stock TRL
            if metric.reduce == "mean":
                out[metric.name] = total[2 * i] / count
            else:
                seen = rows[:, 2 * i + 1] > 0
                values = rows[seen, 2 * i]
                out[metric.name] = float(values.max() if metric.reduce == "max" else values.min())
        return out, total


class Window:
    """The local sums and counts of one mode (`"train"` / `"eval"`) since the last log.

    Values that are tensors stay on their device (added with one `index_add_` per call, no host sync); plain numbers
    (pair counts known on the host) are kept on the host. Both meet in `pack()`, at the logging point.
    """

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.device_sums: torch.Tensor | None = None
        self.host = [0.0] * schema.size
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        #: each call's additions since the last log (read only if the trainer is detached mid-window: `hand_back`)
        self.calls: list[list[tuple[int, Any]]] = []

    def add(self, items: list[tuple[int, Any]]) -> None:
        self.calls.append([(s, v.detach() if isinstance(v, torch.Tensor) else v) for s, v in items])
        slots, values = [], []
        for slot, value in items:
            if isinstance(value, torch.Tensor):
                slots.append(slot)
                values.append(value.detach().reshape(()).to(torch.float64))
            else:
                self.host[slot] += float(value)
        if not values:
            return
        device = values[0].device
        if self.device_sums is None:
            self.device_sums = torch.zeros(self.schema.size, dtype=torch.float64, device=device)
        key = tuple(slots)
        index = self._index_cache.get(key)
        if index is None:
            index = self._index_cache[key] = torch.tensor(slots, dtype=torch.long, device=device)
        self.device_sums.index_add_(0, index, torch.stack(values))

    def pack(self, device: torch.device) -> torch.Tensor:
        vec = torch.tensor(self.host, dtype=torch.float64, device=device)
        if self.device_sums is not None:
            vec += self.device_sums.to(device)
        return vec

    def reset(self) -> None:
        if self.device_sums is not None:
            self.device_sums.zero_()
        self.host = [0.0] * self.schema.size
        self.calls = []
