"""Padding-free (packed) DPO on a stock `trl.DPOTrainer`: no compute is spent on padding.

A collator adds the packing metadata; the forward of every causal LM the trainer runs packs the batch into one row of
real tokens, runs it with per-sequence attention and puts the outputs back in the padded layout, so TRL's
`_compute_loss` runs unchanged.

See docs/plugins/padding_free.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trl_ext.api import Flag, Parser, PluginSpec, boolean, either, lazy_getattr, one_of
from trl_ext.toolkit.roles import PACKING

NAME = "padding_free"


def _true(value: Any) -> bool:
    if boolean(value) is True:
        return True
    raise ValueError(value)  # no "never check": an unverified model is only packed after it passed the check


_SELF_CHECK = Parser(either(one_of("auto"), Parser(_true, "true")), '"auto" or true')


@dataclasses.dataclass(frozen=True)
class PaddingFreeOptions:
    """Options of the `padding_free` plugin (`plugins: {padding_free: {...}}`).

    Args:
        attention (`str`, *optional*, defaults to `"auto"`):
            How `sdpa`/`eager` models keep packed sequences apart: `"auto"` and `"varlen"` use trl-ext's varlen
            attention, with one fused varlen kernel per layer where it runs (CUDA, bf16/fp16, plain sdpa) and the
            per-segment loop elsewhere; `"fused"` requires the fused kernel (a `UsageError` where it cannot run);
            `"segments"` always runs the per-segment loop; `"dense"` transformers' block-diagonal mask.
            Flash-attention models always use their own varlen kernels.
        self_check (`str` or `bool`, *optional*, defaults to `"auto"`):
            `"auto"`: before the first step, measure on a probe batch whether a model that is not in the verified
            table keeps packed sequences apart and equals its stock padded forward (3 forwards; the longest probe
            sequence is as long as the longest training sequence); `true`: check every model.
    """

    attention: str = dataclasses.field(
        default="auto", metadata={"parse": one_of("auto", "varlen", "dense", "fused", "segments")}
    )
    self_check: str | bool = dataclasses.field(default="auto", metadata={"parse": _SELF_CHECK})


TRL_EXT_PLUGIN = PluginSpec(
    name=NAME,
    summary="Packed (padding-free) DPO: no compute spent on padding, equal to padded training.",
    flags=(Flag(NAME, default=False, parse=boolean, help="Pack DPO sequences so no compute is spent on padding."),),
    options=PaddingFreeOptions,
    trainers=("DPOTrainer",),
    trl_flag="padding_free",  # DPOConfig.padding_free, ignored by TRL >= 0.29 (see _compat.TRL_IGNORED_FLAGS)
    serves=(PACKING,),
    hooks=".hooks",
)


__getattr__ = lazy_getattr(__name__, rest="hooks")  # the implementation's names, imported on first use only
