"""What a plugin may use: the one public module for plugin authors, typed, its names kept stable.

A third-party plugin imports `trl_ext` and `trl_ext.api`, nothing else of trl-ext (tests/test_api.py checks the
example plugins). Built-in plugins use the same shared helpers from the private modules that own them; the names here
are those helpers, re-exported.

- Declaring a plugin: `PluginSpec`, `Flag`, the option parsers (`boolean`, `positive_int`, `non_negative_float`,
  `one_of`, `optional`, `either`, `size`, `text`, `Parser`, `Size`, `parse_size`), `hookimpl`.
- What hooks receive: `TrainerContext` (per-trainer `state`, its `patcher`, `wrap_while_running`), `Call` (one call
  of a trainer method a plugin takes part in, `trl_ext_call`), `TrlExtConfig`,
  `Installation`, `Patcher`; and the error every refusal raises, `UsageError` (its message says the fix).
- Roles (`PluginSpec(serves=...)`): `PACKING`, `METRICS`.
- Packed positions, announced around a packed model call by the packing plugin (`PackedPositions`,
  `packed_positions`, `current_packed_positions`); these import torch, so they resolve on first use.
- Self-check probes (sizing a probe from what training will feed, and the stock padded forward to compare with):
  `training_max_length`, `dataset_longest_pair`, `declared_localities`, `probe_lengths`, `model_probe_lengths`,
  `stock_forward`, `stock_attention`, `STOCK_CALL`.
- Memory: `PeakMemory` (the peak of a span of work, as the line `train()` ends with), `ExtraMemory` (the extra memory
  one forward needs, for sizing work by probing it), `over_budget`, `GPU_MEMORY_FRACTION`, `free_memory_bytes`,
  `rss_mib`, `reset_peak_rss`.
- Several processes: `Ranks` (the collectives trl-ext runs across a run's processes; no-ops with one process).
- Logging: `get_logger` (a child of the `trl_ext` logger), `is_main_process`, `NOTICE`.

Importing this module imports neither torch nor TRL, as `import trl_ext` does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_getattr
from ._logging import NOTICE, get_logger, is_main_process
from ._peak_memory import PeakMemory, reset_peak_rss, rss_mib
from ._shared import Ranks, free_memory_bytes
from .calls import Call
from .config import TrlExtConfig
from .context import TrainerContext
from .errors import UsageError
from .hookspecs import hookimpl
from .installation import Installation
from .patching import Patcher
from .plugins._memory import GPU_MEMORY_FRACTION, ExtraMemory, over_budget
from .plugins._probe import (
    STOCK_CALL,
    dataset_longest_pair,
    declared_localities,
    model_probe_lengths,
    probe_lengths,
    stock_attention,
    stock_forward,
    training_max_length,
)
from .plugins._roles import METRICS, PACKING
from .spec import (
    Flag,
    Parser,
    PluginSpec,
    Size,
    boolean,
    either,
    non_negative_float,
    one_of,
    optional,
    parse_size,
    positive_int,
    size,
    text,
)

if TYPE_CHECKING:
    from .plugins._packing.positions import PackedPositions, current_packed_positions, packed_positions

__all__ = [
    "GPU_MEMORY_FRACTION",
    "METRICS",
    "NOTICE",
    "PACKING",
    "STOCK_CALL",
    "Call",
    "ExtraMemory",
    "Flag",
    "Installation",
    "PackedPositions",
    "Parser",
    "Patcher",
    "PeakMemory",
    "PluginSpec",
    "Ranks",
    "Size",
    "TrainerContext",
    "TrlExtConfig",
    "UsageError",
    "boolean",
    "current_packed_positions",
    "dataset_longest_pair",
    "declared_localities",
    "either",
    "free_memory_bytes",
    "get_logger",
    "hookimpl",
    "is_main_process",
    "model_probe_lengths",
    "non_negative_float",
    "one_of",
    "optional",
    "over_budget",
    "packed_positions",
    "parse_size",
    "positive_int",
    "probe_lengths",
    "reset_peak_rss",
    "rss_mib",
    "size",
    "stock_attention",
    "stock_forward",
    "text",
    "training_max_length",
]

_POSITIONS = "trl_ext.plugins._packing.positions"
# torch-backed names: imported on first use, so that `import trl_ext.api` stays as light as `import trl_ext`.
__getattr__ = lazy_getattr(
    __name__,
    names={"PackedPositions": _POSITIONS, "current_packed_positions": _POSITIONS, "packed_positions": _POSITIONS},
)
