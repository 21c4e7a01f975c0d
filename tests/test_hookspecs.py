"""The hook specs are the plugin API: every hook is prefixed, documented, typed, and has no parameter defaults."""

from __future__ import annotations

import inspect

import pluggy

from trl_ext import hookspecs
from trl_ext.manager import TrlExtPluginManager

SPECS = {name: fn for name, fn in vars(hookspecs).items() if callable(fn) and name.startswith("trl_ext_")}


def test_every_hook_is_declared_prefixed_and_documented():
    pm = TrlExtPluginManager()
    declared = {name for name in dir(pm.hook) if not name.startswith("_")}
    assert declared == set(SPECS)
    for name, fn in SPECS.items():
        doc = inspect.getdoc(fn) or ""
        assert doc and len(doc.splitlines()[0]) > 10, f"{name} has no summary line"
        assert fn.__annotations__.get("return") is not None, f"{name} has no return annotation"


def test_no_hook_parameter_has_a_default_and_every_parameter_is_annotated():
    # pluggy does not pass arguments that have defaults, so a default would silently hide the caller's value.
    for name, fn in SPECS.items():
        for param in inspect.signature(fn).parameters.values():
            assert param.default is inspect.Parameter.empty, f"{name}({param.name}) has a default"
            assert param.annotation is not inspect.Parameter.empty, f"{name}({param.name}) is not annotated"


def test_exclusive_hooks_are_plain_hooks_whose_results_the_core_checks():
    pm = TrlExtPluginManager()
    exclusive = [n for n in SPECS if n.startswith("trl_ext_make_") or n == "trl_ext_reduce_metrics"]
    assert exclusive
    for name in exclusive:
        caller = getattr(pm.hook, name)
        assert not caller.spec.opts["firstresult"], name  # every implementation runs, wrappers included
        assert "Exclusive" in (caller.spec.function.__doc__ or ""), name


def test_markers_are_named_after_the_project():
    assert isinstance(hookspecs.hookspec, pluggy.HookspecMarker) and hookspecs.hookspec.project_name == "trl_ext"
    assert isinstance(hookspecs.hookimpl, pluggy.HookimplMarker) and hookspecs.hookimpl.project_name == "trl_ext"
