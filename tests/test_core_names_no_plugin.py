"""The core names no built-in plugin: adding or removing a plugin touches only its own module.

Scans the code (identifiers and string literals, not docstrings or comments, which may show examples) of every core
module: `trl_ext/*.py` except `_compat.py` (TRL's own flag names are TRL facts there, e.g. `DPOConfig.padding_free`)
and `testing.py` (helpers for tests and benchmarks). The plugins and the app (`trl_ext/plugins/`, `trl_ext/app/`)
are not core.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from trl_ext.manager import load_catalog

PACKAGE = Path(__file__).resolve().parents[1] / "trl_ext"
NOT_CORE = {"_compat.py", "testing.py"}


def _code_tokens(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    tokens: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            tokens.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
        elif isinstance(node, ast.Name):
            tokens.add(node.id)
        elif isinstance(node, ast.Attribute):
            tokens.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            tokens.add(node.name)
    return tokens


def test_no_core_module_names_a_builtin_plugin_or_its_flags():
    catalog, _ = load_catalog()
    names = set()
    for name in catalog.builtin:
        names.add(name)
        names.update(catalog.specs[name].flag_names)
    core = [p for p in sorted(PACKAGE.glob("*.py")) if p.name not in NOT_CORE]
    assert core
    found = {path.name: sorted(_code_tokens(path) & names) for path in core}
    assert {k: v for k, v in found.items() if v} == {}
