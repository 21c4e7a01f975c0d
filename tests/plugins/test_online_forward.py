"""Online DPO's scoring forward, written once (`trl_ext.toolkit.online_forward`), against TRL's own `_forward` on the
installed TRL (CI runs this on every TRL release it covers): the check the plugins run at attach time passes, the
steps equal TRL's `_forward` on a real model, and a TRL whose `_forward` scores another way is refused."""

from __future__ import annotations

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from trl_ext import UsageError
from trl_ext.testing import length_reward, make_model, make_prompt_dataset
from trl_ext.toolkit.online_forward import ScoringCall, verify_against_trl

_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)


def _batch(prompt=6, completion=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(4, 250, (4, prompt), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0
    completion_ids = torch.randint(4, 250, (4, completion), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[2, 3:] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def test_the_installed_trl_forward_is_the_one_reproduced():
    from trl.experimental.online_dpo import OnlineDPOTrainer

    verify_against_trl(OnlineDPOTrainer._forward, "test")


@pytest.mark.parametrize("max_length", [None, 8, 5])
def test_steps_equal_trl_forward_on_a_real_model(online_dpo_args, tokenizer, max_length):
    """float64, bitwise: TRL's `_forward` on a tiny Llama against `ScoringCall.build` + the model + `log_probs`
    (`max_length` 8 and 5 cut the prompt on the left, to 3 and to no prompt column)."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    trainer = OnlineDPOTrainer(
        model=make_model(dtype=torch.float64),
        reward_funcs=length_reward,
        args=online_dpo_args(bf16=False, **({} if max_length is None else {"max_length": max_length})),
        train_dataset=make_prompt_dataset(2),
        processing_class=tokenizer,
    )
    batch = _batch()
    with torch.no_grad():
        expected = trainer._forward(trainer.model, *batch)
        call = ScoringCall.build(*batch, trainer.max_length)
        got = call.log_probs(trainer.model(call.ids, attention_mask=call.mask).logits)
    assert torch.equal(got, expected)


def test_a_trl_forward_that_scores_otherwise_is_refused(online_dpo_args, tokenizer, monkeypatch):
    """A TRL whose `_forward` no longer cuts the prompt on the left: prompt_sharing refuses at attach time, naming
    the method, instead of scoring the old way."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    def _forward(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None):
        ids = torch.cat((prompt_ids, completion_ids), dim=1)
        logits = model(ids, attention_mask=torch.cat((prompt_mask, completion_mask), dim=1)).logits
        scored = logits[:, prompt_ids.size(1) - 1 : -1].log_softmax(-1)
        return torch.take_along_dim(scored, completion_ids.unsqueeze(-1), dim=2).squeeze(-1)

    _forward.__qualname__ = "OnlineDPOTrainer._forward"
    _forward.__module__ = OnlineDPOTrainer.__module__
    monkeypatch.setattr(OnlineDPOTrainer, "_forward", _forward)
    with pytest.raises(UsageError, match=r"prompt_sharing: this TRL's `OnlineDPOTrainer._forward` is not"):
        with trl_ext.install(prompt_sharing=True):
            OnlineDPOTrainer(
                model=make_model(),
                reward_funcs=length_reward,
                args=online_dpo_args(bf16=False, max_length=64),
                train_dataset=make_prompt_dataset(2),
                processing_class=tokenizer,
            )
