"""The peak memory of a training step, for the line `trl-ext dpo` / `online-dpo` print per trainer when `train()` is
done: the allocator's peak (`torch.cuda.max_memory_allocated`) on GPU, the process's peak resident set (`VmHWM`) on
CPU, each reset when an optimizer step begins and read when it ends (forward, backward and optimizer step of every
micro-batch), the largest over the steps."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from transformers import TrainerCallback

from .._peak_memory import reset_peak_rss, rss_mib

__all__ = ["StepPeakMemory", "measuring_steps"]


class StepPeakMemory(TrainerCallback):
    """A callback that keeps the peak memory of the trainer's optimizer steps (`peak_bytes`, None until one step ran
    or where it cannot be measured) and the device it was measured on."""

    def __init__(self) -> None:
        self.peak_bytes: float | None = None
        self.where = ""
        self._cuda: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import torch

        device = args.device
        self._cuda = device if device.type == "cuda" and torch.cuda.is_available() else None
        if self._cuda is not None:
            torch.cuda.reset_peak_memory_stats(self._cuda)
        else:
            reset_peak_rss()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import torch

        if self._cuda is not None:
            peak: float | None = float(torch.cuda.max_memory_allocated(self._cuda))
            self.where = f"allocated on {self._cuda}"
        else:
            mib = rss_mib("VmHWM")
            peak = None if mib is None else mib * 2**20
            self.where = "resident (CPU)"
        if peak is not None:
            self.peak_bytes = max(self.peak_bytes or 0.0, peak)

    def text(self) -> str:
        if self.peak_bytes is None:
            return "peak memory of a step: not measured (no step ran, or not on this platform)"
        return f"peak memory of a step: {_size(self.peak_bytes)} {self.where}"


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


@contextlib.contextmanager
def measuring_steps() -> Iterator[list[StepPeakMemory]]:
    """Every `transformers.Trainer` built inside gets a `StepPeakMemory` (yielded, in the order the trainers were
    built): the callback is added to transformers' default callbacks for that time, and removed after."""
    import transformers.trainer as hf_trainer

    made: list[StepPeakMemory] = []

    class Measured(StepPeakMemory):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    defaults: list[Any] = hf_trainer.DEFAULT_CALLBACKS  # `Trainer.__init__` reads it when each trainer is built
    defaults.append(Measured)
    try:
        yield made
    finally:
        defaults.remove(Measured)
