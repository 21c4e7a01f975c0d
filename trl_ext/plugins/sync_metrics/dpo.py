"""The trainers' adapters. DPO: TRL's gathered tensors of one `DPOTrainer._compute_loss` call, identified by their
position in TRL's gather order (`_compat.DPO_METRIC_GATHERS`), become window additions; the last partial batch of an
epoch is recomputed on its real pairs. OnlineDPO (`online_schema`, `ONLINE_CALLS`): TRL's OnlineDPO metrics re-derived
per completion from what one training step produced."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trl_ext import _compat
from trl_ext.api import UsageError

from .capture import Metric, Schema, SyncMetricsState

if TYPE_CHECKING:  # pragma: no cover
    from trl_ext.api import Call


def make_schema(trainer: Any) -> Schema:
    metrics = [Metric(n) for n in _compat.DPO_TOKEN_METRICS + _compat.DPO_PAIR_METRICS]
    if getattr(trainer, _compat.DPO_AUX_LOSS_FLAG, False):
        metrics.append(Metric("aux_loss"))
    return Schema(metrics)


def _items(state: SyncMetricsState, trainer: Any, captured: list[torch.Tensor], mode: str) -> list:
    """Turn the tensors TRL gathered in one `_compute_loss` into (slot, value) additions to the window."""
    aux = getattr(trainer, _compat.DPO_AUX_LOSS_FLAG)
    expected = _compat.DPO_GATHERS_PER_CALL + (1 if mode == "train" else 0) + (1 if aux else 0)
    pairs = captured[-6:]
    n = pairs[0].numel() if pairs else -1
    if (
        len(captured) != expected
        or any(t.dim() != 1 or t.numel() != n for t in pairs)
        or any(t.dim() != 0 for t in captured[:-6])
    ):
        shapes = [tuple(t.shape) for t in captured]
        raise UsageError(
            f"sync_metrics: TRL's DPO `_compute_loss` gathered {len(captured)} tensors of shapes {shapes}; expected "
            f"{expected} ({expected - 6} scalars, then 6 per-pair vectors): {_compat.unexpected_trl('sync_metrics')}"
        )
    s = state.schema
    it = iter(captured)
    items: list = [(s.calls, 1)]
    if aux:
        value = next(it)
        items += [(s.sum_slot("aux_loss"), value.double() * n), (s.count_slot("aux_loss"), n)]
    items += [(s.sum_slot("entropy"), next(it)), (s.count_slot("entropy"), next(it))]
    if mode == "train":
        items.append((s.tokens, next(it)))
    for name in _compat.DPO_TOKEN_METRICS[1:]:  # entropy came first
        items += [(s.sum_slot(name), next(it)), (s.count_slot(name), next(it))]
    for name, tensor in zip(_compat.DPO_PAIR_METRICS, it, strict=True):
        items += [(s.sum_slot(name), tensor.double().sum()), (s.count_slot(name), n)]  # float64 slots: no rounding
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
            raise UsageError(
                f"sync_metrics: cannot take the real pairs of the last batch of the epoch: batch entry {key!r} is not "
                "laid out per sequence ([2B, ...]) or per pair ([B]). Use a collator whose batch entries are laid "
                "out so, or disable sync_metrics."
            )
    return out


def _loss_args(model: Any, inputs: dict[str, Any], return_outputs: bool) -> tuple[Any, dict[str, Any], bool]:
    return model, inputs, return_outputs


def _compute_loss(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    model, inputs, return_outputs = _loss_args(*call.args, **call.kwargs)
    mode = "train" if trainer.model.training else "eval"
    n = inputs["input_ids"].shape[0] // 2
    remainder = state.batch_remainder(mode, trainer.accelerator.gradient_state)
    captured: list[torch.Tensor] | None
    with state.capture() as captured:
        result = call.proceed(model, inputs, return_outputs)
    loss = result[0] if isinstance(result, tuple) else result
    real_loss = loss
    k = state.real_count(remainder, n)
    if remainder is not None:
        # Last batch of a dataloader with duplicates (the same step on every rank). Per-token sums cannot be split
        # by row, so recompute the metrics on the real rows alone; every rank runs this forward so that collectives
        # inside it (DDP buffer broadcast, ZeRO-3 gathers) stay matched.
        devices = [trainer.accelerator.device] if trainer.accelerator.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices), state.capture() as real:
            real_loss = call.proceed(model, _slice_pairs(inputs, max(k, 1)), False)
        captured = real if k > 0 else None
    if mode == "train":
        state.add_step_loss(real_loss.detach() * k, state.global_real_count(remainder, n), remainder is not None)
    state.batch_pairs[mode].append(k)
    if captured is not None:
        state.windows[mode].add(_items(state, trainer, captured, mode))
    else:
        state.windows[mode].add([(state.schema.calls, 1)])
    # TRL appended placeholder values (computed from the CPU zeros): check that it logged no metric this plugin does
    # not know, then drop them.
    buffer = getattr(trainer, _compat.DPO_METRICS_BUFFER)[mode]
    unknown = set(buffer) - {name for name, _ in _compat.DPO_METRIC_GATHERS}
    if unknown:
        raise UsageError(
            f"sync_metrics: TRL logged metrics {sorted(unknown)} that sync_metrics does not reduce: "
            f"{_compat.unexpected_trl('sync_metrics')}"
        )
    buffer.clear()
    return result


def _training_step(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    loss = call.proceed()
    state.add_trainer_loss(loss)
    return loss


#: `trl_ext_call` handlers, by method name: the metrics of every `_compute_loss` call, each micro-batch's training loss
CALLS = {_compat.DPO_COMPUTE_LOSS: _compute_loss, "training_step": _training_step}


def online_schema(trainer: Any) -> Schema:
    stats = getattr(trainer, _compat.ONLINE_DPO_STATS)
    known = set(_compat.ONLINE_DPO_PAIR_METRICS + _compat.ONLINE_DPO_COMPLETION_METRICS)
    unknown = set(stats) - known
    if unknown:
        raise UsageError(
            f"sync_metrics does not know how to reduce the OnlineDPO metrics {sorted(unknown)} of "
            f"trl=={_compat.installed_version('trl')}; disable `sync_metrics` for this trainer."
        )
    return Schema([Metric(name) for name in stats])


def _eos_ids(trainer: Any) -> list[int]:
    # 1.16.0 checks every id in `self.eos_token_ids` (online_dpo_trainer.py:1176-1178); 1.12.0 only
    # `self._tokenizer.eos_token_id` (online_dpo_trainer.py:1152).
    ids = getattr(trainer, _compat.ONLINE_DPO_EOS_IDS_ATTR, None)
    if ids is None:
        ids = [getattr(trainer, _compat.ONLINE_DPO_TOKENIZER_ATTR).eos_token_id]
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]


def _step_values(state: SyncMetricsState, trainer: Any, batch_size: int, k: int) -> tuple[list, torch.Tensor]:
    """For the `k` real prompts of this step: TRL's OnlineDPO metrics re-derived per completion
    (online_dpo_trainer.py 1.16.0:1218-1294) as (slot, value) additions, and the sum of TRL's per-pair losses
    (1.16.0:1218-1256, sigmoid or IPO), so that the logged loss of an epoch's last step counts real pairs only. The
    step's own loss (and gradients) is TRL's."""
    cap = state.online
    assert cap is not None  # set when the training step started
    if len(cap["forward"]) != 2 or cap["completion"] is None or cap["rewards"] is None:
        raise UsageError(
            "sync_metrics: OnlineDPO's training step did not run one generation, two forwards (policy, reference) "
            f"and one reward computation: {_compat.unexpected_trl('sync_metrics')}"
        )
    s = state.schema
    beta = float(trainer.beta)
    items: list = [(s.calls, 1)]
    logprobs, ref_logprobs = (t.detach() for t in cap["forward"])
    if k == 0:
        return items, logprobs.new_zeros(())
    completion_ids, completion_mask = cap["completion"]
    rewards = cap["rewards"].detach()  # missing-EOS penalty already applied in place by TRL
    B = batch_size
    device = logprobs.device
    eos = torch.tensor(_eos_ids(trainer), device=completion_ids.device)
    contain_eos = torch.isin(completion_ids, eos).any(dim=-1)

    first, second = rewards.split(B)
    chosen_first = (first >= second).to(device)
    rng = torch.arange(B, device=device)
    chosen_idx = rng + (~chosen_first).long() * B
    rejected_idx = rng + chosen_first.long() * B
    mask = completion_mask.to(device=device, dtype=logprobs.dtype)
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

    logits = (logps_sum[chosen_idx] - logps_sum[rejected_idx]) - (
        ref_logps_sum[chosen_idx] - ref_logps_sum[rejected_idx]
    )
    loss_type = trainer.args.loss_type
    if loss_type == "sigmoid":
        losses = -torch.nn.functional.logsigmoid(beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:  # TRL itself raises NotImplementedError for any other type before this runs
        raise UsageError(
            f"sync_metrics: cannot re-derive OnlineDPO's loss for loss_type={loss_type!r} (it knows 'sigmoid' and "
            "'ipo'): use one of those or disable sync_metrics"
        )
    return items, losses[:k].sum()


def _online_training_step(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    remainder = state.batch_remainder("train", trainer.accelerator.gradient_state)
    batch_size = len((call.args[1] if len(call.args) > 1 else call.kwargs["inputs"])["prompt"])
    state.online = {"forward": [], "completion": None, "rewards": None}
    try:
        with state.capture():
            loss = call.proceed()
        items, real_sum = _step_values(state, trainer, batch_size, state.real_count(remainder, batch_size))
        state.windows["train"].add(items)
        state.add_step_loss(real_sum, state.global_real_count(remainder, batch_size), remainder is not None)
        state.add_trainer_loss(loss)
    finally:
        state.online = None
    return loss


def _forward(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    out = call.proceed()
    if state.online is not None:
        state.online["forward"].append(out.detach())
    return out


def _generate(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    out = call.proceed()
    if state.online is not None:
        # `_compat.ONLINE_DPO_GENERATE_RETURN`
        state.online["completion"] = (out[_compat.ONLINE_DPO_COMPLETION_IDS], out[_compat.ONLINE_DPO_COMPLETION_MASK])
    return out


def _rewards(trainer: Any, state: SyncMetricsState, call: Call) -> Any:
    out = call.proceed()
    if state.online is not None:
        state.online["rewards"] = out  # TRL subtracts the missing-EOS penalty from this tensor in place
    return out


#: `trl_ext_call` handlers, by method name: what each OnlineDPO training step generates, scores and computes
#: (`_compat.ONLINE_DPO_STEP_METHODS`)
ONLINE_CALLS = dict(
    zip(_compat.ONLINE_DPO_STEP_METHODS, (_online_training_step, _forward, _generate, _rewards), strict=True)
)
