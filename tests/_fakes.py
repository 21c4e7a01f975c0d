"""Test doubles for *small pure parts* only: fake `importlib.metadata` distributions for entry-point discovery.

Trainers are never faked: tests use real TRL trainers.
"""

from __future__ import annotations

import importlib.metadata
import sys
import types


class FakeDistribution(importlib.metadata.Distribution):
    """A distribution that exists only in memory and declares `trl_ext` entry points."""

    def __init__(self, name: str, entry_points: dict[str, str]) -> None:
        self._name = name
        lines = ["[trl_ext]"] + [f"{ep} = {target}" for ep, target in entry_points.items()]
        self._files = {
            "METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n",
            "entry_points.txt": "\n".join(lines) + "\n",
        }

    def read_text(self, filename: str) -> str | None:
        return self._files.get(filename)

    def locate_file(self, path):  # pragma: no cover - not used for entry points
        return path


def install_fake_plugin(monkeypatch, ep_name: str, plugin: object, dist_name: str = "trl-ext-fake") -> str:
    """Expose `plugin` as entry point `ep_name` of a fake installed distribution; returns its module name."""
    module_name = f"_trl_ext_fake_{ep_name}"
    module = types.ModuleType(module_name)
    module.plugin = plugin
    monkeypatch.setitem(sys.modules, module_name, module)
    fake = FakeDistribution(dist_name, {ep_name: f"{module_name}:plugin"})
    real = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: [fake, *real(**kw)])
    return module_name
