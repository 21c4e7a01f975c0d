"""Fused log-probs: Online DPO (and DPO on TRL < 1.15) score completions without the `[rows, length, vocab]` logits.

The output head, told the completion tokens before the model call, scores them `chunk` positions at a time inside its
own call and returns only their log-probs; each chunk is recomputed in the backward pass.

See docs/plugins/fused_logprobs.md.
"""

from __future__ import annotations

import dataclasses

from trl_ext.api import Flag, PluginSpec, boolean, either, lazy_getattr, one_of, positive_int

NAME = "fused_logprobs"
_CHUNK = either(one_of("auto"), positive_int)


@dataclasses.dataclass(frozen=True)
class FusedLogprobsOptions:
    """Options of the `fused_logprobs` plugin (`plugins: {fused_logprobs: {...}}`).

    Args:
        chunk (`str` or `int`, *optional*, defaults to `"auto"`):
            Positions whose logits are computed at once. `"auto"`: about 64 MiB of float32 logits per chunk on
            CPU; on CUDA sized from the free device memory (`chunked.chunk_for_memory`).
    """

    chunk: str | int = dataclasses.field(default="auto", metadata={"parse": _CHUNK})


TRL_EXT_PLUGIN = PluginSpec(
    name=NAME,
    summary="Fused log-probs: completions scored chunk by chunk, never building the full-vocabulary logits.",
    flags=(Flag(NAME, default=False, parse=boolean, help="Score completions without the full-vocabulary logits."),),
    options=FusedLogprobsOptions,
    trainers=("OnlineDPOTrainer", "DPOTrainer"),
    trl_flag=None,
    hooks=".hooks",
    calls=("DPOTrainer._compute_loss", "DPOTrainer.compute_ref_log_probs"),
    replaces=("OnlineDPOTrainer._forward",),
)


__getattr__ = lazy_getattr(__name__, rest="hooks")  # the implementation's names, imported on first use only
