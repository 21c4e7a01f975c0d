"""Fused log-probs: Online DPO (and DPO on TRL < 1.15) score completions without the `[rows, length, vocab]` logits.

`OnlineDPOTrainer._forward` (TRL 1.12 and 1.16) runs the model, keeps the logits of the completion columns, takes a
full-vocabulary `log_softmax` and gathers each completion token's log-prob, for the policy (with gradients) and the
reference. With a 150k vocabulary and long completions those logits are the largest tensors of the step.

How it works. The trainer's `_forward` is replaced (per trainer, undone when the trainer is detached): the model runs
as TRL calls it, and its output head, told the completion tokens and columns before the call, scores them inside its
own call: it takes the completion columns (`[P - 1, P + C - 1)`, after TRL's left truncation to `max_length`) of the
hidden states it receives and `chunked.py` applies the head's original `forward` `chunk` positions at a time with a
float32 log-sum-exp (float64 stays float64), keeping the target token's log-prob; the head returns those `[rows, C]`
log-probs and the model passes them through as its `logits`. In the backward pass each chunk's logits are recomputed
(a per-chunk checkpoint of the head's own code, so a bias and a PEFT adapter on the head keep working). The head
module is called once per forward on every rank, as stock, under the autocast state of the model's forward, and with
the parameters DeepSpeed ZeRO-3 or FSDP2 gather for that call in place (ZeRO-3's pre-backward hook on the head's
output gathers them again before the recomputation). With prompt_sharing the model runs on one packed row; the head
then reads the hidden states of the scored columns through the packed positions prompt_sharing announces around that
call (`_packing.positions`) and returns the padded `[rows, C]` log-probs itself, still inside its one call.

Positions after a completion's end: TRL masks them in the loss but sums their log-probs into `objective/kl`,
`objective/entropy`, `objective/non_score_reward` and `objective/rlhf_reward`. They are computed without gradients
(forward only, no recompute), so the loss, the gradients and every logged metric equal stock.

Enable it with:

```python
with trl_ext.install(fused_logprobs=True):
    trainer = OnlineDPOTrainer(...)         # or DPOTrainer(...)
```

Options (`plugins: {fused_logprobs: {...}}`):

- `chunk` (`"auto"` or a positive integer, defaults to `"auto"`): positions per chunk; `"auto"` on CPU holds about
  64 MiB of float32 logits per chunk (`chunked.auto_chunk`, 16 to 4096 positions); on CUDA it is chosen at attach
  from the free device memory: one chunk's logits, their float32 upcast and gradients take at most 1/8 of it and
  512 MiB (`chunked.chunk_for_memory`, 16 to 8192 positions).

Exact or refused. Before the first step every model runs a self-check (`selfcheck.py`): on a probe batch the model's
own stock logits must equal its output head's output on the hidden states it receives, and the fused log-probs the
model returns must equal the stock `log_softmax` (float64: 1e-10 relative). Refused with `trl_ext.UsageError`, naming
the mechanism: final logit softcapping, logit scaling (`logit_scale`, `logits_scaling`), models without an output
head module, heads the model does not call as a module, vision-language models, any model failing the self-check;
and, when the trainer is built under DeepSpeed ZeRO-3, an output head with parameterized sub-modules (e.g. a PEFT
adapter on the head: ZeRO-3 would gather them once per chunk, and the ranks' chunk counts differ). DDP, ZeRO-2,
ZeRO-3 and FSDP2 equal stock (tests/scale).

`DPOTrainer`: on TRL >= 1.15 TRL's own fused LM head already scores DPO without full logits; the plugin says so in one
log line, leaves it, and the end-of-run line of `trl-ext dpo` says it did nothing ("left TRL's own fused LM head in
place"). On older TRL (`dpo.py`: the logits helpers of 1.10-1.13 and of 1.14, found by a probe) the policy's and
reference's scoring forwards score inside the output head's call as well: told the targets, the completion positions
and the statistics TRL's metrics read, the head runs one chunked pass (log-probs of every loss type, the `sft`
cross-entropy, WPO weights, entropy, mean logits, token accuracy) and the model returns a `LazyLogits` (`lazy.py`)
holding those results, which TRL's `_compute_loss` and `compute_ref_log_probs` read unchanged. Only completion
positions are scored, and the head module is called once per forward, so DPO runs under DDP, ZeRO-2, ZeRO-3 and FSDP2
too. It combines with padding_free and prompt_sharing: their packed forward announces the packed positions and the head
gathers the scored positions from the packed row. An evaluation that asks for the logits themselves
(`prediction_loss_only=False`) gets them, built as stock, with a warning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..._lazy import lazy_getattr
from ...spec import Flag, Parser, PluginSpec, boolean, positive_int

NAME = "fused_logprobs"


def _parse_chunk(value: Any) -> str | int:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return positive_int(value)


_CHUNK = Parser(_parse_chunk, '"auto" or a positive integer')


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
)


__getattr__ = lazy_getattr(__name__, rest="hooks")  # the implementation's names, imported on first use only
