"""The `trl_ext_call` hook (docs/writing-plugins.md, "Taking part in a trainer's method calls"): each trainer method
an enabled plugin lists (`PluginSpec.calls`) is wrapped once per trainer, on the instance and through its undo stack,
and each call runs the chain of those plugins' implementations in pluggy's call order, TRL's own method innermost.
The scoring methods (`_compat.INIT_CALLS`) are wrapped before TRL's `__init__` (`verify` is outside their chains), the
others after it, outside the core's own wrappers, so a chain sees each call as the Trainer makes it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from . import _compat
from ._logging import get_logger
from .errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    import pluggy

    from .context import TrainerContext
    from .manager import Catalog

__all__ = ["Call", "attach", "chains", "declared"]

logger = get_logger(__name__)

HOOK = "trl_ext_call"
_ACCELERATOR = "accelerator."


class Call:
    """One call of a wrapped method, as a `trl_ext_call` implementation sees it: the method's `name`, the `args` and
    `kwargs` this link was called with (without `self`), the bound `original` as the trainer held it before the core
    wrapped it (calling it skips the rest of the chain), and `last`: whether `proceed()` runs `original` itself."""

    __slots__ = ("_rest", "args", "kwargs", "last", "name", "original")

    def __init__(
        self, name: str, original: Callable, args: tuple, kwargs: dict, rest: Callable[..., Any], last: bool
    ) -> None:
        self.name = name
        self.original = original
        self.args = args
        self.kwargs = kwargs
        self._rest = rest
        self.last = last

    def proceed(self, *args: Any, **kwargs: Any) -> Any:
        """Run the rest of the chain (TRL's method last) with these arguments, or with this call's when none are
        given; return its result."""
        if args or kwargs:
            return self._rest(args, kwargs)
        return self._rest(self.args, self.kwargs)

    def __repr__(self) -> str:
        return f"<trl_ext.Call {self.name}>"


def declared(names: Iterable[str], trainer_class: str) -> list[str]:
    """The methods of `names` (a plugin's `PluginSpec.calls` or `replaces`) on a trainer of `trainer_class`
    (class-qualified names of other classes dropped)."""
    out = []
    for entry in names:
        head, _, rest = entry.partition(".")
        if rest and head in _compat.TRAINERS:
            if head == trainer_class:
                out.append(rest)
        else:
            out.append(entry)
    return out


def chains(catalog: Catalog, caller: pluggy.HookCaller, trainer_class: str, enabled: Iterable[str]) -> dict[str, list]:
    """`{method: [hookimpl, ...]}` in call order (outermost first) for a trainer of `trainer_class` running the
    `enabled` plugins; two of them replacing one method are refused."""
    enabled = set(enabled)
    impls = [impl for impl in reversed(caller.get_hookimpls()) if impl.plugin_name in enabled]
    out: dict[str, list] = {}
    replacers: dict[str, list[str]] = {}
    for impl in impls:
        spec = catalog.specs[impl.plugin_name]
        if not spec.calls and not spec.replaces:
            raise UsageError(
                f"trl-ext plugin `{impl.plugin_name}` implements `{HOOK}` but lists no method in "
                "`PluginSpec(calls=...)`; list the trainer methods it takes part in."
            )
        for name in declared((*spec.calls, *spec.replaces), trainer_class):
            out.setdefault(name, []).append(impl)
        for name in declared(spec.replaces, trainer_class):
            replacers.setdefault(name, []).append(impl.plugin_name)
    for name, plugins in replacers.items():
        if len(plugins) > 1:
            raise UsageError(
                f"The enabled plugins {', '.join(f'`{p}`' for p in plugins)} each replace {trainer_class}.{name} "
                "(`PluginSpec.replaces`); only one can. Disable all but one of them (unset its flag, or add it to "
                "`block`)."
            )
    return out


def attach(ctx: TrainerContext, *, init: bool) -> None:
    """Wrap the methods the enabled plugins list for `ctx`'s trainer: those TRL's `__init__` calls (`init=True`,
    before it runs) or all the others (after it)."""
    pm = ctx.plugin_manager
    trainer = ctx.trainer
    if init:
        for name in _compat.TRAINER_SCORING_METHODS.get(ctx.trainer_class, ()):
            if callable(getattr(trainer, name, None)):
                ctx.stock_methods[name] = getattr(trainer, name)
    for name, impls in chains(pm.catalog, pm.hook.trl_ext_call, ctx.trainer_class, ctx.enabled).items():
        if (name in _compat.INIT_CALLS) != init:
            continue
        ctx.calls[name] = tuple(impl.plugin_name for impl in impls)
        owner, attr = (trainer, name)
        if name.startswith(_ACCELERATOR):
            owner, attr = trainer.accelerator, name[len(_ACCELERATOR) :]
        original = getattr(owner, attr, None)
        if not callable(original):
            plugins = ", ".join(f"`{impl.plugin_name}`" for impl in impls)
            raise UsageError(
                f"This {ctx.trainer_class} has no method `{name}`, which {plugins} take part in: "
                + _compat.unexpected_trl(plugins)
                + "."
            )
        ctx.patcher.setattr(owner, attr, _dispatcher(ctx, name, original, impls))
        chain = " > ".join(impl.plugin_name for impl in impls)
        logger.debug("trl-ext: %s.%s runs %s > TRL", ctx.trainer_class, name, chain)


def _dispatcher(ctx: TrainerContext, name: str, original: Callable, impls: list) -> Callable:
    links = [(impl.function, impl.argnames) for impl in impls]

    def run(index: int, args: tuple, kwargs: dict) -> Any:
        if index == len(links):
            return original(*args, **kwargs)
        function, argnames = links[index]
        call = Call(name, original, args, kwargs, functools.partial(run, index + 1), index + 1 == len(links))
        given = {"trainer": ctx.trainer, "context": ctx, "call": call}
        return function(**{arg: given[arg] for arg in argnames})

    @functools.wraps(original)
    def method(*args: Any, **kwargs: Any) -> Any:
        return run(0, args, kwargs)

    return method
