"""The undo stack: exact restoration (own `__dict__` entries, inheritance), reverse order, idempotent undo."""

from __future__ import annotations

import functools
import types

import pytest

from trl_ext import UsageError
from trl_ext.patching import Patcher, resolve


class Base:
    def method(self):
        return "base"

    @staticmethod
    def static():
        return "static"


class Child(Base):
    pass


def test_patching_an_inherited_attribute_restores_the_inheritance():
    patcher = Patcher()
    patcher.wrap(Child, "method", lambda original: functools.wraps(original)(lambda self: "patched"))
    assert Child().method() == "patched" and Base().method() == "base"
    assert "method" in Child.__dict__
    patcher.undo()
    assert "method" not in Child.__dict__  # not a copy of Base.method: the inheritance itself is back
    assert Child().method() == "base"


def test_own_entries_are_restored_identically_in_reverse_order_and_undo_twice_is_a_no_op():
    module = types.ModuleType("m")
    module.f = original = lambda: 1
    static_entry = Base.__dict__["static"]
    patcher = Patcher()
    patcher.setattr(module, "f", lambda: 2)
    patcher.setattr(module, "f", lambda: 3)  # patched twice: undo must end at the first original
    patcher.setattr(Base, "static", staticmethod(lambda: "new"))
    assert module.f() == 3 and Base.static() == "new" and len(patcher) == 3
    patcher.undo()
    assert module.f is original and Base.__dict__["static"] is static_entry
    patcher.undo()
    assert module.f is original and len(patcher) == 0


def test_instance_patches_are_removed_not_overwritten():
    obj = Base()
    patcher = Patcher()
    patcher.setattr(obj, "method", lambda: "instance")
    assert obj.method() == "instance"
    patcher.undo()
    assert "method" not in obj.__dict__ and obj.method() == "base"


def test_a_missing_attribute_is_a_usage_error_naming_the_target():
    patcher = Patcher()
    with pytest.raises(UsageError, match=r"cannot find `.*Base.renamed`.*TRL has renamed or removed it"):
        patcher.setattr(Base, "renamed", 1)
    assert len(patcher) == 0
    patcher.setattr(Base, "renamed", 1, raising=False)
    patcher.undo()
    assert not hasattr(Base, "renamed")


def test_resolve_imports_dotted_names_and_reports_renames():
    assert resolve("trl_ext.patching.Patcher") is Patcher
    with pytest.raises(UsageError, match="cannot find `trl_ext.patching.Nope`"):
        resolve("trl_ext.patching.Nope")


def _tagging(tag):
    def make(original):
        @functools.wraps(original)
        def wrapper():
            return f"{tag}({original()})"

        return wrapper

    return make


def test_undo_out_of_order_removes_only_its_own_layer():
    """Two patchers wrap one attribute; the first is undone while the second's wrapper is in place (two trainers'
    overlapping runs, or a process-wide patch released while a trainer runs): the second's wrapper stays, over the
    original, and undoing it restores the original object itself."""
    module = types.ModuleType("m")
    module.f = original = lambda: "f"
    first, second = Patcher("first"), Patcher("second")
    first.wrap(module, "f", _tagging("A"))
    second.wrap(module, "f", _tagging("B"))
    assert module.f() == "B(A(f))"
    first.undo()
    assert module.f() == "B(f)"
    second.undo()
    assert module.f is original
    # a value set in the middle: the wrapper above it keeps wrapping it; in order, the stack as before
    first.wrap(module, "f", _tagging("A"))
    second.setattr(module, "f", lambda: "set")
    third = Patcher("third")
    third.wrap(module, "f", _tagging("C"))
    assert module.f() == "C(set)"
    first.undo()
    assert module.f() == "C(set)"
    third.undo()
    assert module.f() == "set"
    second.undo()
    assert module.f is original


def test_a_change_made_outside_the_patchers_starts_a_new_stack():
    """Something else replaced the attribute after a patch: a later patch layers over that value, and undoing the
    older patch restores what it recorded, as a plain undo stack does."""
    module = types.ModuleType("m")
    module.f = original = lambda: "f"
    first, second = Patcher("first"), Patcher("second")
    first.wrap(module, "f", _tagging("A"))
    module.f = foreign = lambda: "foreign"
    second.wrap(module, "f", _tagging("B"))
    assert module.f() == "B(foreign)"
    second.undo()
    assert module.f is foreign
    first.undo()
    assert module.f is original
