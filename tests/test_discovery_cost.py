"""Reading plugin declarations costs nothing: no torch, transformers or deepspeed until a plugin is registered."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

import trl_ext
import trl_ext.manager as manager
from trl_ext.manager import load_catalog, make_plugin_manager
from trl_ext.spec import Flag, PluginSpec, boolean

from ._fakes import install_fake_plugin

HEAVY = ("torch", "transformers", "deepspeed", "trl", "accelerate")
#: CPU seconds a discovery command may take (interpreter start-up included).
CPU_LIMIT_S = 1.5


@pytest.mark.slow
def test_load_catalog_and_config_import_nothing_heavy(report):
    code = textwrap.dedent(
        """
        import sys, time
        start = time.perf_counter()
        from trl_ext.manager import load_catalog
        catalog, _ = load_catalog()
        import trl_ext
        trl_ext.TrlExtConfig(**{flag: True for flag in ("padding_free", "prompt_sharing") if flag in catalog.flags})
        print(f"{time.perf_counter() - start:.3f}", len(catalog.specs))
        print(",".join(m for m in sys.argv[1:] if m in sys.modules))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code, *HEAVY], capture_output=True, text=True, check=True)
    out = proc.stdout.splitlines()
    seconds, plugins = out[0].split()
    report(
        "discovery cost",
        f"load_catalog() + TrlExtConfig(...) in a fresh process: {float(seconds):.3f} s, {plugins} plugins",
    )
    assert int(plugins) >= 5
    assert out[1] == "", f"reading the declarations imported {out[1]}"


def _cpu_seconds(argv: list[str]) -> tuple[float, float, str]:
    """CPU seconds (user + system) and wall seconds of a child process, and its output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("command", [["plugins"], ["--help"]])
def test_discovery_commands_are_cheap(command, report):
    cli = str(Path(sys.executable).with_name("trl-ext"))
    cpu, wall, out = _cpu_seconds([cli, *command])
    report("discovery cost", f"trl-ext {' '.join(command)}: {cpu:.2f} s CPU, {wall:.2f} s wall")
    assert out.strip()
    assert cpu < CPU_LIMIT_S, f"`trl-ext {' '.join(command)}` took {cpu:.2f} s of CPU"


def test_builtin_declarations_name_their_hook_module_and_registration_imports_it():
    catalog, plugins = load_catalog()
    for name in catalog.builtin:
        spec = catalog.specs[name]
        assert spec.hooks == ".hooks", name
        pm = make_plugin_manager(catalog=catalog)
        assert pm.get_plugin(name).__name__ == f"{plugins[name].__name__}.hooks"


def test_third_party_hooks_module_is_imported_only_when_registered(monkeypatch):
    impl = types.ModuleType("_trl_ext_fake_lazy_impl")
    seen: list[str] = []

    def trl_ext_describe(trainer, context):
        seen.append("describe")

    impl.trl_ext_describe = trl_ext_describe
    declaration_name = install_fake_plugin(
        monkeypatch,
        "lazy",
        types.SimpleNamespace(
            TRL_EXT_PLUGIN=PluginSpec(
                name="lazy",
                flags=(Flag("lazy", default=False, parse=boolean, help="Lazy."),),
                hooks="_trl_ext_fake_lazy_impl",
            )
        ),
    )
    imported: list[str] = []
    real_import = manager.importlib.import_module

    def tracking_import(name, package=None):
        imported.append(name)
        if name == "_trl_ext_fake_lazy_impl":
            return impl
        return real_import(name, package)

    monkeypatch.setattr(manager.importlib, "import_module", tracking_import)
    catalog, _ = load_catalog()
    assert "lazy" in catalog.specs and "_trl_ext_fake_lazy_impl" not in imported
    assert declaration_name  # the declaration itself was read
    pm = make_plugin_manager(catalog=catalog)
    assert pm.get_plugin("lazy") is impl and "_trl_ext_fake_lazy_impl" in imported


def test_a_hook_module_that_fails_to_import_names_the_plugin_and_how_to_block_it(monkeypatch):
    install_fake_plugin(
        monkeypatch,
        "lazy",
        types.SimpleNamespace(TRL_EXT_PLUGIN=PluginSpec(name="lazy", hooks="_trl_ext_no_such_module_anywhere")),
    )
    catalog, _ = load_catalog()
    with pytest.raises(trl_ext.UsageError, match=r"plugin `lazy` .*No module named.*TRL_EXT_BLOCK=lazy"):
        make_plugin_manager(catalog=catalog)


def test_install_discovers_the_plugins_once(monkeypatch):
    calls = []
    real = manager._sources

    def counting():
        calls.append(1)
        return real()

    monkeypatch.setattr(manager, "_sources", counting)
    monkeypatch.delenv("TRL_EXT_CONFIG", raising=False)
    for key in [k for k in os.environ if k.startswith("TRL_EXT_")]:
        monkeypatch.delenv(key)
    trl_ext.install(sync_metrics=True).uninstall()
    assert len(calls) == 1


def test_a_bad_hooks_path_is_refused_when_declared():
    with pytest.raises(trl_ext.UsageError, match="`hooks` must be a module path"):
        PluginSpec(name="bad", hooks="not a module")
