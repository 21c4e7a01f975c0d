"""The harness of the token_budget tests (test_token_budget*.py): a stock and a `token_budget` DPOTrainer trained from
the same float64 models, data, sampler and seeds with SGD, and the comparison of their runs. The tolerances and
their reasons are in tests/plugins/test_token_budget.py's docstring."""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

import trl_ext
from tests import helpers
from trl_ext.testing import make_model, make_preference_dataset

from ..equivalence import sharpen

PLUGIN = "token_budget"
#: `LOG_ATOL` for metrics near zero: `logits/*` (a mean over the vocabulary, ~1e-3 here) moves by 1.5e-9 between
#: layouts through the float32 LM head; a wrong partition moves it by ~1e-4.
PARAM_RTOL, LOG_RTOL, LOG_ATOL = 1e-6, 1e-6, 1e-8
PAIRS, BATCH, ACCUMULATION = 7, 2, 2
#: On this data (seed 15) the first step's first two pairs share a micro-batch and one pair of 47 tokens is over it.
BUDGET = 56
#: Loss types whose value is a mean over pairs (TRL 1.12 and 1.16), with the config they need.
MEAN_OVER_PAIRS = {
    "sigmoid": {},
    "hinge": {},
    "ipo": {"learning_rate": 0.002},  # a squared loss of scale 1 / (2 beta)^2: large gradients
    "exo_pair": {"label_smoothing": 0.1},
    "nca_pair": {},
    "robust": {"label_smoothing": 0.1},
    "bco_pair": {},
    "sppo_hard": {"learning_rate": 0.005},  # squared distances to 1 / (2 beta): large gradients
    "apo_zero": {},
    "apo_down": {},
    "discopop": {},
    "sigmoid_norm": {},
}
#: Keys of the Trainer's log that are timings, not results.
TIMINGS = {"train_runtime", "train_samples_per_second", "train_steps_per_second"}


class _Params(TrainerCallback):
    """Copies of the trainable parameters after each optimizer step."""

    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})


def _dataset():
    return make_preference_dataset(PAIRS, seed=15, prompt_median=6, completion_median=5, max_prompt=24)


def _train(dpo_args, tokenizer, install: dict | None, peft: bool = False, dataset=None, dtype=torch.float64, **args):
    from trl import DPOTrainer

    model = sharpen(make_model(dtype=dtype, hidden_size=32))
    ref = None if peft else sharpen(make_model(dtype=dtype, hidden_size=32, seed=1))
    peft_config = None
    if peft:
        from peft import LoraConfig

        torch.manual_seed(123)  # the same LoRA init in both trainers
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    config = dict(
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=-1,
        num_train_epochs=1,
        optim="sgd",
        learning_rate=0.05,
        bf16=False,
        max_grad_norm=0.0,
    )
    config.update(args)
    params = _Params()
    with trl_ext.install(**(install or {})):
        trainer = DPOTrainer(
            model,
            ref_model=ref,
            args=dpo_args(**config),
            train_dataset=_dataset() if dataset is None else dataset,
            processing_class=tokenizer,
            callbacks=[params],
            peft_config=peft_config,
        )
        trainer.train()
    return trainer, params.initial, params.steps


def _assert_same_run(stock, plugin) -> None:
    (s_trainer, before, s_steps), (p_trainer, _, p_steps) = stock, plugin
    assert len(s_steps) == len(p_steps) >= 2
    for step, (s_params, p_params) in enumerate(zip(s_steps, p_steps, strict=True)):
        previous = before if step == 0 else s_steps[step - 1]
        change = max((s_params[n] - previous[n]).abs().max().item() for n in s_params)
        assert change > 1e-4, "the step must move the parameters for the comparison to mean anything"
        worst = max((s_params[n] - p_params[n]).abs().max().item() for n in s_params)
        assert worst <= PARAM_RTOL * change, (
            f"step {step}: parameters differ by {worst:.3e} (step change {change:.3e})"
        )
    s_logs, p_logs = s_trainer.state.log_history, p_trainer.state.log_history
    assert len(s_logs) == len(p_logs)
    for s_log, p_log in zip(s_logs, p_logs, strict=True):
        assert set(s_log) == set(p_log)
        for key, value in s_log.items():
            if key not in TIMINGS:
                assert math.isclose(p_log[key], value, rel_tol=LOG_RTOL, abs_tol=LOG_ATOL), (key, value, p_log[key])
    assert any("rewards/margins" in log for log in s_logs)


_records = helpers.trl_ext_records


def _state(trainer):
    return trainer._trl_ext.state[PLUGIN]


# ---------------------------------------------------------------------------------------------------------------------
# The cut itself (pure functions)
# ---------------------------------------------------------------------------------------------------------------------
