"""What trl-ext attaches to one trainer, on the instance and through its undo stack (so it keeps it whatever happens
to the installation): the wrappers of its entry points, `log` and the generation helper; the checks made before TRL's
`__init__` runs; which stock trainer an object is."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping
from typing import Any

from . import _compat
from ._logging import NOTICE, get_logger, is_main_process
from ._peak_memory import PeakMemory
from .context import TrainerContext, live_contexts
from .errors import UsageError
from .patching import resolve

__all__ = [
    "attach_after_init",
    "attach_before_init",
    "call_for_trl_error",
    "check_world",
    "generation_wrapper",
    "stock_trainer_class",
]

logger = get_logger(__name__)


def stock_trainer_class(trainer: str | type | Any) -> str:
    """The name of the stock TRL trainer class (`_compat.TRAINERS`) that `trainer` (a name, class or instance) is."""
    if isinstance(trainer, str):
        if trainer not in _compat.TRAINERS:
            raise UsageError(
                f"`{trainer}` is not a trainer trl-ext attaches to; use one of {', '.join(_compat.TRAINERS)} (or a "
                "trainer class or instance)."
            )
        return trainer
    cls = trainer if isinstance(trainer, type) else type(trainer)
    stock = {(module, name): key for key, (module, name) in _compat.TRAINERS.items()}
    for klass in cls.__mro__:
        key = stock.get((klass.__module__, klass.__qualname__))
        if key is not None:
            return key
    if isinstance(trainer, type) or hasattr(trainer, "train"):
        raise UsageError(
            f"{cls.__qualname__} is not a trainer trl-ext attaches to (nor derived from one): "
            f"{', '.join(_compat.TRAINERS)}."
        )
    raise TypeError(
        f"expected a trainer class name, a trainer class or a trainer instance, got {type(trainer).__name__}: "
        f"{trainer!r}"
    )


def call_for_trl_error(original, trainer_class: str, trainer: Any, args: tuple, kwargs: dict) -> None:
    """Call TRL's `__init__` with arguments that do not fit its signature, so the user sees TRL's own `TypeError`, with
    a note naming the new spelling of a keyword TRL renamed."""
    try:
        original(trainer, *args, **kwargs)
    except TypeError as exc:
        for note in _compat.renamed_keyword_notes(trainer_class, exc, kwargs):
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(note)
            else:
                logger.warning("trl-ext: %s", note)
        raise
    # Only if the signature trl-ext read is not the one Python checks (a decorated `__init__`): then the trainer is
    # built, without plugins, and that must not be silent.
    logger.warning("trl-ext: could not read the arguments of this %s; it runs without plugins", trainer_class)


#: Variables through which launchers announce the number of processes (those accelerate reads, `state.py`).
_WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def check_world(trainer_class: str, trl_args: Any, enabled: list[str]) -> None:
    """Refuse a launch of several processes in which this trainer runs alone: each would silently train its own model
    (`torchrun --nproc_per_node 2` on CPU without `use_cpu=True`)."""
    launched = {}
    for var in _WORLD_SIZE_VARS:
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 1:
            launched[var] = int(value)
    if not launched or trl_args is None or not hasattr(trl_args, "world_size"):
        return
    world = trl_args.world_size  # the accelerate state the trainer's `Accelerator` will use
    expected = max(launched.values())
    if world == expected:
        return
    var = next(v for v, n in launched.items() if n == expected)
    config = type(trl_args).__name__
    raise UsageError(
        f"{var}={expected} says this is one of {expected} processes, but this {trainer_class} runs a world of {world} "
        f"(its {config} sees no distributed setup), so each process would train its own model; trl-ext's "
        f"{', '.join(enabled)} would not be shared either. On CPU, set `use_cpu=True` in the {config}; on GPU, "
        "give every process a device (check CUDA_VISIBLE_DEVICES); or launch a single process."
    )


def attach_before_init(ctx: TrainerContext) -> None:
    """What TRL's `__init__` already needs: a DPOTrainer this TRL can train, the generation helper."""
    if ctx.trainer_class == "DPOTrainer":
        fact = _compat.dpo_training_refusal()  # stock DPOTrainer cannot train with this TRL here: say so now
        if fact is not None:
            raise UsageError(fact.refusal(f"trl-ext cannot run {', '.join(ctx.enabled)} on this DPOTrainer"))
    module_name = _compat.GENERATION_HELPER_MODULES.get(ctx.trainer_class)
    if module_name is not None:
        # Trainer modules look `unwrap_model_for_generation` up by name: it is swapped there while this trainer runs.
        module, wrapper = resolve(module_name), generation_wrapper(ctx)
        ctx.patch("run", lambda patcher: patcher.wrap(module, "unwrap_model_for_generation", wrapper))


def attach_after_init(ctx: TrainerContext) -> None:
    """Instance patches for the trainer's life: metric reduction in `log`, and the run scope of its entry points."""
    trainer = ctx.trainer
    ctx.patcher.setattr(trainer, "log", _log_wrapper(ctx, trainer.log))
    for entry in ("train", "evaluate", "predict"):
        ctx.patcher.setattr(trainer, entry, _running_wrapper(ctx, getattr(trainer, entry), entry == "train"))


def _running_wrapper(ctx: TrainerContext, original, training: bool = False):
    @functools.wraps(original)
    def entry_point(*args, **kwargs):
        if not training:
            with ctx.running():
                return original(*args, **kwargs)
        with ctx.running(), PeakMemory(ctx.trainer.args.device) as peak:
            result = original(*args, **kwargs)
        if is_main_process():
            logger.log(
                NOTICE,
                "trl-ext: %s trained with plugins %s; %s during train()",
                ctx.trainer_class,
                ", ".join(ctx.enabled) or "none",
                peak.text(),
            )
        return result

    return entry_point


def _log_wrapper(ctx: TrainerContext, original):
    @functools.wraps(original)
    def log(logs, *args, **kwargs):
        trainer = ctx.trainer
        result = ctx.call_exclusive("trl_ext_reduce_metrics", trainer=trainer, context=ctx, logs=logs)
        if result is not None:
            # The plugin's values replace TRL's buffered ones for this window (DPOTrainer keeps them in
            # `_metrics[mode]` and would otherwise merge its own local averages in).
            buffers = getattr(trainer, "_metrics", None)
            if isinstance(buffers, Mapping):
                buffers["train" if trainer.model.training else "eval"].clear()
            logs.clear()
            logs.update(result)
        return original(logs, *args, **kwargs)

    return log


def generation_wrapper(ctx: TrainerContext | None):
    """`unwrap_model_for_generation` for one trainer's context, or (`None`) for whichever attached trainer owns the
    accelerator it is called with; a pass-through for every other call."""

    def make(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def unwrap_model_for_generation(model, accelerator, *args, **kwargs):
            candidates = [ctx] if ctx is not None else live_contexts()
            owner = next(
                (c for c in candidates if c.attached and getattr(c.trainer, "accelerator", None) is accelerator), None
            )
            if owner is not None and owner.enabled:
                bound = signature.bind(model, accelerator, *args, **kwargs)
                bound.apply_defaults()
                call_kwargs = {k: v for k, v in bound.arguments.items() if k != "model"}
                manager = owner.call_exclusive(
                    "trl_ext_make_generation_context",
                    trainer=owner.trainer,
                    context=owner,
                    model=model,
                    call_kwargs=call_kwargs,
                )
                if manager is not None:
                    return manager
            return original(model, accelerator, *args, **kwargs)

        return unwrap_model_for_generation

    return make
