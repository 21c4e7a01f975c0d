"""Everything a plugin changes is undone: each built-in plugin (and a combination) trains a step on a real trainer,
then `uninstall()` and `detach()` leave TRL, transformers and the trainer as a stock build of the same trainer.

What is walked, before the install and after the undo:
- every attribute of the modules and classes trl-ext or a plugin may patch (TRL's trainer modules and classes,
  transformers' `Trainer` and modeling utilities, the attention registry), compared by identity;
- the trainer's own attributes: no callable left that a stock trainer does not have, the same data collator type;
- every sub-module of the policy and reference models: the same own attributes as a stock model's (no `forward`, no
  hook left behind), the same forward / backward hooks, the same config;
- the trainer's accelerator (no callable of its own that a stock trainer's does not have: sync_metrics and
  token_budget answer its gathers for a while) and callbacks (the same types);
- every module of TRL, transformers and accelerate and every class defined there, whether listed above or not: no
  function, bound method, instance or registered name of trl-ext's that was not there before (a trainer of an earlier
  test, never detached, may still hold a registration).

And while the plugins build and train: every attribute that trl-ext code sets on a trainer, a model or one of its
modules, a model config or an accelerator goes through the undo stack (`trl_ext/patching.py`), or is one of
`DIRECT_WRITES` (a running total of TRL's that a plugin keeps as stock would).
"""

from __future__ import annotations

import collections
import functools
import gc
import importlib
import sys
import types
from pathlib import Path

import pytest
import torch

import trl_ext
from trl_ext import _compat
from trl_ext.context import release_unheld
from trl_ext.testing import length_reward, make_model, make_preference_dataset, make_prompt_dataset

DPO_CASES = {
    "padding_free": dict(padding_free=True),
    "prompt_sharing": dict(prompt_sharing=True),
    "precompute_ref_batch_size": dict(precompute_ref_batch_size=2),
    "sync_metrics": dict(sync_metrics=True),
    "token_budget": dict(token_budget=400),
    "fused_logprobs": dict(fused_logprobs=True),
    "packing+token_budget+fused_logprobs": dict(padding_free=True, token_budget=400, fused_logprobs=True),
}
ONLINE_CASES = {
    "prompt_sharing": dict(prompt_sharing=True),
    "fused_logprobs": dict(fused_logprobs=True),
    "sync_metrics": dict(sync_metrics=True),
    "prompt_sharing+fused_logprobs": dict(prompt_sharing=True, fused_logprobs=True),
}


#: `(kind, attribute)` that trl-ext code sets directly (not through the undo stack), and why.
DIRECT_WRITES: dict[tuple[str, str], str] = {
    # a probe forward in training mode (`toolkit.randomness.random_draws`) puts each module's own mode back as it was
    ("module", "training"): "a probe's mode, put back when the probe ends",
    # sync_metrics sums TRL's running totals over the ranks and writes them where the Trainer keeps them, as stock does
    ("trainer", "current_flos"): "sync_metrics: the step's floating-point operations, summed over the ranks",
    ("trainer", "_total_loss_scalar"): "sync_metrics: the running loss, from the global mean",
    ("trainer", "_total_train_tokens"): "sync_metrics: DPO's token count, summed over the ranks",
}

_TRL_EXT = str(Path(trl_ext.__file__).resolve().parent)
_UNDO_STACK = str(Path(trl_ext.__file__).resolve().parent / "patching.py")


def _writes_recorded():
    """A context manager that records `{(kind, attribute): "file:function"}` of what trl-ext code outside the undo
    stack sets on trainers, models and their modules, model configs and accelerators."""
    import contextlib

    import accelerate
    import transformers

    kinds = {
        "trainer": transformers.Trainer,
        "module": torch.nn.Module,
        "config": transformers.PretrainedConfig,
        "accelerator": accelerate.Accelerator,
    }
    writes: dict[tuple[str, str], str] = {}

    def recording(kind: str, original):
        def __setattr__(self, name, value):
            code = sys._getframe(1).f_code
            if code.co_filename.startswith(_TRL_EXT) and code.co_filename != _UNDO_STACK:
                writes.setdefault((kind, name), f"{Path(code.co_filename).name}:{code.co_name}")
            return original(self, name, value)

        return __setattr__

    @contextlib.contextmanager
    def record():
        saved = {kind: cls.__dict__.get("__setattr__") for kind, cls in kinds.items()}
        for kind, cls in kinds.items():
            cls.__setattr__ = recording(kind, cls.__setattr__)
        try:
            yield writes
        finally:
            for kind, cls in kinds.items():
                if saved[kind] is None:
                    del cls.__setattr__
                else:
                    cls.__setattr__ = saved[kind]

    return record()


def _process_wide() -> list[object]:
    """The modules and classes whose attributes a plugin may replace (TRL's, transformers', accelerate's)."""
    import accelerate
    import transformers
    from transformers import modeling_utils

    objects: list[object] = []
    for module_name, class_name in _compat.TRAINERS.values():
        module = importlib.import_module(module_name)
        objects += [module, getattr(module, class_name)]
    objects += [importlib.import_module(m) for m in _compat.GENERATION_HELPER_MODULES.values()]
    for name in ("trl.trainer.utils", "trl.models.utils", "transformers.trainer", "transformers.modeling_utils"):
        objects.append(importlib.import_module(name))
    objects += [transformers.Trainer, accelerate.Accelerator, modeling_utils.PreTrainedModel]
    return objects


def _snapshot() -> dict[int, tuple[object, dict[str, object]]]:
    from transformers.modeling_utils import AttentionInterface

    # `__warningregistry__` and other dunders are Python's own bookkeeping (a warning issued from the module)
    out = {id(obj): (obj, {k: v for k, v in vars(obj).items() if not k.startswith("__")}) for obj in _process_wide()}
    out[id(AttentionInterface._global_mapping)] = ("attention registry", dict(AttentionInterface._global_mapping))
    return out


def _changed(before: dict, after: dict) -> list[str]:
    changes = []
    for key, (obj, attrs) in before.items():
        now = after[key][1]
        name = getattr(obj, "__name__", obj)
        changes += [f"{name}.{a} added" for a in now.keys() - attrs.keys()]
        changes += [f"{name}.{a} removed" for a in attrs.keys() - now.keys()]
        changes += [f"{name}.{a} replaced" for a in attrs.keys() & now.keys() if now[a] is not attrs[a]]
    return changes


def _ours(value: object) -> bool:
    """Whether `value` is something trl-ext defined or registered (read from its type, never through `getattr` on
    the object: transformers' lazy modules import on attribute access)."""
    if isinstance(value, str):
        return value.startswith("trl_ext")
    if isinstance(value, functools.partial):
        return _ours(value.func)
    if isinstance(value, types.MethodType):  # a bound method: its function or its object
        return _ours(value.__func__) or _ours(value.__self__)
    if isinstance(value, types.FunctionType):
        return _our_module(value.__module__)
    if isinstance(value, (type, types.ModuleType)):
        return False
    return _our_module(type(value).__module__)


def _our_module(name: str | None) -> bool:
    """trl-ext's modules, but not those `trl_ext.testing` takes the tests' models, data and reward functions from."""
    return (name or "").startswith("trl_ext") and name not in ("trl_ext.testing", "trl_ext.app.bench.workload")


def _leftovers(name: str, value: object, depth: int = 1) -> list[str]:
    """The paths under `value` (the items of the plain dicts, lists and tuples in it, to depth 3) that hold something
    of trl-ext's. Lazy mappings are not walked: reading them imports."""
    if _ours(value):
        return [name]
    if depth >= 3:
        return []
    if type(value) in (dict, collections.defaultdict, collections.OrderedDict):
        items = list(value.items())  # type: ignore[attr-defined]
    elif type(value) in (list, tuple):
        items = list(enumerate(value))  # type: ignore[arg-type]
    else:
        return []
    return [path for key, item in items for path in _leftovers(f"{name}.{key}", item, depth + 1)]


def _library_state() -> set[tuple[str, int]]:
    """Every trl-ext object held by a module of TRL, transformers or accelerate, or by a class defined there: its
    path and identity."""
    found = set()
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] not in ("trl", "transformers", "accelerate"):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, types.ModuleType):
                continue
            held = vars(value).items() if isinstance(value, type) and value.__module__ == module_name else []
            for path, item in [(f"{module_name}.{attr}", value)] + [(f"{module_name}.{attr}.{k}", v) for k, v in held]:
                found.update((leftover, id(item)) for leftover in _leftovers(path, item))
    return found


def _callables(trainer: object) -> set[str]:
    """The trainer's own attributes that are functions or bound methods (a wrapper left behind would be one)."""
    kinds = (types.FunctionType, types.MethodType, types.BuiltinFunctionType)
    return {name for name, value in vars(trainer).items() if isinstance(value, kinds)}


def _modules_state(model: torch.nn.Module) -> dict[str, tuple]:
    return {
        name: (
            sorted(k for k in vars(module) if not k.startswith("_") or k in ("_forward_hooks", "_backward_hooks")),
            "forward" in vars(module),
            len(module._forward_hooks),
            len(module._forward_pre_hooks),
            len(module._backward_hooks),
        )
        for name, module in model.named_modules()
    }


def _assert_stock(trainer, stock) -> None:
    assert "_trl_ext" not in vars(trainer)
    left = _callables(trainer) - _callables(stock)
    assert not left, f"trainer methods still wrapped after detach: {sorted(left)}"
    assert type(trainer.data_collator) is type(stock.data_collator)
    left = _callables(trainer.accelerator) - _callables(stock.accelerator)
    assert not left, f"accelerator methods still wrapped after detach: {sorted(left)}"
    callbacks = trainer.callback_handler.callbacks
    assert [type(c) for c in callbacks] == [type(c) for c in stock.callback_handler.callbacks]
    roots = {"trainer": trainer, "accelerator": trainer.accelerator, "data_collator": trainer.data_collator}
    roots.update({f"callbacks.{i}": c for i, c in enumerate(callbacks)})
    left = [p for root, obj in roots.items() for k, v in vars(obj).items() for p in _leftovers(f"{root}.{k}", v)]
    assert not left, f"trl-ext objects still held after detach: {left}"
    for attr in ("model", "ref_model"):
        ours, theirs = getattr(trainer, attr, None), getattr(stock, attr, None)
        assert (ours is None) == (theirs is None)
        if ours is None:
            continue
        assert _modules_state(ours) == _modules_state(theirs), attr
        assert ours.config.to_dict() == theirs.config.to_dict(), attr


def _dpo(tokenizer, dpo_args, flags):
    from trl import DPOTrainer

    overrides = {"precompute_ref_log_probs": True} if "precompute_ref_batch_size" in flags else {}
    return DPOTrainer(
        make_model(hidden_size=32),
        ref_model=make_model(hidden_size=32, seed=1),
        args=dpo_args(max_steps=1, bf16=False, **overrides),
        train_dataset=make_preference_dataset(8),
        processing_class=tokenizer,
    )


def _online(tokenizer, online_dpo_args, flags):
    from trl.experimental.online_dpo import OnlineDPOTrainer

    return OnlineDPOTrainer(
        model=make_model(hidden_size=32),
        ref_model=make_model(hidden_size=32, seed=1),
        reward_funcs=length_reward,
        args=online_dpo_args(max_steps=1, bf16=False, max_length=64),
        train_dataset=make_prompt_dataset(4),
        processing_class=tokenizer,
    )


def _check(build, flags) -> None:
    """`build()` makes the same trainer (the same TRL config) for stock and for the plugins."""
    gc.collect()  # an earlier test's trainer, garbage-collected undetached, may still hold process-wide changes:
    release_unheld()  # undone here, as the next detach or uninstall would, so that they are not in `before`
    before, held = _snapshot(), _library_state()
    stock = build()
    stock.train()
    with _writes_recorded() as writes:
        installation = trl_ext.install(**flags)
        trainer = build()
        assert set(trainer._trl_ext.enabled) >= set(flags)  # every requested plugin attached
        trainer.train()
    installation.uninstall(detach=True)
    direct = {write: where for write, where in writes.items() if write not in DIRECT_WRITES}
    assert not direct, f"set outside the undo stack (`trl_ext/patching.py`): {direct}"
    assert not _changed(before, _snapshot())
    assert sorted(path for path, _ in _library_state() - held) == []
    _assert_stock(trainer, stock)
    trainer.train()  # stock TRL again


#: in the fast loop: one combination (the other cases are `slow`, ~5 s each)
FAST = {"packing+token_budget+fused_logprobs"}


def _cases(cases: dict) -> list:
    return [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in cases]


@pytest.mark.parametrize("case", _cases(DPO_CASES))
def test_dpo_plugins_are_undone(case, tokenizer, dpo_args):
    flags = DPO_CASES[case]
    _check(lambda: _dpo(tokenizer, dpo_args, flags), flags)


@pytest.mark.parametrize("case", _cases(ONLINE_CASES))
def test_online_dpo_plugins_are_undone(case, tokenizer, online_dpo_args):
    flags = ONLINE_CASES[case]
    _check(lambda: _online(tokenizer, online_dpo_args, flags), flags)


def test_the_walk_sees_a_change_left_behind():
    """The process-wide walk and the trainer walk each notice one replaced attribute."""
    from trl import DPOTrainer

    before = _snapshot()
    module = importlib.import_module(DPOTrainer.__module__)
    name = next(n for n, v in vars(module).items() if callable(v) and not n.startswith("__"))
    original = vars(module)[name]
    setattr(module, name, lambda *a, **k: None)
    try:
        assert _changed(before, _snapshot()) == [f"{module.__name__}.{name} replaced"]
    finally:
        setattr(module, name, original)
    assert not _changed(before, _snapshot())
    stock, patched = types.SimpleNamespace(), types.SimpleNamespace()
    patched.training_step = lambda *a: None
    assert _callables(patched) - _callables(stock) == {"training_step"}
    # the library walk: a trl-ext function set on a module it does not list, and a name registered in a dict there
    from transformers import utils as hf_utils

    from trl_ext.patching import resolve

    held = _library_state()
    hf_utils.trl_ext_left_behind = resolve
    hf_utils.__dict__.setdefault("TRL_EXT_REGISTRY", {})["x"] = functools.partial(resolve, "trl")
    try:
        assert sorted(p for p, _ in _library_state() - held) == [
            "transformers.utils.TRL_EXT_REGISTRY.x",
            "transformers.utils.trl_ext_left_behind",
        ]
    finally:
        del hf_utils.trl_ext_left_behind, hf_utils.TRL_EXT_REGISTRY
    assert not _library_state() - held
    # the trainer walk: a trl-ext wrapper an accelerator still holds, and a callback of trl-ext's in a list
    assert _leftovers("accelerator.gather", functools.partial(resolve, "accelerate")) == ["accelerator.gather"]
    assert _leftovers("callbacks", [None, resolve]) == ["callbacks.1"]


def test_the_write_recorder_sees_a_direct_write_and_not_the_undo_stack():
    """A write from trl-ext code is recorded with its place; the same write through a `Patcher` is not."""
    from trl_ext.patching import Patcher

    model = make_model(hidden_size=32)
    code = compile("def leave(model):\n    model.trl_ext_mark = 1\n", str(Path(_TRL_EXT) / "plugins" / "x.py"), "exec")
    namespace: dict = {}
    exec(code, namespace)
    patcher = Patcher("test")
    with _writes_recorded() as writes:
        patcher.setattr(model.config, "use_cache", False)
        namespace["leave"](model)
    patcher.undo()
    assert writes == {("module", "trl_ext_mark"): "x.py:leave"}
