"""`token_budget`: each optimizer step runs stock's pairs in micro-batches cut by tokens, with stock's gradients,
losses and logged metrics.

Every comparison trains a stock `DPOTrainer` and a `token_budget` one from the same float64 models, data, sampler and
seeds, with SGD, for two optimizer steps of `per_device_train_batch_size=2 x gradient_accumulation_steps=2` over 7
pairs: the second step is the epoch's uneven last one (stock micro-batches of 2 and 1 pairs), and the budget is below
the longest pair's tokens, so that pair runs alone. Parameters after each step must agree to `PARAM_RTOL` of the
step's parameter change (a loss weight wrong by 0.1 % fails by three orders of magnitude), every logged value
(loss, grad_norm, every TRL metric) to `LOG_RTOL`. These are float32 floors, not float64 ones: Llama's RMSNorm and
TRL >= 1.15's fused LM head compute in float32 inside a float64 model, and a different row layout (the re-cut
micro-batches are padded to other widths) changes their rounding. Stock against stock padded to a multiple of 64
moves as much on this data: 1.0e-6 (`sppo_hard`) and 7.9e-7 (`use_weighting`) of the step's change, where
token_budget moves 1.7e-7 and 1.5e-7; 5e-9 for `sigmoid`.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import trl_ext
from trl_ext import UsageError
from trl_ext.api import PluginSpec
from trl_ext.plugins.token_budget.cut import Pair, cut_step, pair_length, plan, spread
from trl_ext.plugins.token_budget.hooks import COUPLED_LOSS_TYPES
from trl_ext.testing import make_model

from .._fakes import install_fake_plugin
from ..equivalence import one_thread, sharpen
from .token_budget_harness import (
    ACCUMULATION,
    BUDGET,
    LOG_ATOL,
    LOG_RTOL,
    MEAN_OVER_PAIRS,
    PAIRS,
    PLUGIN,
    _assert_same_run,
    _dataset,
    _records,
    _state,
    _train,
)

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


def test_plan_cuts_by_tokens_in_order():
    pairs = [Pair(0, 0, 10), Pair(0, 1, 12), Pair(1, 0, 30), Pair(1, 1, 5), Pair(2, 0, 4)]
    # padded, 2 x pairs x longest <= 64: [10, 12] = 48; adding 30 would be 2*3*30; [30] = 60; [5] with 30 = 120;
    # batch 2 has 1 pair (not 2): it weighs differently and starts its own micro-batch.
    runs = plan(pairs, [2, 2, 1], 64)
    assert [[(p.batch, p.row) for p in run] for run in runs] == [[(0, 0), (0, 1)], [(1, 0)], [(1, 1)], [(2, 0)]]
    assert [len(r) for r in plan(pairs, [2, 2, 2], 1000)] == [5]
    assert [len(r) for r in plan(pairs, [2, 2, 2], 8)] == [1] * 5  # every pair over the budget runs alone
    # packed: the sum of the pairs' tokens
    assert [len(r) for r in plan(pairs, [2, 2, 2], 51, packed=True)] == [2, 3]  # 10 + 12 (+ 30 > 51) | 30 + 5 + 4


def _example(prompt: int, chosen: int, rejected: int) -> dict:
    return {"prompt_ids": [5] * prompt, "chosen_ids": [6] * chosen, "rejected_ids": [7] * rejected}


def test_cut_step_weights_lengths_and_collation():
    step = [[_example(2, 3, 1), _example(1, 1, 3)], [_example(3, 3, 2)]]  # a short last stock batch
    assert [pair_length(e, False, None) for e in step[0]] == [5, 4]
    assert pair_length(step[1][0], True, None) == 11 and pair_length(step[1][0], False, 4) == 4
    collated: list[list] = []

    def collate(examples):
        collated.append(examples)
        return {"n": len(examples)}

    micro_batches, over = cut_step(step, 16, collate)
    assert over == 0 and [len(mb.pairs) for mb in micro_batches] == [1, 1, 1]  # 2 x 2 x 5 = 20 > 16
    assert [mb.weight for mb in micro_batches] == [1 / 4, 1 / 4, 1 / 2]
    assert collated == [[step[0][0]], [step[0][1]], [step[1][0]]]
    micro_batches, over = cut_step(step, 20, collate)
    assert [len(mb.pairs) for mb in micro_batches] == [2, 1] and over == 0
    assert sum(mb.weight for mb in micro_batches) == 1.0 and micro_batches[0].tokens == 20
    assert cut_step(step, 10, collate)[1] == 1  # the last pair alone costs 2 x 6
    assert [list(r) for r in spread(1, 3)] == [[], [], [0]] and [list(r) for r in spread(3, 2)] == [[0], [1, 2]]


def test_cut_refuses_examples_it_cannot_measure():
    with pytest.raises(UsageError, match="images"):
        cut_step([[{**_example(1, 1, 1), "images": [None]}]], 100, lambda examples: {})


# ---------------------------------------------------------------------------------------------------------------------
# Against stock TRL
# ---------------------------------------------------------------------------------------------------------------------


def test_equals_stock_sigmoid(dpo_args, tokenizer):
    """GA 2, the epoch's uneven last step, a pair over the budget: gradients, loss and metrics equal stock."""
    stock = _train(dpo_args, tokenizer, None)
    with _records() as records:
        plugin = _train(dpo_args, tokenizer, {PLUGIN: BUDGET})
    _assert_same_run(stock, plugin)
    lines = [r.getMessage() for r in records if "exceed the budget" in r.getMessage()]
    assert len(lines) == 1 and f"budget of {BUDGET} padded tokens" in lines[0], "one line per run"
    assert "said once" in lines[0]
    state = _state(plugin[0])
    assert len(state.micro_batch_counts) == 2
    assert sum(state.over_budget) > 0, "the data must hold a pair longer than the budget"
    assert sum(state.micro_batch_counts) < PAIRS, "some pairs must share a micro-batch"
    assert state.gathered is None, "TRL's gathers are recorded only while a micro-batch's `compute_loss` runs"


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", sorted(MEAN_OVER_PAIRS))
def test_equals_stock_every_loss_type(dpo_args, tokenizer, loss_type):
    args = {"loss_type": [loss_type], **MEAN_OVER_PAIRS[loss_type]}
    _assert_same_run(_train(dpo_args, tokenizer, None, **args), _train(dpo_args, tokenizer, {PLUGIN: BUDGET}, **args))


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        {"use_weighting": True, "learning_rate": 100.0},  # the WPO weights (~1e-5 here) shrink the gradient
        {"ld_alpha": 0.5},
        {"loss_type": ["sigmoid", "bco_pair"], "loss_weights": [0.7, 0.3]},
        {"precompute_ref_log_probs": True},
        {"f_divergence_type": "js_divergence"},
        {"gradient_accumulation_steps": 3},
    ],
    ids=["use_weighting", "ld_alpha", "two_losses", "precompute_ref", "js_divergence", "ga3"],
)
def test_equals_stock_options(dpo_args, tokenizer, args):
    _assert_same_run(_train(dpo_args, tokenizer, None, **args), _train(dpo_args, tokenizer, {PLUGIN: BUDGET}, **args))


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["padding_free", "prompt_sharing"])
def test_packed_equals_stock(dpo_args, tokenizer, packing):
    """With a packing plugin the micro-batches are collated (packed) by that plugin, and the budget counts the real
    tokens of both sequences (prompt_sharing alone differs from stock here by 1.1e-7 of a step's change; token_budget
    on top of it changes that difference by less than 1e-12)."""
    plugin = _train(dpo_args, tokenizer, {PLUGIN: 2 * BUDGET, packing: True})
    _assert_same_run(_train(dpo_args, tokenizer, None), plugin)
    state = _state(plugin[0])
    assert state.packed and state.micro_batch_counts != [ACCUMULATION, ACCUMULATION]


@pytest.mark.slow
@pytest.mark.parametrize("peft", [False, True], ids=["full", "peft"])
def test_gradient_checkpointing_and_peft_equal_stock(dpo_args, tokenizer, peft):
    """Gradient checkpointing, and a LoRA policy whose reference is the adapter-disabled model (a second forward
    through the same module, which the plugin's capture of the policy forward must skip)."""
    args = dict(gradient_checkpointing=True, learning_rate=0.5 if peft else 0.05)
    stock = _train(dpo_args, tokenizer, None, peft=peft, **args)
    _assert_same_run(stock, _train(dpo_args, tokenizer, {PLUGIN: BUDGET}, peft=peft, **args))


@pytest.mark.slow
def test_with_fused_logprobs_equals_stock(dpo_args, tokenizer):
    """fused_logprobs hands TRL < 1.15 lazy logits; the per-row token sums go through the same functions TRL calls.
    (fused_logprobs itself refuses TRL 1.14, whose DPO module calls another helper: nothing to compare there.)"""
    try:
        plugin = _train(dpo_args, tokenizer, {PLUGIN: BUDGET, "fused_logprobs": True})
    except UsageError as error:
        if str(error).startswith("fused_logprobs:") and "has no ['entropy_from_logits']" in str(error):
            pytest.skip(f"fused_logprobs refuses this TRL: {error}")
        raise
    _assert_same_run(_train(dpo_args, tokenizer, None), plugin)


@pytest.mark.slow
def test_with_sync_metrics_equals_sync_metrics_alone(dpo_args, tokenizer):
    """sync_metrics weighs its window means by pairs and tokens, so the cut must not change what it logs."""
    alone = _train(dpo_args, tokenizer, {"sync_metrics": True})
    both = _train(dpo_args, tokenizer, {"sync_metrics": True, PLUGIN: BUDGET})
    _assert_same_run(alone, both)
    assert _state(both[0]).micro_batch_counts != [ACCUMULATION, ACCUMULATION]


@pytest.mark.slow
def test_micro_batch_counts_follow_the_budget(dpo_args, tokenizer):
    """A budget that holds a whole step runs one micro-batch per step; a tiny one runs every pair alone."""
    trainer, _, _ = _train(dpo_args, tokenizer, {PLUGIN: 100_000})
    assert _state(trainer).micro_batch_counts == [1, 2]  # the short last batch is cut apart from the full one
    with _records() as records:
        trainer, _, _ = _train(dpo_args, tokenizer, {PLUGIN: 1})
    state = _state(trainer)
    assert state.micro_batch_counts == [4, 3]
    assert all(count == 4 or count == 3 for count in state.over_budget)
    # One line when train() returns, its figures those of the run: 7 micro-batches where stock ran 2 + 2.
    lines = [r.getMessage() for r in records if r.getMessage().startswith("token_budget: 2 optimizer step(s)")]
    assert len(lines) == 1, [r.getMessage() for r in records]
    assert state.stock_micro_batch_counts == [ACCUMULATION, ACCUMULATION]
    rows, width = max(state.stock_largest, key=lambda s: s[0] * s[1])
    expected = (
        f"token_budget: 2 optimizer step(s) ran 7 micro-batches (stock: {2 * ACCUMULATION}) within the budget of 1 "
        f"padded tokens; 7 pairs over the budget ran alone, the largest of {max(state.max_tokens)} tokens; stock "
        f"TRL's largest micro-batch from the same batches: {rows * width} padded tokens ({rows} rows x {width})"
    )
    assert lines[0] == expected


def test_evaluation_batches_over_the_budget_are_split(dpo_args, tokenizer):
    """`evaluate()` (loss only): eval batches of 4 and 3 pairs, split by the budget; loss and every metric as stock."""
    from trl import DPOTrainer

    def evaluate(install):
        with trl_ext.install(**install):
            trainer = DPOTrainer(
                sharpen(make_model(dtype=torch.float64, hidden_size=32)),
                ref_model=sharpen(make_model(dtype=torch.float64, hidden_size=32, seed=1)),
                args=dpo_args(bf16=False, per_device_eval_batch_size=4),
                train_dataset=_dataset(),
                eval_dataset=_dataset(),
                processing_class=tokenizer,
            )
            return trainer, trainer.evaluate()

    _, stock = evaluate({})
    trainer, cut = evaluate({PLUGIN: BUDGET})
    assert set(stock) == set(cut) and "eval_rewards/margins" in stock
    for key, value in stock.items():
        if not key.endswith(("_runtime", "_per_second")):
            assert math.isclose(cut[key], value, rel_tol=LOG_RTOL, abs_tol=LOG_ATOL), (key, value, cut[key])
    assert _state(trainer).eval_micro_batch_counts and max(_state(trainer).eval_micro_batch_counts) > 1


@pytest.mark.slow
def test_prediction_with_logits_runs_batches_whole(dpo_args, tokenizer):
    """`predict()` asks for logits (`prediction_loss_only=False`), which split batches cannot return as stock does:
    those batches run whole, and one warning says so. Results equal stock."""
    from trl import DPOTrainer

    def predict(install):
        with trl_ext.install(**install):
            trainer = DPOTrainer(
                sharpen(make_model(dtype=torch.float64, hidden_size=32)),
                ref_model=sharpen(make_model(dtype=torch.float64, hidden_size=32, seed=1)),
                args=dpo_args(bf16=False, per_device_eval_batch_size=4),
                train_dataset=_dataset(),
                processing_class=tokenizer,
            )
            return trainer, trainer.predict(trainer.train_dataset)

    _, stock = predict({})
    trainer, cut = predict({PLUGIN: BUDGET})
    assert torch.equal(torch.as_tensor(stock.predictions), torch.as_tensor(cut.predictions))
    for key, value in stock.metrics.items():
        if not key.endswith(("_runtime", "_per_second")):
            assert math.isclose(cut.metrics[key], value, rel_tol=LOG_RTOL, abs_tol=LOG_ATOL), key
    assert _state(trainer).warned_logits


# ---------------------------------------------------------------------------------------------------------------------
# Refusals and lifecycle
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", sorted(COUPLED_LOSS_TYPES))
def test_refuses_losses_that_couple_pairs(dpo_args, tokenizer, loss_type):
    with pytest.raises(UsageError, match=f"loss_type='{loss_type}'"):
        _train(dpo_args, tokenizer, {PLUGIN: BUDGET}, loss_type=["sigmoid", loss_type])


def test_flag_is_validated():
    with pytest.raises(UsageError):
        trl_ext.install(token_budget=0)
    with pytest.raises(UsageError):
        trl_ext.install(token_budget="lots")  # "auto" is accepted: tests/plugins/test_token_budget_auto.py


def test_detach_restores_the_trainer(dpo_args, tokenizer):
    from trl import DPOTrainer

    names = ("get_train_dataloader", "get_eval_dataloader", "get_test_dataloader", "get_batch_samples")
    names += ("training_step", "compute_loss", "prediction_step", "loss_is_scaled_for_ga", "train")
    with trl_ext.install(token_budget=BUDGET) as installation:
        trainer = DPOTrainer(
            make_model(hidden_size=32),
            ref_model=make_model(hidden_size=32, seed=1),
            args=dpo_args(bf16=False),
            train_dataset=_dataset(),
            processing_class=tokenizer,
        )
        assert all(name in trainer.__dict__ for name in names)
        assert trainer.loss_is_scaled_for_ga is True
        assert {"gather", "gather_for_metrics"} <= set(vars(trainer.accelerator))
        installation.detach(trainer)
    assert not any(name in trainer.__dict__ for name in names)
    assert trainer.loss_is_scaled_for_ga is type(trainer).loss_is_scaled_for_ga
    assert not {"gather", "gather_for_metrics"} & set(vars(trainer.accelerator))


class _Observer:
    """A third-party plugin taking part in the same trainer methods as token_budget, with the default order: outside
    token_budget's (`trylast`), so it sees the calls the Trainer makes."""

    TRL_EXT_PLUGIN = PluginSpec(
        name="observer",
        summary="Counts calls.",
        trainers=("DPOTrainer",),
        calls=("get_batch_samples", "training_step", "compute_loss", "train"),
    )

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.told: list[tuple[str, int, list[int]]] = []

    @trl_ext.hookimpl
    def trl_ext_call(self, trainer, context, call):
        self.calls[call.name] += 1
        if call.name == "get_batch_samples":  # what the Trainer gets: one entry per stock batch
            batches, num_items_in_batch = result = call.proceed()
            self.calls["batches"] += len(batches)
            return result
        return call.proceed()

    @trl_ext.hookimpl
    def trl_ext_stock_batches(self, trainer, context, mode, calls, sizes):
        self.told.append((mode, calls, sizes))


def test_a_plugin_outside_sees_the_trainers_calls_and_is_told_stocks_batches(dpo_args, tokenizer, monkeypatch):
    """What sync_metrics relies on: outside token_budget in the chain, one `training_step` per stock batch, a
    `compute_loss` per re-cut micro-batch, and after each step the stock batches they stood for
    (`trl_ext_stock_batches`)."""
    observer = _Observer()
    install_fake_plugin(monkeypatch, "observer", observer)
    with _records() as records:
        trainer, _, _ = _train(dpo_args, tokenizer, {PLUGIN: BUDGET, "plugins": {"observer": {}}})
    state = _state(trainer)
    stock = [ACCUMULATION, ACCUMULATION]  # 7 pairs in batches of 2 (2, 2 | 2, 1), 2 per step
    assert state.stock_micro_batch_counts == stock
    assert observer.calls["training_step"] == observer.calls["batches"] == sum(stock)
    assert observer.calls["compute_loss"] == sum(state.micro_batch_counts) != sum(stock)
    assert observer.calls["train"] == 1 and observer.calls["get_batch_samples"] >= 2
    counts = state.micro_batch_counts
    assert observer.told == [("train", counts[0], [2, 2]), ("train", counts[1], [2, 1])]
    assert [r.getMessage() for r in records if r.getMessage().startswith("token_budget: 2 optimizer step(s)")]


def test_end_line_sets_the_largest_micro_batch_against_stocks(dpo_args, tokenizer, monkeypatch):
    """Issue 41, point 5, as a user meets it: when `train()` returns, one line says the budget, the largest micro-batch
    token_budget built, and the largest micro-batch stock TRL builds from the same batches, `rows x padded width`,
    here measured on a stock run of the same data and seeds; the over-budget warning is said once, with its count."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    shapes: list[tuple[int, int]] = []
    collate = DataCollatorForPreference.torch_call

    def recording(self, examples):
        batch = collate(self, examples)
        shapes.append(tuple(batch["input_ids"].shape))
        return batch

    with monkeypatch.context() as patch:
        patch.setattr(DataCollatorForPreference, "torch_call", recording)
        _train(dpo_args, tokenizer, None)  # stock: every batch its collator built is one of its micro-batches
    assert len(shapes) == 2 * ACCUMULATION
    rows, width = max(shapes, key=lambda s: s[0] * s[1])
    with _records() as records:
        trainer, _, _ = _train(dpo_args, tokenizer, {PLUGIN: BUDGET})
    state = _state(trainer)
    assert state.stock_largest and all(s == (rows, width) or s[0] * s[1] <= rows * width for s in state.stock_largest)
    ends = [r.getMessage() for r in records if r.getMessage().startswith("token_budget: 2 optimizer step(s)")]
    assert len(ends) == 1, [r.getMessage() for r in records]
    largest = max(state.max_tokens)
    assert f"within the budget of {BUDGET} padded tokens" in ends[0]
    assert f"; a pair of {largest} tokens is over the budget of {BUDGET} and ran alone" in ends[0]
    stock = f"{rows * width} padded tokens ({rows} rows x {width})"
    assert ends[0].endswith(f"; stock TRL's largest micro-batch from the same batches: {stock}"), ends[0]
    assert largest < rows * width  # what the plugin is for: a smaller largest micro-batch than stock's
    warnings = [r.getMessage() for r in records if "exceed the budget" in r.getMessage()]
    over = sum(state.over_budget)
    assert len(warnings) == 1 and warnings[0].startswith(f"token_budget: {over} pair(s) of this step"), warnings
