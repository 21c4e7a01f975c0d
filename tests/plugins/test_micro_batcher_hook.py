"""`trl_ext_make_micro_batcher`: cutting a training step into micro-batches, a hook spec any plugin can answer.

`Halves` is written as a third-party plugin would be (it imports `trl_ext` and `trl_ext.api` only): it runs each stock
batch as two micro-batches of half its pairs, each loss weighted by its pairs' share of the step, through the
`MicroBatcher` protocol. The core wraps the trainer for it (loaders, `get_batch_samples`, `training_step`,
`compute_loss`, `prediction_step`, `train`) through the trainer's undo stack; the plugin sets no trainer attribute.
Trained in float64 with SGD against stock, the parameters after every step and the logged losses agree to `RTOL`.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

import trl_ext
from tests import helpers
from trl_ext import UsageError
from trl_ext.api import MicroBatcher, PluginSpec
from trl_ext.testing import make_preference_dataset

from .._fakes import install_fake_plugin
from ..equivalence import dpo_builder, one_thread

#: Parameters after each step (relative to the step's change) and logged losses. Every batch is padded to one width
#: (`pad_to_multiple_of`), so a half runs rows stock runs, in a batch of another size. Measured: 1.5e-15 of the step's
#: change on TRL 1.12; on TRL 1.16 (its fused LM head computes in float32 inside the float64 model) 8.4e-8 of the
#: second step's change and losses equal, with 1 or 2 threads, but `eval_loss` 1.3e-7 apart with 2 threads and
#: `ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE` (other kernels, as on another CPU) and 2.0e-7 on another machine.
#: 1e-6 is 5x that floor; a loss weight wrong by 0.1 % moves the parameters by 1e-3 of it.
RTOL = 1e-6
KEY = "_halves_examples"
#: 7 pairs in batches of 3, 2 per step: the second step's last batch has 1 pair (one half, weighed as stock does).
PAIRS, BATCH, ACCUMULATION = 7, 3, 2
#: What the core wraps on the trainer for a micro-batcher (besides `log` and the entry points of every trainer).
WRAPPED = (
    "get_batch_samples",
    "training_step",
    "compute_loss",
    "prediction_step",
    "loss_is_scaled_for_ga",
    "get_train_dataloader",
    "get_eval_dataloader",
    "get_test_dataloader",
)

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


class _Entry(dict):
    """One stock batch (its items) and the halves to run in its place: `(inputs, loss weight)`."""

    halves: list[tuple[dict, float]]
    step_end: tuple[str, int, list[int]] | None


class HalvingBatcher:
    """A `MicroBatcher`: each stock batch of a step runs as two micro-batches of half its pairs."""

    def __init__(self) -> None:
        self.collator = None
        self.weight: float | None = None
        self.calls: Counter[str] = Counter()
        self.pending: list[tuple[str, int, list[int]]] = []
        self.steps = 0

    def loader_collator(self, collator):
        self.calls["loader_collator"] += 1
        self.collator = collator

        def keep_examples(examples):
            batch = collator(examples)
            batch[KEY] = list(examples)
            return batch

        return keep_examples

    def loader_built(self, loader, collator):
        self.calls["loader_built"] += 1

    def cut(self, batches, num_items_in_batch):
        if num_items_in_batch is not None:
            raise UsageError("halves: cannot keep `num_items_in_batch`")
        entries, sizes = [], []
        for batch in batches:
            examples = batch.pop(KEY)
            sizes.append(len(examples))
            entry = _Entry(batch)
            middle = (len(examples) + 1) // 2
            parts = [part for part in (examples[:middle], examples[middle:]) if part]
            # a pair's share of the step as stock weighs it: 1 / (pairs in its batch x batches in the step)
            entry.halves = [(self.collator(part), len(part) / (len(examples) * len(batches))) for part in parts]
            entry.step_end = None
            entries.append(entry)
        if entries:
            runs = sum(len(entry.halves) for entry in entries)
            entries[-1].step_end = ("train", runs, sizes)
            self.steps += 1
        return entries

    def training_step(self, original, model, inputs, args, kwargs):
        self.calls["training_step"] += 1
        assert isinstance(inputs, _Entry), "only the training loop's batches in this test"
        total = None
        for half, weight in inputs.halves:
            self.weight = weight
            try:
                loss = original(model, half, *args, **kwargs)
            finally:
                self.weight = None
            total = loss if total is None else total + loss
        if inputs.step_end is not None:
            self.pending.append(inputs.step_end)
        return total

    def compute_loss(self, original, model, inputs, args, kwargs):
        self.calls["compute_loss"] += 1
        loss = original(model, inputs, *args, **kwargs)
        return loss if self.weight is None else loss * self.weight

    def prediction_step(self, original, model, inputs, prediction_loss_only, args, kwargs):
        self.calls["prediction_step"] += 1
        stock = {key: value for key, value in inputs.items() if key != KEY}
        return original(model, stock, prediction_loss_only, *args, **kwargs)

    def stock_batches(self):
        told, self.pending = self.pending, []
        return told

    def train_started(self) -> None:
        self.steps = 0

    def train_summary(self):
        return f"halves: {self.steps} step(s) in halves"


class Halves:
    """A third-party plugin answering `trl_ext_make_micro_batcher` (`answer`: what it returns)."""

    def __init__(self, name: str = "halves", answer=None, report: bool = True) -> None:
        self.TRL_EXT_PLUGIN = PluginSpec(name=name, summary="Each batch in two halves.", trainers=("DPOTrainer",))
        self.answer = answer
        self.report = report
        self.batchers: list[HalvingBatcher] = []
        self.told: list[tuple[str, int, list[int]]] = []

    @trl_ext.hookimpl
    def trl_ext_make_micro_batcher(self, trainer, context):
        if self.answer is not None:
            return self.answer
        self.batchers.append(HalvingBatcher())
        if not self.report:
            self.batchers[-1].stock_batches = list  # tells nothing
        return self.batchers[-1]

    @trl_ext.hookimpl
    def trl_ext_stock_batches(self, trainer, context, mode, calls, sizes):
        self.told.append((mode, calls, sizes))


class _Params(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.detach().clone() for n, p in model.named_parameters()})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.detach().clone() for n, p in model.named_parameters()})


_records = helpers.trl_ext_records


def _build(dpo_args, tokenizer, **args):
    dataset = make_preference_dataset(PAIRS, seed=15, prompt_median=6, completion_median=5, max_prompt=24)
    make = dpo_builder(dpo_args, tokenizer, dataset, dtype=torch.float64)
    config = dict(
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=-1,
        num_train_epochs=1,
        optim="sgd",
        learning_rate=0.05,
        max_grad_norm=0.0,
        pad_to_multiple_of=64,
    )
    return make(eval_dataset=dataset, **{**config, **args})


def _train(dpo_args, tokenizer):
    trainer = _build(dpo_args, tokenizer)
    params = _Params()
    trainer.add_callback(params)
    trainer.train()
    evaluation = trainer.evaluate()
    return trainer, params.steps, evaluation


def test_a_third_party_micro_batcher_runs_halves_equal_to_stock(dpo_args, tokenizer, monkeypatch):
    plugin = Halves()
    install_fake_plugin(monkeypatch, "halves", plugin)
    stock, stock_steps, stock_eval = _train(dpo_args, tokenizer)
    with trl_ext.install(plugins={"halves": {}}), _records() as records:
        trainer, steps, evaluation = _train(dpo_args, tokenizer)
    (batcher,) = plugin.batchers
    assert isinstance(batcher, MicroBatcher)
    # two steps: batches of 3 + 3 pairs, then 1 pair: halves 2 + 2, then 1 micro-batch, each a `compute_loss` call
    assert plugin.told == [("train", 4, [3, 3]), ("train", 1, [1])]
    assert batcher.calls["training_step"] == 3  # the Trainer's count, one per stock batch
    assert batcher.calls["compute_loss"] == 5 + 2  # the halves, then the two evaluation batches (4 + 3 pairs)
    assert batcher.calls["prediction_step"] == 2 and batcher.calls["loader_built"] == 2  # train and eval loaders
    assert any(r.getMessage() == "halves: 2 step(s) in halves" for r in records)
    assert len(steps) == len(stock_steps) == 3
    for step in (1, 2):
        change = max((stock_steps[step][n] - stock_steps[step - 1][n]).abs().max().item() for n in stock_steps[step])
        assert change > 1e-4
        worst = max((stock_steps[step][n] - steps[step][n]).abs().max().item() for n in stock_steps[step])
        assert worst <= RTOL * change, (step, worst, change)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    stock_losses = [log["loss"] for log in stock.state.log_history if "loss" in log]
    assert len(losses) == len(stock_losses) == 2
    for loss, stock_loss in zip(losses, stock_losses, strict=True):
        assert math.isclose(loss, stock_loss, rel_tol=RTOL), (loss, stock_loss)
    assert math.isclose(evaluation["eval_loss"], stock_eval["eval_loss"], rel_tol=RTOL)


@pytest.mark.parametrize("report", [True, False])
def test_a_metrics_reducer_counts_the_stock_batches_it_is_told(dpo_args, tokenizer, monkeypatch, report):
    """sync_metrics counts the pairs of each `compute_loss` call and says when a window's batches were uneven: told
    the stock batches (`trl_ext_stock_batches`), it sees stock's 3 + 3 pairs, not the halves' 2 + 1 + 2 + 1."""
    install_fake_plugin(monkeypatch, "halves", Halves(report=report))
    with trl_ext.install(plugins={"halves": {}}, sync_metrics=True), _records() as records:
        trainer = _build(dpo_args, tokenizer)
        trainer.train()
    uneven = [r.getMessage() for r in records if "the train batches since the last log held" in r.getMessage()]
    if report:
        assert not uneven
    else:  # the halves' own calls, untold
        assert len(uneven) == 1 and "held 2 / 2 / 1 / 1 pairs (6 in all)" in uneven[0], uneven


def test_detach_restores_every_wrapped_trainer_attribute(dpo_args, tokenizer, monkeypatch):
    install_fake_plugin(monkeypatch, "halves", Halves())
    with trl_ext.install(plugins={"halves": {}}) as installation:
        trainer = _build(dpo_args, tokenizer)
        assert all(name in vars(trainer) for name in WRAPPED)
        assert trainer.loss_is_scaled_for_ga is True
        installation.detach(trainer)
    assert not [name for name in (*WRAPPED, "train", "log") if name in vars(trainer)]
    assert trainer.loss_is_scaled_for_ga is type(trainer).loss_is_scaled_for_ga


def test_two_micro_batchers_are_refused(dpo_args, tokenizer, monkeypatch):
    install_fake_plugin(monkeypatch, "halves", Halves(), dist_name="trl-ext-fake-a")
    install_fake_plugin(monkeypatch, "halves_b", Halves("halves_b"), dist_name="trl-ext-fake-b")
    with trl_ext.install(plugins={"halves": {}, "halves_b": {}}):
        with pytest.raises(UsageError, match=r"answered `trl_ext_make_micro_batcher`"):
            _build(dpo_args, tokenizer)


def test_an_answer_without_the_protocol_is_refused(dpo_args, tokenizer, monkeypatch):
    install_fake_plugin(monkeypatch, "halves", Halves(answer=object()))
    with trl_ext.install(plugins={"halves": {}}):
        with pytest.raises(UsageError, match="lacks methods of `trl_ext.api.MicroBatcher`"):
            _build(dpo_args, tokenizer)


def test_token_budget_sets_no_trainer_attribute_itself():
    """token_budget acts through `trl_ext_make_micro_batcher`: the core wraps the trainer for it."""
    package = Path(trl_ext.__file__).parent / "plugins" / "token_budget"
    sources = {path.name: path.read_text() for path in package.glob("*.py")}
    assert "def trl_ext_make_micro_batcher" in sources["hooks.py"]
    assert not [name for name, text in sources.items() if "setattr(trainer" in text or "setattr(self.trainer" in text]
