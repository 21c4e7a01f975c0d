"""Fixtures of the scale matrix: the FSDP2-on-CPU shim (tests/scale/fsdp2_shim.py) applied in the pytest process."""

from __future__ import annotations

import pytest

from tests.scale.fsdp2_shim import enable_fsdp2_on_cpu


@pytest.fixture
def fsdp2_on_cpu():
    """Apply the shim in this (pytest) process, and undo it afterwards."""
    from accelerate.state import AcceleratorState

    original = AcceleratorState.__init__
    enable_fsdp2_on_cpu()
    yield
    AcceleratorState.__init__ = original
