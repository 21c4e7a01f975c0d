"""Unit tests of `generation.check_fsdp_generation`, the generation plugin's answer under FSDP (issue 18, point 2).

Small fakes stand in for the accelerator (only `distributed_type` and `state.fsdp_plugin` are read); the real FSDP2
behaviour (refusals raised by a real `OnlineDPOTrainer`, and the generation memory that justifies them) is checked
by the fsdp2 cells of tests/scale/test_scale_matrix.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from trl_ext.errors import UsageError
from trl_ext.plugins.generation import GenerationState, check_fsdp_generation


def _accelerator(kind=DistributedType.FSDP, version=2, reshard=True):
    plugin = SimpleNamespace(fsdp_version=version, reshard_after_forward=reshard)
    return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=plugin))


def test_false_with_reshard_is_accepted_and_logged(caplog):
    state = GenerationState(False, {})
    with caplog.at_level(logging.INFO, logger="trl_ext"):
        check_fsdp_generation(state, _accelerator())
    assert "fsdp" in state.logged
    assert any("under FSDP2 with reshard_after_forward=True" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("flag", [True, "auto"])
def test_gathering_flags_are_refused_under_fsdp(flag):
    with pytest.raises(UsageError, match=r"ds3_gather_for_generation=.*no effect under FSDP2.*Set ds3_gather"):
        check_fsdp_generation(GenerationState(flag, {}), _accelerator())


def test_budget_is_refused_under_fsdp():
    with pytest.raises(UsageError, match=r"`budget` option has no effect under FSDP2"):
        check_fsdp_generation(GenerationState(False, {"budget": "1GB"}), _accelerator())


def test_false_without_reshard_is_refused():
    with pytest.raises(UsageError, match=r"reshard_after_forward=False.*holds the whole model"):
        check_fsdp_generation(GenerationState(False, {}), _accelerator(reshard=False))


@pytest.mark.parametrize("flag", [True, False, "auto"])
def test_not_fsdp_is_left_alone(flag):
    state = GenerationState(flag, {})
    check_fsdp_generation(state, _accelerator(kind=DistributedType.DEEPSPEED))
    check_fsdp_generation(state, SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, state=SimpleNamespace()))
    assert state.logged == set()
