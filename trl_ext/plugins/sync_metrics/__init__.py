"""Exact global metrics with one collective per logging step (`sync_metrics=True`).

In a distributed run, stock TRL reduces its metrics expensively and slightly wrong:

- `DPOTrainer._compute_loss` gathers ~15 tensors across ranks on every micro-step, each followed by a host sync
  (`.item()`) (trl/trainer/dpo_trainer.py, 1.16.0:1533-1601, 1.12.0:1613-1683);
- `DPOTrainer.log` then averages the per-micro-step means, so steps with few pairs (or few tokens) weigh as much as
  full ones;
- `accelerator.gather` (rewards, log-probs) counts the duplicate samples that accelerate's `even_batches` adds to the
  last batch of an epoch;
- `OnlineDPOTrainer` logs `val/contain_eos_token` from the local rank only (online_dpo_trainer.py 1.16.0:1266).

With this plugin every rank accumulates, locally and on its device, the sums and counts behind every metric TRL logs:
per-pair metrics (rewards, log-probs, OnlineDPO scores, ...) are weighted by pairs, per-token metrics (`entropy`,
`logits/*`, `mean_token_accuracy`) by tokens. Nothing is gathered during the step. At each logging or evaluation point
the ranks exchange one packed float64 vector in **one** collective, and every rank logs the same values: the metric
over exactly the real pairs processed since the last log. `num_tokens` counts the real pairs' tokens.

Enable it with:

```python
with trl_ext.install(sync_metrics=True):
    trainer = DPOTrainer(...)   # or OnlineDPOTrainer
    trainer.train()
```

(or `TRL_EXT_SYNC_METRICS=1`, or `sync_metrics: true` in the trl-ext YAML file). It has no options.

How it works.

- *Local values.* For the duration of `DPOTrainer._compute_loss` / `OnlineDPOTrainer.training_step`, the trainer's
  accelerator answers `gather` / `gather_for_metrics` with CPU zeros and records the tensor it was given, so TRL's
  metric code runs without a collective or a device sync (the numbers it appends to `_metrics` / `stats` are
  discarded). The loss and its gradients are TRL's own, untouched. DPO: the recorded tensors are TRL's per-pair values
  and per-batch token sums, identified by their position in TRL's fixed gather sequence (checked for count, shape
  and metric names on every call). OnlineDPO: the metrics are re-derived per completion from the log-probs, rewards
  and completions the step produced (TRL's formulas, online_dpo_trainer.py 1.16.0:1218-1294).
- *Duplicates.* The last batch of a dataloader with a remainder holds duplicate samples on some ranks; like
  `gather_for_metrics`, the real samples are the first `remainder` of the rank-major concatenation. For training
  batches the dataloader's state is recorded when the batch is fetched (the Trainer fetches a whole gradient
  accumulation window ahead). Per-pair values are sliced; the per-token sums of such a step come from a second,
  no-grad `_compute_loss` on the real rows only, run on every rank (so collectives inside the forward, e.g. ZeRO-3,
  stay matched) under a forked RNG. This happens once per epoch end with a remainder.
- *One collective.* The metric names are a fixed, sorted schema decided at `__init__` from the trainer's config
  (identical on all ranks), so a metric seen on one rank only needs no second round trip: the other ranks send
  zeros for it. The packed vector (sum and count per metric; the number of loss calls and of tokens; the Trainer's
  loss and FLOs, see below) goes through one `all_gather`, not an `all_reduce`: one collective that can also reduce
  min/max metrics (an all-reduce has one op, so sums and maxima would need two) and that gives bit-identical results
  on every rank (each sums the same rows in rank order). TRL 1.10-1.16 log no min/max metrics.
- *No deadlock.* Every rank calls `trainer.log` at the same points (the Trainer's logging/evaluation schedule and the
  final summary), and the plugin issues its collective there unconditionally: a rank that saw no pairs, uneven
  numbers of batches, an evaluation set smaller than the world size and a run that ends between two logging steps
  all issue the same single collective. Do not call `trainer.log` from one rank only.
- *The Trainer's own gathers.* At every logging step transformers also gathers the training loss (`nested_gather`
  in `_maybe_log_save_evaluate`) and the FLO count (`store_flos`). The plugin keeps both local and carries them in
  its one collective instead, so a logging step costs exactly one collective; the logged `loss`, `train_loss` and
  `total_flos` equal transformers' values (the loss is the same float32 mean over ranks), except on the last step of
  an epoch with duplicates, below. A checkpoint still gathers the FLOs itself, since it writes them to disk at once.
  `grad_norm` needs no reduction (gradients are already synchronized).
- *The loss of an epoch's last step.* There the Trainer's loss averages over the duplicated pairs too (in
  tests/plugins/test_sync_metrics.py, 2 ranks and 9 pairs, stock logs 0.3412 at the end of the first epoch, where
  the one real pair's loss is 0.5841). Each rank knows how many real pairs every rank holds (same remainder, same
  rule), takes the real-pair loss (DPO: from the no-grad recompute above; OnlineDPO: TRL's per-pair loss formula on
  the step's captured log-probs and rewards, `online_dpo._real_loss_sum`), and carries in its one collective the
  difference to what the Trainer added, so the logged `loss` (and `train_loss`) is the mean over real pairs, like
  every other metric. **Training itself keeps accelerate's behaviour:** the duplicated pairs still contribute their
  gradients to that last step (as without trl-ext); only the logged value changes.

Differences from stock TRL's numbers, all on purpose: window means are weighted by pairs/tokens instead of averaging
per-step means (this shows in a single process too, whenever the batches of a window differ in size, typically a
partial last eval batch: one notice line says so the first time); duplicate samples are excluded (also from
`num_tokens` and from DPO's logged `loss`); `aux_loss` (MoE) is weighted by pairs;
OnlineDPO's `val/contain_eos_token` is global; OnlineDPO metrics of steps after the last logging step are added to
the final summary log (as DPO does). Evaluation of an `OnlineDPOTrainer` keeps TRL's own metrics.

Checked with 2-process DDP (gloo) and DeepSpeed ZeRO-3 on CPU, on TRL 1.12.0 and 1.16.0
(tests/plugins/test_sync_metrics.py); `benchmarks/metric_sync.py` measures collectives and step time.

Limits: `trainer.predict()` computes DPO metrics but never logs them, so (as in stock TRL, whose `_metrics["eval"]`
buffer behaves the same) they are counted in the next evaluation's window. A checkpoint's `total_flos` is exact; the
in-memory `state.total_flos` between two logging steps lags by the FLOs not yet reduced.

Refused with `trl_ext.UsageError`:

- options under `plugins: {sync_metrics: ...}` (it has none);
- `DPOConfig(use_liger_kernel=True)` on TRL < 1.15: its fused loss returns per-batch scalar means of the logits that
  cannot be weighted by tokens nor cleared of duplicates;
- `OnlineDPOConfig(use_vllm=True)`: the vLLM generation path is not covered;
- tensor, context or sequence parallelism (`accelerator.parallelism_config` with a size > 1): ranks of one group
  see the same or split pairs, so pair counts would be wrong.
"""

from __future__ import annotations

from ... import _compat
from ..._lazy import lazy_getattr
from ...spec import Flag, PluginSpec, boolean
from .._roles import METRICS

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
