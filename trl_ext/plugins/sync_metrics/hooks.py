"""The hook implementations of `sync_metrics` (declared in its package), imported when the plugin is registered, and
the reduction at a logging point: the window's packed vector, the Trainer's held-back loss and FLOs, one collective
(`trl_ext._shared.Ranks.all_gather_rows`), and the logged values."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trl_ext import _compat
from trl_ext.api import NOTICE, Ranks, UsageError, get_logger, hookimpl

from . import NAME
from .capture import SyncMetricsState

if TYPE_CHECKING:  # pragma: no cover
    from transformers import Trainer

    from trl_ext.api import Call, TrainerContext

logger = get_logger(__name__)


@hookimpl
def trl_ext_trainer_init_start(trainer: Trainer, context: TrainerContext, init_kwargs: dict[str, Any]) -> None:
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
    # first on the undo stack, so last undone: once every wrapper is gone, the window in progress goes back to TRL
    states = context.state
    context.patcher.defer(lambda: hand_back(states.get(NAME)))


@hookimpl
def trl_ext_trainer_init_end(trainer: Trainer, context: TrainerContext) -> None:
    from . import capture, dpo

    config = getattr(trainer.accelerator, "parallelism_config", None)
    sizes = {name: getattr(config, f"{name}_size", 1) or 1 for name in ("tp", "cp", "sp")} if config else {}
    if any(size > 1 for size in sizes.values()):
        raise UsageError(
            f"`sync_metrics=True` does not support tensor/context/sequence parallelism ({sizes}): ranks of one group "
            "see the same or split pairs. Disable `sync_metrics`."
        )
    dpo_trainer = context.trainer_class == "DPOTrainer"
    schema = dpo.make_schema(trainer) if dpo_trainer else dpo.online_schema(trainer)
    state = SyncMetricsState(trainer, context.trainer_class, schema)
    state.calls = {**capture.CALLS, **(dpo.CALLS if dpo_trainer else dpo.ONLINE_CALLS)}
    context.state[NAME] = state
    capture.install(context)
    logger.info("sync_metrics: %s metrics %s", context.trainer_class, [m.name for m in schema.metrics])


@hookimpl(tryfirst=True)  # outermost: one `training_step` per stock batch, outside any micro-batching
def trl_ext_call(trainer: Trainer, context: TrainerContext, call: Call) -> Any:
    """Every method in `PluginSpec.calls`, by `call.name` (`capture` and the trainer's adapter)."""
    state = context.state.get(NAME)
    if state is None:  # between the core's wrapping and `trl_ext_trainer_init_end`
        return call.proceed()
    return state.calls[call.name](trainer, state, call)


@hookimpl
def trl_ext_stock_batches(trainer: Trainer, context: TrainerContext, mode: str, calls: int, sizes: list[int]) -> None:
    # The pairs of each `_compute_loss` call are counted (`batch_pairs`, behind the notice that stock's mean of
    # per-batch means differs from the pair-weighted one): a micro-batcher's re-cut calls count as stock's batches.
    state = context.state.get(NAME)
    pairs = None if state is None else state.batch_pairs.get(mode)
    if pairs is not None and len(pairs) >= calls:
        del pairs[len(pairs) - calls :]
        pairs.extend(sizes)


def _say_uneven_batches(state: SyncMetricsState, mode: str) -> None:
    """One line (per trainer and mode, main process) when a window's batches held different numbers of pairs, e.g. a
    partial last eval batch: there the logged means are over pairs, and stock TRL's mean of per-batch means differs."""
    pairs = state.batch_pairs[mode]
    sizes = sorted(set(pairs), reverse=True)
    state.batch_pairs[mode] = []
    if len(sizes) < 2 or mode in state.uneven_said or state.rank != 0:
        return
    state.uneven_said.add(mode)
    logger.log(
        NOTICE,
        "trl-ext sync_metrics: the %s batches since the last log held %s pairs (%d in all); the logged %smetrics are "
        "means over those pairs, while stock TRL averages the per-batch means, so its numbers differ here (by "
        "design; said once per trainer)",
        mode,
        # every batch's pairs, largest first, so that they add up to the total (sizes with a count past 8 batches)
        " / ".join(
            [str(size) for size in sorted(pairs, reverse=True)]
            if len(pairs) <= 8
            else [f"{size} (x{pairs.count(size)})" for size in sizes]
        ),
        sum(pairs),
        "eval_" if mode == "eval" else "",
    )


@hookimpl
def trl_ext_reduce_metrics(trainer: Any, context: TrainerContext, logs: dict[str, float]) -> dict[str, float] | None:
    """The logs with every metric of the window replaced by its exact global value (None: leave TRL's logs)."""
    state = context.state.get(NAME)
    if state is None:
        return None
    mode = "train" if trainer.model.training else "eval"
    if state.trainer_class == "OnlineDPOTrainer" and mode == "eval":
        return None  # OnlineDPO evaluation logs no `stats`; TRL's own evaluation metrics stay as they are
    schema = state.schema
    _say_uneven_batches(state, mode)
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
        state.close_step()
        correction, state.loss_correction = state.loss_correction, 0.0  # an epoch's last step: real pairs only (DPO)
        vec[schema.loss] = local_loss.to(vec.device, torch.float64) + (
            correction.to(vec.device) if isinstance(correction, torch.Tensor) else correction
        )
        vec[schema.loss_count] = 1.0
    vec[schema.flos] = state.pending_flos
    state.pending_loss, state.pending_flos = None, 0.0

    rows = Ranks(state.world, state.rank).all_gather_rows(vec)
    state.collectives += 1
    metrics, total = schema.reduce(rows)

    out = {key: value for key, value in logs.items() if key not in schema.index}
    if local_loss is not None and total[schema.loss_count] > 0:
        # Exactly transformers' `nested_gather(tr_loss).mean().item()` (a float32 mean over ranks, in rank order).
        global_loss = rows[:, schema.loss].to(local_loss.dtype).mean().item()
        value = global_loss / state.pending_loss_steps
        # OnlineDPO rounds its own logged loss (`_compat.ONLINE_DPO_LOSS_DECIMALS`).
        out["loss"] = (
            round(value, _compat.ONLINE_DPO_LOSS_DECIMALS) if state.trainer_class == "OnlineDPOTrainer" else value
        )
        running = getattr(trainer, _compat.TRAINER_TOTAL_LOSS_ATTR)
        # allowed write: the running loss gets the global mean over ranks in place of the local value it was given
        setattr(trainer, _compat.TRAINER_TOTAL_LOSS_ATTR, running + global_loss - local_loss.item())
    # allowed write: the FLOs held back since the last log, summed over ranks
    trainer.state.total_flos += total[schema.flos]
    # the final summary read `state.total_flos` before this log (trainer.py `_inner_training_loop`)
    if "total_flos" in out:
        out["total_flos"] = trainer.state.total_flos
    if state.trainer_class == "DPOTrainer":
        tokens = getattr(trainer, _compat.DPO_TOTAL_TRAIN_TOKENS) + int(round(total[schema.tokens]))
        # allowed write: the real pairs' tokens of the window, summed over ranks
        setattr(trainer, _compat.DPO_TOTAL_TRAIN_TOKENS, tokens)
        if total[schema.calls] > 0:
            metrics["num_tokens"] = tokens
    prefix = "eval_" if mode == "eval" else ""  # TRL's `log` prefixes eval metrics with "eval_" (dpo_trainer.py)
    out.update({f"{prefix}{key}": value for key, value in metrics.items()})
    return out


def hand_back(state: SyncMetricsState | None) -> None:
    """Detached mid-window (`installation.detach`, `uninstall(detach=True)`): each batch's metrics, the training
    tokens and the held-back FLOs go back to TRL's and the Trainer's buffers as stock would have filled them, so the
    stock log at the window's end covers its whole span. No collective (a detach need not run on every rank at once):
    on several processes the batches before the detach are this process's, and a warning says so."""
    trainer = state.trainer_ref() if state is not None else None
    if state is None or trainer is None:
        return
    schema = state.schema
    dpo = state.trainer_class == "DPOTrainer"
    buffers = getattr(trainer, _compat.DPO_METRICS_BUFFER) if dpo else None
    for mode, window in state.windows.items():
        tokens = window.pack(torch.device("cpu"))[schema.tokens].item()
        calls = window.calls
        window.reset()
        target = buffers[mode] if buffers is not None else getattr(trainer, _compat.ONLINE_DPO_STATS)
        if not dpo and mode != "train":
            continue
        for items in calls:
            vec = torch.zeros(schema.size, dtype=torch.float64)
            for slot, value in items:
                vec[slot] += float(value)
            metrics, _ = schema.reduce(vec.unsqueeze(0))
            for key, value in metrics.items():
                if key != "num_tokens":
                    target[key].append(value)
        if dpo and mode == "train" and tokens:
            total = getattr(trainer, _compat.DPO_TOTAL_TRAIN_TOKENS) + int(round(tokens))
            # allowed write: detached mid-window: this process's training tokens go back to TRL's running count
            setattr(trainer, _compat.DPO_TOTAL_TRAIN_TOKENS, total)
            target["num_tokens"] = [total]
    # allowed write: detached mid-window: the held-back FLOs go back to the Trainer's
    setattr(trainer, _compat.TRAINER_FLOS_ATTR, getattr(trainer, _compat.TRAINER_FLOS_ATTR) + state.pending_flos)
    state.pending_flos = 0.0
    if state.world > 1 and any(state.batch_pairs.values()):
        get_logger(__name__).warning(
            "sync_metrics: detached in the middle of a logging window on %d processes: the metrics TRL logs for that "
            "window count this process's batches before the detach, and every process's after it.",
            state.world,
        )
