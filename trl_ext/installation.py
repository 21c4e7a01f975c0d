"""`trl_ext.install()`: attach the enabled plugins to every stock TRL trainer constructed while installed."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping
from typing import Any

from . import _compat, build
from ._logging import NOTICE, get_logger, is_main_process
from .config import TrlExtConfig, load_config
from .context import ATTR, TrainerContext, live_contexts, release_unheld
from .errors import UsageError
from .manager import TrlExtPluginManager, make_plugin_manager
from .patching import Patcher, resolve

__all__ = ["Installation", "current", "install", "install_config"]

logger = get_logger(__name__)


class Installation:
    """An active trl-ext installation; a context manager (`uninstall()` at the end of the block).

    While installed, every stock trainer constructed gets its plugins, attached to the trainer itself, so it keeps
    them for its whole life, also after `uninstall()` (docs/lifecycle.md). `uninstall()` makes TRL stock again for new
    trainers; `detach(trainer)` makes a trainer and its models stock.
    """

    _active: Installation | None = None

    def __init__(self, config: TrlExtConfig, plugin_manager: TrlExtPluginManager, trl_version: str) -> None:
        self.config = config
        self.plugin_manager = plugin_manager
        self.trl_version = trl_version
        self.patcher = Patcher("trl-ext")
        self._installed = False
        #: Keep every trainer context after the trainer is gone, for `records` (plugin state may reference models:
        #: off by default; the `trl-ext dpo` job turns it on).
        self.keep_records = False
        self._kept: list[TrainerContext] = []

    @property
    def installed(self) -> bool:
        return self._installed

    def enabled_plugins(self, trainer: str | type | Any, trl_args: Any = None) -> list[str]:
        """The plugins a trainer gets, in registration order (`build.enabled_plugins` says which).

        `trainer` is a stock trainer class name, a trainer class (or a subclass) or an instance: for a class or name,
        what a trainer built now (with the TRL config `trl_args`) would get; for an instance without `trl_args`, what
        it runs (`[]` if built before `install()` or detached). A `TypeError` for anything else; a `UsageError` for a
        trainer trl-ext does not attach to.
        """
        trainer_class = stock_trainer_class(trainer)
        if not isinstance(trainer, (str, type)) and trl_args is None:
            ctx = getattr(trainer, "__dict__", {}).get(ATTR)
            return list(ctx.enabled) if ctx is not None and ctx.attached else []
        return build.enabled_plugins(self.config, trainer_class, trl_args)[0]

    def _wrapped_trainers(self) -> list[str]:
        """The stock trainer classes that a registered plugin applies to and is enabled for (or could be, by a TRL
        flag it serves), or may advise about (`trl_ext_advise_unused`)."""
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
        return [ctx for ctx in live_contexts() if ctx.installation is self]

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
        """Undo every change made to `trainer` (default: every live trainer this installation attached to), its
        models and its collator: it trains as stock TRL. Detaching twice, or a trainer never attached, does nothing."""
        if trainer is None:
            for ctx in reversed(self.contexts()):
                ctx.detach()
            return
        ctx = trainer.__dict__.get(ATTR)
        if ctx is not None and ctx.installation is self:
            ctx.detach()

    def uninstall(self, *, detach: bool = False) -> None:
        """Make TRL's classes and modules stock again for new trainers. Trainers built while installed keep their
        plugins until garbage-collected or detached (`detach=True` detaches them all now). A second call does nothing.
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
            release_unheld()
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
            # after `uninstall()` each trainer swaps it in only while it runs (`build.build`).
            self.patcher.wrap(resolve(module_name), "unwrap_model_for_generation", build.generation_wrapper(None))
        self._installed = True

    def _wrap_init(self, trainer_class: str, original):
        installation = self
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(trainer, *args, **kwargs):
            if not installation._installed or ATTR in trainer.__dict__:
                return original(trainer, *args, **kwargs)
            try:
                bound = signature.bind(trainer, *args, **kwargs)
            except TypeError:
                bound = None
            if bound is None:
                # The call does not match TRL's signature: let TRL raise its own error, word for word.
                return call_for_trl_error(original, trainer_class, trainer, args, kwargs)
            init_kwargs = dict(bound.arguments)
            init_kwargs.pop(next(iter(signature.parameters)))  # self
            build.build(installation, trainer_class, original, trainer, init_kwargs)

        return __init__


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


def install(
    config: TrlExtConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None, **flags: Any
) -> Installation:
    """Attach trl-ext's plugins to every stock `DPOTrainer` / `OnlineDPOTrainer` constructed from now on.

    `config` (a `TrlExtConfig`, a mapping or a YAML path; default `$TRL_EXT_CONFIG`) is overridden by `TRL_EXT_*`
    variables, overridden by `flags`. Returns the `Installation`, a context manager; while installed, the same
    resulting configuration returns the active one (`trl_ext.current()`), another is a `UsageError`, as is every
    setting trl-ext cannot run correctly. Example: `with trl_ext.install(padding_free=True): DPOTrainer(...).train()`.
    """
    return install_config(load_config(config, flags))


def install_config(config: TrlExtConfig) -> Installation:
    """`install()` of exactly `config`, already merged (no environment variable or file is read): `trl-ext dpo`
    merges its own sources."""
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
    # A `plugins:` entry of a plugin whose flags are off would do nothing (one a TRL flag may enable: per trainer).
    for name in config.plugins:
        spec = config.catalog.specs[name]
        if spec.flags and not config.flag_is_set(name) and not spec.trl_flag:
            raise UsageError(config.unused_options_message(name))
    pm.hook.trl_ext_validate_config(config=config, trl_version=trl_version)
    installation = Installation(config, pm, trl_version)
    with installation.patcher.undone_on_error():
        installation._apply()
    Installation._active = installation
    logger.info("trl-ext installed on trl %s with %s", trl_version, config)
    return installation


def current() -> Installation | None:
    """The active installation (the one `install()` returned and that is not uninstalled), or None."""
    active = Installation._active
    return active if active is not None and active.installed else None
