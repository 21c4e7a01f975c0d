"""fused_logprobs acts only through hook specs: its output-head `forward` is its answer to `trl_ext_make_head_forward`
(exclusive: a second plugin answering is refused) and it takes part in the trainer's scoring methods through
`trl_ext_call` (replacing Online DPO's `_forward`: a second replacement is refused), both installed by the core through
the trainer's undo stack, and the TRL helpers it replaces process-wide for DPO
(TRL < 1.15) go through an undo stack held per trainer (`TrainerContext.patch("process")`): detaching restores every
original object, by identity.
"""

from __future__ import annotations

import ast
import gc
import importlib
from pathlib import Path

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from trl_ext import _compat
from trl_ext.spec import PluginSpec
from trl_ext.testing import make_preference_dataset

from .._fakes import install_fake_plugin

PACKAGE = Path(trl_ext.__file__).parent / "plugins" / "fused_logprobs"


@pytest.fixture
def online(online_trainer):
    return online_trainer


def _heads(trainer):
    return {role: model.get_output_embeddings() for role, model in trainer._trl_ext.models().items()}


def test_online_dpo_head_and_forward_are_installed_by_the_core_and_undone_by_detach(online):
    from trl.experimental.online_dpo import OnlineDPOTrainer

    method = _compat.ONLINE_DPO_FORWARD_METHOD
    with trl_ext.install(fused_logprobs=True) as installation:
        trainer = online()
    heads = _heads(trainer)
    assert set(heads) == {"policy", "ref"}
    for head in heads.values():
        installed = vars(head)["forward"]  # an instance attribute over the class's `forward`
        assert installed.__wrapped__.__func__ is type(head).forward
    assert method in vars(trainer) and trainer._trl_ext.calls[method] == ("fused_logprobs",)
    installation.detach(trainer)
    for head in heads.values():
        assert "forward" not in vars(head)
    assert method not in vars(trainer)
    assert getattr(trainer, method).__func__ is getattr(OnlineDPOTrainer, method)


def test_a_scoring_method_this_trl_lacks_is_refused(online, monkeypatch):
    """A TRL without the scoring method is refused before TRL's `__init__`, not run half-fused."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    monkeypatch.delattr(OnlineDPOTrainer, _compat.ONLINE_DPO_FORWARD_METHOD)
    with trl_ext.install(fused_logprobs=True):
        with pytest.raises(trl_ext.UsageError, match=r"OnlineDPOTrainer has no method `_forward`, which `fused_log"):
            online()


class Rival:
    """A third-party plugin answering fused_logprobs' head extension point, or replacing Online DPO's `_forward`, with
    a pass-through."""

    def __init__(self, hook):
        replaces = ("OnlineDPOTrainer._forward",) if hook == "scoring" else ()
        self.TRL_EXT_PLUGIN = PluginSpec(name="rival", summary="Answers one extension point.", replaces=replaces)
        self.hook = hook
        self.calls = 0
        if replaces:
            self.trl_ext_call = trl_ext.hookimpl(lambda trainer, context, call: call.proceed())

    @trl_ext.hookimpl
    def trl_ext_make_head_forward(self, trainer, context, role, head):
        self.calls += 1
        return head.forward if self.hook == "head" else None


@pytest.mark.parametrize(
    "hook, message",
    [
        ("head", r"2 enabled plugins \(.*`rival`.*\) answered `trl_ext_make_head_forward`"),
        ("scoring", r"`rival`, `fused_logprobs` each replace OnlineDPOTrainer._forward"),
    ],
)
def test_a_second_plugin_answering_an_extension_point_is_refused(online, monkeypatch, hook, message):
    install_fake_plugin(monkeypatch, "rival", Rival(hook))
    with trl_ext.install(fused_logprobs=True, plugins={"rival": {}}):
        with pytest.raises(trl_ext.UsageError, match=message):
            online()


def test_rival_alone_installs_its_answers(online, monkeypatch):
    """The core installs a third-party plugin's answer (the hooks name no built-in plugin)."""
    rival = Rival("head")
    install_fake_plugin(monkeypatch, "rival", rival)
    with trl_ext.install(plugins={"rival": {}}) as installation:
        trainer = online()
    assert trainer._trl_ext.enabled == ("rival",)
    heads = _heads(trainer)
    assert all(vars(head)["forward"].__func__ is type(head).forward for head in heads.values())
    installation.detach(trainer)
    assert all("forward" not in vars(head) for head in heads.values())


def test_the_plugin_changes_nothing_itself():
    """No `setattr`, no attribute assignment and no use of the trainer's undo stack in the plugin's code: every change
    is an answer to a hook spec, or goes through a `Patcher` (`context.patch("process")`, the per-call wrap in
    dpo.py)."""
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            function = node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None
            if function in ("setattr", "delattr"):
                found.append(f"{path.name}:{node.lineno} {function}")
            elif isinstance(node, ast.Attribute) and node.attr in ("patcher", "hold"):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and target.attr in ("forward", "_forward"):
                        found.append(f"{path.name}:{node.lineno} .{target.attr} =")
    assert found == []


@pytest.mark.skipif(_compat.dpo_uses_fused_lm_head(), reason="TRL >= 1.15: DPOTrainer runs TRL's own fused LM head")
def test_dpo_helpers_are_held_until_the_last_trainer_is_detached(dpo_args, tokenizer):
    from trl import DPOTrainer

    module = importlib.import_module(_compat.DPO_LOGITS_MODULE)
    names = _compat.dpo_logits_helpers()
    assert names
    # TRL defines them in its utils module and imports them by name into the DPO module, where they are replaced.
    originals = {n: getattr(importlib.import_module(getattr(module, n).__module__), n) for n in names}
    build = eq.dpo_builder(dpo_args, tokenizer, make_preference_dataset(2), dtype=torch.float64)
    gc.collect()  # trainers of earlier tests, never detached, may still hold the helpers
    installation = trl_ext.install(fused_logprobs=True)
    first, second = build(), build()
    installation.uninstall()  # both trainers keep their plugins
    for name in names:
        assert getattr(module, name) is not originals[name]
        assert getattr(module, name).__wrapped__ is originals[name]
    heads = _heads(first)
    for trainer in (first, second):
        for method in _compat.DPO_SCORING_METHODS:
            assert method in vars(trainer)
    installation.detach(first)
    for method in _compat.DPO_SCORING_METHODS:  # `first` is stock again
        assert method not in vars(first)
        assert getattr(first, method).__func__ is getattr(DPOTrainer, method)
    assert all("forward" not in vars(head) for head in heads.values())
    for name in names:  # `second` still holds the helpers
        assert getattr(module, name).__wrapped__ is originals[name]
    installation.detach(second)
    for name in names:
        assert getattr(module, name) is originals[name]
