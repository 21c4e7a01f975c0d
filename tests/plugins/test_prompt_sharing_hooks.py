"""prompt_sharing acts only through hook specs: each causal LM's shared `forward` is its answer to
`trl_ext_make_model_forward` (exclusive: a rival answer is refused), and it takes part in Online DPO's `_forward`
through `trl_ext_call` (outside fused_logprobs' replacement when both are enabled, else running TRL's steps itself);
the core installs both through the trainer's undo stack, and detaching restores every original object, by identity.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from trl_ext import _compat
from trl_ext.spec import PluginSpec
from trl_ext.testing import make_preference_dataset

from .._fakes import install_fake_plugin

PACKAGE = Path(trl_ext.__file__).parent / "plugins" / "prompt_sharing"
METHOD = _compat.ONLINE_DPO_FORWARD_METHOD


@pytest.fixture
def online(online_trainer):
    return online_trainer


def _defined_in(function, module_file: str) -> bool:
    """Whether `function` is one of trl-ext's own functions in `module_file` (`functools.wraps` copies the names)."""
    code = getattr(function, "__code__", None)
    return code is not None and Path(code.co_filename).as_posix().endswith(module_file)


def _models_and_attention(trainer):
    models = trainer._trl_ext.models()
    return models, {role: model.config._attn_implementation for role, model in models.items()}


def test_online_dpo_forwards_are_installed_by_the_core_and_undone_by_detach(online):
    from trl.experimental.online_dpo import OnlineDPOTrainer

    with trl_ext.install(verify=False, prompt_sharing=True) as installation:
        trainer = online()
    models, attention = _models_and_attention(trainer)
    assert set(models) == {"policy", "ref"}
    for model in models.values():
        installed = vars(model)["forward"]  # an instance attribute over the class's `forward`
        assert _defined_in(installed, "prompt_sharing/forward.py")
        assert installed.__wrapped__.__func__ is type(model).forward
        assert model.config._attn_implementation.startswith("trl_ext")
    assert METHOD in vars(trainer) and trainer._trl_ext.calls[METHOD] == ("prompt_sharing",)
    assert trainer._trl_ext.state["prompt_sharing"].online_own  # no other plugin takes part: TRL's steps run shared
    installation.detach(trainer)
    for role, model in models.items():
        assert "forward" not in vars(model)
        assert model.config._attn_implementation != attention[role]
    assert METHOD not in vars(trainer)
    assert getattr(trainer, METHOD).__func__ is getattr(OnlineDPOTrainer, METHOD)


def test_dpo_model_forwards_are_installed_by_the_core_and_undone_by_detach(dpo_args, tokenizer):
    from trl import DPOTrainer

    build = eq.dpo_builder(dpo_args, tokenizer, make_preference_dataset(2), dtype=torch.float64)
    with trl_ext.install(verify=False, prompt_sharing=True) as installation:
        trainer = build()
    models, _ = _models_and_attention(trainer)
    assert set(models) == {"policy", "ref"}
    before = {}
    for role, model in models.items():
        installed = vars(model)["forward"]
        assert _defined_in(installed, "prompt_sharing/forward.py")
        before[role] = installed.__wrapped__  # the forward the model had (the sharpened test model's)
    for name in _compat.DPO_SCORING_METHODS:  # the wrapper wraps Online DPO's `_forward` only
        assert getattr(trainer, name).__func__ is getattr(DPOTrainer, name)
    installation.detach(trainer)
    for role, model in models.items():
        assert model.forward == before[role]
        assert not _defined_in(model.forward, "prompt_sharing/forward.py")


def test_with_fused_logprobs_prompt_sharing_wraps_its_online_forward(online):
    """Both enabled on Online DPO: prompt_sharing's link runs outside fused_logprobs' replacement of `_forward`, the
    head's fused `forward` inside prompt_sharing's model `forward`; detaching restores TRL's."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    with trl_ext.install(prompt_sharing=True, fused_logprobs=True) as installation:
        trainer = online()
    assert METHOD in vars(trainer) and trainer._trl_ext.calls[METHOD] == ("prompt_sharing", "fused_logprobs")
    assert not trainer._trl_ext.state["prompt_sharing"].online_own  # fused_logprobs' `_forward` runs inside
    models, _ = _models_and_attention(trainer)
    for model in models.values():
        assert _defined_in(vars(model)["forward"], "prompt_sharing/forward.py")
        assert "forward" in vars(model.get_output_embeddings())  # fused_logprobs' head, called inside
    installation.detach(trainer)
    assert METHOD not in vars(trainer)
    assert getattr(trainer, METHOD).__func__ is getattr(OnlineDPOTrainer, METHOD)
    for model in models.values():
        assert "forward" not in vars(model) and "forward" not in vars(model.get_output_embeddings())


class Rival:
    """A third-party plugin answering prompt_sharing's model-forward extension point, or taking part in (`"call"`) or
    replacing (`"replace"`) Online DPO's `_forward`, with a pass-through."""

    def __init__(self, hook):
        kind = {"call": "calls", "replace": "replaces"}.get(hook)
        declared = {kind: ("OnlineDPOTrainer._forward",)} if kind else {}
        self.TRL_EXT_PLUGIN = PluginSpec(name="rival", summary="Answers one extension point.", **declared)
        self.hook = hook
        self.calls = 0
        if declared:
            self.trl_ext_call = trl_ext.hookimpl(lambda trainer, context, call: call.proceed())

    @trl_ext.hookimpl
    def trl_ext_make_model_forward(self, trainer, context, role, model):
        self.calls += 1
        return model.forward if self.hook == "model" else None


@pytest.mark.parametrize(
    "hook, message, plugins",
    [
        (
            "model",
            r"2 enabled plugins \(.*`rival`.*\) answered `trl_ext_make_model_forward`",
            {"prompt_sharing": True},
        ),
        # prompt_sharing takes part without replacing: fused_logprobs' replacement and the rival's are two, refused
        (
            "replace",
            r"`rival`, `fused_logprobs` each replace OnlineDPOTrainer._forward",
            {"prompt_sharing": True, "fused_logprobs": True},
        ),
    ],
)
def test_a_second_plugin_answering_an_extension_point_is_refused(online, monkeypatch, hook, message, plugins):
    rival = Rival(hook)
    install_fake_plugin(monkeypatch, "rival", rival)
    with trl_ext.install(**plugins, plugins={"rival": {}}):
        with pytest.raises(trl_ext.UsageError, match=message):
            online()
    assert rival.calls or hook == "replace"


def test_a_third_party_plugin_taking_part_in_the_online_forward_composes(online, monkeypatch):
    """A third-party plugin taking part in `_forward` (registered last: outermost) leaves prompt_sharing innermost,
    running TRL's steps shared (none names a plugin)."""
    install_fake_plugin(monkeypatch, "rival", Rival("call"))
    with trl_ext.install(prompt_sharing=True, plugins={"rival": {}}) as installation:
        trainer = online()
    assert trainer._trl_ext.calls[METHOD] == ("rival", "prompt_sharing")
    assert trainer._trl_ext.state["prompt_sharing"].online_own
    installation.detach(trainer)
    assert METHOD not in vars(trainer)


def test_an_online_forward_this_trl_lacks_is_refused(online, monkeypatch):
    """A TRL without Online DPO's `_forward` is refused before TRL's `__init__`, not run unshared."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    monkeypatch.delattr(OnlineDPOTrainer, METHOD)
    with trl_ext.install(prompt_sharing=True):
        with pytest.raises(trl_ext.UsageError, match=r"OnlineDPOTrainer has no method `_forward`, which `prompt_sh"):
            online()


def test_the_plugin_sets_no_forward_itself():
    """No `setattr` of a `forward`/`_forward` and no attribute assignment of one in the plugin's code: the models'
    and the trainer's forwards are answers to hook specs, installed by the core."""
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and len(node.args) >= 2:
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                attr = node.args[1]
                names_forward = (isinstance(attr, ast.Constant) and attr.value in ("forward", "_forward")) or (
                    isinstance(attr, ast.Attribute) and attr.attr == "ONLINE_DPO_FORWARD_METHOD"
                )
                if called in ("setattr", "wrap") and names_forward:
                    found.append(f"{path.name}:{node.lineno} {called}")
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and target.attr in ("forward", "_forward"):
                        found.append(f"{path.name}:{node.lineno} .{target.attr} =")
    assert found == []
