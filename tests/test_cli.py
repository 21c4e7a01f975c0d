"""The `trl-ext` command line, run as users run it (a subprocess of the installed console script)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

import trl_ext
from trl_ext.plugins import BUILTIN_PLUGINS

pytestmark = pytest.mark.slow  # every test runs the installed console script


def _run(*args, check=True):
    exe = shutil.which("trl-ext") or str(__import__("pathlib").Path(sys.executable).with_name("trl-ext"))
    return subprocess.run([exe, *args], capture_output=True, text=True, check=check, timeout=300)


def test_doctor_prints_versions_support_and_attention_backends():
    out = _run("doctor").stdout
    import trl

    assert f"trl           {trl.__version__}" in out and "supported" in out
    for dist in ("transformers", "torch", "accelerate", "deepspeed"):
        assert dist in out
    assert "attention" in out and "sdpa" in out
    assert out.strip().endswith("OK")


def test_plugins_lists_builtins_with_flags_and_applicability():
    out = _run("plugins").stdout
    for name in BUILTIN_PLUGINS:
        assert name in out
    if BUILTIN_PLUGINS:
        assert "built-in" in out and "applies" in out


def test_plugins_with_unknown_block_name_fails_with_usage_message():
    proc = _run("plugins", "--block", "nope", check=False)
    assert proc.returncode == 2
    assert "trl-ext: error: `block` names unknown plugin" in proc.stderr


def test_version():
    assert _run("--version").stdout.strip() == f"trl-ext {trl_ext.__version__}"
