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


@pytest.mark.slow
def test_wheel_ships_py_typed(tmp_path):
    """PEP 561: the wheel carries `trl_ext/py.typed`, so a plugin author's type checker reads trl-ext's annotations."""
    import shutil
    import zipfile

    src = tmp_path / "src"  # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(ROOT / "trl_ext", src / "trl_ext", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    proc = subprocess.run([*pip_wheel, "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("trl_ext-*.whl")
    assert "trl_ext/py.typed" in zipfile.ZipFile(wheel).namelist()


def test_plugin_api_is_exported():
    import trl_ext

    for name in ("PluginSpec", "Flag", "TrainerContext", "UsageError", "hookimpl", "install", "TrlExtConfig"):
        assert name in trl_ext.__all__ and getattr(trl_ext, name) is not None
