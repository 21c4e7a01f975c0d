"""Plugin discovery, declarations and hook calls: entry points, blocking, misspelled hooks, exclusive hooks."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import types

import pytest

import trl_ext
from trl_ext import UsageError
from trl_ext.config import load_config
from trl_ext.manager import builtin_plugin_modules, call_exclusive, load_catalog, make_plugin_manager
from trl_ext.plugins import BUILTIN_PLUGINS
from trl_ext.spec import Flag, PluginSpec, boolean, positive_int

from ._fakes import FakeDistribution, install_fake_plugin


class Answering:
    """A third-party style plugin that answers one exclusive hook."""

    def __init__(self, value):
        self.value = value

    @trl_ext.hookimpl
    def trl_ext_make_collator(self, trainer, context, collator):
        return self.value


class Wrapping:
    """A new-style pluggy wrapper around an exclusive hook: it sees the results but is not an answer."""

    def __init__(self):
        self.seen = []

    @trl_ext.hookimpl(wrapper=True)
    def trl_ext_make_collator(self, trainer, context, collator):
        results = yield
        self.seen.append(list(results))
        return results


@dataclasses.dataclass(frozen=True)
class MineOptions:
    """Options of `mine`.

    Args:
        alpha (`int`, *optional*, defaults to `1`):
            A positive number.
    """

    alpha: int = dataclasses.field(default=1, metadata={"parse": positive_int})


def _module_plugin(name: str, spec: PluginSpec | None = None, **attrs) -> types.ModuleType:
    module = types.ModuleType(f"_trl_ext_fake_{name}")
    if spec is not None:
        module.TRL_EXT_PLUGIN = spec
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def test_builtins_are_discovered_from_the_package_not_named_in_the_core():
    assert BUILTIN_PLUGINS == builtin_plugin_modules()
    catalog, plugins = load_catalog()
    assert set(BUILTIN_PLUGINS) <= set(catalog.builtin)
    for name in BUILTIN_PLUGINS:
        assert catalog.specs[name].name == name  # same name everywhere
        assert plugins[name].__name__ == BUILTIN_PLUGINS[name]


def test_entry_point_plugins_are_discovered_and_registered_like_builtins(monkeypatch):
    plugin = Answering("x")
    install_fake_plugin(monkeypatch, "thirdparty", plugin)
    pm = make_plugin_manager()
    assert pm.get_plugin("thirdparty") is plugin
    assert [n for n, _ in pm.list_name_plugin()] == [*BUILTIN_PLUGINS, "thirdparty"]
    assert "thirdparty" not in pm.catalog.builtin


def test_third_party_plugin_declares_a_flag_and_options(monkeypatch):
    spec = PluginSpec(
        name="mine",
        summary="Mine.",
        flags=(Flag("mine_flag", default=False, parse=boolean, help="Turn mine on."),),
        options=MineOptions,
        trainers=("DPOTrainer",),
    )
    install_fake_plugin(monkeypatch, "mine", _module_plugin("mine", spec))
    config = load_config(flags={"mine_flag": "yes", "plugins": {"mine": {"alpha": "3"}}}, environ={})
    assert config.mine_flag is True and config.options("mine") == MineOptions(alpha=3)
    assert load_config(environ={"TRL_EXT_MINE_FLAG": "1"}).mine_flag is True
    with pytest.raises(UsageError, match=r"`plugins.mine.alpha` must be a positive integer, got -1"):
        load_config(flags={"plugins": {"mine": {"alpha": -1}}}, environ={})
    with pytest.raises(UsageError, match=r"Unknown option\(s\) `alpah` \(did you mean `alpha`\?\)"):
        load_config(flags={"plugins": {"mine": {"alpah": 1}}}, environ={})
    with trl_ext.install(mine_flag=True) as installation:
        assert installation.enabled_plugins("DPOTrainer") == ["mine"]
        assert installation.enabled_plugins("OnlineDPOTrainer") == []


def test_legacy_declarations_and_bad_specs_are_refused(monkeypatch):
    install_fake_plugin(monkeypatch, "old", _module_plugin("old", TRL_EXT_FLAGS=("old",)))
    with pytest.raises(UsageError, match=r"`old` declares TRL_EXT_FLAGS.*TRL_EXT_PLUGIN = trl_ext.PluginSpec"):
        make_plugin_manager()


def test_spec_name_must_match_the_registration_name(monkeypatch):
    install_fake_plugin(monkeypatch, "thirdparty", _module_plugin("x", PluginSpec(name="other")))
    with pytest.raises(UsageError, match="registered as `thirdparty` declares the name `other`"):
        make_plugin_manager()


def test_two_plugins_cannot_own_one_flag(monkeypatch):
    spec = PluginSpec(name="clash", flags=(Flag("padding_free", default=False, parse=boolean, help="x"),))
    install_fake_plugin(monkeypatch, "clash", _module_plugin("clash", spec))
    with pytest.raises(UsageError, match="both declare the flag `padding_free`"):
        make_plugin_manager()


def test_bad_declarations_fail_when_declared():
    with pytest.raises(UsageError, match="default 'no' of flag `f` is not a normalised value"):
        PluginSpec(name="p", flags=(Flag("f", default="no", parse=boolean, help=""),))

    @dataclasses.dataclass
    class Mutable:
        a: int = 1

    with pytest.raises(UsageError, match="must be frozen"):
        PluginSpec(name="p", options=Mutable)


def test_blocked_plugin_is_not_loaded(monkeypatch):
    install_fake_plugin(monkeypatch, "thirdparty", Answering("x"))
    pm = make_plugin_manager(block=["thirdparty"])
    assert pm.get_plugin("thirdparty") is None and pm.is_blocked("thirdparty")


def test_blocking_an_unknown_name_is_an_error():
    with pytest.raises(UsageError, match="`block` names unknown plugin"):
        make_plugin_manager(block=["no_such_plugin"])


def test_misspelled_hook_fails_at_start_up(monkeypatch):
    class Typo:
        def trl_ext_trainer_init_strat(self, trainer, context, init_kwargs):  # note the typo, and no marker
            pass

    install_fake_plugin(monkeypatch, "typo", Typo())
    with pytest.raises(UsageError, match=r"`typo` implements a hook that does not exist.*trl_ext_trainer_init_strat"):
        make_plugin_manager()


def test_wrong_hook_arguments_are_a_usage_error(monkeypatch):
    class BadArgs:
        @trl_ext.hookimpl
        def trl_ext_trainer_init_end(self, trainer, ctx):  # `ctx` is not a spec argument
            pass

    install_fake_plugin(monkeypatch, "badargs", BadArgs())
    with pytest.raises(UsageError, match=r"`badargs` has a hook implementation that does not match its spec.*ctx"):
        make_plugin_manager()


def test_broken_entry_point_names_the_plugin(monkeypatch):
    fake = FakeDistribution("trl-ext-broken", {"broken": "_trl_ext_no_such_module:plugin"})
    real = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: [fake, *real(**kw)])
    with pytest.raises(UsageError, match=r"Could not load trl-ext plugin `broken`.*block: \[broken\]"):
        make_plugin_manager()


def test_exclusive_hook_with_two_answers_is_an_error():
    pm = trl_ext.manager.TrlExtPluginManager()
    pm.register(Answering("a"), name="first")
    pm.register(Answering("b"), name="second")
    with pytest.raises(
        UsageError, match=r"2 enabled plugins \(`first`, `second` implement it\) answered `trl_ext_make"
    ):
        call_exclusive(pm.hook.trl_ext_make_collator, trainer=None, context=None, collator=None)
    pm.unregister(name="second")
    assert call_exclusive(pm.hook.trl_ext_make_collator, trainer=None, context=None, collator=None) == "a"


def test_wrapper_beside_an_answer_is_not_a_second_answer_and_monitoring_sees_the_call():
    pm = trl_ext.manager.TrlExtPluginManager()
    wrapper = Wrapping()
    pm.register(Answering("a"), name="answer")
    pm.register(wrapper, name="wrapper")
    calls = []
    undo = pm.add_hookcall_monitoring(lambda name, impls, kwargs: calls.append(name), lambda *a: None)
    try:
        assert call_exclusive(pm.hook.trl_ext_make_collator, trainer=None, context=None, collator=None) == "a"
    finally:
        undo()
    assert wrapper.seen == [["a"]]
    assert calls == ["trl_ext_make_collator"]


def test_validate_config_is_called_through_pluggy_including_specname(monkeypatch):
    seen = []

    class Validator:
        @trl_ext.hookimpl(specname="trl_ext_validate_config")
        def check(self, config, trl_version):
            seen.append(trl_version)

    install_fake_plugin(monkeypatch, "validator", Validator())
    with trl_ext.install(plugins={"validator": {}}):
        pass
    assert len(seen) == 1


def test_options_for_a_plugin_that_is_off_are_refused():
    with pytest.raises(
        UsageError, match=r"`plugins.generation` sets \['budget'\], but `ds3_gather_for_generation` is"
    ):
        trl_ext.install(plugins={"generation": {"budget": "8GB"}})
