"""Plugin discovery, declarations and hook calls: entry points, blocking, misspelled hooks, exclusive hooks."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import sys
import types

import pytest

import trl_ext
from trl_ext import UsageError
from trl_ext.config import load_config
from trl_ext.manager import builtin_plugin_modules, call_exclusive, load_catalog, make_plugin_manager
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
    import pkgutil

    import trl_ext.plugins

    builtins = builtin_plugin_modules()
    public = {i.name for i in pkgutil.iter_modules(trl_ext.plugins.__path__) if not i.name.startswith("_")}
    assert builtins and set(builtins) == public
    catalog, plugins = load_catalog()
    assert set(builtins) <= set(catalog.builtin)
    for name in builtins:
        assert catalog.specs[name].name == name  # same name everywhere
        assert plugins[name].__name__ == builtins[name] == f"trl_ext.plugins.{name}"


def test_entry_point_plugins_are_discovered_and_registered_like_builtins(monkeypatch):
    plugin = Answering("x")
    install_fake_plugin(monkeypatch, "thirdparty", plugin)
    pm = make_plugin_manager()
    assert pm.get_plugin("thirdparty") is plugin
    assert [n for n, _ in pm.list_name_plugin()] == [*builtin_plugin_modules(), "thirdparty"]
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


@pytest.fixture
def manager_log(trl_ext_log, monkeypatch):
    """trl-ext's log records, with the once-per-process memory of reported broken plugins cleared."""
    import trl_ext.manager

    monkeypatch.setattr(trl_ext.manager, "_WARNED", set())
    return trl_ext_log


def _assert_broken(name: str, match: str, log, enable: dict | None = None) -> None:
    """`name` is skipped with one warning naming it and the exact block setting; the other plugins still work; enabling
    it is a UsageError with the same advice; blocking it silences it."""
    pm = make_plugin_manager()
    assert pm.get_plugin(name) is None and set(builtin_plugin_modules()) <= {n for n, _ in pm.list_name_plugin()}
    warnings = [r.getMessage() for r in log.records if r.levelname == "WARNING" and f"`{name}`" in r.getMessage()]
    assert len(warnings) == 1, log.text
    assert f"`TRL_EXT_BLOCK={name}`" in warnings[0] and f"`block: [{name}]`" in warnings[0], warnings[0]
    assert re.search(match, warnings[0]), warnings[0]
    make_plugin_manager()
    assert len([r for r in log.records if f"`{name}`" in r.getMessage()]) == 1  # once per process
    with trl_ext.install(sync_metrics=True) as installation:  # every other plugin is usable
        assert installation.enabled_plugins("DPOTrainer") == ["sync_metrics"]
    with pytest.raises(UsageError, match=rf"(?s)`{name}`.*{match}.*`TRL_EXT_BLOCK={name}`"):
        trl_ext.install(**(enable or {"plugins": {name: {}}}))
    log.clear()
    assert make_plugin_manager(block=[name]).is_blocked(name)
    assert not [r for r in log.records if f"`{name}`" in r.getMessage()]


def test_legacy_declaration_is_a_broken_plugin(monkeypatch, manager_log):
    install_fake_plugin(monkeypatch, "old", _module_plugin("old", TRL_EXT_FLAGS=("old",)))
    _assert_broken("old", r"declares TRL_EXT_FLAGS.*TRL_EXT_PLUGIN = trl_ext.PluginSpec", manager_log)


def test_spec_name_must_match_the_registration_name(monkeypatch, manager_log):
    install_fake_plugin(monkeypatch, "thirdparty", _module_plugin("x", PluginSpec(name="other")))
    _assert_broken("thirdparty", "registered as `thirdparty` declares the name `other`", manager_log)


def test_two_plugins_cannot_own_one_flag(monkeypatch, manager_log):
    spec = PluginSpec(name="clash", flags=(Flag("padding_free", default=False, parse=boolean, help="x"),))
    install_fake_plugin(monkeypatch, "clash", _module_plugin("clash", spec))
    _assert_broken(
        "clash", "declares the flag `padding_free`, which the plugin `padding_free` declares too", manager_log
    )


def test_flag_of_a_broken_plugin_names_it(monkeypatch, manager_log):
    class BadHook:
        TRL_EXT_PLUGIN = PluginSpec(name="turbo", flags=(Flag("turbo", default=False, parse=boolean, help="x"),))

        def trl_ext_trainer_init_strat(self, trainer, context, init_kwargs):  # misspelled
            pass

    install_fake_plugin(monkeypatch, "turbo", BadHook())
    _assert_broken("turbo", "implements a hook that does not exist", manager_log, enable={"turbo": True})
    with pytest.raises(UsageError, match=r"`turbo` is set \(from environment variable \$TRL_EXT_TURBO\)"):
        load_config(environ={"TRL_EXT_TURBO": "1"})
    # A broken plugin whose declaration cannot be read: unknown flags point at it.
    fake = FakeDistribution("trl-ext-gone", {"gone": "_trl_ext_no_such_module:plugin"})
    real = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: [fake, *real(**kw)])
    with pytest.raises(UsageError, match=r"Unknown trl-ext flag `gone_fast`.*could not be loaded.*`gone`"):
        load_config(flags={"gone_fast": True}, environ={})


def test_misspelled_hook_is_a_broken_plugin(monkeypatch, manager_log):
    class Typo:
        def trl_ext_trainer_init_strat(self, trainer, context, init_kwargs):  # note the typo, and no marker
            pass

    install_fake_plugin(monkeypatch, "typo", Typo())
    _assert_broken("typo", r"`typo` implements a hook that does not exist.*trl_ext_trainer_init_strat", manager_log)


def test_wrong_hook_arguments_are_a_broken_plugin(monkeypatch, manager_log):
    class BadArgs:
        @trl_ext.hookimpl
        def trl_ext_trainer_init_end(self, trainer, ctx):  # `ctx` is not a spec argument
            pass

    install_fake_plugin(monkeypatch, "badargs", BadArgs())
    _assert_broken("badargs", r"`badargs` has a hook implementation that does not match its spec.*ctx", manager_log)


def test_broken_entry_point_names_the_plugin(monkeypatch, manager_log):
    fake = FakeDistribution("trl-ext-broken", {"broken": "_trl_ext_no_such_module:plugin"})
    real = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: [fake, *real(**kw)])
    _assert_broken(
        "broken", r"importing `_trl_ext_no_such_module:plugin` \(package `trl-ext-broken`\) failed", manager_log
    )
    from trl_ext.app.cli import main

    assert main(["plugins"]) == 0  # `trl-ext plugins` lists the others


def test_two_distributions_with_one_plugin_name(monkeypatch, manager_log):
    install_fake_plugin(monkeypatch, "twin", Answering("a"), dist_name="trl-ext-twin-a")
    install_fake_plugin(monkeypatch, "twin", Answering("b"), dist_name="trl-ext-twin-b")
    _assert_broken(
        "twin", r"`trl-ext-twin-b`, `trl-ext-twin-a` each provide a trl-ext plugin named `twin`", manager_log
    )


def test_same_distribution_twice_on_the_path_is_one_plugin(monkeypatch, manager_log):
    module = install_fake_plugin(monkeypatch, "single", Answering("a"), dist_name="trl-ext-single")
    again = FakeDistribution("trl_ext.single", {"single": f"{module}:plugin"})  # same name, normalised
    real = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: [*real(**kw), again])
    assert make_plugin_manager().get_plugin("single") is not None
    assert not [r for r in manager_log.records if "`single`" in r.getMessage()]


def test_builtin_name_taken_by_a_third_party(monkeypatch, manager_log):
    install_fake_plugin(monkeypatch, "sync_metrics", Answering("x"), dist_name="trl-ext-impostor")
    pm = make_plugin_manager()
    assert pm.get_plugin("sync_metrics") is None and pm.get_plugin("padding_free") is not None
    with pytest.raises(UsageError, match=r"`sync_metrics` is set.*`trl-ext-impostor` provides .* built-in"):
        trl_ext.install(sync_metrics=True)
    with trl_ext.install(padding_free=True):
        pass


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


def test_trl_ext_plugins_lists_each_flag_and_option_with_values_default_and_help(monkeypatch, capsys):
    from trl_ext.app.cli import main

    spec = PluginSpec(
        name="mine",
        summary="Mine.",
        flags=(Flag("mine_flag", default=False, parse=boolean, help="Turn mine on. More text that is not shown."),),
        options=MineOptions,
    )
    install_fake_plugin(monkeypatch, "mine", _module_plugin("mine", spec))
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  flag   mine_flag: true or false; default false. Turn mine on." in lines
    assert "  option plugins.mine.alpha: a positive integer; default 1. A positive number." in lines
    assert any(
        line.startswith('  option plugins.padding_free.attention: "auto" or "varlen" or "dense"') for line in lines
    )
    assert (
        "  flag   sync_metrics: true or false; default false. Log exact global metrics, one collective per log step."
        in lines
    )


def _dist_info(root, name: str) -> None:
    """An installed third-party plugin `name`: its module and a `.dist-info` with its `trl_ext` entry point."""
    declaration = f"from trl_ext.spec import PluginSpec\nTRL_EXT_PLUGIN = PluginSpec(name={name!r})\n"
    (root / f"{name}.py").write_text(declaration)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[trl_ext]\n{name} = {name}\n")


def _touched(folder) -> None:
    """The folder's modification time moved on by a millisecond, as the next install's would (a filesystem's clock
    may tick coarser than two writes of a test)."""
    import os

    stamp = os.stat(folder).st_mtime_ns + 1_000_000
    os.utime(folder, ns=(stamp, stamp))


def test_installed_plugins_are_read_again_only_when_the_path_changed(tmp_path, monkeypatch):
    import shutil

    from trl_ext import manager

    _dist_info(tmp_path, "tp_first")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "tp_first" in load_catalog()[0].specs
    read = manager._sources()
    assert manager._sources() is read  # nothing changed: not read again
    _dist_info(tmp_path, "tp_second")  # installed while Python runs
    _touched(tmp_path)
    assert {"tp_first", "tp_second"} <= set(load_catalog()[0].specs)
    shutil.rmtree(tmp_path / "tp_first-0.1.dist-info")  # uninstalled
    _touched(tmp_path)
    specs = load_catalog()[0].specs
    assert "tp_first" not in specs and "tp_second" in specs
    install_fake_plugin(monkeypatch, "tp_fake", Answering("x"))  # `importlib.metadata.distributions` replaced
    assert "tp_fake" in load_catalog()[0].specs
    read = manager._sources()
    monkeypatch.syspath_prepend(str(tmp_path / "absent"))  # a path entry that does not exist holds nothing
    assert manager._sources() is read
    (tmp_path / "absent").mkdir()  # until it does
    assert manager._sources() is not read

    class Finder:  # a finder of `sys.meta_path` that finds a distribution outside every folder of the path
        def find_spec(self, *args):
            return None

        def find_distributions(self, context=None):
            return [FakeDistribution("trl-ext-meta", {"tp_meta": f"{module}:plugin"})]

    module = install_fake_plugin(monkeypatch, "tp_meta_module", Answering("m"), dist_name="trl-ext-other")
    assert "tp_meta" not in load_catalog()[0].specs
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, Finder()])
    assert "tp_meta" in load_catalog()[0].specs
