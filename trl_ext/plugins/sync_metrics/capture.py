"""The fixed metric schema of a trainer, the packed vector it describes, and the local window of sums and counts;
per-trainer state and the capture of what TRL gathers: during a loss computation the trainer's accelerator answers
`gather`/`gather_for_metrics` locally and records the tensor; the end-of-epoch duplicates are counted at fetch time.
The Trainer's own gathers at a logging step (the training loss in `nested_gather`, the FLOs in `store_flos`) are kept
local and carried in sync_metrics' one collective instead."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from trl_ext import _compat
from trl_ext.api import CallSlot, UsageError

if TYPE_CHECKING:  # pragma: no cover
    from trl_ext.api import Call


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


class SyncMetricsState:
    """Per-trainer state (`context.state["sync_metrics"]`): the schema, one window per mode, the capture buffer."""

    def __init__(self, trainer: Any, trainer_class: str, schema: Schema) -> None:
        self.trainer_class = trainer_class
        self.schema = schema
        self.windows = {"train": Window(schema), "eval": Window(schema)}
        accelerator = trainer.accelerator
        self.rank = accelerator.process_index
        self.world = accelerator.num_processes
        self.even_batches = bool(getattr(accelerator, "even_batches", True))
        #: tensors handed to `gather`/`gather_for_metrics` during the current capture (None: not capturing)
        self.captured: list[torch.Tensor] | None = None
        #: OnlineDPO captures of the current training step
        self.online: dict[str, Any] | None = None
        #: for each training batch fetched but not yet computed: the dataloader remainder if it is the last batch of a
        #: dataloader with duplicates, else None
        self.fetched: collections.deque = collections.deque()
        #: the Trainer's training loss and FLOs, held back from transformers' own gathers until the next log
        self.trainer_ref = weakref.ref(trainer)
        self.expect_loss = False
        self.pending_loss: torch.Tensor | None = None
        self.pending_loss_steps = 0
        self.pending_flos = 0.0
        self.in_checkpoint = False
        #: DPO: the training loss of the current optimizer step over its real pairs (see `add_step_loss`), and the
        #: correction to this rank's held-back loss that makes the logged `loss` the mean over real pairs
        self.step_loss: dict[str, Any] | None = None
        self.loss_correction: torch.Tensor | float = 0.0
        #: number of collectives this plugin issued (for tests and benchmarks)
        self.collectives = 0
        #: DPO: the real pairs of each batch of the current window, by mode, and the modes whose window held batches
        #: of different sizes (where the pair-weighted mean differs from stock's mean of per-batch means)
        self.batch_pairs: dict[str, list[int]] = {"train": [], "eval": []}
        self.uneven_said: set[str] = set()
        #: the `trl_ext_call` handlers of this trainer's class, by method name
        self.calls: dict[str, Callable[[Any, SyncMetricsState, Call], Any]] = {}

    def remainder_now(self, gradient_state: Any) -> int | None:
        """The dataloader remainder when the current batch is the last one of a dataloader that added duplicates."""
        if not self.even_batches or self.world == 1:
            return None
        try:
            if gradient_state.end_of_dataloader and gradient_state.remainder > 0:
                return int(gradient_state.remainder)
        except Exception:  # no active dataloader / no length: like `gather_for_metrics`, keep everything
            return None
        return None

    def batch_remainder(self, mode: str, gradient_state: Any) -> int | None:
        if mode == "train" and self.fetched:
            return self.fetched.popleft()
        return self.remainder_now(gradient_state)

    def real_count(self, remainder: int | None, n: int, rank: int | None = None) -> int:
        """Real samples in the batch of `n` of this rank (or `rank`): the first `remainder` of the rank-major
        concatenation are real (accelerate's `gather_for_metrics` rule, accelerator.py `_adjust_samples`)."""
        if remainder is None:
            return n
        return min(max(remainder - (self.rank if rank is None else rank) * n, 0), n)

    def global_real_count(self, remainder: int | None, n: int) -> int:
        """Real samples in the batches of `n` of all ranks (every rank knows it: same remainder, same rule)."""
        return sum(self.real_count(remainder, n, rank) for rank in range(self.world))

    # The logged training loss over real pairs (docs/plugins/sync_metrics.md, "The loss of an epoch's last step"): the
    # real-pair mean of a step is `sum over ranks and micro-batches of (real pairs x mean loss) / all real pairs`;
    # every rank knows the denominator, so each holds back `world x (its share) - (what the Trainer added)` and the
    # mean over ranks in the one collective is the real-pair mean. The gradients keep accelerate's behaviour.

    def add_step_loss(self, real_sum: Any, real_count: int, duplicates: bool) -> None:
        """One micro-batch of the current optimizer step: `real_sum` = real pairs x their mean loss (a tensor),
        `real_count` = real pairs of this micro-batch on all ranks."""
        step = self.step_loss
        if step is None:
            step = self.step_loss = {"real": 0.0, "count": 0, "trainer": 0.0, "duplicates": False}
        step["real"] = step["real"] + real_sum
        step["count"] += real_count
        step["duplicates"] = step["duplicates"] or duplicates

    def add_trainer_loss(self, value: Any) -> None:
        """What the Trainer adds to its running loss for the micro-batch just computed (`training_step`'s return)."""
        if self.step_loss is not None:
            self.step_loss["trainer"] = self.step_loss["trainer"] + value.detach()

    def close_step(self) -> None:
        """End of an optimizer step: fold its correction into `loss_correction` if it held duplicates."""
        step, self.step_loss = self.step_loss, None
        if step is None or not step["duplicates"] or step["count"] == 0:
            return
        real = step["real"] * self.world / step["count"]
        self.loss_correction = self.loss_correction + (real - step["trainer"]).detach().to(torch.float64)

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Record what `gather`/`gather_for_metrics` are given while it runs (a nested capture restores the outer)."""
        previous, self.captured = self.captured, []
        try:
            yield self.captured
        finally:
            self.captured = previous

    def record(self, data: Any) -> torch.Tensor:
        if not isinstance(data, torch.Tensor):
            raise UsageError(
                f"sync_metrics: TRL gathered a {type(data).__name__} during a metric capture; only tensors are "
                f"supported: {_compat.unexpected_trl('sync_metrics')}"
            )
        assert self.captured is not None  # set by the capture that is running
        self.captured.append(data.detach())
        # CPU zeros: TRL's `.item()` on them is free, and the values it derives from them are discarded.
        return torch.zeros(data.shape if data.dim() else (1,), dtype=data.dtype)


def _gather(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    """`accelerator.gather` / `gather_for_metrics`: local during a capture (the tensor is recorded)."""
    if state.captured is None:
        return call.proceed()
    return state.record(call.args[0] if call.args else call.kwargs.get("input_data", call.kwargs.get("tensor")))


def _get_batch_samples(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    # The Trainer fetches a whole gradient-accumulation window before computing it, so the dataloader's end-of-epoch
    # state must be read at fetch time (transformers trainer.py `get_batch_samples`).
    state.fetched.clear()
    state.close_step()  # a new optimizer step begins
    args, kwargs = list(call.args), dict(call.kwargs)
    epoch_iterator = args.pop(0) if args else kwargs.pop("epoch_iterator")
    return call.proceed(_recording(epoch_iterator, state, trainer.accelerator.gradient_state), *args, **kwargs)


def _recording(iterator: Any, state: SyncMetricsState, gradient_state: Any) -> Iterator[Any]:
    """The Trainer's epoch iterator, noting for each fetched batch whether it holds duplicates."""
    for batch in iterator:
        state.fetched.append(state.remainder_now(gradient_state))
        yield batch


#: The state of the trainer whose `_maybe_log_save_evaluate` is running (transformers calls the module-level
#: `nested_gather` there, with no reference to the trainer; the call context keeps this per call, not global).
_LOGGING_TRAINER: CallSlot[SyncMetricsState] = CallSlot("sync_metrics.logging_trainer")


def _deferring_nested_gather(original):
    @functools.wraps(original)
    def nested_gather(tensors, *args, **kwargs):
        state = _LOGGING_TRAINER.get()
        if state is None or not state.expect_loss or not isinstance(tensors, torch.Tensor):
            return original(tensors, *args, **kwargs)
        # The loss of this logging step: keep it local (TRL/transformers then log the local value, and
        # `trl_ext_reduce_metrics` replaces it with the global mean from the one collective).
        trainer = state.trainer_ref()
        state.expect_loss = False
        state.pending_loss = tensors.detach().clone().reshape(())  # the caller zeroes `tr_loss` in place next
        state.pending_loss_steps = trainer.state.global_step - getattr(trainer, _compat.TRAINER_LAST_LOGGED_ATTR)
        return state.pending_loss.reshape(1)

    nested_gather.__trl_ext_sync_metrics__ = True
    return nested_gather


def _maybe_log_save_evaluate(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    # transformers gathers the loss only under this condition (trainer.py `_maybe_log_save_evaluate`).
    state.expect_loss = bool(
        trainer.control.should_log and trainer.state.global_step > getattr(trainer, _compat.TRAINER_LAST_LOGGED_ATTR)
    )
    try:
        with _LOGGING_TRAINER.entered(state):
            return call.proceed()
    finally:
        state.expect_loss = False


def _store_flos(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    if state.in_checkpoint:
        # A checkpoint writes `state.total_flos` to disk right after: make it exact now (transformers' gather).
        # allowed write: the FLOs held back since the last log go back to the Trainer's count
        setattr(trainer, _compat.TRAINER_FLOS_ATTR, getattr(trainer, _compat.TRAINER_FLOS_ATTR) + state.pending_flos)
        state.pending_flos = 0.0
        return call.proceed()
    state.pending_flos += float(getattr(trainer, _compat.TRAINER_FLOS_ATTR))
    # allowed write: the FLOs are held back, to be summed across ranks in the next log's one collective
    setattr(trainer, _compat.TRAINER_FLOS_ATTR, 0)
    return None


def _save_checkpoint(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    state.in_checkpoint = True
    try:
        return call.proceed()
    finally:
        state.in_checkpoint = False


def install(context: Any) -> None:
    """The loss gather is the module-level `nested_gather` (no trainer method): wrapped while this trainer runs, it
    acts only inside the `_maybe_log_save_evaluate` of a trainer that has sync_metrics (pass-through elsewhere)."""
    import importlib

    for module_name in _compat.LOSS_GATHER_MODULES:
        module = importlib.import_module(module_name)
        current = getattr(module, "nested_gather", None)
        if current is not None and not getattr(current, "__trl_ext_sync_metrics__", False):
            context.patch("run", lambda patcher, m=module: patcher.wrap(m, "nested_gather", _deferring_nested_gather))


#: `trl_ext_call` handlers, by method name (`call.name`), for both trainers
CALLS = {
    "accelerator.gather": _gather,
    "accelerator.gather_for_metrics": _gather,
    _compat.TRAINER_BATCH_SAMPLES_METHOD: _get_batch_samples,
    # the logging step, FLO bookkeeping and checkpoints (`_compat.TRAINER_METHODS`)
    **dict(zip(_compat.TRAINER_METHODS[:3], (_maybe_log_save_evaluate, _store_flos, _save_checkpoint), strict=True)),
}
