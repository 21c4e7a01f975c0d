"""The call context (`trl_ext.call_context`): one object says what is in effect for the running call, entries nest
and are undone on exit (also on an error), a plugin's slot is its own, and nothing else in the package keeps a context
variable of its own."""

from __future__ import annotations

import ast
import contextvars
import threading
from pathlib import Path

import pytest

from trl_ext import api, call_context
from trl_ext.call_context import CallContext, CallSlot, call_entered, current_call

PACKAGE = Path(__file__).resolve().parents[1] / "trl_ext"


def test_entries_nest_and_each_exit_restores_the_context_before():
    assert current_call() == CallContext()
    with call_entered(stock=True) as outer:
        assert current_call() is outer and outer.stock and not outer.packed
        with call_entered(packed=True, packed_bounds=[0, 3, 5]):
            call = current_call()
            assert (call.stock, call.packed, call.packed_bounds) == (True, True, [0, 3, 5])
        with call_entered(stock=False):  # an inner layer may turn a fact off for its block (verify's float32 call)
            assert not current_call().stock
        assert current_call() is outer
    assert current_call() == CallContext()


def test_an_error_inside_the_block_restores_the_context():
    slot: CallSlot[int] = CallSlot("test.error")
    with pytest.raises(ValueError, match="boom"), call_entered(probing=True), slot.entered(3):
        assert current_call().probing and slot.get() == 3
        raise ValueError("boom")
    assert current_call() == CallContext() and slot.get() is None


def test_slots_are_kept_apart_and_read_from_a_given_context():
    first: CallSlot[str] = CallSlot("test.first")
    second: CallSlot[str] = CallSlot("test.first")  # the same name is another slot: a slot is its object
    with first.entered("a") as value:
        assert value == "a" and first.get() == "a" and second.get() is None
        inside = current_call()
        with second.entered("b"):
            assert (first.get(), second.get()) == ("a", "b")
    assert first.get() is None and first.get(inside) == "a"
    assert "CallSlot('test.first')" in repr(inside)


def test_the_context_is_immutable():
    with pytest.raises(AttributeError):
        current_call().stock = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        current_call().slots[CallSlot("x")] = 1  # type: ignore[index]
    with pytest.raises(TypeError, match="unexpected keyword"):
        with call_entered(stok=True):
            pass


def test_a_thread_started_inside_a_block_sees_the_context_only_when_copied():
    """As with any context variable: a plain thread starts from the default, `copy_context` carries the block's."""
    seen = {}
    with call_entered(stock=True):
        plain = threading.Thread(target=lambda: seen.setdefault("plain", current_call().stock))
        copied = contextvars.copy_context()
        carried = threading.Thread(target=lambda: seen.setdefault("copied", copied.run(lambda: current_call().stock)))
        for thread in (plain, carried):
            thread.start()
            thread.join()
    assert seen == {"plain": False, "copied": True}


def test_the_public_api_serves_the_call_context():
    assert (api.CallContext, api.CallSlot, api.call_entered, api.current_call) == (
        call_context.CallContext,
        call_context.CallSlot,
        call_context.call_entered,
        call_context.current_call,
    )


def _context_variables(source: str) -> list[int]:
    """The lines of `source` that create a `contextvars.ContextVar`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "ContextVar":
                found.append(node.lineno)
    return found


def test_only_the_call_context_holds_a_context_variable():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        lines = _context_variables(source) if "ContextVar" in source else []  # only those that name it: 2 ms, not 1 s
        if lines:
            found[path.relative_to(PACKAGE).as_posix()] = lines
    assert list(found) == ["call_context.py"] and len(found["call_context.py"]) == 1


def test_the_context_variable_rule_finds_one():
    source = "import contextvars\nfrom contextvars import ContextVar\n"
    source += "A = contextvars.ContextVar('a')\nB = ContextVar('b')\n"
    assert _context_variables(source) == [3, 4]
