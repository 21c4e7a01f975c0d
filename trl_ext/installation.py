"""`trl_ext.install()`: attach the enabled plugins to every stock TRL trainer constructed while installed."""

from __future__ import annotations

import functools
import inspect
import os
import weakref
from collections.abc import Mapping
from typing import Any

from . import _compat
from ._logging import get_logger
from .config import TrlExtConfig, load_config
from .context import TrainerContext
from .errors import UsageError
from .manager import TrlExtPluginManager, make_plugin_manager
from .patching import Patcher, resolve

__all__ = ["Installation", "install"]

logger = get_logger(__name__)

_ATTR = "_trl_ext"  # the attribute that holds a trainer's TrainerContext


class Installation:
    """An active trl-ext installation. Use it as a context manager, or call `uninstall()` when done.

    Attributes:
        config (`TrlExtConfig`): the merged configuration.
        plugin_manager (`pluggy.PluginManager`): the registered plugins (built-in and third-party).
        trl_version (`str`): the TRL version the patches were applied to.
    """

    _active: Installation | None = None

    def __init__(self, config: TrlExtConfig, plugin_manager: TrlExtPluginManager, trl_version: str) -> None:
        self.config = config
        self.plugin_manager = plugin_manager
        self.trl_version = trl_version
        self.patcher = Patcher("trl-ext")
        self._contexts: list[weakref.ref] = []
        self._installed = False
        #: `{TRL config field: plugin}` for the TRL flags that plugins serve (`PluginSpec.trl_flag`).
        self._owners = plugin_manager.catalog.trl_flag_owners()
        #: Keep every trainer context (and so its plugins' state) after the trainer is gone, for `records`. Off by
        #: default because plugin state may reference models; the `trl-ext dpo` job turns it on.
        self.keep_records = False
        self._kept: list[TrainerContext] = []

    # ------------------------------------------------------------------------------------------------------------
    # public API
    # ------------------------------------------------------------------------------------------------------------

    @property
    def installed(self) -> bool:
        return self._installed

    def enabled_plugins(self, trainer_class: str, trl_args: Any = None) -> list[str]:
        """The plugins that a `trainer_class` trainer built with `trl_args` gets, in registration order.

        A plugin is enabled when it applies to the trainer (`PluginSpec.trainers`) and one of its flags is set, or,
        for a plugin without flags, when it is named under `plugins:`, or when the trainer's TRL config sets the TRL
        flag it serves (`PluginSpec.trl_flag`) and the installed TRL ignores that flag.
        """
        ignored = _compat.trl_ignored_flags(trainer_class)
        enabled = []
        for name, spec in self.plugin_manager.catalog.specs.items():
            if not spec.applies_to(trainer_class):
                continue
            on = self.config.flag_is_set(name) if spec.flags else name in self.config.plugins
            trl_flag = spec.trl_flag
            on = on or (trl_flag is not None and trl_flag in ignored and bool(getattr(trl_args, trl_flag, False)))
            if on:
                enabled.append(name)
        return enabled

    def contexts(self) -> list[TrainerContext]:
        """Contexts of the live trainers this installation attached to."""
        out = []
        for ref in self._contexts:
            trainer = ref()
            ctx = trainer.__dict__.get(_ATTR) if trainer is not None else None
            if ctx is not None and ctx.installation is self:
                out.append(ctx)
        return out

    @property
    def records(self) -> list[dict[str, Any]]:
        """With `keep_records`, one entry per trainer: its class, its plugins, and each plugin state's `summary()`."""
        out = []
        for ctx in self._kept:
            summaries = {
                name: state.summary() for name, state in ctx.state.items() if callable(getattr(state, "summary", None))
            }
            out.append({"trainer": ctx.trainer_class, "plugins": list(ctx.enabled), "summaries": summaries})
        return out

    def uninstall(self) -> None:
        """Undo every change trl-ext made to TRL and to the trainers it attached to. A second call does nothing."""
        if not self._installed:
            return
        self._installed = False
        try:
            self.plugin_manager.hook.trl_ext_uninstall(installation=self)
        finally:
            for ctx in reversed(self.contexts()):
                ctx.patcher.undo()
                trainer = ctx.trainer
                if trainer is not None:
                    trainer.__dict__.pop(_ATTR, None)
            self._contexts.clear()
            self.patcher.undo()
            if Installation._active is self:
                Installation._active = None
            logger.info("trl-ext uninstalled; TRL is stock again")

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        state = "installed" if self._installed else "uninstalled"
        return f"<trl_ext.Installation {state} plugins={[n for n, _ in self.plugin_manager.list_name_plugin()]}>"

    # ------------------------------------------------------------------------------------------------------------
    # patching
    # ------------------------------------------------------------------------------------------------------------

    def _apply(self) -> None:
        """Patch TRL. Class patches only: instance patches come per trainer, through each trainer's own stack."""
        for trainer_class, (module_name, class_name) in _compat.TRAINERS.items():
            cls = resolve(f"{module_name}.{class_name}")
            self.patcher.wrap(cls, "__init__", functools.partial(self._wrap_init, trainer_class))
            self.patcher.wrap(cls, "log", self._wrap_log)
            if trainer_class == "DPOTrainer":
                self.patcher.wrap(cls, _compat.DPO_PRECOMPUTE_METHOD, self._wrap_precompute)
        for module_name in _compat.GENERATION_HELPER_MODULES.values():
            module = resolve(module_name)
            self.patcher.wrap(module, "unwrap_model_for_generation", self._wrap_unwrap_for_generation)
        self._installed = True

    def _context_of(self, trainer: Any) -> TrainerContext | None:
        ctx = trainer.__dict__.get(_ATTR)
        return ctx if ctx is not None and ctx.installation is self and self._installed else None

    def _wrap_init(self, trainer_class: str, original):
        installation = self
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(trainer, *args, **kwargs):
            if not installation._installed or _ATTR in trainer.__dict__:
                return original(trainer, *args, **kwargs)
            bound = signature.bind(trainer, *args, **kwargs)
            init_kwargs = dict(bound.arguments)
            init_kwargs.pop(next(iter(signature.parameters)))  # self
            trl_args = init_kwargs.get("args")
            enabled = installation.enabled_plugins(trainer_class, trl_args)
            ctx = TrainerContext(installation, trainer, trainer_class, enabled, trl_args)
            trainer.__dict__[_ATTR] = ctx
            installation._contexts.append(weakref.ref(trainer))
            if installation.keep_records:
                installation._kept.append(ctx)
            if enabled:
                logger.info("trl-ext: %s gets plugins %s", type(trainer).__name__, ", ".join(enabled))
            ctx.hook.trl_ext_trainer_init_start(trainer=trainer, context=ctx, init_kwargs=init_kwargs)
            # A TRL flag that TRL ignores but a trl-ext plugin implements is hidden from TRL while its `__init__` runs
            # (so TRL neither warns that it falls back nor acts on it), then restored on the user's config object.
            hidden = installation._hide_ignored_flags(trainer_class, init_kwargs.get("args"), ctx)
            try:
                original(trainer, **init_kwargs)
            finally:
                for flag, value in hidden.items():
                    setattr(init_kwargs["args"], flag, value)
            ctx.prepare_models()
            ctx.hook.trl_ext_trainer_init_end(trainer=trainer, context=ctx)

        return __init__

    def _hide_ignored_flags(self, trainer_class: str, trl_args: Any, ctx: TrainerContext) -> dict[str, Any]:
        # A flag TRL used to ignore but now honours (e.g. a patched TRL) must not be claimed by both.
        ignored_now = set(_compat.trl_ignored_flags(trainer_class))
        honoured = set(_compat.TRL_IGNORED_FLAGS.get(trainer_class, ())) - ignored_now
        for flag in honoured:
            owner = self._owners.get(flag)
            if trl_args is not None and getattr(trl_args, flag, False) and owner in ctx.enabled:
                raise UsageError(
                    f"Both TRL's own `{flag}=True` (this TRL implements it) and the trl-ext plugin `{owner}` are on "
                    f"for this {trainer_class}. Use one: unset `{flag}` in the TRL config, or in trl-ext's flags."
                )
        hidden = {}
        for flag in _compat.trl_ignored_flags(trainer_class):
            owner = self._owners.get(flag)
            if trl_args is not None and getattr(trl_args, flag, False) and owner in ctx.enabled:
                hidden[flag] = getattr(trl_args, flag)
                setattr(trl_args, flag, False)
                logger.info("trl-ext: `%s=True` in the TRL config is handled by the trl-ext plugin `%s`", flag, owner)
        return hidden

    def _wrap_precompute(self, original):
        installation = self

        @functools.wraps(original)
        def _precompute_ref_logps(trainer, dataset, name, batch_size):
            ctx = installation._context_of(trainer)
            if ctx is None:
                return original(trainer, dataset, name, batch_size)
            ctx.prepare_models()
            result = ctx.call_exclusive(
                "trl_ext_make_ref_precompute",
                trainer=trainer,
                context=ctx,
                dataset=dataset,
                name=name,
                batch_size=batch_size,
            )
            return original(trainer, dataset, name, batch_size) if result is None else result

        return _precompute_ref_logps

    def _wrap_log(self, original):
        installation = self

        @functools.wraps(original)
        def log(trainer, logs, *args, **kwargs):
            ctx = installation._context_of(trainer)
            if ctx is not None:
                result = ctx.call_exclusive("trl_ext_reduce_metrics", trainer=trainer, context=ctx, logs=logs)
                if result is not None:
                    # The plugin's values replace TRL's buffered ones for this window (DPOTrainer keeps them in
                    # `_metrics[mode]` and would otherwise merge its own local averages in).
                    buffers = getattr(trainer, "_metrics", None)
                    if isinstance(buffers, Mapping):
                        buffers["train" if trainer.model.training else "eval"].clear()
                    logs.clear()
                    logs.update(result)
            return original(trainer, logs, *args, **kwargs)

        return log

    def _wrap_unwrap_for_generation(self, original):
        installation = self

        @functools.wraps(original)
        def unwrap_model_for_generation(model, accelerator, *args, **kwargs):
            ctx = next(
                (c for c in installation.contexts() if getattr(c.trainer, "accelerator", None) is accelerator), None
            )
            if ctx is not None and installation._installed:
                bound = inspect.signature(original).bind(model, accelerator, *args, **kwargs)
                bound.apply_defaults()
                call_kwargs = {k: v for k, v in bound.arguments.items() if k != "model"}
                manager = ctx.call_exclusive(
                    "trl_ext_make_generation_context",
                    trainer=ctx.trainer,
                    context=ctx,
                    model=model,
                    call_kwargs=call_kwargs,
                )
                if manager is not None:
                    return manager
            return original(model, accelerator, *args, **kwargs)

        return unwrap_model_for_generation


def install(
    config: TrlExtConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None, **flags: Any
) -> Installation:
    """Attach trl-ext's plugins to every stock `DPOTrainer` / `OnlineDPOTrainer` constructed from now on.

    Args:
        config (`TrlExtConfig`, mapping, or path of a YAML file, *optional*):
            Base configuration. When `None`, the YAML file named by `$TRL_EXT_CONFIG` is read, if set.
        **flags:
            `TrlExtConfig` fields; they override `TRL_EXT_*` environment variables, which override `config`.

    Returns:
        `Installation`: a context manager; `uninstall()` restores TRL exactly.

    Raises:
        `trl_ext.UsageError`: unknown flag or option, bad value, unsupported TRL, a blocked or missing plugin that a
            flag needs, a combination a plugin cannot run correctly, or trl-ext already installed.

    Example:
    ```python
    import trl_ext
    from trl import DPOConfig, DPOTrainer

    with trl_ext.install(padding_free=True):
        trainer = DPOTrainer(model, args=DPOConfig(...), train_dataset=ds, processing_class=tok)
        trainer.train()
    ```
    """
    merged = load_config(config, flags)
    trl_version = _compat.check_trl_version()
    if Installation._active is not None and Installation._active.installed:
        raise UsageError(
            "trl-ext is already installed in this process. Call `uninstall()` on the existing installation (or leave "
            "its `with` block) before installing again with other flags."
        )
    pm = make_plugin_manager(merged.block)
    merged.check_options_apply()
    pm.hook.trl_ext_validate_config(config=merged, trl_version=trl_version)
    installation = Installation(merged, pm, trl_version)
    try:
        installation._apply()
    except BaseException:
        installation.patcher.undo()
        raise
    Installation._active = installation
    logger.info("trl-ext installed on trl %s with %s", trl_version, merged)
    return installation
