"""Padding-free (packed) DPO on a stock `trl.DPOTrainer`: no compute is spent on padding.

Since TRL 0.29, `DPOConfig(padding_free=True)` only logs "temporarily unavailable after a refactor" and falls back to
padding (trl/trainer/dpo_trainer.py, checked 1.12.0 and 1.16.0; upstream issue huggingface/trl#2469). This plugin gives
that compute back, with results equal to padded training.

How it works. TRL's collator still builds the padded `[2B, L]` batch (chosen rows, then rejected rows); a
padding-free collator wrapped around it adds the packing metadata (the flat indices of the real tokens, position ids
that restart at 0 for every sequence, cumulative sequence lengths and the indices that restore the padded layout), in
the data loader, off the training hot path. The forward of every causal LM the trainer runs (policy, reference model,
the reference precompute, and under PEFT the base model with the adapter on or off) is wrapped: it packs the batch
into one row `[1, N]` of real tokens, runs the model on it (backbone *and* LM head, so the LM head and log-softmax
only see real tokens), and puts the per-token outputs back into the padded layout. TRL's own `_compute_loss` then runs
unchanged: every loss type, `loss_weights`, `ld_alpha`, `use_weighting`, and every metric (`num_tokens` counts real
tokens from the padded `attention_mask`, as before).

- TRL >= 1.15: the wrapped forward is TRL's fused LM head (`fused_lm_head=True`); its per-token `log_probs`,
  `entropy`, `mean_logits`, `is_top1` (and `log_sum_sq_probs`) come back as `[2B, L - 1]`.
- TRL < 1.15: the wrapped forward is the model's own; its logits are scattered back to `[2B, L, V]`. TRL then takes
  its log-softmax over the padded layout, so there the LM head is saved but the log-softmax of the padding is not.
- The backbone (`model.base_model`) is wrapped as well, so code that calls it directly with a padded batch is packed
  too. Batches without the metadata (another collator, a precompute of your own) are packed from `attention_mask`.

Sequences of a packed row never see each other:

- `flash_attention_2/3/4`: the varlen arguments `cu_seq_lens_q/k`, `max_length_q/k` are passed, so the flash kernels
  run per sequence.
- `sdpa` / `eager` (CPU): by default the model is switched, for as long as trl-ext is installed, to a per-segment SDPA
  attention registered in transformers' `AttentionInterface` (`trl_ext_varlen_sdpa` / `trl_ext_varlen_eager`; cost
  sum(len^2)). It acts only on packed calls; every other call (e.g. `generate`) runs the original attention with its
  usual mask. Option `attention: dense` keeps the model's attention and lets transformers build its block-diagonal
  mask instead (correct, but (sum len)^2 per layer).

Enable it with either:

```python
with trl_ext.install(padding_free=True):            # every DPOTrainer built inside
    ...
with trl_ext.install():
    DPOTrainer(..., args=DPOConfig(..., padding_free=True))   # TRL's own flag, per trainer
```

Options (`plugins: {padding_free: {...}}`):

- `attention` (`"auto"`, `"varlen"`, `"fused"`, `"segments"` or `"dense"`, defaults to `"auto"`): how `sdpa`/`eager`
  models keep packed sequences apart. `"auto"` and `"varlen"` use trl-ext's varlen attention: on CUDA in bf16/fp16,
  one fused varlen kernel per layer (`torch.nn.attention.varlen.varlen_attn`, `_packing/kernels.py`); elsewhere, and
  for what the kernel lacks (eager attention, softcapping, attention sinks, custom masks, dropout in attention), the
  per-segment attention (each sequence runs the model's own attention function, so sliding windows, softcapping and
  attention sinks apply inside each sequence). One log line per trainer says which runs and why. `"fused"` requires
  the kernel (a `UsageError` before the first step where it cannot run), `"segments"` forces the per-segment loop,
  `"dense"` uses transformers' block-diagonal mask. Flash-attention models always use their own varlen kernels.
- `self_check` (`"auto"` or `true`, defaults to `"auto"`): run the self-check (`selfcheck.py`) for every model, not
  only for those whose `model_type` is not in the verified table (`architecture.VERIFIED_MODEL_TYPES`).

Which models pack exactly is decided by mechanism (`architecture.py`), not by name: attention decoders with
rotary / partial rotary / learned positions (positions restart per sequence), sliding windows, sinks, softcapping,
QK-norm and token-choice MoE (the router auxiliary loss stays on: over the real tokens of the packed row it equals the
mask-weighted loss TRL computes on the padded batch). Every architecture of the installed transformers is checked by
tests/plugins/test_padding_free_sweep.py. Models outside the verified table (custom, `trust_remote_code`, new) run a
self-check before their first step: on a probe batch, changing one packed sequence must leave the others'
logits bit-identical, and each sequence must match its unpacked forward; one log line reports it and its cost.

Refused with `trl_ext.UsageError` (nothing is silently turned off; the advice is to train without padding_free):

- layers that carry state along the sequence (short convolutions, Mamba/SSM, linear attention: LFM2, NemotronH,
  Jamba, Qwen3-Next, ...), named in the message; layers that mix the whole row (sparse-attention indexers of
  DeepSeek-V3.2 / GLM-MoE-DSA, DeepSeek-V4's KV compressor, BLT's byte patches, CPM-Ant's prepended prompt tokens);
  positions numbered from the padding id (RoBERTa and its copies); Falcon's ALiBi (`alibi=True`) and Bloom in 16
  bits; capacity-limited MoE routing; any model that fails the self-check (the message names the first leaking
  layer);
- attention implementations other than `sdpa`, `eager` and `flash_attention_2/3/4` (e.g. `flex_attention`, which has
  no backward on CPU with torch 2.13);
- vision-language models and vision datasets;
- prompt-learning PEFT (prompt tuning, prefix tuning, P-tuning: virtual tokens are prepended to every row);
- `use_liger_kernel=True` (not verified; on TRL <= 1.14 its fused DPO loss bypasses the model forward).

Random draws in training. A policy whose forward draws random numbers in training mode (PhiMoE's router samples its
experts; dropout TRL's `disable_dropout` misses, such as OPT's `config.dropout`) is found by the generator it advances
(`trl_ext.plugins._randomness`) and trained with one warning that names the layers: a packed row draws those numbers
on other shapes than the padded batch, so training takes other samples than stock TRL (equal in distribution where
the layer draws per token, not step for step), while the forward without draws (eval mode) equals stock; the
self-check then runs in eval mode. Otherwise the self-check runs the policy in training mode, as it trains.

Row limits. MPT computes its ALiBi biases for rows of at most `max_seq_len` tokens: its packed batches run as
several packed rows of at most that many tokens each (equal to stock, which never feeds a longer row).

Batch dispatching: the collator's packing metadata is row-major (`row_starts`, `row_lengths`), so accelerate's
`DataLoaderDispatcher` (iterable datasets, `dispatch_batches=True`), which concatenates and slices batches along
dim 0, keeps it with its rows; it is checked against the batch's `attention_mask` before use and rebuilt from the mask
(with a warning) when it does not match.

Limits: each row of a batch must hold one sequence whose real tokens are contiguous (TRL's collator pads on the
right); packed position ids restart at 0, so a user collator that pads on the left gets positions 0..n-1 (what
generation uses) instead of the shifted ones a padded forward would use. Calls that carry a cache, `inputs_embeds`,
`output_hidden_states` or `output_attentions` are not packed (they run padded, with a one-time warning). The
flash-attention path passes transformers' documented varlen arguments but is not exercised by the CPU test suite. The
fused kernel reads the batch's `cu_seq_lens` on the device and its longest sequence from the host (both built once
per batch): no host synchronisation per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..._lazy import lazy_getattr
from ...spec import Flag, Parser, PluginSpec, boolean, one_of
from .._roles import PACKING

NAME = "padding_free"


def _parse_self_check(value: Any) -> str | bool:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if boolean(value) is True:
        return True
    raise ValueError(value)  # no "never check": an unverified model is only packed after it passed the check


_SELF_CHECK = Parser(_parse_self_check, '"auto" or true')


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
