"""House rule (issue 40): every change a plugin makes to a trainer, its models, its accelerator, its collator and
callbacks, or to TRL, transformers and accelerate, goes through the undo mechanism, so that `detach(trainer)` and
`uninstall()` leave nothing of trl-ext behind.

Every built-in plugin, in the combinations that train together, on a real DPOTrainer and OnlineDPOTrainer that train
one step: after `installation.uninstall(detach=True)`, no object that trl-ext defined (a function, a bound method, an
instance of one of its classes, a name it registered) is reachable from those objects, nor from the modules of TRL,
transformers and accelerate, beyond what was there before the test (trainers of earlier tests that were never detached
may still hold a registration)."""

from __future__ import annotations

import collections
import functools
import gc
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import trl_ext
from trl_ext.testing import length_reward, make_model, make_preference_dataset, make_prompt_dataset

#: What may stay after detach, each with its reason. Empty: nothing does.
ALLOWED: dict[str, str] = {}

_DPO_SETS = [
    {"padding_free": True, "token_budget": 96, "fused_logprobs": True, "sync_metrics": True},
    {"prompt_sharing": True, "sync_metrics": True, "precompute_ref_batch_size": 4},
]
_ONLINE_SETS = [
    {"prompt_sharing": True, "fused_logprobs": True, "sync_metrics": True, "ds3_gather_for_generation": "auto"},
]


def _ours(value: Any) -> bool:
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


def _leftovers(name: str, value: Any, depth: int = 0) -> Iterator[str]:
    """The paths under `value` (its attributes, and the items of the dicts, lists and tuples among them, two levels
    deep) that hold something of trl-ext's."""
    if _ours(value):
        yield name
        return
    if depth >= 3:
        return
    if type(value) in (dict, collections.defaultdict, collections.OrderedDict):  # not lazy mappings: they import
        items = list(value.items())
    elif type(value) in (list, tuple):
        items = list(enumerate(value))
    elif depth == 0 or isinstance(value, torch.nn.Module):
        items = list(getattr(value, "__dict__", {}).items())
    else:
        return
    for key, item in items:
        if isinstance(item, torch.Tensor):
            continue
        yield from _leftovers(f"{name}.{key}", item, depth + 1)


def _trainer_leftovers(trainer: Any) -> list[str]:
    roots: dict[str, Any] = {
        "trainer": trainer,
        "accelerator": trainer.accelerator,
        "data_collator": trainer.data_collator,
        "callbacks": trainer.callback_handler.callbacks,
    }
    for role in ("model", "ref_model"):
        model = getattr(trainer, role, None)
        if model is not None:
            roots[f"{role}.config"] = model.config
            for path, module in model.named_modules():
                roots[f"{role}.{path}" if path else role] = module
    out: list[str] = []
    for name, value in roots.items():
        out += [p for p in _leftovers(name, value) if p not in ALLOWED]
    return out


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
            if isinstance(value, type) and value.__module__ == module_name:
                for class_attr, class_value in list(vars(value).items()):
                    for path in _leftovers(f"{module_name}.{attr}.{class_attr}", class_value, depth=1):
                        found.add((path, id(class_value)))
            else:
                for path in _leftovers(f"{module_name}.{attr}", value, depth=1):
                    found.add((path, id(value)))
    return found


def _dpo(tokenizer, dpo_args, flags):
    from trl import DPOTrainer

    precompute = "precompute_ref_batch_size" in flags
    return DPOTrainer(
        make_model(seed=0),
        ref_model=make_model(seed=1),
        args=dpo_args(max_steps=1, precompute_ref_log_probs=precompute),
        train_dataset=make_preference_dataset(8),
        processing_class=tokenizer,
    )


def _online(tokenizer, online_dpo_args, flags):
    from trl.experimental.online_dpo import OnlineDPOTrainer

    return OnlineDPOTrainer(
        make_model(seed=0),
        ref_model=make_model(seed=1),
        reward_funcs=length_reward,
        args=online_dpo_args(max_steps=1),
        train_dataset=make_prompt_dataset(4),
        processing_class=tokenizer,
    )


@pytest.mark.parametrize(
    ("build", "flags"),
    [("dpo", f) for f in _DPO_SETS] + [("online", f) for f in _ONLINE_SETS],
    ids=lambda v: v if isinstance(v, str) else "+".join(v),
)
def test_uninstall_with_detach_leaves_nothing_of_trl_ext(build, flags, tokenizer, dpo_args, online_dpo_args):
    gc.collect()
    before = _library_state()
    installation = trl_ext.install(**flags)
    try:
        if build == "dpo":
            trainer = _dpo(tokenizer, dpo_args, flags)
        else:
            trainer = _online(tokenizer, online_dpo_args, flags)
        assert set(trainer._trl_ext.enabled) >= set(flags) - {"ds3_gather_for_generation"}
        assert _trainer_leftovers(trainer), "the walk sees the plugins while they are attached"
        trainer.train()
    finally:
        installation.uninstall(detach=True)
    assert _trainer_leftovers(trainer) == []
    gc.collect()
    assert sorted(path for path, _ in _library_state() - before) == []


def test_the_walk_finds_a_wrapper_set_by_hand(tokenizer, dpo_args):
    """The control: an attribute a plugin set outside the undo mechanism is found after detach."""
    from trl_ext.patching import resolve

    installation = trl_ext.install(padding_free=True)
    try:
        trainer = _dpo(tokenizer, dpo_args, {})
        # each stands for a wrapper a plugin set by hand, outside the undo mechanism
        trainer.model.generate = functools.partial(resolve, "trl")
        trainer.accelerator.gather = functools.partial(resolve, "accelerate")
    finally:
        installation.uninstall(detach=True)
    found = _trainer_leftovers(trainer)
    assert {"accelerator.gather", "model.generate"} <= set(found), found
