"""Plugins declare what they serve; they never name each other. The core resolves roles and attaches only to the
trainers an enabled plugin applies to."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import trl_ext
from trl_ext.manager import load_catalog, resolve_roles
from trl_ext.plugins.prompt_sharing import setup as sharing_setup
from trl_ext.spec import PluginSpec
from trl_ext.toolkit import architecture

from .helpers import code_tokens, parse

PLUGINS = Path(__file__).resolve().parents[1] / "trl_ext" / "plugins"


def _names(catalog, plugin: str) -> set[str]:
    return {plugin, *catalog.specs[plugin].flag_names}


def _named(path: Path, names: set[str]) -> list[str]:
    """The plugin names a module's code uses: identifiers and string tokens; a name that is an ordinary word
    (`generation`) counts in a string only as the whole string (`is_enabled("generation")`)."""
    tokens = code_tokens(path)
    strings = {node.value for node in ast.walk(parse(path.read_text())) if isinstance(node, ast.Constant)}
    return sorted(n for n in names if (n in tokens and "_" in n) or n in strings)


def test_no_builtin_plugin_module_names_another_plugin():
    catalog, _ = load_catalog()
    found = {}
    for plugin in sorted(catalog.builtin):
        others = set().union(*(_names(catalog, other) for other in catalog.builtin if other != plugin))
        for path in sorted((PLUGINS / plugin).rglob("*.py")):
            named = _named(path, others)
            if named:
                found[str(path.relative_to(PLUGINS))] = named
    every = set().union(*(_names(catalog, name) for name in catalog.builtin))
    for path in sorted(PLUGINS.glob("_*.py")):  # the shared library modules name no plugin at all
        named = _named(path, every)
        if named:
            found[path.name] = named
    assert found == {}


def test_no_builtin_plugin_imports_another():
    catalog, _ = load_catalog()
    found = []
    for plugin in sorted(catalog.builtin):
        for path in sorted((PLUGINS / plugin).rglob("*.py")):
            for node in ast.walk(parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    parts = set(node.module.split("."))
                    if parts & (set(catalog.builtin) - {plugin}):
                        found.append((str(path.relative_to(PLUGINS)), node.module))
    assert found == []


def _spec(name: str, precedence: int = 0, serves: tuple[str, ...] = ("packing",)) -> PluginSpec:
    return PluginSpec(name=name, serves=serves, precedence=precedence)


def test_roles_keep_the_highest_precedence_and_say_what_was_left_out():
    specs = {"a": _spec("a"), "b": _spec("b", 1), "c": _spec("c", serves=("other",)), "d": PluginSpec(name="d")}
    assert resolve_roles(specs, ["a", "b", "c", "d"]) == (["b", "c", "d"], {"a": "b"})
    assert resolve_roles(specs, ["a", "c"]) == (["a", "c"], {})
    with pytest.raises(trl_ext.UsageError, match=r"`a`, `e` all serve `packing` .* same precedence"):
        resolve_roles({**specs, "e": _spec("e")}, ["a", "e"])


def test_serves_must_be_a_tuple_of_roles():
    with pytest.raises(trl_ext.UsageError, match="`serves` must be a tuple"):
        PluginSpec(name="x", serves="packing")  # type: ignore[arg-type]


def test_builtin_packing_plugins_declare_the_role():
    catalog, _ = load_catalog()
    packing = {n: s.precedence for n, s in catalog.specs.items() if "packing" in s.serves}
    assert packing == {"padding_free": 0, "prompt_sharing": 1}


def test_prompt_sharing_table_is_the_packing_table_less_its_exclusions():
    assert sharing_setup.VERIFIED_MODEL_TYPES == architecture.verified_except(sharing_setup.NOT_VERIFIED)
    assert set(sharing_setup.NOT_VERIFIED) <= set(architecture.VERIFIED_MODEL_TYPES)
    print(
        f"\npacking table: {len(architecture.VERIFIED_MODEL_TYPES)} types; prompt_sharing: "
        f"{len(sharing_setup.VERIFIED_MODEL_TYPES)} (less {sorted(sharing_setup.NOT_VERIFIED)})"
    )
    with pytest.raises(ValueError, match="not in VERIFIED_MODEL_TYPES"):
        architecture.verified_except({"no_such_type": "?"})


@pytest.mark.parametrize(
    ("flags", "wrapped"),
    [
        ({"sync_metrics": True, "block": ["generation"]}, {"DPOTrainer", "OnlineDPOTrainer"}),
        ({"ds3_gather_for_generation": "auto"}, {"DPOTrainer", "OnlineDPOTrainer", "GRPOTrainer", "RLOOTrainer"}),
        # padding_free serves `DPOConfig.padding_free`, which can enable it per trainer; precompute_ref_batch_size,
        # off, advises on TRL's own `precompute_ref_batch_size` (`trl_ext_advise_unused`)
        ({"block": ["generation"]}, {"DPOTrainer"}),
        ({"block": ["padding_free", "generation", "precompute_ref_batch_size"]}, set()),
        # generation, off, advises on TRL's own ZeRO-3 `ds3_gather_for_generation=False`
        (
            {"block": ["padding_free", "precompute_ref_batch_size"]},
            {"OnlineDPOTrainer", "GRPOTrainer", "RLOOTrainer"},
        ),
    ],
)
def test_the_core_attaches_only_to_trainers_an_enabled_plugin_applies_to(flags, wrapped, monkeypatch):
    import trl.trainer.grpo_trainer as grpo

    from trl_ext import _compat

    for key in [k for k in __import__("os").environ if k.startswith("TRL_EXT_")]:
        monkeypatch.delenv(key)
    stock = grpo.unwrap_model_for_generation
    with trl_ext.install(**flags) as installation:
        assert set(installation._wrapped_trainers()) == wrapped
        patched = {
            name
            for name, (module, cls) in _compat.TRAINERS.items()
            if hasattr(getattr(__import__(module, fromlist=[cls]), cls).__init__, "__wrapped__")
        }
        assert patched == wrapped
        assert (grpo.unwrap_model_for_generation is not stock) == ("GRPOTrainer" in wrapped)
