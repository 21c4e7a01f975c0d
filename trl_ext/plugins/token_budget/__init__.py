"""Micro-batches cut by tokens instead of pairs, with the same gradients and metrics as stock TRL
(`token_budget=<tokens>`).

A TRL DPO user picks `per_device_train_batch_size` so that the *longest* micro-batch fits in memory; on data of very
different lengths most micro-batches then run far below capacity. With this plugin, each optimizer step still
consumes exactly the pairs stock TRL gives it (`per_device_train_batch_size x gradient_accumulation_steps`, same
sampler, same order), but runs them in micro-batches of at most `token_budget` tokens: many short pairs share one
forward/backward, long ones run in small groups. Chosen and rejected sequences of a pair stay together; a pair longer
than the budget runs alone, and one warning line per step says so.

What the budget counts: alone, padded tokens (`2 x pairs x longest sequence`, the longest rounded up to the collator's
`pad_to_multiple_of`: the width the model sees); with a packing plugin (the plugin
that holds the `packing` role for the trainer, which then collates each micro-batch), real tokens, as its collator
declares (`token_layout`): under padding_free
both sequences of every pair, under prompt_sharing what its shared row holds: the prompt once and each completion
after a copy of the prompt's last token (a pair that `max_length` truncates counts both sequences, since
`truncation_mode="keep_end"` may leave it unshared).
Sequences count at most `DPOConfig.max_length`.

```python
with trl_ext.install(token_budget=4096):
    trainer = DPOTrainer(...)
    trainer.train()
```

(or `TRL_EXT_TOKEN_BUDGET=4096`, or `token_budget: 4096` in the trl-ext YAML file).

`token_budget="auto"` measures the budget when the trainer is built, as `precompute_ref_batch_size="auto"` does (the
memory probe both use, `trl_ext.plugins._memory`): training steps (the trainer's `compute_loss` under its autocast, and
the backward) on micro-batches of the dataset's heaviest pairs, doubling, while the peak memory a step adds stays
within the memory budget (GPU: 90% of the free device memory, less the optimizer's two moments per trainable
parameter; CPU: the `ram_budget` option, the kernel's peak-RSS counter). The budget is the largest token count a
linear fit of peak memory against tokens keeps within 90% of that memory, capped at the heaviest step's tokens (and
never past a size that did not fit); several processes take the smallest. Probes run with the random state saved and
restored, and the trainer's metrics and token count are put back, so training equals a run with the chosen budget.
One line (level `notice`) says what was chosen and against which memory, and the trainer's log line shows
`budget=auto:<tokens>`. Refused for a dataset that is not a `datasets.Dataset`, under DeepSpeed or FSDP (the model is
not sharded yet when the trainer is built: set a number), and when one step on the heaviest pair needs more than the
memory budget.

Exact. The gradient of every optimizer step and every logged metric equal stock TRL's with the same batch size and
gradient accumulation (tests/plugins/test_token_budget.py and test_token_budget_settings.py, float64, every accepted
loss type):

- *Loss weights.* Each micro-batch's mean loss is weighted by the share of the step that stock gives its pairs
  (`pairs / (pairs in their stock micro-batch x stock micro-batches in the step)`), through transformers' own hook
  (`Trainer.loss_is_scaled_for_ga`), so the Trainer does not divide it again. Pairs of the short last batch of an
  epoch weigh more in stock TRL; they are never mixed with others in one micro-batch. `use_weighting`, `ld_alpha`,
  the f-divergences and several `loss_type`s with `loss_weights` are per-pair and covered.
- *`loss_type` "sft"* (alone or combined, RPO's `["sigmoid", "sft"]`): TRL takes it as one mean over the chosen
  tokens of the micro-batch; the plugin adds a term that weighs each token by the chosen tokens of the *stock*
  micro-batch it belongs to, as stock does (`.sft`).
- *Accepted loss types* are an allow-list (`hooks.ACCEPTED_LOSS_TYPES`), checked in the tests against the list TRL
  itself holds (DPOConfig's help and `_compute_loss`'s branches): a loss type a new TRL adds is refused until verified.
- *NaN and inf* metrics are rebuilt as stock logs them (NaN where stock logs NaN). Under transformers'
  `logging_nan_inf_filter` a step whose micro-batches are all non-finite logs stock's loss; a step with finite and
  non-finite micro-batches cannot tell which stock micro-steps were non-finite, and one warning says its logged loss
  may differ from stock's.
- *Metrics.* Stock TRL logs the mean of per-micro-batch means; the plugin records the per-pair values behind them
  (rewards, log-probs, and per-row token sums for `entropy`, `logits/*`, `mean_token_accuracy`) and appends, at the
  end of each step, what stock would have appended for each of its micro-batches. The logged `loss`, `num_tokens`,
  `total_flos` and the Trainer's epoch/step bookkeeping equal stock's.
- *The training loop is transformers' own.* The training loader's collator also passes on the examples of each
  batch (with accelerate's batch dispatching, `dispatch_batches=True` or an iterable dataset on several processes, as
  one tensor whose rows follow the batch's, since accelerate joins batches of tensors only: `.dispatch`);
  `get_batch_samples` returns one entry per stock micro-batch (equal to it, so FLOs and token counting are
  unchanged); the re-cut micro-batches, collated by the trainer's collator, are spread over those entries and
  `training_step` runs each entry's micro-batches in turn. The plugin takes part in those trainer methods through
  `trl_ext_call` (`.calls`), innermost (`trylast`): a plugin outside it sees one `training_step` per stock batch.
- *Other plugins and options.* With padding_free or prompt_sharing the result equals stock within their own float32
  floor; with sync_metrics (which reduces the metrics itself, weighting by pairs and tokens) the logs equal
  sync_metrics alone. PEFT (the adapter-disabled reference included), gradient checkpointing and
  `precompute_ref_log_probs` are covered by the same tests.

Evaluation and prediction: each batch over the budget is split into micro-batches by the same count (never merged
with other batches); its loss is the pair-weighted mean of the parts (what stock's mean over the batch is) and its
metrics are rebuilt for the whole batch, so `evaluate()` logs what stock logs. A split batch cannot return logits as
stock does, so when logits are asked for (`prediction_loss_only=False`, e.g. `predict()`, or `compute_metrics`)
batches run whole, and one warning says so.

Several processes (DDP, DeepSpeed ZeRO-2 and ZeRO-3, FSDP2; tests/scale/ `dpo-token_budget`, equal to stock under
each engine):

- *Balanced.* The ranks exchange the examples of the step (one all-gather) and all compute the same cut of all its
  pairs (longest first within pairs of equal stock weight, so similar lengths share a micro-batch) and the same
  assignment of micro-batches to ranks (the most tokens first, each to the rank holding the fewest). A pair keeps the
  weight stock gives it on its own rank; the engine averages gradients over ranks as in stock, so the global gradient
  is stock's. The log at level debug gives, per step, the most and the mean tokens per rank.
- *In lockstep.* ZeRO-3 and FSDP2 gather parameters on every forward and DDP reduces gradients on the synchronised
  backward, so every rank runs the same number of micro-batches per step: a rank given fewer runs its smallest (or
  the step's smallest) again with loss weight 0, its metrics and tokens not counted. Only the step's last
  micro-batch runs with gradient synchronisation (before it: `accelerator.no_sync`, and `sync_gradients` False, so
  DeepSpeed steps once).
- *Metrics.* The ranks' micro-batches hold different numbers of pairs, which `accelerator.gather` cannot join: TRL's
  per-call gathers are answered locally, and the per-pair values and token counts are exchanged in one all-gather at
  the end of the step, from which stock's gathered metrics (per stock micro-batch, rank-major) and `num_tokens` are
  rebuilt.
- *Evaluation* batches are cut on their own rank (not balanced), every rank running as many parts as the rank with
  most (one all-reduce per batch), their metrics rebuilt from every rank's values.

Refused with `trl_ext.UsageError`, when the trainer is built:

- `loss_type` `aot`, `aot_unpaired` (sorted across the micro-batch): their values change with the cut; any loss type
  not in the allow-list; `sft` with `use_weighting=True` (a product of two means over the micro-batch);
- FSDP v1 (FSDP2 is covered);
- batch dispatching with a packing plugin (its batches are not laid out 2 rows per pair), at the first batch;
- a MoE model with `router_aux_loss_coef != 0` (the auxiliary loss is computed over all tokens of a micro-batch);
- `use_liger_kernel=True`;
- `sync_metrics` on several processes (it would count the zero-weight repeats' pairs);
- vision datasets (examples other than tokenized text pairs), at the first step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..._lazy import lazy_getattr
from ...spec import Flag, PluginSpec, Size, either, one_of, optional, positive_int, size

NAME = "token_budget"


class _NoValue(str):
    """What a bare `--trl-ext-token-budget` (no value) gives the flag's parser, which refuses it: the flag takes a
    number of tokens or "auto", never a silent default."""

    def __repr__(self) -> str:
        return 'no value (a bare `--trl-ext-token-budget`: give a number of tokens or "auto")'


NO_VALUE = _NoValue("")


@dataclass(frozen=True)
class TokenBudgetOptions:
    """Options of the `token_budget` plugin (`plugins: {token_budget: {...}}`).

    Args:
        ram_budget (`str`, `int` or `float`, *optional*, defaults to `0.25`):
            Memory a training micro-batch may add on CPU when `token_budget="auto"` measures the budget: bytes
            (`"4GB"`, `"512MiB"`, an int), or a fraction of the memory available when the trainer is built (`0.25`,
            `"25%"`), shared among the node's processes. On GPU the budget is 90% of the free device memory.
    """

    ram_budget: Size = field(default=Size("fraction", 0.25), metadata={"parse": size})


TRL_EXT_PLUGIN = PluginSpec(
    name=NAME,
    summary="Micro-batches of at most N tokens, gradients and metrics equal to stock.",
    flags=(
        Flag(
            NAME,
            default=None,
            parse=optional(either(positive_int, one_of("auto"))),
            help='Most tokens per DPO micro-batch (pairs per optimizer step unchanged), or "auto" to measure it; '
            "a value is required.",
            cli_const=NO_VALUE,
        ),
    ),
    options=TokenBudgetOptions,
    trainers=("DPOTrainer",),
    hooks=".hooks",
    calls=(
        "get_train_dataloader",
        "get_eval_dataloader",
        "get_test_dataloader",
        "get_batch_samples",
        "training_step",
        "compute_loss",
        "prediction_step",
        "train",
        "accelerator.gather",
        "accelerator.gather_for_metrics",
    ),
)


__getattr__ = lazy_getattr(__name__, rest="hooks")  # the implementation's names, imported on first use only
