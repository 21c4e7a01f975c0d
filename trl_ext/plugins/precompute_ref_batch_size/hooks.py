"""The hook implementations of `precompute_ref_batch_size` (declared in its package), imported when the plugin is
registered."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trl_ext.api import get_logger, hookimpl

if TYPE_CHECKING:  # pragma: no cover
    from datasets import Dataset
    from transformers import Trainer

    from trl_ext.api import Call, TrainerContext

from . import NAME, PrecomputeOptions

logger = get_logger(__name__)


@hookimpl
def trl_ext_trainer_init_start(trainer: Trainer, context: TrainerContext, init_kwargs: dict[str, Any]) -> None:
    state = context.state[NAME] = PrecomputeState(options=context.options(NAME))
    args = init_kwargs.get("args")
    if not getattr(args, "precompute_ref_log_probs", False):
        state.idle = (
            "this DPOTrainer has `precompute_ref_log_probs=False`, so there was no reference precompute to run "
            "(set `precompute_ref_log_probs=True` in the DPOConfig)"
        )
        logger.warning(
            "trl-ext: `precompute_ref_batch_size` is set, but this DPOTrainer has `precompute_ref_log_probs=False`, "
            "so there is no reference precompute to run. Set `precompute_ref_log_probs=True` in the DPOConfig."
        )


@hookimpl
def trl_ext_call(trainer: Trainer, context: TrainerContext, call: Call) -> Dataset:
    """Runs DPO's reference precompute (`_precompute_ref_logps(dataset, name, batch_size)`) in TRL's place."""
    from datasets import IterableDataset

    dataset, name, _ = inspect.signature(call.original).bind(*call.args, **call.kwargs).args

    if isinstance(dataset, IterableDataset):
        # Step aside so that TRL's own check speaks first, in TRL's words (`_compat.DPO_PRECOMPUTE_ITERABLE_MESSAGE`,
        # the first statement of `_precompute_ref_logps`): nobody can precompute a stream.
        logger.info("trl-ext `%s`: the %s split is an IterableDataset; leaving it to TRL.", NAME, name)
        return call.proceed()
    from .runner import Precompute

    return Precompute(trainer, context, context.state[NAME], dataset, name).run()


@hookimpl
def trl_ext_describe(trainer: Trainer, context: TrainerContext) -> str | None:
    state = context.state.get(NAME)
    if state is None:
        return None
    parts = [f"batch size {context.config.precompute_ref_batch_size}"]
    if state.cache_problem is not None:  # the cache named in the options is not the one in use
        parts.append(state.cache_problem)
    elif state.options.cache_dir is not None:
        parts.append(f"cache {state.options.cache_dir}")
    # TRL precomputes in `__init__` on the versions that do it eagerly: say what already ran.
    return ", ".join(parts + [_ran(run) for run in state.runs])


def _ran(run: dict[str, Any]) -> str:
    return f"{run['name']}: {run['n_pairs']} pairs {'from the cache' if run.get('source') == 'cache' else 'computed'}"


@hookimpl
def trl_ext_advise_unused(trainer: Trainer, trainer_class: str, trl_args: Any) -> str | None:
    # The plugin is off for this trainer: TRL's own precompute runs, and its batch size is TRL's.
    if not getattr(trl_args, "precompute_ref_log_probs", False):
        return None
    size = getattr(trl_args, "precompute_ref_batch_size", None)
    given = f", precompute_ref_batch_size={size}" if size is not None else ""
    return (
        f"{type(trl_args).__name__}(precompute_ref_log_probs=True{given}) is left to TRL's own precompute "
        f"(dataset-order batches, a cache keyed without max_length or truncation); set trl-ext's "
        f'`precompute_ref_batch_size={size if size is not None else 64}` (or "auto") for length-planned batches and '
        "a cache keyed by every setting."
    )


@dataclass
class PrecomputeState:
    """Per-trainer state, `context.state["precompute_ref_batch_size"]`."""

    options: PrecomputeOptions
    #: one record per precompute call (split name, where the values came from, batch plan, timings)
    runs: list[dict[str, Any]] = field(default_factory=list)
    #: the per-batch token budget `"auto"` chose (kept for later `evaluate()` precomputes)
    batch_tokens: float | None = None
    #: the hash of the reference weights, taken at the first precompute
    model_hash: str | None = None
    #: why the plugin has nothing to do for this trainer (no `precompute_ref_log_probs`), or None
    idle: str | None = None
    #: what became of a cache directory that cannot be used (created, written), or None
    cache_problem: str | None = None

    def summary(self) -> str:
        """What ran, for the end-of-run line (`trl-ext dpo`: `[trl-ext]   precompute_ref_batch_size: ...`)."""
        if self.idle is not None:
            return f"did nothing: {self.idle}"
        if not self.runs:
            return "did nothing: TRL asked for no reference precompute"
        runs = [_ran(run) for run in self.runs]
        caches = sorted({run["cache_dir"] for run in self.runs if "cache_dir" in run})
        cache = self.cache_problem or (f"cache {', '.join(caches)}" if caches else "no cache")
        return f"{', '.join(runs)}; {cache}"
