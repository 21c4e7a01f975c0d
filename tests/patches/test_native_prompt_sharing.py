"""patches/0006-dpo-prompt-sharing.patch: TRL's native `DPOConfig(prompt_sharing=True)` equals stock padded DPO and the
trl-ext `prompt_sharing` plugin.

Runs only against the patched TRL (`TRL_EXT_PATCHED_TRL=1`, see conftest.py and patches/check.sh). Float64 models;
TRL 1.16's fused LM head computes in float32 and Llama's RMSNorm too, so per-sequence log-probs and gradients agree to
float32 round-off (1e-6 relative), far below what a response attending to the other one would give (> 1e-2).
"""

from __future__ import annotations

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from trl_ext.testing import make_model, make_preference_dataset

RTOL = 1e-6


@pytest.fixture
def build(dpo_args, tokenizer):
    data = make_preference_dataset(12, seed=3, prompt_median=14, completion_median=8)

    def make(**args):
        from trl import DPOTrainer

        return DPOTrainer(
            eq.sharpen(make_model(dtype=torch.float64)),
            ref_model=eq.sharpen(make_model(seed=1, dtype=torch.float64)),
            args=dpo_args(bf16=False, **args),
            train_dataset=data,
            processing_class=tokenizer,
        )

    return make


def _scores(trainer, examples):
    batch = trainer.data_collator(examples)
    logps = torch.cat(trainer.compute_ref_log_probs(trainer.model, batch))
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()])
    return logps, loss.detach(), grads


def _close(a, b):
    logps_a, loss_a, grads_a = a
    logps_b, loss_b, grads_b = b
    assert ((logps_a - logps_b).abs() / logps_a.abs().clamp(min=1)).max() <= RTOL
    assert (loss_a - loss_b).abs() <= RTOL * max(1.0, loss_a.abs().item())
    assert (grads_a - grads_b).abs().max() <= RTOL * grads_a.abs().max()


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sppo_hard", "apo_down"])
def test_native_equals_stock_and_plugin(build, loss_type):
    stock = build(loss_type=[loss_type])
    native = build(loss_type=[loss_type], prompt_sharing=True)
    examples = [stock.train_dataset[i] for i in range(6)]
    expected = _scores(stock, examples)
    _close(expected, _scores(native, examples))
    with trl_ext.install(prompt_sharing=True):
        plugin = build(loss_type=[loss_type])
        _close(expected, _scores(plugin, examples))
        assert plugin._trl_ext.state["prompt_sharing"].shared_calls > 0
