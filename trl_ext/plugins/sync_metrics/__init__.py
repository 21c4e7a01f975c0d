"""Exact global metrics with one collective per logging step (`sync_metrics=True`, DPO and Online DPO).

Every rank accumulates the sums and counts behind TRL's metrics locally and exchanges them in one `all_gather` per
logging step; losses and gradients are unchanged.

See docs/plugins/sync_metrics.md.
"""

from __future__ import annotations

from trl_ext import _compat
from trl_ext.api import Flag, PluginSpec, boolean, lazy_getattr
from trl_ext.toolkit.roles import METRICS

NAME = "sync_metrics"

TRL_EXT_PLUGIN = PluginSpec(
    name=NAME,
    summary="Exact global metrics with one collective per logging step.",
    flags=(Flag(NAME, default=False, parse=boolean, help="Log exact global metrics, one collective per log step."),),
    trainers=("DPOTrainer", "OnlineDPOTrainer"),
    serves=(METRICS,),
    hooks=".hooks",
    calls=(
        "accelerator.gather",
        "accelerator.gather_for_metrics",
        "training_step",
        *_compat.TRAINER_METHODS,
        f"DPOTrainer.{_compat.DPO_COMPUTE_LOSS}",
        *(f"OnlineDPOTrainer.{name}" for name in _compat.ONLINE_DPO_STEP_METHODS[1:]),
    ),
)


__getattr__ = lazy_getattr(__name__, rest="hooks")  # the implementation's names, imported on first use only
