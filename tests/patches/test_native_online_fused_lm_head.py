"""patches/0007-online-dpo-fused-lm-head.patch: `OnlineDPOConfig(use_fused_lm_head=True)` (the patch's default) scores
completions with TRL's fused LM head and equals the full-logit path (`use_fused_lm_head=False`) and the trl-ext
`fused_logprobs` plugin: per-token log-probs of policy and reference, loss, every logged metric, gradients.

Runs only against the patched TRL (`TRL_EXT_PATCHED_TRL=1`, see conftest.py and patches/check.sh). Float64 models;
TRL's fused head accumulates in float32, so the tolerance is float32 round-off (1e-6 relative).
"""

from __future__ import annotations

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from trl_ext.testing import length_reward, make_model, make_prompt_dataset

RTOL = 1e-6


@pytest.fixture
def build(online_dpo_args, tokenizer, monkeypatch):
    from trl.experimental.online_dpo import OnlineDPOTrainer

    batch = (*eq.online_generation(), None)
    monkeypatch.setattr(OnlineDPOTrainer, "_generate", lambda self, model, prompts, images=None: batch)

    def make(**overrides):
        args = online_dpo_args(per_device_train_batch_size=3, optim="sgd", learning_rate=0.1, bf16=False, **overrides)
        return OnlineDPOTrainer(
            model=eq.sharpen(make_model(dtype=torch.float64)),
            ref_model=eq.sharpen(make_model(seed=1, dtype=torch.float64)),
            reward_funcs=length_reward,
            args=args,
            train_dataset=make_prompt_dataset(6),
            processing_class=tokenizer,
        )

    return make


def _scores(trainer):
    logps = [trainer._forward(m, *eq.online_generation()) for m in (trainer.model, trainer.ref_model)]
    for values in trainer.stats.values():
        values.clear()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.training_step(trainer.model, {"prompt": ["w1 w2"] * 3})
    grads = torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()])
    stats = {k: v[-1] for k, v in trainer.stats.items() if v}
    return logps, loss.double(), grads, stats


def _close(a, b):
    for x, y in zip(a[0], b[0], strict=True):
        assert (x.double() - y.double()).abs().max() <= RTOL * y.double().abs().max()
    assert (a[1] - b[1]).abs() <= RTOL * max(1.0, b[1].abs().item())
    assert (a[2] - b[2]).abs().max() <= RTOL * b[2].abs().max()
    assert a[3].keys() == b[3].keys() and len(a[3]) >= 10
    for key in a[3]:
        # metrics that are differences of sums (margins, KL) lose relative precision: float32 round-off, absolute
        assert a[3][key] == pytest.approx(b[3][key], rel=RTOL, abs=1e-6), key


def test_native_equals_full_logits_and_plugin(build):
    stock = build(use_fused_lm_head=False)
    native = build()
    assert native.use_fused_lm_head and not stock.use_fused_lm_head
    with trl_ext.install(fused_logprobs=True):
        plugin = build(use_fused_lm_head=False)
    reference = _scores(stock)
    _close(_scores(native), reference)
    _close(_scores(plugin), reference)
