"""The hook implementations of `sync_metrics` (declared in its package), imported when the plugin is registered."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trl_ext import _compat
from trl_ext.api import UsageError, get_logger, hookimpl

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
    context.patcher.defer(lambda: _hand_back(states.get(NAME)))


@hookimpl
def trl_ext_trainer_init_end(trainer: Trainer, context: TrainerContext) -> None:
    from . import capture, dpo, online_dpo

    config = getattr(trainer.accelerator, "parallelism_config", None)
    sizes = {name: getattr(config, f"{name}_size", 1) or 1 for name in ("tp", "cp", "sp")} if config else {}
    if any(size > 1 for size in sizes.values()):
        raise UsageError(
            f"`sync_metrics=True` does not support tensor/context/sequence parallelism ({sizes}): ranks of one group "
            "see the same or split pairs. Disable `sync_metrics`."
        )
    adapter = dpo if context.trainer_class == "DPOTrainer" else online_dpo
    schema = adapter.make_schema(trainer)
    state = SyncMetricsState(trainer, context.trainer_class, schema)
    state.calls = {**capture.CALLS, **adapter.CALLS}
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


def _hand_back(state: SyncMetricsState | None) -> None:
    from .reduction import hand_back

    trainer = state.trainer_ref() if state is not None else None
    if state is not None and trainer is not None:
        hand_back(trainer, state)


@hookimpl
def trl_ext_reduce_metrics(
    trainer: Trainer, context: TrainerContext, logs: dict[str, float]
) -> dict[str, float] | None:
    state = context.state.get(NAME)
    if state is None:
        return None
    from .reduction import reduce_logs

    return reduce_logs(trainer, state, logs)


@hookimpl
def trl_ext_stock_batches(trainer: Trainer, context: TrainerContext, mode: str, calls: int, sizes: list[int]) -> None:
    # The pairs of each `_compute_loss` call are counted (`batch_pairs`, behind the notice that stock's mean of
    # per-batch means differs from the pair-weighted one): a micro-batcher's re-cut calls count as stock's batches.
    state = context.state.get(NAME)
    pairs = None if state is None else state.batch_pairs.get(mode)
    if pairs is not None and len(pairs) >= calls:
        del pairs[len(pairs) - calls :]
        pairs.extend(sizes)
