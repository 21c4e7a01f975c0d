"""The core names no built-in plugin: adding or removing a plugin touches only its own module.

Scans the code (identifiers and string literals, not docstrings or comments, which may show examples) of every core
module: `trl_ext/*.py` except `testing.py` (helpers for tests and benchmarks). The index of TRL facts (the package
`_compat/`: TRL's own flag names are TRL facts there, e.g. `DPOConfig.padding_free`), the plugins and the app
(`trl_ext/plugins/`, `trl_ext/app/`) are not core.
"""

from __future__ import annotations

from pathlib import Path

from tests import helpers
from trl_ext.manager import load_catalog

PACKAGE = Path(__file__).resolve().parents[1] / "trl_ext"
NOT_CORE = {"testing.py"}


def test_no_core_module_names_a_builtin_plugin_or_its_flags():
    catalog, _ = load_catalog()
    names = set()
    for name in catalog.builtin:
        names.add(name)
        names.update(catalog.specs[name].flag_names)
    core = [p for p in sorted(PACKAGE.glob("*.py")) if p.name not in NOT_CORE]
    assert core
    found = {path.name: sorted(helpers.code_tokens(path) & names) for path in core}
    assert {k: v for k, v in found.items() if v} == {}
