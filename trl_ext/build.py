"""One trainer's build, as a script in call order (`build`): what trl-ext does while a stock trainer's `__init__`
runs, on the trainer instance and through its own undo stack (so the trainer keeps it whatever happens to the
installation). Methods TRL's `__init__` calls are wrapped before it runs; `log`, the entry points, `verify` and the
other `trl_ext_call` methods after it, each outside the one before (a chain of `training_step` runs outside verify's;
verify outside the chains of the scoring methods).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import _compat, calls, verify
from ._logging import NOTICE, get_logger, is_main_process
from ._shared import PeakMemory
from .context import TrainerContext, live_contexts, output_head_module
from .errors import UsageError
from .manager import resolve_roles
from .patching import resolve

if TYPE_CHECKING:  # pragma: no cover
    from .config import TrlExtConfig
    from .installation import Installation

__all__ = [
    "announce",
    "build",
    "check_trainer_settings",
    "check_world",
    "enabled_plugins",
    "generation_wrapper",
    "hide_ignored_flags",
    "prepare_models",
]

logger = get_logger(__name__)


def build(installation: Installation, trainer_class: str, original: Any, trainer: Any, init_kwargs: dict) -> None:
    """Run TRL's `__init__` (`original`, with `init_kwargs`) on `trainer`, with the plugins `installation` gives."""
    trl_args = init_kwargs.get("args")
    enabled = check_trainer_settings(installation.config, trainer_class, trl_args)
    if enabled:
        check_world(trainer_class, trl_args, enabled)
    ctx = TrainerContext(installation, trainer, trainer_class, enabled, trl_args)
    if installation.keep_records:
        installation._kept.append(ctx)
    try:
        ctx.hook.trl_ext_trainer_init_start(trainer=trainer, context=ctx, init_kwargs=init_kwargs)
        # A TRL flag that TRL ignores but a trl-ext plugin implements is hidden from TRL while its `__init__` runs
        # (so TRL neither warns that it falls back nor acts on it), then restored on the user's config object.
        hidden, left = hide_ignored_flags(ctx, trl_args)
        if enabled:
            calls.attach(ctx, init=True)
            if trainer_class == "DPOTrainer":
                fact = _compat.dpo_training_refusal()  # stock DPOTrainer cannot train with this TRL here: say so now
                if fact is not None:
                    raise UsageError(fact.refusal(f"trl-ext cannot run {', '.join(enabled)} on this DPOTrainer"))
                method = _compat.DPO_PRECOMPUTE_METHOD
                ctx.patcher.setattr(trainer, method, precompute_wrapper(ctx, getattr(trainer, method)))
            module_name = _compat.GENERATION_HELPER_MODULES.get(trainer_class)
            if module_name is not None:
                # Trainer modules look `unwrap_model_for_generation` up by name: swapped there while this trainer runs.
                module, wrapper = resolve(module_name), generation_wrapper(ctx)
                ctx.patch("run", lambda patcher: patcher.wrap(module, "unwrap_model_for_generation", wrapper))
        try:
            with ctx.running():
                original(trainer, **init_kwargs)
        finally:
            for flag, value in hidden.items():
                setattr(trl_args, flag, value)
        prepare_models(ctx)
        if enabled:  # for the trainer's life: metric reduction in `log`, the run scope of its entry points
            ctx.patcher.setattr(trainer, "log", _log_wrapper(ctx, trainer.log))
            for entry in ("train", "evaluate", "predict"):
                ctx.patcher.setattr(trainer, entry, _running_wrapper(ctx, getattr(trainer, entry), entry == "train"))
            verify.attach(ctx)
            calls.attach(ctx, init=False)
        ctx.hook.trl_ext_trainer_init_end(trainer=trainer, context=ctx)
    except BaseException:
        ctx.detach()  # a trainer TRL (or a plugin) refused to build holds nothing
        raise
    announce(ctx, left)


def precompute_wrapper(ctx: TrainerContext, original: Any) -> Any:
    """DPO's reference precompute (its `trl_ext_call` chain), once the models are ready."""

    @functools.wraps(original)
    def _precompute_ref_logps(dataset, name, batch_size):
        prepare_models(ctx)
        return original(dataset, name, batch_size)

    return _precompute_ref_logps


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


def prepare_models(ctx: TrainerContext) -> None:
    """Apply the collator, packed, head and model forward extension points, then `trl_ext_trainer_models_ready`;
    once, where TRL first runs a model (the DPO precompute) or at the end of `__init__`."""
    if ctx.models_ready:
        return
    ctx.models_ready = True
    trainer = ctx.trainer
    collator = getattr(trainer, "data_collator", None)
    if collator is not None:
        new = ctx.call_exclusive("trl_ext_make_collator", trainer=trainer, context=ctx, collator=collator)
        if new is not None:
            ctx.patcher.setattr(trainer, "data_collator", new)
    # Each model's backbone, then its output head, then the whole model (outermost): (hook, argument, module).
    for hook, argument, module_of in (
        ("trl_ext_make_packed_forward", "backbone", _backbone),
        ("trl_ext_make_head_forward", "head", output_head_module),
        ("trl_ext_make_model_forward", "model", lambda m: m),
    ):
        for role, model in ctx.models().items():
            module = module_of(model)
            if module is None:
                continue
            forward = ctx.call_math(hook, trainer=trainer, context=ctx, role=role, **{argument: module})
            if forward is not None:
                ctx.patcher.setattr(module, "forward", forward)
    ctx.hook.trl_ext_trainer_models_ready(trainer=trainer, context=ctx)


def _backbone(model: Any) -> Any:
    backbone = getattr(model, "base_model", None)
    return None if backbone is model else backbone


def hide_ignored_flags(ctx: TrainerContext, trl_args: Any) -> tuple[dict[str, Any], list[str]]:
    """Hide the TRL flags a plugin serves from TRL; return them, and notes on those left to TRL."""
    trainer_class, catalog = ctx.trainer_class, ctx.plugin_manager.catalog
    owners = {spec.trl_flag: name for name, spec in catalog.specs.items() if spec.trl_flag}
    # A flag TRL used to ignore but now honours (e.g. a patched TRL) must not be claimed by both.
    ignored_now = set(_compat.trl_ignored_flags(trainer_class))
    honoured = set(_compat.TRL_IGNORED_FLAGS.get(trainer_class, ())) - ignored_now
    left = []
    for flag in sorted(honoured):
        owner = owners.get(flag)
        if owner is None or trl_args is None or not getattr(trl_args, flag, False):
            continue
        if owner in ctx.enabled:
            raise UsageError(
                f"Both TRL's own `{flag}=True` (this TRL implements it) and the trl-ext plugin `{owner}` are on "
                f"for this {trainer_class}. Use one: unset `{flag}` in the TRL config, or in trl-ext's flags."
            )
        flags = " / ".join(f"`{f}`" for f in catalog.specs[owner].flag_names) or f"`{owner}`"
        left.append(
            f"{type(trl_args).__name__}.{flag}=True is left to TRL (this TRL implements it); trl-ext's {flags} "
            "would serve it instead"
        )
    hidden = {}
    for flag in _compat.trl_ignored_flags(trainer_class):
        owner = owners.get(flag)
        if trl_args is not None and getattr(trl_args, flag, False) and owner in ctx.enabled:
            hidden[flag] = getattr(trl_args, flag)
            setattr(trl_args, flag, False)
            logger.info("trl-ext: `%s=True` in the TRL config is handled by the trl-ext plugin `%s`", flag, owner)
    return hidden, left


def announce(ctx: TrainerContext, left: list[str]) -> None:
    """The per-trainer lines, on the main process: the plugins and their choices, and what does not apply."""
    trainer = ctx.trainer
    if not is_main_process(getattr(trainer, "accelerator", None)):
        return
    name = type(trainer).__name__
    pm, config = ctx.plugin_manager, ctx.config
    specs = pm.catalog.specs
    if ctx.enabled or left:
        parts = []
        for plugin in ctx.enabled:
            others = {p for n, p in pm.list_name_plugin() if n != plugin}
            texts = pm.subset_hook_caller("trl_ext_describe", remove_plugins=others)(trainer=trainer, context=ctx)
            parts.append(f"{plugin} ({'; '.join(texts)})" if texts else plugin)
        line = f"trl-ext: {name} gets plugins {', '.join(parts)}" if parts else f"trl-ext: {name} gets no plugins"
        _, superseded = enabled_plugins(config, ctx.trainer_class, ctx.trl_args)
        left = [*(f"{n} is left out: {by} serves the same role" for n, by in superseded.items()), *left]
        logger.log(NOTICE, "; ".join([line, *left]))
    stray = []
    for plugin, spec in specs.items():
        if spec.flags and not spec.applies_to(ctx.trainer_class) and config.flag_is_set(plugin):
            flags = " / ".join(f"`{f.name}`" for f in spec.flags if config.flags[f.name] != f.default)
            stray.append(f"{flags} is set, but the plugin `{plugin}` applies only to {', '.join(spec.trainers or ())}")
    if stray:
        logger.log(NOTICE, "trl-ext: %s; this %s runs without it", "; ".join(stray), name)
    # Plugins that apply to this trainer but are off may point at a TRL setting they would serve better.
    skip = {p for n, p in pm.list_name_plugin() if n in ctx.enabled or n not in specs}
    skip |= {pm.get_plugin(n) for n, spec in specs.items() if not spec.applies_to(ctx.trainer_class)}
    caller = pm.subset_hook_caller("trl_ext_advise_unused", remove_plugins=skip)
    for advice in caller(trainer=trainer, trainer_class=ctx.trainer_class, trl_args=ctx.trl_args):
        logger.warning("trl-ext: %s", advice)


def enabled_plugins(config: TrlExtConfig, trainer_class: str, trl_args: Any) -> tuple[list[str], dict[str, str]]:
    """The plugins a `trainer_class` built with `trl_args` gets under `config`, and `{left out: kept instead}` by role
    (`Installation.enabled_plugins`)."""
    ignored = _compat.trl_ignored_flags(trainer_class)
    enabled = []
    for name, spec in config.catalog.specs.items():
        if not spec.applies_to(trainer_class):
            continue
        on = config.flag_is_set(name) if spec.flags else name in config.plugins
        trl_flag = spec.trl_flag
        on = on or (trl_flag is not None and trl_flag in ignored and bool(getattr(trl_args, trl_flag, False)))
        if on:
            enabled.append(name)
    return resolve_roles(config.catalog.specs, enabled)


def check_trainer_settings(config: TrlExtConfig, trainer_class: str, trl_args: Any) -> list[str]:
    """The plugins a `trainer_class` built with `trl_args` gets under `config`, once what would otherwise be silently
    ignored is refused (`UsageError`): a plugin flag given off while the TRL config sets the TRL flag it serves (and
    the installed TRL ignores: one of the two would be silently overridden), and options for a plugin a TRL flag could
    enable that this trainer does not get. `trl-ext dpo` calls it before any model loads."""
    ignored = _compat.trl_ignored_flags(trainer_class)
    for name, spec in config.catalog.specs.items():
        trl_flag = spec.trl_flag
        if trl_flag is None or trl_flag not in ignored or not spec.applies_to(trainer_class):
            continue
        off = [f.name for f in spec.flags if f.name in config.given and config.flags[f.name] == f.default]
        if not off or config.flag_is_set(name) or not getattr(trl_args, trl_flag, False):
            continue
        flag, given = off[0], config.flags[off[0]]
        value = str(given).lower() if isinstance(given, bool) else repr(given)
        trl_config = type(trl_args).__name__
        raise UsageError(
            f"`{flag}={value}` (from {config.given[flag]}) contradicts `{trl_flag}=True` in the {trl_config}: the "
            f"installed TRL ignores that flag for {trainer_class} and trl-ext serves it with the plugin `{name}`, "
            f"so one of the two would silently win. To train with `{name}`, remove `{flag}={value}`; to train "
            f"without it, set `{trl_flag}=False` in the {trl_config} (`--{trl_flag} false`)."
        )
    enabled = enabled_plugins(config, trainer_class, trl_args)[0]
    for name in config.plugins:
        spec = config.catalog.specs[name]
        if spec.flags and spec.trl_flag and spec.applies_to(trainer_class) and name not in enabled:
            trl_config_name = type(trl_args).__name__ if trl_args is not None else None
            raise UsageError(config.unused_options_message(name, trainer_class, trl_config_name))
    return enabled


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
