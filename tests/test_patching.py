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
