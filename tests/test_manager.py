"""Plugin discovery and validation: entry points, blocking, misspelled hooks, exclusive hooks."""

from __future__ import annotations

import importlib.metadata

import pluggy
import pytest

import trl_ext
from trl_ext import UsageError
from trl_ext.manager import call_exclusive, known_plugin_names, make_plugin_manager
from trl_ext.plugins import BUILTIN_PLUGINS

from ._fakes import FakeDistribution, install_fake_plugin


class Answering:
    """A third-party style plugin that answers one exclusive hook."""

    def __init__(self, value):
        self.value = value

    @trl_ext.hookimpl
    def trl_ext_make_collator(self, trainer, context, collator):
        return self.value


def test_entry_point_plugins_are_discovered_and_registered_like_builtins(monkeypatch):
    plugin = Answering("x")
    install_fake_plugin(monkeypatch, "thirdparty", plugin)
    assert "thirdparty" in known_plugin_names()
    pm = make_plugin_manager()
    assert pm.get_plugin("thirdparty") is plugin
    assert [n for n, _ in pm.list_name_plugin()] == [*BUILTIN_PLUGINS, "thirdparty"]


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


def test_wrong_hook_arguments_fail_at_start_up(monkeypatch):
    class BadArgs:
        @trl_ext.hookimpl
        def trl_ext_trainer_init_end(self, trainer, ctx):  # `ctx` is not a spec argument
            pass

    install_fake_plugin(monkeypatch, "badargs", BadArgs())
    with pytest.raises(pluggy.PluginValidationError):
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
    with pytest.raises(UsageError, match=r"`second`, `first` all provide `trl_ext_make_collator`"):
        call_exclusive(pm.hook.trl_ext_make_collator, trainer=None, context=None, collator=None)
    pm.unregister(name="second")
    assert call_exclusive(pm.hook.trl_ext_make_collator, trainer=None, context=None, collator=None) == "a"


def test_exclusive_hooks_are_declared_firstresult():
    pm = trl_ext.manager.TrlExtPluginManager()
    for name in dir(pm.hook):
        if name.startswith("trl_ext_make_") or name == "trl_ext_reduce_metrics":
            caller = getattr(pm.hook, name)
            assert caller.spec.opts["firstresult"], name
            assert "Stops at first non-None result" in caller.spec.function.__doc__, name
