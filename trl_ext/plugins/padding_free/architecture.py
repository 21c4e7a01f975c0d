"""padding_free's view of the shared architecture inspection (`trl_ext.toolkit.architecture`): its verified table and
its refusals, which name padding_free."""

from __future__ import annotations

from typing import Any

from trl_ext.toolkit import architecture
from trl_ext.toolkit.architecture import Inspection

from . import NAME

__all__ = ["VERIFIED_MODEL_TYPES", "Inspection", "inspect_model"]

#: The model types padding_free packs without a self-check: the shared table, whole.
VERIFIED_MODEL_TYPES = architecture.VERIFIED_MODEL_TYPES


def inspect_model(model: Any) -> Inspection:
    """The packing mechanisms of `model`, or why padding_free refuses it."""
    return architecture.inspect_model(model, NAME, VERIFIED_MODEL_TYPES)
