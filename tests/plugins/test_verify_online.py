"""`verify` on Online DPO (`trl_ext.verify`): the completion log-probs `_forward` returns for the policy and the
reference are checked against TRL's own `_forward` on the same completions at the first step; a planted wrong
shared attention is stopped before any parameter changes."""

from __future__ import annotations

import logging

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from tests import helpers
from trl_ext import UsageError

_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("trl-ext verify:")]


@pytest.mark.parametrize(
    "flags",
    [
        {"prompt_sharing": True},
        pytest.param({"fused_logprobs": True}, marks=pytest.mark.slow),
        pytest.param({"fused_logprobs": True, "prompt_sharing": True}, marks=pytest.mark.slow),
    ],
)
def test_the_right_path_passes(online_build, flags, caplog):
    with trl_ext.install(**flags):
        trainer = online_build(max_steps=1)
    with caplog.at_level(logging.INFO, logger="trl_ext"):
        trainer.train()
    assert trainer.state.global_step == 1
    (line,) = _lines(caplog)
    assert line.startswith("trl-ext verify: OnlineDPOTrainer step 1: ")
    assert "(2 model calls: policy/reference; " in line and "from float32 floor" in line


def test_a_planted_wrong_shared_attention_stops_before_any_parameter_changes(online_build, request):
    with trl_ext.install(prompt_sharing=True):
        trainer = online_build(max_steps=1)
    right = None

    def wrong(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        scaling = (query.shape[-1] ** -0.5 if scaling is None else scaling) * 1.05
        return right(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    right = helpers.plant_attention(request, "trl_ext_shared_sdpa", wrong)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(UsageError, match=r"OnlineDPOTrainer with prompt_sharing does not compute stock TRL's log"):
        trainer.train()
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
