"""Per-trainer state: which plugins are enabled for one trainer, their state objects, and the trainer's undo stack."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from .errors import UsageError
from .manager import call_exclusive
from .patching import Patcher

if TYPE_CHECKING:  # pragma: no cover
    import pluggy

    from . import hookspecs
    from .config import TrlExtConfig
    from .manager import TrlExtPluginManager

__all__ = ["ATTR", "TrainerContext", "live_contexts", "output_head_module", "release_unheld", "unwrap_causal_lm"]

#: The trainer attribute that holds its `TrainerContext`.
ATTR = "_trl_ext"
#: Every live trainer that trl-ext attached to, whatever installation built it (an uninstalled one's included).
_LIVE: weakref.WeakSet = weakref.WeakSet()
#: `{key: undo stack}` of the process-wide changes that attached trainers hold (`TrainerContext.patch("process")`).
_HELD_PATCHERS: dict[str, Patcher] = {}
#: The scopes of `TrainerContext.patch`, shortest first (the call scope is a local `with Patcher(...)`).
SCOPES = ("run", "trainer", "process")


def live_contexts() -> list[TrainerContext]:
    """The contexts of every live, attached trainer, across installations (oldest first)."""
    contexts = [trainer.__dict__.get(ATTR) for trainer in list(_LIVE)]
    return sorted((ctx for ctx in contexts if ctx is not None and ctx.attached), key=lambda c: c.serial)


def release_unheld() -> None:
    """Undo the process-wide changes (`patch("process", ...)`) that no live, attached trainer holds any more: those of
    a detached trainer, and those a trainer garbage-collected undetached left behind (run on detach and uninstall)."""
    still_held = {key for ctx in live_contexts() for key in ctx.held}
    for key in sorted(set(_HELD_PATCHERS) - still_held):
        _HELD_PATCHERS.pop(key).undo()


class _SubsetHooks:
    """`context.hook.<name>(...)` calls only the plugins enabled for this trainer."""

    def __init__(self, pm: pluggy.PluginManager, disabled: set[Any]) -> None:
        self._pm = pm
        self._disabled = disabled

    def __getattr__(self, name: str) -> pluggy.HookCaller:
        return self._pm.subset_hook_caller(name, remove_plugins=self._disabled)


class TrainerContext:
    """trl-ext's view of one trainer, stored on it as `trainer._trl_ext` (`ATTR`) when made: the installation that
    attached to it (its `config` and `plugin_manager`), the stock `trainer_class`, the `enabled` plugins in
    registration order, their per-trainer `state` by plugin name (never in globals), the trainer's undo stack
    `patcher` (undone by `Installation.detach(trainer)`), and `attached` (False once detached: stock again)."""

    _serial = 0

    def __deepcopy__(self, memo: dict) -> Any:
        # `copy.deepcopy(trainer)`: the plugins' wrappers are bound to this trainer, its models and their state, so a
        # copy would train the original's models or half of its plugins.
        if not self.attached:
            return self  # a detached trainer is stock: its inert record is shared, the rest copies as stock does
        raise UsageError(
            f"copy.deepcopy of a {self.trainer_class} with trl-ext plugins ({', '.join(self.enabled) or 'none'}) is "
            "not supported: their wrappers belong to this trainer and its models. Build the second trainer inside "
            "`trl_ext.install(...)` (it gets its own plugins), or `installation.detach(trainer)` first to copy a "
            "stock trainer."
        )

    def __init__(
        self,
        installation: hookspecs.Installation,
        trainer: Any,
        trainer_class: str,
        enabled: list[str],
        trl_args: Any,
    ) -> None:
        self.installation = installation
        self.config = cast("TrlExtConfig", installation.config)
        self.plugin_manager = cast("TrlExtPluginManager", installation.plugin_manager)
        self._trainer = weakref.ref(trainer)
        self.trainer_class = trainer_class
        self.enabled: tuple[str, ...] = tuple(enabled)
        self.trl_args = trl_args
        self.state: dict[str, Any] = {}
        self.patcher = Patcher(f"trl-ext[{trainer_class}]")
        self.models_ready = False
        self.attached = True
        TrainerContext._serial += 1
        self.serial = TrainerContext._serial
        #: The changes applied only while this trainer runs (`patch("run", apply)`).
        self._run_applies: list[Callable[[Patcher], None]] = []
        self._run_patcher = Patcher(f"trl-ext[{trainer_class}] while running")
        self._run_depth = 0
        self.held: set[str] = set()
        #: What `trl_ext.verify` checks and runs as stock: the plugins whose answers change the log-probs, and the
        #: scoring methods as the trainer held them before any plugin took part in their calls.
        self.math_plugins: list[str] = []
        self.stock_methods: dict[str, Callable[..., Any]] = {}
        #: `{method: plugins}`: the chain of each method wrapped for `trl_ext_call`, outermost first (`trl_ext.calls`).
        self.calls: dict[str, tuple[str, ...]] = {}
        #: `trl_ext.verify.Verify` when verify checks this trainer (its `results`), else None.
        self.verified: Any = None
        disabled = {plugin for name, plugin in self.plugin_manager.list_name_plugin() if name not in self.enabled}
        self.hook = _SubsetHooks(self.plugin_manager, disabled)
        trainer.__dict__[ATTR] = self
        _LIVE.add(trainer)

    @property
    def trainer(self) -> Any:
        return self._trainer()

    def options(self, plugin: str) -> Any:
        """The parsed options of `plugin` (an instance of its declared options dataclass, or None if it has none)."""
        return self.config.options(plugin)

    def is_enabled(self, plugin: str) -> bool:
        return plugin in self.enabled

    def plugins_serving(self, role: str) -> tuple[str, ...]:
        """The registered plugins that declare `role` (`PluginSpec.serves`) and apply to this trainer, enabled or
        not: what a plugin's advice may offer instead of itself, without naming it."""
        specs = self.plugin_manager.catalog.specs
        return tuple(n for n, s in specs.items() if role in s.serves and s.applies_to(self.trainer_class))

    def call_exclusive(self, hook_name: str, **kwargs: Any) -> Any:
        return call_exclusive(getattr(self.hook, hook_name), **kwargs)

    def call_math(self, hook_name: str, **kwargs: Any) -> Any:
        """`call_exclusive` for a hook whose answer changes the math: when answered, its implementers (wrappers
        included) join `math_plugins`."""
        caller = getattr(self.hook, hook_name)
        result = call_exclusive(caller, **kwargs)
        if result is not None:
            for impl in caller.get_hookimpls():
                if impl.plugin_name not in self.math_plugins:
                    self.math_plugins.append(impl.plugin_name)
        return result

    def patch(self, scope: str, apply: Callable[[Patcher], None], *, key: str | None = None) -> None:
        """Make changes through an undo stack of `scope` (docs/lifecycle.md, docs/writing-plugins.md): `apply(patcher)`
        makes them with `patcher.setattr`, `wrap` and `defer`. `"run"`: applied on each entry of TRL's `__init__` and
        every outermost `train()`, `evaluate()`, `predict()`, undone on exit (its wrappers pass other trainers' calls
        through); `"trainer"`: on `patcher`, until detached; `"process"`: shared by the trainers holding `key`, undone
        when no live, attached trainer holds it (`release_unheld`).
        """
        if scope == "trainer":
            apply(self.patcher)
        elif scope == "run":
            self._run_applies.append(apply)
            if self._run_depth:
                apply(self._run_patcher)
        elif scope == "process":
            if not key:
                raise UsageError('`context.patch("process", apply)` needs a `key` naming what the trainers share')
            if key not in _HELD_PATCHERS:
                patcher = Patcher(f"trl-ext[{key}]")
                with patcher.undone_on_error():
                    apply(patcher)
                _HELD_PATCHERS[key] = patcher
            self.held.add(key)
        else:
            raise UsageError(f"`context.patch`: unknown scope {scope!r}; the scopes are {', '.join(SCOPES)}")

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Apply the `patch("run", ...)` changes for the duration of the block (re-entrant)."""
        if self._run_depth == 0:
            with self._run_patcher.undone_on_error():
                for apply in self._run_applies:
                    apply(self._run_patcher)
        self._run_depth += 1
        try:
            yield
        finally:
            self._run_depth -= 1
            if self._run_depth == 0:
                self._run_patcher.undo()

    def detach(self) -> None:
        """Undo every change made for this trainer (its own attributes, its models, its collator) and forget it."""
        if not self.attached:
            return
        self.attached = False
        self._run_patcher.undo()
        self._run_applies.clear()
        self.patcher.undo()
        trainer = self.trainer
        if trainer is not None:
            trainer.__dict__.pop(ATTR, None)
            _LIVE.discard(trainer)
        release_unheld()

    def models(self) -> dict[str, Any]:
        """The causal LMs this trainer runs, by role (`"policy"`, `"ref"`), unwrapped from DeepSpeed/DDP and PEFT."""
        policy = unwrap_causal_lm(getattr(self.trainer, "model", None))
        ref = unwrap_causal_lm(getattr(self.trainer, "ref_model", None))
        models = {"policy": policy, "ref": None if ref is policy else ref}
        return {role: model for role, model in models.items() if model is not None}


def output_head_module(model: Any) -> Any:
    """The output head of a causal LM (`get_output_embeddings()`, the module that turns hidden states into logits),
    or None when the model has none, or one that is not a module with a `forward`."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None or not callable(getattr(head, "forward", None)) or not hasattr(head, "__dict__"):
        return None
    return head


#: The classes, by name, that hold the model they wrap as `.module`.
_WRAPPERS = ("DeepSpeedEngine", "DistributedDataParallel", "DataParallel")


def unwrap_causal_lm(model: Any) -> Any:
    """Strip DeepSpeed engines, DDP and PEFT wrappers: return the `*ForCausalLM` module (or None)."""
    seen = 0
    while model is not None and seen < 8:
        seen += 1
        if hasattr(model, "get_base_model") and callable(model.get_base_model) and hasattr(model, "peft_config"):
            model = model.get_base_model()
            continue
        inner = getattr(model, "module", None)
        if inner is not None and type(model).__name__ in _WRAPPERS:
            model = inner
            continue
        break
    return model
