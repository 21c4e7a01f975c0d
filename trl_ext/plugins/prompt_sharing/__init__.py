"""Prompt sharing for DPO and Online DPO: every prompt is computed once, with results equal to padded training.

The batch is packed into one row in which each prompt appears once, followed by its responses
(`prompt[:-1] | prompt[-1] chosen | prompt[-1] rejected | ...`); each response attends to the prompt and itself, and
TRL's loss and metric code runs unchanged on the outputs scattered back to the padded layout.

See docs/plugins/prompt_sharing.md.
"""

from __future__ import annotations

import dataclasses

from trl_ext.api import Flag, Parser, PluginSpec, boolean, either, lazy_getattr, one_of
from trl_ext.toolkit.roles import PACKING

NAME = "prompt_sharing"
_SELF_CHECK = Parser(either(one_of("auto"), boolean), '"auto", true or false')


@dataclasses.dataclass(frozen=True)
class PromptSharingOptions:
    """Options of the `prompt_sharing` plugin (`plugins: {prompt_sharing: {...}}`).

    Args:
        self_check (`str` or `bool`, *optional*, defaults to `"auto"`):
            `"auto"`: before the first step, measure on a probe of prompt-sharing pairs (sized from the training
            lengths) whether a model outside the verified table computes a shared prompt as its stock padded forward
            does; `true`: check every model; `false`: check none, and refuse model types outside the verified table.
        attention (`str`, *optional*, defaults to `"auto"`):
            How the shared attention runs: `"auto"`, one fused varlen kernel per layer where it runs (CUDA,
            bf16/fp16, plain sdpa), else one attention call per segment; `"fused"` requires the kernel (a
            `UsageError` before the first step where it cannot run); `"segments"` always runs per segment.
    """

    self_check: str | bool = dataclasses.field(default="auto", metadata={"parse": _SELF_CHECK})
    attention: str = dataclasses.field(default="auto", metadata={"parse": one_of("auto", "fused", "segments")})


TRL_EXT_PLUGIN = PluginSpec(
    name=NAME,
    summary="Prompt sharing: each prompt computed once in a packed row, equal to padded DPO / Online DPO.",
    flags=(Flag(NAME, default=False, parse=boolean, help="Compute each prompt once (packed, shared prefix)."),),
    options=PromptSharingOptions,
    trainers=("DPOTrainer", "OnlineDPOTrainer"),
    trl_flag=None,
    serves=(PACKING,),
    precedence=1,  # it packs too, and shares prompts: kept over a plain packing plugin
    hooks=".hooks",
    calls=("OnlineDPOTrainer._forward",),
)


__getattr__ = lazy_getattr(__name__, rest="hooks")  # the implementation's names, imported on first use only
