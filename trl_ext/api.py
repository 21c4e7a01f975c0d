"""What a plugin may use: the one public, typed module for plugin authors, its names kept stable and re-exported from
the modules that own them (docs/writing-plugins.md, "The plugin API", lists them by use and says what else a plugin
imports). Importing this module imports neither torch nor TRL: the packed positions' names resolve on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ._logging import NOTICE, get_logger, is_main_process
from ._shared import PeakMemory, Ranks, free_memory_bytes, reset_peak_rss, rss_mib, size_text
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
    from . import hookspecs
    from .toolkit.packing.positions import PackedPositions, current_packed_positions, packed_positions

    # The classes hooks receive satisfy the protocols the hook specs name: checked by mypy.
    _CALL: type[hookspecs.Call] = Call
    _CONFIG: type[hookspecs.TrlExtConfig] = TrlExtConfig
    _CONTEXT: type[hookspecs.TrainerContext] = TrainerContext
    _INSTALLATION: type[hookspecs.Installation] = Installation

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


def lazy_getattr(owner: str, names: Mapping[str, str] | None = None, rest: str | None = None) -> Callable[[str], Any]:
    """The one lazy module `__getattr__` (PEP 562) of trl-ext, `__getattr__ = lazy_getattr(__name__, names, rest)`,
    so that a plugin's declaration stays cheap to import: each of `names` from its (absolute) module, imported on
    first use; any other name from the submodule `rest` of `owner` (`"hooks"`, whose own name returns it). Other names
    and dunders (`copy`, `pickle`, `inspect` probing `__path__`...) are an `AttributeError`, importing nothing."""
    names = dict(names or {})

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {owner!r} has no attribute {name!r}")
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        if rest is not None:
            module = importlib.import_module(f"{owner}.{rest}")
            return module if name == rest else getattr(module, name)
        raise AttributeError(f"module {owner!r} has no attribute {name!r}")

    return __getattr__


_POSITIONS = "trl_ext.toolkit.packing.positions"
# torch-backed names: imported on first use, so that `import trl_ext.api` stays as light as `import trl_ext`.
__getattr__ = lazy_getattr(
    __name__,
    names={"PackedPositions": _POSITIONS, "current_packed_positions": _POSITIONS, "packed_positions": _POSITIONS},
)
