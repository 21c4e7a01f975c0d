"""Fixtures of the plugin tests: a float64 Online DPO trainer over a stored generation (prompt_sharing, the varlen
kernels), shared here so that no test module imports another."""

from __future__ import annotations

import pytest
import torch

from tests import equivalence as eq
from tests.helpers import generate_arity
from trl_ext.testing import length_reward, make_model, make_preference_dataset, make_prompt_dataset


@pytest.fixture(scope="session")
def dataset():
    """16 preference pairs (seed 0), the DPO plugin tests' data; a module with other data defines its own `dataset`."""
    return make_preference_dataset(16, seed=0)


@pytest.fixture
def online_build(online_dpo_args, tokenizer):
    """A float64 `OnlineDPOTrainer` (SGD) whose generation is one stored batch (`eq.online_generation()`, or
    `generation=`): stock and plugin trainers score exactly the same completions."""

    def make(*, generation=None, ref=True, peft_config=None, model_type=None, **overrides):
        from trl.experimental.online_dpo import OnlineDPOTrainer

        overrides.setdefault("bf16", False)
        overrides.setdefault("max_length", 64)  # longer than every sequence here; sizes the self-check's probe
        args = online_dpo_args(per_device_train_batch_size=3, optim="sgd", learning_rate=0.1, **overrides)
        if peft_config is not None:
            torch.manual_seed(123)
        model = eq.sharpen(make_model(dtype=torch.float64))
        ref_model = eq.sharpen(make_model(seed=1, dtype=torch.float64)) if ref else None
        if model_type is not None:  # a model type outside every table, as a `trust_remote_code` model would be
            for m in (model, ref_model):
                if m is not None:
                    m.config.model_type = model_type
        trainer = OnlineDPOTrainer(
            model=model,
            ref_model=ref_model,
            reward_funcs=length_reward,
            args=args,
            train_dataset=make_prompt_dataset(6),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        batch = (*(generation or eq.online_generation()), None)[: generate_arity()]
        trainer._generate = lambda model, prompts, images=None: batch  # the same completions for both

        return trainer

    return make


@pytest.fixture
def online_trainer(online_dpo_args, tokenizer):
    """`online_trainer()`: a plain `OnlineDPOTrainer` (tiny float32 Llamas, policy seed 0, reference seed 1, bf16 off)
    that generates for itself: the hook tests check what is installed and undone, not values."""

    def make():
        from trl.experimental.online_dpo import OnlineDPOTrainer

        return OnlineDPOTrainer(
            model=make_model(),
            ref_model=make_model(seed=1),
            reward_funcs=length_reward,
            args=online_dpo_args(bf16=False, max_length=64),
            train_dataset=make_prompt_dataset(4),
            processing_class=tokenizer,
        )

    return make
