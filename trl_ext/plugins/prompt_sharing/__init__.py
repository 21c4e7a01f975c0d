"""Prompt sharing for DPO and Online DPO: every prompt is computed once, with results equal to padded training.

A padded DPO batch computes each prompt twice (once with the chosen, once with the rejected response); Online DPO
computes it once per generated completion. Packing (padding_free) removes the padding but keeps the duplicate. With
`prompt_sharing=True`, the batch is packed into one row in which each prompt appears once, followed by its responses:

    prompt[:-1] | prompt[-1] chosen | prompt[-1] rejected | next prompt[:-1] | ...

Both responses attend to the prompt and to themselves, never to each other, and their positions continue from the
prompt; so every per-token output equals the padded forward's. TRL's loss and metric code then runs unchanged on the
outputs scattered back to the padded layout (fused LM head fields on TRL >= 1.15, logits before), every loss type,
`ld_alpha`, `use_weighting` and every metric included. The prompt's hidden states receive the sum of both branches'
gradients, so the gradients are equal too. Token bound over packing alone, per pair: (2P + C + R) / (P + C + 1 + R).

What runs shared:

- `DPOTrainer`: the policy forward and backward, the reference forward (a reference model, or the adapter-disabled
  PEFT model), the reference precompute, evaluation; with gradient checkpointing as well. The collator (TRL's, or the
  user's, wrapped) builds the layout in the data loader.
- `OnlineDPOTrainer`: the policy and reference scoring forwards over the generated completions (the two completions
  of a prompt share it). Generation itself is untouched.

Rows share a prompt when their prompt tokens are identical and start at the same column (so at the same positions).
Where TRL's truncation leaves two different prompt prefixes for a pair (`truncation_mode="keep_end"`), that pair runs
unshared (packed, one segment per sequence); the share of sequences that ran unshared is logged (a warning the first
time, and in `context.state["prompt_sharing"].counts()`).

Dropout (`dropout.py`). A shared prompt is computed once, so in training both responses would see one dropout mask
on it where padded training draws two. With `disable_dropout=True` (TRL's default) every dropout site of the models
is set to 0 while the trainer keeps its plugins, also the functional dropout and layer drop that TRL's
`disable_dropout` misses (OPT's `config.dropout`), in one log line; with `disable_dropout=False` a policy with
dropout is refused. Any other random numbers the forward draws in training mode (dropout applied inside `forward`,
PhiMoE's router sampling its experts) are found by the generator they advance (`trl_ext.plugins._randomness`): the
model is refused before the first step, naming the layer, since a shared prompt would get one sample where padded
training draws one per response. Chunked attention (Llama 4's `attention_chunk_size`) that acts on the sequences
training feeds is refused too (it lives only in the mask transformers builds).

Batch dispatching (`dispatch_batches=True`, iterable datasets): the batch carries the layout as tensors only, with the
prompt ends row-major; when accelerate's dim-0 concatenation and slicing cut the serialized layout, the forward
rebuilds it from the prompt ends (a once-only warning), so dispatched training, evaluation and prediction equal stock.

`prompt_sharing=True` packs by itself. It serves the `packing` role with precedence 1: a plugin that only packs
(precedence 0), enabled as well, is left out for the trainers prompt_sharing applies to (the trainer's log line says
so).

Attention. The model's `sdpa`/`eager` attention is switched, for as long as trl-ext is installed, to a shared
attention registered in transformers' `AttentionInterface` (`trl_ext_shared_sdpa` / `trl_ext_shared_eager`): per
segment, the prompt's keys/values plus the segment's own, so its cost follows the shared layout. It acts only on
shared calls; generation and every other call run the original attention with its usual mask. Sliding windows are
applied by position. Flash attention and FlexAttention are not supported yet (refused, see below).

Self-check (`selfcheck.py`, option `self_check`, defaults to `"auto"`): before the first step, every model outside
the verified table (every model with `self_check: true`) runs a probe of chosen/rejected pairs sharing a prompt, sized
from what training will feed (one pair as long as the longest training sequence, the others longer than every window
or chunk the config declares), through the shared forward and through its own stock padded forward (stock attention,
`attention_mask`, `use_cache=False`, training dtype); the logits of every real token must agree to the dtype's
round-off. A difference raises `trl_ext.UsageError` naming the model, the output and the position; one log line gives
the result and its cost.

Enable it with:

```python
with trl_ext.install(prompt_sharing=True):
    trainer = DPOTrainer(...)          # or OnlineDPOTrainer(...)
```

Options (`plugins: {prompt_sharing: {...}}`):

- `self_check` (`"auto"`, `true` or `false`, defaults to `"auto"`): `"auto"` checks the models outside the verified
  table, `true` every model, `false` none (model types outside the verified table are then refused).
- `attention` (`"auto"`, `"fused"` or `"segments"`, defaults to `"auto"`): on CUDA in bf16/fp16, `"auto"` runs the
  shared attention as one fused varlen kernel per layer (`torch.nn.attention.varlen.varlen_attn`, its causal mask
  aligned to the bottom right: each response's queries over the prompt's keys followed by its own; a second call for
  Online DPO's trailing padding), elsewhere and for what the kernel lacks one call per segment; one log line per
  trainer says which runs and why. `"fused"` requires the kernel (`UsageError` where it cannot run), `"segments"`
  forces one call per segment.

Architectures: the model types of `setup.VERIFIED_MODEL_TYPES` (padding_free's verified table but StableLM) run without
a self-check, each checked against the padded forward in float64 by tests/plugins/test_prompt_sharing_architectures.py:
rotary, partial rotary and learned positions, sliding windows mixed with full layers, attention sinks (GPT-OSS),
softcapping (Gemma 2), QK-norm, parallel blocks, and token-choice MoE with the router auxiliary loss on (`moe.py`
recomputes it in the padded layout, so it counts a shared prompt once per response, as stock TRL does). Layers other
than plain SDPA (eager, softcapping, sinks) run their own attention function per segment with an explicit mask.

Refused with `trl_ext.UsageError`: what padding_free's inspection refuses (layers that carry state along the sequence,
ALiBi, capacity-limited routing), naming the layer; a model outside the verified table whose shared forward differs
from its stock padded forward (the self-check); a layer that drops the segments on the way to its attention;
vision-language models; prompt-learning PEFT; `use_liger_kernel`; attention implementations other than `sdpa` and
`eager`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..._lazy import lazy_getattr
from ...spec import Flag, Parser, PluginSpec, boolean, one_of
from .._roles import PACKING

NAME = "prompt_sharing"


def _parse_self_check(value: Any) -> str | bool:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return boolean(value)


_SELF_CHECK = Parser(_parse_self_check, '"auto", true or false')


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
)


__getattr__ = lazy_getattr(__name__, rest="hooks")  # the implementation's names, imported on first use only
