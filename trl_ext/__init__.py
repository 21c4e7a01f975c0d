"""trl-ext: plugins that make preference training with a stock TRL faster and cheaper (`with
trl_ext.install(padding_free=True): DPOTrainer(...).train()`). Importing it imports neither torch nor TRL.
"""

from __future__ import annotations

from .config import TrlExtConfig
from .context import TrainerContext
from .errors import UsageError
from .hookspecs import hookimpl, hookspec
from .installation import Installation, current, install
from .spec import Flag, PluginSpec

__version__ = "0.1.0"

__all__ = [
    "Flag",
    "Installation",
    "PluginSpec",
    "TrainerContext",
    "TrlExtConfig",
    "UsageError",
    "__version__",
    "current",
    "hookimpl",
    "hookspec",
    "install",
]
