"""`trl_ext.api`, the public module for plugin authors, and the import rules around it, checked on the source:

- a module of one built-in plugin (`trl_ext/plugins/<name>/...`) never imports another plugin
  (`trl_ext.plugins.<other>` and anything under it);
- a built-in plugin imports trl-ext only through the public surface, as a third-party plugin of its kind would:
  `trl_ext.api`, the toolkit (`trl_ext.toolkit[.x]`), the public names of `trl_ext`, plus `trl_ext._compat` (the
  core's index of TRL facts) and its own package; never a private core module (`trl_ext._logging`, `trl_ext.errors`,
  `trl_ext.context`, ...);
- third-party-style code (tests/typed_plugin/, the example plugin of docs/writing-plugins.md, which
  tests/test_third_party.py installs) imports only `trl_ext`, `trl_ext.api` and the toolkit of trl-ext;
- every name of `trl_ext.api` resolves, to the object of the module that owns it, and importing it is light.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import trl_ext.api as api
from tests import helpers

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_ext"
PUBLIC = {"trl_ext", "trl_ext.api"}
TOOLKIT = "trl_ext.toolkit"
#: What a built-in plugin imports of trl-ext besides the public surface: the core's index of TRL facts.
BUILT_IN_EXTRA = {"trl_ext._compat"}
HEAVY = ("torch", "transformers", "deepspeed", "trl", "accelerate")


def imported_names(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """Every dotted name `module` imports, at any level (function bodies and `TYPE_CHECKING` blocks included),
    relative imports resolved: `import a.b` gives `a.b`; `from a import b` gives `a.b` (`b` may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(helpers.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source_module = helpers.imported_from(node, package)
            out.update(f"{source_module}.{alias.name}" for alias in node.names)
    return out


def _trl_ext_module(name: str) -> str | None:
    """The module of trl-ext that dotted `name` (a module, or a name imported from one) lies in, or None."""
    parts = name.split(".")
    if parts[0] != "trl_ext":
        return None
    for end in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:end])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts[:end])
    return "trl_ext"


def _plugin_of(module: str) -> str | None:
    """The built-in plugin `trl_ext.plugins.<name>...` belongs to (public names only), or None."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["trl_ext", "plugins"] and not parts[2].startswith("_"):
        return parts[2]
    return None


def _plugin_imports(sources: dict[str, tuple[str, bool]], refused) -> list[str]:
    """`"importer -> imported"` for every import in a module of a built-in plugin for which `refused(name, plugin)`
    holds. `sources`: `{module: (source, is_package)}`."""
    found = []
    for module, (source, is_package) in sorted(sources.items()):
        own = _plugin_of(module)
        if own is None:
            continue
        found += [
            f"{module} -> {name}"
            for name in sorted(imported_names(source, module, is_package=is_package))
            if refused(name, own)
        ]
    return found


def cross_plugin_imports(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every import, in a module of one plugin, of another plugin's modules."""
    return _plugin_imports(sources, lambda name, own: _plugin_of(name) not in (None, own))


def _public_module(module: str) -> bool:
    return module in PUBLIC or module == TOOLKIT or module.startswith(f"{TOOLKIT}.")


def non_public_imports(source: str) -> list[str]:
    """The modules of trl-ext that third-party code `source` imports other than `trl_ext`, `trl_ext.api` and the
    toolkit's."""
    names = {_trl_ext_module(name) for name in imported_names(source, "third_party")}
    return sorted(name for name in names if name is not None and not _public_module(name))


def _built_in_may_import(name: str, own: str) -> bool:
    """Whether the built-in plugin `own` may import dotted `name` (a module, or a name imported from one)."""
    package = f"trl_ext.plugins.{own}"
    if name == package or name.startswith(f"{package}."):
        return True
    module = _trl_ext_module(name)
    if module is None:
        return True  # not trl-ext's
    if module == "trl_ext":  # a name of the package itself: its public ones
        return name == "trl_ext" or not name.split(".")[1].startswith("_")
    return _public_module(module) or module in BUILT_IN_EXTRA


def built_in_private_imports(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every import, in a module of a built-in plugin, of trl-ext outside what a built-in may import
    (`_built_in_may_import`)."""
    return _plugin_imports(sources, lambda name, own: not _built_in_may_import(name, own))


def _package_sources() -> dict[str, tuple[str, bool]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = (path.read_text(), is_package)
    return out


def _third_party_sources() -> dict[str, str]:
    docs = (ROOT / "docs" / "writing-plugins.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", docs, flags=re.S) if "trl_ext" in b]
    assert blocks, "docs/writing-plugins.md has no python example that uses trl_ext"
    return {
        "tests/typed_plugin/typed_counter.py": (ROOT / "tests" / "typed_plugin" / "typed_counter.py").read_text(),
        **{f"docs/writing-plugins.md block {i}": block for i, block in enumerate(blocks)},
    }


def test_no_plugin_imports_another():
    sources = _package_sources()
    plugins = {_plugin_of(module) for module in sources} - {None}
    assert {"padding_free", "prompt_sharing", "token_budget"} <= plugins
    assert cross_plugin_imports(sources) == []


def test_the_cross_plugin_check_catches_relative_and_absolute_imports():
    sources = {
        "trl_ext.plugins.alpha": ("from ...toolkit import roles\nfrom . import hooks\n", True),
        "trl_ext.plugins.alpha.hooks": (
            "from trl_ext.toolkit.packing import positions\nfrom ..beta.cut import plan\n"
            "def f():\n    import trl_ext.plugins.gamma\n",
            False,
        ),
        "trl_ext.plugins.beta": ("from .. import alpha\n", True),
        "trl_ext.plugins._shared_thing": ("from . import alpha\n", False),  # not a plugin: not this rule's
    }
    assert cross_plugin_imports(sources) == [
        "trl_ext.plugins.alpha.hooks -> trl_ext.plugins.beta.cut.plan",
        "trl_ext.plugins.alpha.hooks -> trl_ext.plugins.gamma",
        "trl_ext.plugins.beta -> trl_ext.plugins.alpha",
    ]


def test_built_in_plugins_import_only_the_public_surface():
    """A built-in plugin is written as a third-party one of its kind could be: `trl_ext.api`, the toolkit,
    `trl_ext._compat` and its own package; module-level, function-level and `TYPE_CHECKING` imports alike."""
    sources = _package_sources()
    checked = [module for module in sources if _plugin_of(module) is not None]
    # the scan read every module of every built-in plugin (all but trl_ext/plugins/__init__.py)
    assert len(checked) == len(list((PACKAGE / "plugins").rglob("*.py"))) - 1
    assert built_in_private_imports(sources) == []


def test_the_built_in_import_check_catches_a_private_import():
    sources = {
        "trl_ext.plugins.alpha": (
            "from trl_ext.api import PluginSpec, lazy_getattr\nfrom ... import _compat\nfrom . import hooks\n",
            True,
        ),
        "trl_ext.plugins.alpha.hooks": (
            "from typing import TYPE_CHECKING\n"
            "import torch\n"
            "import trl_ext\n"
            "from trl_ext import UsageError\n"
            "from ...api import hookimpl\n"
            "from ...toolkit.packing.glue import scoring_call\n"
            "from trl_ext.toolkit import roles\n"
            "from .cut import plan\n"
            "from ..._logging import get_logger\n"  # a private core module, relative
            "from trl_ext import errors\n"  # a private core module, as a name of the package
            "if TYPE_CHECKING:\n"
            "    from trl_ext.context import TrainerContext\n"
            "def f():\n"
            "    import trl_ext._shared\n"
            "    from trl_ext import _private_name\n"
            "    from ..beta import NAME\n",
            False,
        ),
    }
    assert built_in_private_imports(sources) == [
        "trl_ext.plugins.alpha.hooks -> trl_ext._logging.get_logger",
        "trl_ext.plugins.alpha.hooks -> trl_ext._private_name",
        "trl_ext.plugins.alpha.hooks -> trl_ext._shared",
        "trl_ext.plugins.alpha.hooks -> trl_ext.context.TrainerContext",
        "trl_ext.plugins.alpha.hooks -> trl_ext.errors",
        "trl_ext.plugins.alpha.hooks -> trl_ext.plugins.beta.NAME",
    ]


def test_third_party_examples_import_only_the_public_modules():
    sources = _third_party_sources()
    assert len(sources) >= 2
    for where, source in sources.items():
        assert {_trl_ext_module(n) for n in imported_names(source, "x")} & PUBLIC, f"{where} does not use trl-ext"
        assert non_public_imports(source) == [], f"{where} imports trl-ext's private or internal modules"


def test_the_public_import_check_catches_internal_modules():
    source = textwrap.dedent(
        """
        import trl_ext
        from trl_ext import UsageError, api, spec
        from trl_ext.api import PACKING
        from trl_ext.toolkit.roles import METRICS
        from trl_ext.toolkit.packing import positions
        from trl_ext.plugins.padding_free import hooks
        import trl_ext._shared
        """
    )
    assert non_public_imports(source) == ["trl_ext._shared", "trl_ext.plugins.padding_free.hooks", "trl_ext.spec"]


@pytest.mark.parametrize("name", api.__all__)
def test_every_api_name_is_the_owners_object(name):
    value = getattr(api, name)
    owner = getattr(value, "__module__", None)
    if isinstance(owner, str) and owner.startswith("trl_ext.") and hasattr(sys.modules[owner], name):
        assert getattr(sys.modules[owner], name) is value
    assert name in dir(api) or name in {"PackedPositions", "current_packed_positions", "packed_positions"}


def test_api_covers_what_the_built_ins_share():
    """The shared helpers that the built-in plugins and a packing-aware module inside the model meet through."""
    from trl_ext._shared import Ranks
    from trl_ext.errors import UsageError
    from trl_ext.toolkit import roles
    from trl_ext.toolkit.packing import positions

    assert api.PackedPositions is positions.PackedPositions
    assert api.packed_positions is positions.packed_positions
    assert api.current_packed_positions is positions.current_packed_positions
    assert (api.PACKING, api.METRICS) == (roles.PACKING, roles.METRICS)
    assert api.Ranks is Ranks and api.UsageError is UsageError
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        api.nothing_here  # noqa: B018


@pytest.mark.slow
def test_importing_the_api_imports_nothing_heavy():
    code = "import sys, trl_ext.api, trl_ext.toolkit; print(','.join(m for m in sys.argv[1:] if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code, *HEAVY], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "", f"import trl_ext.api, trl_ext.toolkit imported {out.stdout.strip()}"
