"""`trl_ext.install()`: attach the enabled plugins to every stock TRL trainer constructed while installed."""

from __future__ import annotations

import functools
import inspect
import os
import weakref
from collections.abc import Mapping
from typing import Any

from . import _compat, attach, calls, verify
from ._logging import NOTICE, get_logger, is_main_process
from .config import TrlExtConfig, load_config
from .context import _LIVE, TrainerContext
from .errors import UsageError
from .manager import TrlExtPluginManager, make_plugin_manager, resolve_roles
from .patching import Patcher, resolve

__all__ = ["Installation", "check_trainer_settings", "current", "install", "install_config"]

logger = get_logger(__name__)

_ATTR = "_trl_ext"  # the attribute that holds a trainer's TrainerContext


class Installation:
    """An active trl-ext installation. Use it as a context manager, or call `uninstall()` when done.

    Lifecycle: while installed, every stock trainer constructed gets its plugins. Everything a trainer needs later
    lives on the trainer itself (instance attributes of the trainer, its models and its collator, through the
    trainer's own undo stack), so a trainer keeps its plugins for `train()`, `evaluate()`, `predict()` and a resumed
    `train(resume_from_checkpoint=...)` whenever they are called, also after `uninstall()` and under a later
    installation. `uninstall()` makes TRL's classes and modules stock again (new trainers are stock) and leaves live
    trainers as they are; `detach(trainer)` (or `uninstall(detach=True)`) makes a trainer and its models stock.

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

    def enabled_plugins(self, trainer: str | type | Any, trl_args: Any = None) -> list[str]:
        """The plugins that a trainer gets, in registration order.

        A plugin is enabled when it applies to the trainer (`PluginSpec.trainers`) and one of its flags is set, or,
        for a plugin without flags, when it is named under `plugins:`, or when the trainer's TRL config sets the TRL
        flag it serves (`PluginSpec.trl_flag`) and the installed TRL ignores that flag. Of the enabled plugins that
        serve one role (`PluginSpec.serves`), only the one of highest precedence is kept.

        Args:
            trainer (`str`, `type` or trainer instance):
                A stock trainer class name (`"DPOTrainer"`), a trainer class (stock or derived from one), or a trainer.
                For a class or name, the plugins a trainer built now would get; for a trainer instance, the plugins
                it actually runs (`[]` for a trainer built before `install()`, or detached: it is stock).
            trl_args (TRL config, *optional*):
                The trainer's TRL config, for the TRL flags plugins serve. With an instance, asks what a trainer of
                that class built now with `trl_args` would get.

        Raises:
            `TypeError`: `trainer` is none of these. `trl_ext.UsageError`: not a trainer trl-ext attaches to.
        """
        trainer_class = attach.stock_trainer_class(trainer)
        if not isinstance(trainer, (str, type)) and trl_args is None:
            # An instance runs what was attached when it was built: nothing if it was built before `install()` (or
            # detached), whatever this installation would give a new trainer.
            ctx = getattr(trainer, "__dict__", {}).get(_ATTR)
            return list(ctx.enabled) if ctx is not None and ctx.attached else []
        return self._enabled(trainer_class, trl_args)[0]

    def _enabled(self, trainer_class: str, trl_args: Any) -> tuple[list[str], dict[str, str]]:
        """The plugins a `trainer_class` built with `trl_args` gets, and `{left out: kept instead}` by role."""
        return _enabled(self.config, trainer_class, trl_args)

    def _wrapped_trainers(self) -> list[str]:
        """The stock trainer classes to attach to: those that a registered plugin applies to and that the
        configuration enables (or that a TRL flag it serves could enable per trainer), and those a registered plugin
        that is off may advise about (`trl_ext_advise_unused`: a TRL setting it would serve better)."""
        pm = self.plugin_manager
        advising = {impl.plugin_name for impl in pm.hook.trl_ext_advise_unused.get_hookimpls()}
        out: list[str] = []
        for name, spec in pm.catalog.specs.items():
            on = self.config.flag_is_set(name) if spec.flags else name in self.config.plugins
            if on or spec.trl_flag is not None or name in advising:
                out.extend(t for t in spec.trainers or _compat.TRAINERS if t in _compat.TRAINERS and t not in out)
        return [t for t in _compat.TRAINERS if t in out]

    def contexts(self) -> list[TrainerContext]:
        """Contexts of the live trainers this installation attached to (and that were not detached)."""
        out = []
        for ref in self._contexts:
            trainer = ref()
            ctx = trainer.__dict__.get(_ATTR) if trainer is not None else None
            if ctx is not None and ctx.installation is self and ctx.attached:
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

    def detach(self, trainer: Any = None) -> None:
        """Make `trainer` (default: every live trainer this installation attached to) and its models stock again.

        Undoes every change trl-ext made to the trainer, its models and its collator; it then trains as stock TRL.
        Detaching a trainer twice, or one trl-ext never attached to, does nothing.
        """
        if trainer is None:
            for ctx in reversed(self.contexts()):
                ctx.detach()
            return
        ctx = trainer.__dict__.get(_ATTR)
        if ctx is not None and ctx.installation is self:
            ctx.detach()

    def uninstall(self, *, detach: bool = False) -> None:
        """Make TRL's classes and modules stock again: trainers constructed from now on get no plugins.

        Trainers constructed while installed keep their plugins (for `train()`, `evaluate()`, `predict()`, resuming)
        until they are garbage-collected or detached; `detach=True` detaches them all now (see `detach`). A second
        call does nothing.
        """
        if not self._installed:
            if detach:
                self.detach()
            return
        self._installed = False
        try:
            self.plugin_manager.hook.trl_ext_uninstall(installation=self)
        finally:
            if detach:
                self.detach()
            self.patcher.undo()
            if Installation._active is self:
                Installation._active = None
            live = [ctx for ctx in self.contexts() if ctx.enabled]
            if live and is_main_process():
                logger.log(
                    NOTICE,
                    "trl-ext uninstalled: TRL is stock again for new trainers; %d trainer(s) built under it keep "
                    "their plugins until garbage-collected or `installation.detach(trainer)`",
                    len(live),
                )
            else:
                logger.info("trl-ext uninstalled: TRL is stock again")

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        state = "installed" if self._installed else "uninstalled"
        return f"<trl_ext.Installation {state} plugins={[n for n, _ in self.plugin_manager.list_name_plugin()]}>"

    # ------------------------------------------------------------------------------------------------------------
    # patching: TRL's classes only get an `__init__` wrapper; everything else is per trainer
    # ------------------------------------------------------------------------------------------------------------

    def _apply(self) -> None:
        """Patch TRL: the `__init__` of each stock trainer class, nothing else (the rest is per trainer)."""
        wrapped = self._wrapped_trainers()
        for trainer_class in wrapped:
            module_name, class_name = _compat.TRAINERS[trainer_class]
            cls = resolve(f"{module_name}.{class_name}")
            self.patcher.wrap(cls, "__init__", functools.partial(self._wrap_init, trainer_class))
            if trainer_class == "DPOTrainer":
                resolve(f"{module_name}.{class_name}.{_compat.DPO_PRECOMPUTE_METHOD}")  # fail now if TRL renamed it
        for trainer_class, module_name in _compat.GENERATION_HELPER_MODULES.items():
            if trainer_class not in wrapped:
                continue
            # While installed, the name serves every attached trainer (also when called from outside its methods);
            # after `uninstall()` each trainer swaps it in only while it runs (`attach.attach_before_init`).
            self.patcher.wrap(resolve(module_name), "unwrap_model_for_generation", attach.generation_wrapper(None))
        self._installed = True

    def _wrap_init(self, trainer_class: str, original):
        installation = self
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(trainer, *args, **kwargs):
            if not installation._installed or _ATTR in trainer.__dict__:
                return original(trainer, *args, **kwargs)
            try:
                bound = signature.bind(trainer, *args, **kwargs)
            except TypeError:
                bound = None
            if bound is None:
                # The call does not match TRL's signature: let TRL raise its own error, word for word.
                return attach.call_for_trl_error(original, trainer_class, trainer, args, kwargs)
            init_kwargs = dict(bound.arguments)
            init_kwargs.pop(next(iter(signature.parameters)))  # self
            trl_args = init_kwargs.get("args")
            enabled = check_trainer_settings(installation.config, trainer_class, trl_args)
            if enabled:
                attach.check_world(trainer_class, trl_args, enabled)
            ctx = TrainerContext(installation, trainer, trainer_class, enabled, trl_args)
            trainer.__dict__[_ATTR] = ctx
            _LIVE.add(trainer)
            installation._contexts.append(weakref.ref(trainer))
            if installation.keep_records:
                installation._kept.append(ctx)
            try:
                left = installation._build(ctx, original, init_kwargs)
            except BaseException:
                ctx.detach()  # a trainer TRL (or a plugin) refused to build holds nothing
                raise
            installation._announce(ctx, left)

        return __init__

    def _build(self, ctx: TrainerContext, original, init_kwargs: dict[str, Any]) -> list[str]:
        trainer, enabled = ctx.trainer, ctx.enabled
        ctx.hook.trl_ext_trainer_init_start(trainer=trainer, context=ctx, init_kwargs=init_kwargs)
        # A TRL flag that TRL ignores but a trl-ext plugin implements is hidden from TRL while its `__init__` runs
        # (so TRL neither warns that it falls back nor acts on it), then restored on the user's config object.
        hidden, left = self._hide_ignored_flags(ctx.trainer_class, init_kwargs.get("args"), ctx)
        if enabled:
            calls.attach(ctx, init=True)
            attach.attach_before_init(ctx)
        try:
            with ctx.running():
                original(trainer, **init_kwargs)
        finally:
            for flag, value in hidden.items():
                setattr(init_kwargs["args"], flag, value)
        ctx.prepare_models()
        if enabled:
            attach.attach_after_init(ctx)
            verify.attach(ctx)
            calls.attach(ctx, init=False)
        ctx.hook.trl_ext_trainer_init_end(trainer=trainer, context=ctx)
        return left

    def _hide_ignored_flags(
        self, trainer_class: str, trl_args: Any, ctx: TrainerContext
    ) -> tuple[dict[str, Any], list[str]]:
        """Hide the TRL flags a plugin serves from TRL; return them, and notes on those left to TRL."""
        # A flag TRL used to ignore but now honours (e.g. a patched TRL) must not be claimed by both.
        ignored_now = set(_compat.trl_ignored_flags(trainer_class))
        honoured = set(_compat.TRL_IGNORED_FLAGS.get(trainer_class, ())) - ignored_now
        left = []
        for flag in sorted(honoured):
            owner = self._owners.get(flag)
            if owner is None or trl_args is None or not getattr(trl_args, flag, False):
                continue
            if owner in ctx.enabled:
                raise UsageError(
                    f"Both TRL's own `{flag}=True` (this TRL implements it) and the trl-ext plugin `{owner}` are on "
                    f"for this {trainer_class}. Use one: unset `{flag}` in the TRL config, or in trl-ext's flags."
                )
            flags = " / ".join(f"`{f}`" for f in self.plugin_manager.catalog.specs[owner].flag_names) or f"`{owner}`"
            left.append(
                f"{type(trl_args).__name__}.{flag}=True is left to TRL (this TRL implements it); trl-ext's {flags} "
                "would serve it instead"
            )
        hidden = {}
        for flag in _compat.trl_ignored_flags(trainer_class):
            owner = self._owners.get(flag)
            if trl_args is not None and getattr(trl_args, flag, False) and owner in ctx.enabled:
                hidden[flag] = getattr(trl_args, flag)
                setattr(trl_args, flag, False)
                logger.info("trl-ext: `%s=True` in the TRL config is handled by the trl-ext plugin `%s`", flag, owner)
        return hidden, left

    def _announce(self, ctx: TrainerContext, left: list[str]) -> None:
        """The per-trainer lines, on the main process: the plugins and their choices, and what does not apply."""
        trainer = ctx.trainer
        if not is_main_process(getattr(trainer, "accelerator", None)):
            return
        name = type(trainer).__name__
        pm = self.plugin_manager
        specs = pm.catalog.specs
        if ctx.enabled or left:
            parts = []
            for plugin in ctx.enabled:
                others = {p for n, p in pm.list_name_plugin() if n != plugin}
                texts = pm.subset_hook_caller("trl_ext_describe", remove_plugins=others)(trainer=trainer, context=ctx)
                parts.append(f"{plugin} ({'; '.join(texts)})" if texts else plugin)
            line = f"trl-ext: {name} gets plugins {', '.join(parts)}" if parts else f"trl-ext: {name} gets no plugins"
            _, superseded = self._enabled(ctx.trainer_class, ctx.trl_args)
            left = [*(f"{n} is left out: {by} serves the same role" for n, by in superseded.items()), *left]
            logger.log(NOTICE, "; ".join([line, *left]))
        stray = []
        for plugin, spec in specs.items():
            if spec.flags and not spec.applies_to(ctx.trainer_class) and self.config.flag_is_set(plugin):
                flags = " / ".join(f"`{f.name}`" for f in spec.flags if self.config.flags[f.name] != f.default)
                stray.append(
                    f"{flags} is set, but the plugin `{plugin}` applies only to {', '.join(spec.trainers or ())}"
                )
        if stray:
            logger.log(NOTICE, "trl-ext: %s; this %s runs without it", "; ".join(stray), name)
        # Plugins that apply to this trainer but are off may point at a TRL setting they would serve better.
        skip = {p for n, p in pm.list_name_plugin() if n in ctx.enabled or n not in specs}
        skip |= {pm.get_plugin(n) for n, spec in specs.items() if not spec.applies_to(ctx.trainer_class)}
        caller = pm.subset_hook_caller("trl_ext_advise_unused", remove_plugins=skip)
        for advice in caller(trainer=trainer, trainer_class=ctx.trainer_class, trl_args=ctx.trl_args):
            logger.warning("trl-ext: %s", advice)


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
        `Installation`: a context manager; `uninstall()` restores TRL exactly. Calling `install()` again with the same
        resulting configuration while installed returns the active installation (re-running a notebook cell is
        harmless); `trl_ext.current()` returns it too.

    Raises:
        `trl_ext.UsageError`: unknown flag or option, bad value, unsupported TRL, a blocked or missing plugin that a
            flag needs, a combination a plugin cannot run correctly, or trl-ext already installed with another
            configuration.

    Example:
    ```python
    import trl_ext
    from trl import DPOConfig, DPOTrainer

    with trl_ext.install(padding_free=True):
        trainer = DPOTrainer(model, args=DPOConfig(...), train_dataset=ds, processing_class=tok)
        trainer.train()
    ```
    """
    return install_config(load_config(config, flags))


def install_config(config: TrlExtConfig) -> Installation:
    """Install exactly `config`, an already merged configuration: no environment variable or file is read.

    The command line (`trl-ext dpo`) merges its sources itself (command line > `TRL_EXT_*` environment > recipe) and
    installs the result with this function. Same return value and errors as `install()`.
    """
    trl_version = _compat.check_trl_version()
    active = current()
    if active is not None:
        if active.config == config:
            logger.info("trl-ext is already installed with the same configuration; returning that installation")
            return active
        raise UsageError(
            f"trl-ext is already installed in this process with {active.config}; this call asks for {config}. "
            "Uninstall it first: `trl_ext.current().uninstall()` (or leave its `with` block), then install again."
        )
    pm = make_plugin_manager(catalog=config.catalog)
    config.check_options_apply()
    pm.hook.trl_ext_validate_config(config=config, trl_version=trl_version)
    installation = Installation(config, pm, trl_version)
    try:
        installation._apply()
    except BaseException:
        installation.patcher.undo()
        raise
    Installation._active = installation
    logger.info("trl-ext installed on trl %s with %s", trl_version, config)
    return installation


def _enabled(config: TrlExtConfig, trainer_class: str, trl_args: Any) -> tuple[list[str], dict[str, str]]:
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
    """The plugins a `trainer_class` built with `trl_args` (its TRL config) gets under `config`, once what would
    otherwise be silently ignored is refused: a plugin flag given off while the TRL config sets the TRL flag that
    plugin serves (`TrlExtConfig.check_trl_flags`), and options for a plugin that a TRL flag could enable but that
    this trainer does not get (checked at install time for the others). `trl-ext dpo` / `online-dpo` call it
    before any model loads, every trainer built while installed when it is built.

    Raises:
        `trl_ext.UsageError`: naming the setting and what to do.
    """
    config.check_trl_flags(trainer_class, trl_args)
    enabled = _enabled(config, trainer_class, trl_args)[0]
    for name in config.plugins:
        spec = config.catalog.specs[name]
        if spec.flags and spec.trl_flag and spec.applies_to(trainer_class) and name not in enabled:
            trl_config = type(trl_args).__name__ if trl_args is not None else None
            raise UsageError(config.unused_options_message(name, trainer_class, trl_config))
    return enabled


def current() -> Installation | None:
    """The active installation (the one `install()` returned and that is not uninstalled), or None."""
    active = Installation._active
    return active if active is not None and active.installed else None
