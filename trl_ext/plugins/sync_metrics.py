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
  `total_flos` equal transformers' values (the loss is the same float32 mean over ranks). A checkpoint still gathers
  the FLOs itself, since it writes them to disk at once. `grad_norm` needs no reduction (gradients are already
  synchronized).

Differences from stock TRL's numbers, all on purpose: window means are weighted by pairs/tokens instead of averaging
per-step means; duplicate samples are excluded (also from `num_tokens`); `aux_loss` (MoE) is weighted by pairs;
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

import collections
import contextvars
import dataclasses
import functools
import weakref
from typing import Any

import torch

from .. import _compat
from .._logging import get_logger
from ..errors import UsageError
from ..hookspecs import hookimpl
from ..spec import Flag, PluginSpec, boolean

logger = get_logger(__name__)

NAME = "sync_metrics"

TRL_EXT_PLUGIN = PluginSpec(
    name=NAME,
    summary="Exact global metrics with one collective per logging step.",
    flags=(Flag(NAME, default=False, parse=boolean, help="Log exact global metrics, one collective per log step."),),
    trainers=("DPOTrainer", "OnlineDPOTrainer"),
)

# ---------------------------------------------------------------------------------------------------------------------
# Metric schemas
# ---------------------------------------------------------------------------------------------------------------------

#: DPO metrics and how they are weighted. The order of the tensors TRL gathers in `_compute_loss` is fixed (checked
#: on 1.12.0 dpo_trainer.py:1610-1683 and 1.16.0:1530-1601, the fused and the logits paths gather the same sequence):
#: [aux_loss]? entropy_sum, entropy_tokens, [attention_mask tokens (train only)], chosen_logits_sum, chosen_tokens,
#: rejected_logits_sum, rejected_tokens, correct_tokens, chosen_tokens, then six per-pair tensors.
_DPO_TOKEN_METRICS = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")
_DPO_PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)

#: OnlineDPO metrics (`self.stats`, online_dpo_trainer.py 1.16.0:352-368, 1.12.0:343-359), by what they average over.
_ONLINE_PAIR_METRICS = (
    "beta",
    "logps/chosen",
    "logps/rejected",
    "objective/scores_margin",
    "rewards/accuracies",
    "rewards/chosen",
    "rewards/margins",
    "rewards/rejected",
)
_ONLINE_COMPLETION_METRICS = (
    "objective/entropy",
    "objective/kl",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "val/contain_eos_token",
)


@dataclasses.dataclass(frozen=True)
class Metric:
    """One logged metric: `sum / count` over all ranks (`reduce="mean"`), or the min/max over ranks of per-rank
    values whose count is > 0 (`reduce="max"` / `"min"`)."""

    name: str
    reduce: str = "mean"


class Schema:
    """A fixed, sorted list of metrics, identical on every rank, and the layout of the packed vector.

    Layout: `[sum_0, count_0, sum_1, count_1, ..., calls, tokens, loss, loss_count, flos]`. `calls` counts loss calls
    in the window (DPO logs `num_tokens` only after one), `tokens` the attention-mask tokens of real training pairs
    (folded into every collective so that `num_tokens` is exact at evaluation points too); `loss`/`loss_count` carry
    the Trainer's accumulated training loss and `flos` its FLOs, which transformers would otherwise gather in two more
    collectives per logging step.
    """

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = sorted(metrics, key=lambda m: m.name)
        self.index = {m.name: i for i, m in enumerate(self.metrics)}
        self.calls = 2 * len(self.metrics)
        self.tokens = self.calls + 1
        self.loss = self.calls + 2
        self.loss_count = self.calls + 3
        self.flos = self.calls + 4
        self.size = self.calls + 5

    def sum_slot(self, name: str) -> int:
        return 2 * self.index[name]

    def count_slot(self, name: str) -> int:
        return 2 * self.index[name] + 1

    def reduce(self, rows: torch.Tensor) -> tuple[dict[str, float], list[float]]:
        """Reduce the gathered `[world, size]` matrix. Returns (metrics with a count > 0, column sums)."""
        rows = rows.double().cpu()
        total = rows.sum(dim=0).tolist()
        out = {}
        for i, metric in enumerate(self.metrics):
            count = total[2 * i + 1]
            if count <= 0:
                continue  # no rank saw this metric in the window: not logged, like stock TRL
            if metric.reduce == "mean":
                out[metric.name] = total[2 * i] / count
            else:
                seen = rows[:, 2 * i + 1] > 0
                values = rows[seen, 2 * i]
                out[metric.name] = float(values.max() if metric.reduce == "max" else values.min())
        return out, total


class Window:
    """The local sums and counts of one mode (`"train"` / `"eval"`) since the last log.

    Values that are tensors stay on their device (added with one `index_add_` per call, no host sync); plain numbers
    (pair counts known on the host) are kept on the host. Both meet in `pack()`, at the logging point.
    """

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.device_sums: torch.Tensor | None = None
        self.host = [0.0] * schema.size
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}

    def add(self, items: list[tuple[int, Any]]) -> None:
        slots, values = [], []
        for slot, value in items:
            if isinstance(value, torch.Tensor):
                slots.append(slot)
                values.append(value.detach().reshape(()).to(torch.float64))
            else:
                self.host[slot] += float(value)
        if not values:
            return
        device = values[0].device
        if self.device_sums is None:
            self.device_sums = torch.zeros(self.schema.size, dtype=torch.float64, device=device)
        key = tuple(slots)
        index = self._index_cache.get(key)
        if index is None:
            index = self._index_cache[key] = torch.tensor(slots, dtype=torch.long, device=device)
        self.device_sums.index_add_(0, index, torch.stack(values))

    def pack(self, device: torch.device) -> torch.Tensor:
        vec = torch.tensor(self.host, dtype=torch.float64, device=device)
        if self.device_sums is not None:
            vec += self.device_sums.to(device)
        return vec

    def reset(self) -> None:
        if self.device_sums is not None:
            self.device_sums.zero_()
        self.host = [0.0] * self.schema.size


def all_gather_rows(vec: torch.Tensor) -> torch.Tensor:
    """The one collective: gather every rank's packed vector into a `[world, size]` matrix."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return vec.unsqueeze(0)
    out = torch.empty(dist.get_world_size() * vec.numel(), dtype=vec.dtype, device=vec.device)
    # Newer torch (2.13 here) renamed `all_gather_into_tensor` to `all_gather_single` and warns on the old name.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, vec)
    return out.view(dist.get_world_size(), vec.numel())


# ---------------------------------------------------------------------------------------------------------------------
# Per-trainer state
# ---------------------------------------------------------------------------------------------------------------------


class SyncMetricsState:
    """Per-trainer state (`context.state["sync_metrics"]`): the schema, one window per mode, the capture buffer."""

    def __init__(self, trainer: Any, trainer_class: str, schema: Schema) -> None:
        self.trainer_class = trainer_class
        self.schema = schema
        self.windows = {"train": Window(schema), "eval": Window(schema)}
        accelerator = trainer.accelerator
        self.rank = accelerator.process_index
        self.world = accelerator.num_processes
        self.even_batches = bool(getattr(accelerator, "even_batches", True))
        #: tensors handed to `gather`/`gather_for_metrics` during the current capture (None: not capturing)
        self.captured: list[torch.Tensor] | None = None
        #: OnlineDPO captures of the current training step
        self.online: dict[str, Any] | None = None
        #: for each training batch fetched but not yet computed: the dataloader remainder if it is the last batch of a
        #: dataloader with duplicates, else None
        self.fetched: collections.deque = collections.deque()
        #: the Trainer's training loss and FLOs, held back from transformers' own gathers until the next log
        self.trainer_ref = weakref.ref(trainer)
        self.expect_loss = False
        self.pending_loss: torch.Tensor | None = None
        self.pending_loss_steps = 0
        self.pending_flos = 0.0
        self.in_checkpoint = False
        #: number of collectives this plugin issued (for tests and benchmarks)
        self.collectives = 0

    # -- duplicates ----------------------------------------------------------------------------------------------

    def remainder_now(self, gradient_state: Any) -> int | None:
        """The dataloader remainder when the current batch is the last one of a dataloader that added duplicates."""
        if not self.even_batches or self.world == 1:
            return None
        try:
            if gradient_state.end_of_dataloader and gradient_state.remainder > 0:
                return int(gradient_state.remainder)
        except Exception:  # no active dataloader / no length: like `gather_for_metrics`, keep everything
            return None
        return None

    def batch_remainder(self, mode: str, gradient_state: Any) -> int | None:
        if mode == "train" and self.fetched:
            return self.fetched.popleft()
        return self.remainder_now(gradient_state)

    def real_count(self, remainder: int | None, n: int) -> int:
        """Real samples in this rank's batch of `n`: the first `remainder` of the rank-major concatenation are real
        (accelerate's `gather_for_metrics` rule, accelerator.py `_adjust_samples`)."""
        if remainder is None:
            return n
        return min(max(remainder - self.rank * n, 0), n)

    # -- capture -------------------------------------------------------------------------------------------------

    def record(self, data: Any) -> torch.Tensor:
        if not isinstance(data, torch.Tensor):
            raise RuntimeError(
                f"sync_metrics: TRL gathered a {type(data).__name__} during a metric capture; only tensors are "
                f"supported (trl=={_compat.installed_version('trl')}). Disable sync_metrics and report this."
            )
        self.captured.append(data.detach())
        # CPU zeros: TRL's `.item()` on them is free, and the values it derives from them are discarded.
        return torch.zeros(data.shape if data.dim() else (1,), dtype=data.dtype)


class _Capture:
    def __init__(self, state: SyncMetricsState) -> None:
        self.state = state

    def __enter__(self) -> list[torch.Tensor]:
        self.previous = self.state.captured
        self.state.captured = []
        return self.state.captured

    def __exit__(self, *exc: object) -> None:
        self.state.captured = self.previous


def _make_local_gather(state: SyncMetricsState, original):
    @functools.wraps(original)
    def gather(input_data, *args, **kwargs):
        if state.captured is None:
            return original(input_data, *args, **kwargs)
        return state.record(input_data)

    return gather


class _RecordingIterator:
    """Wraps the Trainer's epoch iterator to note, for each fetched batch, whether it holds duplicates."""

    def __init__(self, iterator: Any, state: SyncMetricsState, gradient_state: Any) -> None:
        self._iterator = iterator
        self._state = state
        self._gradient_state = gradient_state

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._iterator)
        self._state.fetched.append(self._state.remainder_now(self._gradient_state))
        return batch


# ---------------------------------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------------------------------


def _dpo_schema(trainer: Any) -> Schema:
    metrics = [Metric(n) for n in _DPO_TOKEN_METRICS + _DPO_PAIR_METRICS]
    if getattr(trainer, "aux_loss_enabled", False):
        metrics.append(Metric("aux_loss"))
    return Schema(metrics)


def _dpo_items(state: SyncMetricsState, trainer: Any, captured: list[torch.Tensor], mode: str) -> list:
    """Turn the tensors TRL gathered in one `_compute_loss` into (slot, value) additions to the window."""
    aux = getattr(trainer, "aux_loss_enabled", False)
    expected = 14 + (1 if mode == "train" else 0) + (1 if aux else 0)
    pairs = captured[-6:]
    n = pairs[0].numel() if pairs else -1
    if (
        len(captured) != expected
        or any(t.dim() != 1 or t.numel() != n for t in pairs)
        or any(t.dim() != 0 for t in captured[:-6])
    ):
        shapes = [tuple(t.shape) for t in captured]
        raise RuntimeError(
            f"sync_metrics: TRL's DPO `_compute_loss` gathered {len(captured)} tensors of shapes {shapes}; expected "
            f"{expected} ({expected - 6} scalars, then 6 per-pair vectors). The installed "
            f"trl=={_compat.installed_version('trl')} computes its metrics differently from the versions trl-ext "
            f"was checked on; disable sync_metrics and report this."
        )
    s = state.schema
    it = iter(captured)
    items: list = [(s.calls, 1)]
    if aux:
        value = next(it)
        items += [(s.sum_slot("aux_loss"), value.float() * n), (s.count_slot("aux_loss"), n)]
    items += [(s.sum_slot("entropy"), next(it)), (s.count_slot("entropy"), next(it))]
    if mode == "train":
        items.append((s.tokens, next(it)))
    for name in ("logits/chosen", "logits/rejected", "mean_token_accuracy"):
        items += [(s.sum_slot(name), next(it)), (s.count_slot(name), next(it))]
    for name, tensor in zip(_DPO_PAIR_METRICS, it, strict=True):
        items += [(s.sum_slot(name), tensor.float().sum()), (s.count_slot(name), n)]
    return items


def _slice_pairs(inputs: dict[str, Any], k: int) -> dict[str, Any]:
    """The first `k` pairs of a DPO batch (`[2B, ...]` rows: chosen then rejected; `[B]` per-pair columns).

    trl-ext batch metadata (keys starting with `trl_ext`, e.g. padding_free's packing indices) describes the whole
    batch, so it is dropped; its plugin recomputes it from `attention_mask`.
    """
    n2 = inputs["input_ids"].shape[0]
    n = n2 // 2
    rows = torch.cat([torch.arange(k), torch.arange(n, n + k)])
    out = {}
    for key, value in inputs.items():
        if key.startswith("trl_ext"):
            continue
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n2:
            out[key] = value[rows.to(value.device)]
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
            out[key] = value[:k]
        else:
            raise RuntimeError(
                f"sync_metrics: cannot take the real pairs of the last batch of the epoch: batch entry {key!r} is not "
                f"laid out per sequence ([2B, ...]) or per pair ([B]). Disable sync_metrics for this collator."
            )
    return out


def _wrap_dpo_compute_loss(trainer: Any, state: SyncMetricsState, original):
    @functools.wraps(original)
    def _compute_loss(model, inputs, return_outputs):
        mode = "train" if trainer.model.training else "eval"
        n = inputs["input_ids"].shape[0] // 2
        remainder = state.batch_remainder(mode, trainer.accelerator.gradient_state)
        with _Capture(state) as captured:
            result = original(model, inputs, return_outputs)
        if remainder is not None:
            # Last batch of a dataloader with duplicates (the same step on every rank). Per-token sums cannot be
            # split by row, so recompute the metrics on the real rows alone; every rank runs this forward so that
            # collectives inside it (DDP buffer broadcast, ZeRO-3 gathers) stay matched.
            k = state.real_count(remainder, n)
            devices = [trainer.accelerator.device] if trainer.accelerator.device.type == "cuda" else []
            with torch.no_grad(), torch.random.fork_rng(devices=devices), _Capture(state) as real:
                original(model, _slice_pairs(inputs, max(k, 1)), False)
            captured = real if k > 0 else None
        if captured is not None:
            state.windows[mode].add(_dpo_items(state, trainer, captured, mode))
        else:
            state.windows[mode].add([(state.schema.calls, 1)])
        _check_and_clear_trl_buffer(trainer, mode)
        return result

    return _compute_loss


def _check_and_clear_trl_buffer(trainer: Any, mode: str) -> None:
    """TRL appended placeholder values (computed from the CPU zeros) to `_metrics[mode]`: check that it logged no
    metric this plugin does not know, then drop them."""
    buffer = trainer._metrics[mode]
    known = set(_DPO_TOKEN_METRICS + _DPO_PAIR_METRICS) | {"num_tokens", "aux_loss"}
    unknown = set(buffer) - known
    if unknown:
        raise RuntimeError(
            f"sync_metrics: TRL logged metrics {sorted(unknown)} that sync_metrics does not reduce "
            f"(trl=={_compat.installed_version('trl')}). Disable sync_metrics and report this."
        )
    buffer.clear()


# ---------------------------------------------------------------------------------------------------------------------
# OnlineDPO
# ---------------------------------------------------------------------------------------------------------------------


def _online_schema(trainer: Any) -> Schema:
    known = set(_ONLINE_PAIR_METRICS + _ONLINE_COMPLETION_METRICS)
    unknown = set(trainer.stats) - known
    if unknown:
        raise UsageError(
            f"sync_metrics does not know how to reduce the OnlineDPO metrics {sorted(unknown)} of "
            f"trl=={_compat.installed_version('trl')}; disable `sync_metrics` for this trainer."
        )
    return Schema([Metric(name) for name in trainer.stats])


def _online_eos_ids(trainer: Any) -> list[int]:
    # 1.16.0 checks every id in `self.eos_token_ids` (online_dpo_trainer.py:1176-1178); 1.12.0 only
    # `self._tokenizer.eos_token_id` (online_dpo_trainer.py:1152).
    ids = getattr(trainer, "eos_token_ids", None)
    if ids is None:
        ids = [trainer._tokenizer.eos_token_id]
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]


def _online_items(state: SyncMetricsState, trainer: Any, batch_size: int, k: int) -> list:
    """Re-derive TRL's OnlineDPO metrics per completion (online_dpo_trainer.py 1.16.0:1218-1294) for the `k` real
    prompts of this step, as (slot, value) additions."""
    cap = state.online
    if len(cap["forward"]) != 2 or cap["completion"] is None or cap["rewards"] is None:
        raise RuntimeError(
            "sync_metrics: OnlineDPO's training step did not run one generation, two forwards (policy, reference) "
            f"and one reward computation (trl=={_compat.installed_version('trl')}). Disable sync_metrics and report."
        )
    s = state.schema
    beta = float(trainer.beta)
    items: list = [(s.calls, 1)]
    if k == 0:
        return items
    logprobs, ref_logprobs = (t.detach() for t in cap["forward"])
    completion_ids, completion_mask = cap["completion"]
    rewards = cap["rewards"].detach()  # missing-EOS penalty already applied in place by TRL
    B = batch_size
    device = logprobs.device
    eos = torch.tensor(_online_eos_ids(trainer), device=completion_ids.device)
    contain_eos = torch.isin(completion_ids, eos).any(dim=-1)

    first, second = rewards.split(B)
    chosen_first = first >= second
    rng = torch.arange(B, device=device)
    chosen_idx = rng + (~chosen_first).long().to(device) * B
    rejected_idx = rng + chosen_first.long().to(device) * B
    mask = completion_mask.to(logprobs.dtype)
    logps_sum = (logprobs * mask).sum(1)
    ref_logps_sum = (ref_logprobs * mask).sum(1)
    kl = (logprobs - ref_logprobs).sum(1)  # TRL sums over every completion position (online_dpo_trainer.py:1270)
    non_score = -beta * kl
    chosen_rewards = beta * (logps_sum[chosen_idx] - ref_logps_sum[chosen_idx])
    rejected_rewards = beta * (logps_sum[rejected_idx] - ref_logps_sum[rejected_idx])
    margins = chosen_rewards - rejected_rewards
    rewards = rewards.to(device)

    pair = {
        "objective/scores_margin": rewards[chosen_idx] - rewards[rejected_idx],
        "logps/chosen": logps_sum[chosen_idx],
        "logps/rejected": logps_sum[rejected_idx],
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/margins": margins,
        "rewards/accuracies": (margins > 0).to(logprobs.dtype),
    }
    completion = {
        "objective/scores": rewards,
        "val/contain_eos_token": contain_eos.to(device=device, dtype=logprobs.dtype),
        "objective/kl": kl,
        "objective/non_score_reward": non_score,
        "objective/rlhf_reward": rewards + non_score,
        "objective/entropy": -logprobs.sum(1),
    }
    # Completions are [prompt_0..prompt_{B-1}, prompt_0..prompt_{B-1}] (two samples per prompt); pairs follow prompts.
    real_rows = torch.cat([torch.arange(k), torch.arange(B, B + k)]).to(device)
    for name in s.index:
        if name == "beta":
            items += [(s.sum_slot(name), beta * k), (s.count_slot(name), k)]
        elif name in pair:
            items += [(s.sum_slot(name), pair[name][:k].sum()), (s.count_slot(name), k)]
        elif name in completion:
            items += [(s.sum_slot(name), completion[name][real_rows].sum()), (s.count_slot(name), 2 * k)]
    return items


def _wrap_online_training_step(trainer: Any, state: SyncMetricsState, original):
    @functools.wraps(original)
    def training_step(model, inputs, *args, **kwargs):
        remainder = state.batch_remainder("train", trainer.accelerator.gradient_state)
        batch_size = len(inputs["prompt"])
        state.online = {"forward": [], "completion": None, "rewards": None}
        try:
            with _Capture(state):
                loss = original(model, inputs, *args, **kwargs)
            k = state.real_count(remainder, batch_size)
            state.windows["train"].add(_online_items(state, trainer, batch_size, k))
        finally:
            state.online = None
        return loss

    return training_step


def _wrap_online_forward(state: SyncMetricsState, original):
    @functools.wraps(original)
    def _forward(*args, **kwargs):
        out = original(*args, **kwargs)
        if state.online is not None:
            state.online["forward"].append(out.detach())
        return out

    return _forward


def _wrap_online_generate(state: SyncMetricsState, original):
    @functools.wraps(original)
    def _generate(*args, **kwargs):
        out = original(*args, **kwargs)
        if state.online is not None:
            # (prompt_ids, prompt_mask, completion_ids, completion_mask[, vision_inputs]) on 1.12.0 and 1.16.0
            state.online["completion"] = (out[2], out[3])
        return out

    return _generate


def _wrap_online_rewards(state: SyncMetricsState, original):
    @functools.wraps(original)
    def _calculate_rewards_from_functions(*args, **kwargs):
        out = original(*args, **kwargs)
        if state.online is not None:
            state.online["rewards"] = out  # TRL subtracts the missing-EOS penalty from this tensor in place
        return out

    return _calculate_rewards_from_functions


# ---------------------------------------------------------------------------------------------------------------------
# The Trainer's loss and FLOs: folded into the same collective
# ---------------------------------------------------------------------------------------------------------------------

#: The state of the trainer whose `_maybe_log_save_evaluate` is running (transformers calls the module-level
#: `nested_gather` there, with no reference to the trainer; a context variable keeps this per call, not global).
_LOGGING_TRAINER: contextvars.ContextVar[SyncMetricsState | None] = contextvars.ContextVar(
    "trl_ext_sync_metrics_logging_trainer", default=None
)
#: Modules whose `nested_gather` gathers the training loss in `_maybe_log_save_evaluate`: transformers >= 5.2
#: (trainer.py:2249 in 5.23) and OnlineDPO's own override (online_dpo_trainer.py:1325 in 1.16.0, 1326 in 1.12.0, which
#: import the name only with transformers >= 5.2; older transformers call `self._nested_gather`, patched per trainer).
_LOSS_GATHER_MODULES = ("transformers.trainer", "trl.experimental.online_dpo.online_dpo_trainer")


def _deferring_nested_gather(original):
    @functools.wraps(original)
    def nested_gather(tensors, *args, **kwargs):
        state = _LOGGING_TRAINER.get()
        if state is None or not state.expect_loss or not isinstance(tensors, torch.Tensor):
            return original(tensors, *args, **kwargs)
        # The loss of this logging step: keep it local (TRL/transformers then log the local value, and
        # `trl_ext_reduce_metrics` replaces it with the global mean from the one collective).
        trainer = state.trainer_ref()
        state.expect_loss = False
        state.pending_loss = tensors.detach().clone().reshape(())  # the caller zeroes `tr_loss` in place next
        state.pending_loss_steps = trainer.state.global_step - trainer._globalstep_last_logged
        return state.pending_loss.reshape(1)

    nested_gather.__trl_ext_sync_metrics__ = True
    return nested_gather


def _wrap_maybe_log_save_evaluate(trainer: Any, state: SyncMetricsState, original):
    @functools.wraps(original)
    def _maybe_log_save_evaluate(*args, **kwargs):
        # transformers gathers the loss only under this condition (trainer.py `_maybe_log_save_evaluate`).
        state.expect_loss = bool(
            trainer.control.should_log and trainer.state.global_step > trainer._globalstep_last_logged
        )
        token = _LOGGING_TRAINER.set(state)
        try:
            return original(*args, **kwargs)
        finally:
            _LOGGING_TRAINER.reset(token)
            state.expect_loss = False

    return _maybe_log_save_evaluate


def _wrap_store_flos(trainer: Any, state: SyncMetricsState, original):
    @functools.wraps(original)
    def store_flos():
        if state.in_checkpoint:
            # A checkpoint writes `state.total_flos` to disk right after: make it exact now (transformers' gather).
            trainer.current_flos += state.pending_flos
            state.pending_flos = 0.0
            return original()
        state.pending_flos += float(trainer.current_flos)
        trainer.current_flos = 0
        return None

    return store_flos


def _wrap_save_checkpoint(state: SyncMetricsState, original):
    @functools.wraps(original)
    def _save_checkpoint(*args, **kwargs):
        state.in_checkpoint = True
        try:
            return original(*args, **kwargs)
        finally:
            state.in_checkpoint = False

    return _save_checkpoint


def _install_loss_deferral(trainer: Any, context: Any, state: SyncMetricsState) -> None:
    import importlib

    for module_name in _LOSS_GATHER_MODULES:
        module = importlib.import_module(module_name)
        current = getattr(module, "nested_gather", None)
        if current is not None and not getattr(current, "__trl_ext_sync_metrics__", False):
            # Module-level, only while this trainer runs (so also after `uninstall()`); it acts only inside the
            # `_maybe_log_save_evaluate` of a trainer that has sync_metrics (pass-through everywhere else).
            context.wrap_while_running(module, "nested_gather", _deferring_nested_gather)
    patcher = context.patcher
    if hasattr(trainer, "_nested_gather"):
        patcher.setattr(trainer, "_nested_gather", _deferring_nested_gather(trainer._nested_gather))
    patcher.setattr(
        trainer,
        "_maybe_log_save_evaluate",
        _wrap_maybe_log_save_evaluate(trainer, state, trainer._maybe_log_save_evaluate),
    )
    patcher.setattr(trainer, "store_flos", _wrap_store_flos(trainer, state, trainer.store_flos))
    patcher.setattr(trainer, "_save_checkpoint", _wrap_save_checkpoint(state, trainer._save_checkpoint))


# ---------------------------------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------------------------------


@hookimpl
def trl_ext_trainer_init_start(trainer, context, init_kwargs):
    args = init_kwargs.get("args")
    if context.trainer_class == "DPOTrainer":
        if getattr(args, "use_liger_kernel", False) and not _compat.dpo_uses_fused_lm_head():
            raise UsageError(
                "`sync_metrics=True` cannot be combined with `DPOConfig(use_liger_kernel=True)` on "
                f"trl=={_compat.installed_version('trl')}: the Liger DPO loss returns per-batch means of the logits "
                "that cannot be weighted by tokens. Set `use_liger_kernel=False` or upgrade to trl>=1.15."
            )
    elif getattr(args, "use_vllm", False):
        raise UsageError(
            "`sync_metrics=True` does not support `OnlineDPOConfig(use_vllm=True)`: the vLLM generation path is not "
            "covered. Set `use_vllm=False` or disable `sync_metrics`."
        )


@hookimpl
def trl_ext_trainer_init_end(trainer, context):
    config = getattr(trainer.accelerator, "parallelism_config", None)
    sizes = {name: getattr(config, f"{name}_size", 1) or 1 for name in ("tp", "cp", "sp")} if config else {}
    if any(size > 1 for size in sizes.values()):
        raise UsageError(
            f"`sync_metrics=True` does not support tensor/context/sequence parallelism ({sizes}): ranks of one group "
            "see the same or split pairs. Disable `sync_metrics`."
        )
    if context.trainer_class == "DPOTrainer":
        schema = _dpo_schema(trainer)
    else:
        schema = _online_schema(trainer)
    state = SyncMetricsState(trainer, context.trainer_class, schema)
    context.state[NAME] = state
    patcher = context.patcher
    accelerator = trainer.accelerator
    for attr in ("gather", "gather_for_metrics"):
        patcher.setattr(accelerator, attr, _make_local_gather(state, getattr(accelerator, attr)))

    original_get_batch_samples = trainer.get_batch_samples

    @functools.wraps(original_get_batch_samples)
    def get_batch_samples(epoch_iterator, num_batches, *args, **kwargs):
        # The Trainer fetches a whole gradient-accumulation window before computing it, so the dataloader's
        # end-of-epoch state must be read at fetch time (transformers trainer.py `get_batch_samples`).
        state.fetched.clear()
        wrapped = _RecordingIterator(epoch_iterator, state, accelerator.gradient_state)
        return original_get_batch_samples(wrapped, num_batches, *args, **kwargs)

    patcher.setattr(trainer, "get_batch_samples", get_batch_samples)
    if context.trainer_class == "DPOTrainer":
        patcher.setattr(trainer, "_compute_loss", _wrap_dpo_compute_loss(trainer, state, trainer._compute_loss))
    else:
        patcher.setattr(trainer, "training_step", _wrap_online_training_step(trainer, state, trainer.training_step))
        patcher.setattr(trainer, "_forward", _wrap_online_forward(state, trainer._forward))
        patcher.setattr(trainer, "_generate", _wrap_online_generate(state, trainer._generate))
        patcher.setattr(
            trainer,
            "_calculate_rewards_from_functions",
            _wrap_online_rewards(state, trainer._calculate_rewards_from_functions),
        )
    _install_loss_deferral(trainer, context, state)
    logger.info("sync_metrics: %s metrics %s", context.trainer_class, [m.name for m in schema.metrics])


@hookimpl
def trl_ext_reduce_metrics(trainer, context, logs):
    state: SyncMetricsState | None = context.state.get(NAME)
    if state is None:
        return None
    mode = "train" if trainer.model.training else "eval"
    if state.trainer_class == "OnlineDPOTrainer" and mode == "eval":
        return None  # OnlineDPO evaluation logs no `stats`; TRL's own evaluation metrics stay as they are
    schema = state.schema
    window = state.windows[mode]
    vec = window.pack(trainer.accelerator.device)
    window.reset()
    # Training tokens of the train window ride along in every collective, so `num_tokens` is exact at eval points.
    if mode == "eval":
        train = state.windows["train"]
        vec[schema.tokens] += train.pack(vec.device)[schema.tokens]
        train.host[schema.tokens] = 0.0
        if train.device_sums is not None:
            train.device_sums[schema.tokens] = 0.0
    local_loss = state.pending_loss
    if local_loss is not None:
        vec[schema.loss] = local_loss.to(vec.device, torch.float64)
        vec[schema.loss_count] = 1.0
    vec[schema.flos] = state.pending_flos
    state.pending_loss, state.pending_flos = None, 0.0

    rows = all_gather_rows(vec)
    state.collectives += 1
    metrics, total = schema.reduce(rows)

    out = {key: value for key, value in logs.items() if key not in schema.index}
    if local_loss is not None and total[schema.loss_count] > 0:
        # Exactly transformers' `nested_gather(tr_loss).mean().item()` (a float32 mean over ranks, in rank order).
        global_loss = rows[:, schema.loss].to(local_loss.dtype).mean().item()
        value = global_loss / state.pending_loss_steps
        # OnlineDPO rounds its logged loss to 4 decimals (online_dpo_trainer.py 1.16.0:1331, 1.12.0:1332).
        out["loss"] = round(value, 4) if state.trainer_class == "OnlineDPOTrainer" else value
        trainer._total_loss_scalar += global_loss - local_loss.item()
    trainer.state.total_flos += total[schema.flos]
    if (
        "total_flos" in out
    ):  # the final summary read `state.total_flos` before this log (trainer.py `_inner_training_loop`)
        out["total_flos"] = trainer.state.total_flos
    if state.trainer_class == "DPOTrainer":
        trainer._total_train_tokens += int(round(total[schema.tokens]))
        if total[schema.calls] > 0:
            metrics["num_tokens"] = trainer._total_train_tokens
    prefix = "eval_" if mode == "eval" else ""  # TRL's `log` prefixes eval metrics with "eval_" (dpo_trainer.py)
    out.update({f"{prefix}{key}": value for key, value in metrics.items()})
    return out
