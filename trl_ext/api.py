"""What a plugin may use: the one public module for plugin authors, typed, its names kept stable.

A third-party plugin imports `trl_ext`, `trl_ext.api` and the toolkit (`trl_ext.toolkit`), nothing else of trl-ext;
the built-in plugins import the same, plus `trl_ext._compat` (the core's index of TRL facts), and their own package
(tests/test_api.py checks both). The names here are re-exported from the modules that own them.

- Declaring a plugin: `PluginSpec`, `Flag`, the option parsers (`boolean`, `positive_int`, `non_negative_float`,
  `one_of`, `optional`, `either`, `size`, `text`, `Parser`, `Size`, `parse_size`), `hookimpl`.
- What hooks receive: `TrainerContext` (per-trainer `state`, its `patcher`, `patch(scope, apply)`), `Call` (one call
  of a trainer method a plugin takes part in, `trl_ext_call`), `TrlExtConfig`,
  `Installation`, `Patcher`; and the error every refusal raises, `UsageError` (its message says the fix;
  `did_you_mean` suggests a known name), and `InternalError`, raised where trl-ext itself is wrong (its message asks
  to report it).
- Models: `unwrap_causal_lm` (the `*ForCausalLM` module inside DeepSpeed, DDP and PEFT wrappers).
- Roles (`PluginSpec(serves=...)`): `PACKING`, `METRICS`.
- Packed positions, announced around a packed model call by the packing plugin (`PackedPositions`,
  `packed_positions`, `current_packed_positions`); these import torch, so they resolve on first use.
- Self-check probes (sizing a probe from what training will feed, and the stock padded forward to compare with):
  `training_max_length`, `dataset_longest_pair`, `declared_localities`, `probe_lengths`, `model_probe_lengths`,
  `stock_forward`, `stock_attention`.
- The call context (`trl_ext.call_context`): `CallContext`, what is in effect for the running call (a stock
  reference, a packed or shared-prompt forward), `current_call`, `call_entered`, and `CallSlot`, a plugin's own
  per-call entry.
- Memory: `PeakMemory` (the peak of a span of work, as the line `train()` ends with), `ExtraMemory` (the extra memory
  one forward needs, for sizing work by probing it), `over_budget`, `GPU_MEMORY_FRACTION`, `free_memory_bytes`,
  `rss_mib`, `reset_peak_rss`, `size_text` (bytes as a user reads them).
- Several processes: `Ranks` (the collectives trl-ext runs across a run's processes; no-ops with one process).
- Logging: `get_logger` (a child of the `trl_ext` logger), `is_main_process`, `NOTICE`.
- A plugin's declaration: `lazy_getattr` (its module `__getattr__`, resolving the hooks module's names on first use).

Importing this module imports neither torch nor TRL, as `import trl_ext` does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_getattr
from ._logging import NOTICE, get_logger, is_main_process
from ._peak_memory import PeakMemory, reset_peak_rss, rss_mib, size_text
from ._shared import Ranks, free_memory_bytes
from .call_context import CallContext, CallSlot, call_entered, current_call
from .calls import Call
from .config import TrlExtConfig
from .context import TrainerContext, unwrap_causal_lm
from .errors import InternalError, UsageError, did_you_mean
from .hookspecs import hookimpl
from .installation import Installation
from .patching import Patcher
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
from .toolkit.memory import GPU_MEMORY_FRACTION, ExtraMemory, over_budget
from .toolkit.probe import (
    dataset_longest_pair,
    declared_localities,
    model_probe_lengths,
    probe_lengths,
    stock_attention,
    stock_forward,
    training_max_length,
)
from .toolkit.roles import METRICS, PACKING

if TYPE_CHECKING:
    from .toolkit.packing.positions import PackedPositions, current_packed_positions, packed_positions

__all__ = [
    "GPU_MEMORY_FRACTION",
    "METRICS",
    "NOTICE",
    "PACKING",
    "Call",
    "CallContext",
    "CallSlot",
    "ExtraMemory",
    "Flag",
    "Installation",
    "InternalError",
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
    "call_entered",
    "current_call",
    "current_packed_positions",
    "dataset_longest_pair",
    "declared_localities",
    "did_you_mean",
    "either",
    "free_memory_bytes",
    "get_logger",
    "hookimpl",
    "is_main_process",
    "lazy_getattr",
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
    "size_text",
    "stock_attention",
    "stock_forward",
    "text",
    "training_max_length",
    "unwrap_causal_lm",
]

_POSITIONS = "trl_ext.toolkit.packing.positions"
# torch-backed names: imported on first use, so that `import trl_ext.api` stays as light as `import trl_ext`.
__getattr__ = lazy_getattr(
    __name__,
    names={"PackedPositions": _POSITIONS, "current_packed_positions": _POSITIONS, "packed_positions": _POSITIONS},
)
