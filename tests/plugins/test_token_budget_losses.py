"""`token_budget` against stock TRL in issue 33 §2's loss settings: NaN metrics (stock logs NaN and goes on), the
allow-list of loss types read against TRL's own list, and `loss_type` "sft" (RPO and every combination with it), exact
by per-token weights (`trl_ext.plugins.token_budget.metrics`).

The comparisons use tests/plugins/token_budget_harness.py (float64 models, SGD, two optimizer steps of 2 x
2 pairs, the second the epoch's uneven last one, parameters to 1e-6 of a step's change, logs to 1e-6).
"""

from __future__ import annotations

import math

import pytest
import torch

import trl_ext
from trl_ext import UsageError
from trl_ext.plugins.token_budget.hooks import (
    ACCEPTED_LOSS_TYPES,
    COUPLED_LOSS_TYPES,
    PER_PAIR_LOSS_TYPES,
    check_loss_types,
    trl_loss_types,
)
from trl_ext.testing import make_model, make_preference_dataset

from ..equivalence import one_thread, sharpen
from .token_budget_harness import (
    BUDGET,
    LOG_ATOL,
    LOG_RTOL,
    MEAN_OVER_PAIRS,
    PARAM_RTOL,
    PLUGIN,
    TIMINGS,
    _records,
    _state,
    _train,
)

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=LOG_RTOL, abs_tol=LOG_ATOL)


# ---------------------------------------------------------------------------------------------------------------------
# NaN metrics (issue 33 §2): stock logs NaN and goes on; so does token_budget, with the same values
# ---------------------------------------------------------------------------------------------------------------------


# one_micro_batch (its empty Trainer micro-step replaced too) is `slow`: the fast loop keeps the cut budget
@pytest.mark.parametrize(
    "budget", [BUDGET, pytest.param(100_000, marks=pytest.mark.slow)], ids=["cut", "one_micro_batch"]
)
def test_nan_metrics_equal_stock(dpo_args, tokenizer, budget):
    """A learning rate of 1e300: the first step is finite, its update overflows the weights, and every value of the
    second step is NaN. 8 pairs, logged every 2 steps: the one log holds the finite step and the NaN one, whose
    losses transformers' `logging_nan_inf_filter` replaces by the window's mean once per `training_step` call (with
    budget 100000 a whole step runs in one micro-batch, and its other, empty, Trainer micro-step is replaced too)."""
    data = make_preference_dataset(8, seed=15, prompt_median=6, completion_median=5, max_prompt=24)
    args = dict(learning_rate=1e300, logging_steps=2, dataset=data)
    stock, _, _ = _train(dpo_args, tokenizer, None, **args)
    with _records() as records:
        plugin, _, _ = _train(dpo_args, tokenizer, {PLUGIN: budget}, **args)
    s_logs, p_logs = stock.state.log_history, plugin.state.log_history
    assert math.isnan(s_logs[0]["rewards/chosen"]) and math.isfinite(s_logs[0]["loss"]) and s_logs[0]["loss"] > 0
    assert len(s_logs) == len(p_logs) == 2
    for s_log, p_log in zip(s_logs, p_logs, strict=True):
        assert set(s_log) == set(p_log)
        bad = {k: (v, p_log[k]) for k, v in s_log.items() if k not in TIMINGS and not _same(v, p_log[k])}
        assert not bad, bad
    assert not [r for r in records if "non-finite" in r.getMessage()], "every micro-batch of the NaN step is NaN"
    if budget == 100_000:
        assert _state(plugin).micro_batch_counts == [1, 1]


# ---------------------------------------------------------------------------------------------------------------------
# Loss types: an allow-list checked against TRL's own list; "sft" re-weighted per token
# ---------------------------------------------------------------------------------------------------------------------


def test_every_trl_loss_type_is_classified():
    """TRL's loss types, read from TRL (DPOConfig's help and `_compute_loss`'s branches): each is accepted (verified)
    or refused with a reason. A TRL that adds one fails here until it is verified and classified."""
    known = trl_loss_types()
    assert {"sigmoid", "sft", "aot"} <= known, known
    classified = ACCEPTED_LOSS_TYPES | set(COUPLED_LOSS_TYPES)
    assert known == classified, f"not classified: {sorted(known - classified)}; gone: {sorted(classified - known)}"
    # every accepted type is compared with stock: the per-pair ones in test_token_budget.py, "sft" here
    assert set(MEAN_OVER_PAIRS) == PER_PAIR_LOSS_TYPES and ACCEPTED_LOSS_TYPES - PER_PAIR_LOSS_TYPES == {"sft"}
    assert not ACCEPTED_LOSS_TYPES & set(COUPLED_LOSS_TYPES)


def test_unverified_loss_types_are_refused(monkeypatch):
    from trl_ext.plugins.token_budget import hooks

    # a loss type a newer TRL adds, which token_budget has not verified
    monkeypatch.setattr(hooks, "trl_loss_types", lambda: {*trl_loss_types(), "brand_new"})
    with pytest.raises(UsageError, match="has not been verified with `loss_type='brand_new'`"):
        check_loss_types(["sigmoid", "brand_new"], False)
    with pytest.raises(UsageError, match="use_weighting=True"):
        check_loss_types(["sigmoid", "sft"], True)
    check_loss_types(sorted(ACCEPTED_LOSS_TYPES), False)


def test_a_loss_type_trl_does_not_know_is_named_as_trl_names_it():
    """Issue 41: a misspelled loss type is TRL's "Unknown loss type" (which stock TRL raises at the first step), with
    a "did you mean", not token_budget's "not verified"."""
    with pytest.raises(UsageError) as info:
        check_loss_types(["sigmod"], False)
    message = str(info.value)
    assert "`loss_type='sigmod'` is no loss type of the installed TRL" in message
    assert "`ValueError: Unknown loss type: sigmod`" in message and "Did you mean `sigmoid`?" in message
    assert "not been verified" not in message


def test_sft_with_use_weighting_is_refused_when_built(dpo_args, tokenizer):
    with pytest.raises(UsageError, match="`loss_type='sft'` with `use_weighting=True`"):
        _train(dpo_args, tokenizer, {PLUGIN: BUDGET}, loss_type=["sigmoid", "sft"], use_weighting=True)


def _assert_same_run_sft(stock, plugin) -> None:
    """Parameters to `PARAM_RTOL` of each step's change and logs to `LOG_RTOL`, as `_assert_same_run`, with `rewards/*`
    taken to the float32 floor of the log-probs they are differences of (`beta x LOG_RTOL x |logps|`). TRL >= 1.15
    scores in float32 inside a float64 model (its fused head), and sft's gradients are large: after one step, stock
    TRL against stock TRL padded to a multiple of 64 moves `rewards/chosen` by 7e-6 of its value for `sigmoid` alone
    (a log-prob of -105 by 8e-6), token_budget with RPO by as much (6.7e-6), its parameters by 2.4e-7 of the step's
    change. A wrong token weight moves the parameters by percents."""
    (s_trainer, before, s_steps), (p_trainer, _, p_steps) = stock, plugin
    assert len(s_steps) == len(p_steps) >= 2
    for step, (s_params, p_params) in enumerate(zip(s_steps, p_steps, strict=True)):
        previous = before if step == 0 else s_steps[step - 1]
        change = max((s_params[n] - previous[n]).abs().max().item() for n in s_params)
        worst = max((s_params[n] - p_params[n]).abs().max().item() for n in s_params)
        assert change > 1e-4 and worst <= PARAM_RTOL * change, (step, worst, change)
    s_logs, p_logs = s_trainer.state.log_history, p_trainer.state.log_history
    assert len(s_logs) == len(p_logs) and any("rewards/margins" in log for log in s_logs)
    for s_log, p_log in zip(s_logs, p_logs, strict=True):
        assert set(s_log) == set(p_log)
        floor = 0.1 * LOG_RTOL * max(abs(s_log.get("logps/chosen", 0.0)), abs(s_log.get("logps/rejected", 0.0)))
        for key, value in s_log.items():
            atol = max(LOG_ATOL, floor if key.startswith("rewards/") else 0.0)
            if key not in TIMINGS:
                assert math.isclose(p_log[key], value, rel_tol=LOG_RTOL, abs_tol=atol), (key, value, p_log[key])


@pytest.mark.parametrize(
    "args",
    [
        {"loss_type": ["sigmoid", "sft"]},
        pytest.param({"loss_type": ["sft"]}, marks=pytest.mark.slow),
        pytest.param({"loss_type": ["sigmoid", "sft"], "loss_weights": [0.8, 0.6]}, marks=pytest.mark.slow),
        pytest.param({"loss_type": ["sigmoid", "sft"], "gradient_accumulation_steps": 3}, marks=pytest.mark.slow),
        pytest.param({"loss_type": ["ipo", "sft"], "learning_rate": 0.002}, marks=pytest.mark.slow),
        pytest.param({"loss_type": ["sigmoid", "sft"], "ld_alpha": 0.5}, marks=pytest.mark.slow),
    ],
    ids=["rpo", "sft", "rpo_weights", "rpo_ga3", "ipo_sft", "rpo_ld_alpha"],
)
def test_sft_equals_stock(dpo_args, tokenizer, args):
    """RPO and every combination with "sft": updated weights, loss and every logged metric equal stock's, with pairs
    of different stock micro-batches sharing a micro-batch and a pair over the budget alone."""
    plugin = _train(dpo_args, tokenizer, {PLUGIN: BUDGET}, **args)
    _assert_same_run_sft(_train(dpo_args, tokenizer, None, **args), plugin)
    state = _state(plugin[0])
    assert state.sft_weight > 0 and sum(state.over_budget) > 0
    assert state.micro_batch_counts != state.stock_micro_batch_counts


@pytest.mark.slow
def test_sft_bf16_equals_stock(dpo_args, tokenizer):
    """RPO in bf16 autocast (float32 weights) against stock in bf16. Measured on this data: stock against stock padded
    to a multiple of 64 moves the parameters by 2.0e-3 and 6.3e-3 of each step's change, token_budget by 1.8e-3 and
    5.9e-3; without the per-token sft weights it moves them by 0.24 and 0.29, the loss by 5e-4 and the grad norm by
    1.2e-2. Bounds at 10x the floor: parameters 2e-2 of the change, loss 1e-3, grad norm and log-probs 5e-3."""
    args = {"loss_type": ["sigmoid", "sft"], "bf16": True, "dtype": torch.float32}
    (s_trainer, before, s_steps), (p_trainer, _, p_steps) = (
        _train(dpo_args, tokenizer, None, **args),
        _train(dpo_args, tokenizer, {PLUGIN: BUDGET}, **args),
    )
    for step, (s_params, p_params) in enumerate(zip(s_steps, p_steps, strict=True)):
        previous = before if step == 0 else s_steps[step - 1]
        change = max((s_params[n] - previous[n]).abs().max().item() for n in s_params)
        worst = max((s_params[n] - p_params[n]).abs().max().item() for n in s_params)
        assert change > 1e-4 and worst <= 2e-2 * change, (step, worst, change)
    bounds = {"loss": 1e-3, "grad_norm": 5e-3, "logps/chosen": 5e-3, "logps/rejected": 5e-3}
    for s_log, p_log in zip(s_trainer.state.log_history, p_trainer.state.log_history, strict=True):
        for key, bound in bounds.items():
            if key in s_log:
                assert math.isclose(p_log[key], s_log[key], rel_tol=bound), (key, s_log[key], p_log[key])


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["padding_free", "prompt_sharing"])
def test_sft_packed_equals_stock(dpo_args, tokenizer, packing):
    args = {"loss_type": ["sigmoid", "sft"]}
    plugin = _train(dpo_args, tokenizer, {PLUGIN: 2 * BUDGET, packing: True}, **args)
    _assert_same_run_sft(_train(dpo_args, tokenizer, None, **args), plugin)
    assert _state(plugin[0]).packed


@pytest.mark.slow  # fast loop: sft's training cuts (test_sft_equals_stock[rpo]), eval splits (test_token_budget.py)
def test_sft_evaluation_batches_split_equal_stock(dpo_args, tokenizer):
    from trl import DPOTrainer

    def evaluate(install):
        with trl_ext.install(**install):
            trainer = DPOTrainer(
                sharpen(make_model(dtype=torch.float64, hidden_size=32)),
                ref_model=sharpen(make_model(dtype=torch.float64, hidden_size=32, seed=1)),
                args=dpo_args(bf16=False, per_device_eval_batch_size=4, loss_type=["sigmoid", "sft"]),
                train_dataset=make_preference_dataset(7, seed=15, max_prompt=24),
                eval_dataset=make_preference_dataset(7, seed=15, prompt_median=6, completion_median=5, max_prompt=24),
                processing_class=tokenizer,
            )
            return trainer, trainer.evaluate()

    _, stock = evaluate({})
    trainer, cut = evaluate({PLUGIN: BUDGET})
    assert max(_state(trainer).eval_micro_batch_counts) > 1
    assert all(_same(v, cut[k]) for k, v in stock.items() if not k.endswith(("_runtime", "_per_second"))), (stock, cut)


@pytest.mark.slow  # two runs; on TRL >= 1.15 fused_logprobs leaves DPO to TRL's own fused head
def test_sft_with_fused_logprobs_equals_stock(dpo_args, tokenizer):
    """token_budget's per-token sft weights read the chosen tokens' log-probs of the policy forward; with
    fused_logprobs on (TRL < 1.15: the logits are never built) they come from the fused pass. RPO with both plugins:
    weights, loss and every logged metric equal stock's, as token_budget alone."""
    args = {"loss_type": ["sigmoid", "sft"]}
    plugin = _train(dpo_args, tokenizer, {PLUGIN: BUDGET, "fused_logprobs": True}, **args)
    _assert_same_run_sft(_train(dpo_args, tokenizer, None, **args), plugin)
    assert _state(plugin[0]).sft_weight > 0
