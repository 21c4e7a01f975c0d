"""The typed plugin API: mypy runs clean on the package (config in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_is_clean_on_trl_ext():
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_plugin_api_is_exported():
    import trl_ext

    for name in ("PluginSpec", "Flag", "TrainerContext", "UsageError", "hookimpl", "install", "TrlExtConfig"):
        assert name in trl_ext.__all__ and getattr(trl_ext, name) is not None
