"""Fused log-probs: Online DPO (and DPO on TRL < 1.15) score completions without the `[rows, length, vocab]` logits.

`OnlineDPOTrainer._forward` (TRL 1.12 and 1.16) runs the model, keeps the logits of the completion columns, takes a
full-vocabulary `log_softmax` and gathers each completion token's log-prob, for the policy (with gradients) and the
reference. With a 150k vocabulary and long completions those logits are the largest tensors of the step.

How it works. The trainer's `_forward` is replaced (per trainer, undone when the trainer is detached): the model runs
as TRL calls it, but its output head passes its input through for that call, so the model returns the last hidden
states; TRL's left truncation to `max_length` and its completion slicing are applied to them; then `chunked.py`
applies the head `chunk` positions at a time (under the autocast state the head had inside the model's forward, as
stock runs it under accelerate's mixed precision) with a float32 log-sum-exp (float64 stays float64) and keeps the
target token's log-prob. In the backward pass each chunk's logits are recomputed (a per-chunk checkpoint calling
the head module, so a bias and a PEFT adapter on the head keep working).

Positions after a completion's end: TRL masks them in the loss but sums their log-probs into `objective/kl`,
`objective/entropy`, `objective/non_score_reward` and `objective/rlhf_reward`. They are computed without gradients
(forward only, no recompute), so the loss, the gradients and every logged metric equal stock.

Enable it with:

```python
with trl_ext.install(fused_logprobs=True):
    trainer = OnlineDPOTrainer(...)         # or DPOTrainer(...)
```

Options (`plugins: {fused_logprobs: {...}}`):

- `chunk` (`"auto"` or a positive integer, defaults to `"auto"`): positions per chunk; `"auto"` holds about 64 MiB of
  float32 logits per chunk (`chunked.auto_chunk`, 16 to 4096 positions).

Exact or refused. Before the first step every model runs a self-check (`selfcheck.py`): on a probe batch the model's
own stock logits must equal its output head applied to the hidden states the plugin receives, and the fused
log-probs must equal the stock `log_softmax` (float64: 1e-10 relative). Refused with `trl_ext.UsageError`, naming the
mechanism: final logit softcapping, logit scaling (`logit_scale`, `logits_scaling`), models without an output head
module, heads the model does not call as a module, vision-language models, any model failing the self-check; and,
when the trainer is built, DeepSpeed ZeRO-3 (each chunk's head call gathers the head's parameters and the chunk
count follows each rank's completion lengths, so the ranks' collectives would fall out of step) and FSDP (the head is
called outside the model's forward, where FSDP has resharded its weight). DDP and ZeRO-2 equal stock (tests/scale).

`DPOTrainer`: on TRL >= 1.15 TRL's own fused LM head already scores DPO without full logits; the plugin says so in one
log line and leaves it. On older TRL (`dpo.py`) the policy's and reference's scoring forwards return `LazyLogits`
(`lazy.py`): every reduction TRL's `_compute_loss` and `compute_ref_log_probs` apply to the logits (log-probs of every
loss type, the `sft` cross-entropy, WPO weights, entropy, mean logits, token accuracy) runs chunk by chunk, and only
completion positions are scored. There it does not combine with packing yet (refused); an evaluation that asks for
the logits themselves (`prediction_loss_only=False`) gets them, built as stock, with a warning.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

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
            Positions whose logits are computed at once. `"auto"`: about 64 MiB of float32 logits per chunk.
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


def __getattr__(name: str) -> Any:
    """The implementation's names: `.hooks` is imported on first use only, so that reading the declaration above
    imports no torch."""
    if name.startswith("__"):
        raise AttributeError(name)
    hooks = importlib.import_module(f"{__name__}.hooks")
    return hooks if name == "hooks" else getattr(hooks, name)
