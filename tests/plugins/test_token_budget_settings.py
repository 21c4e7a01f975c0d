"""`token_budget` against stock TRL in the settings of issue 33 §2 and issue 35: no `args=`, `pad_to_multiple_of`,
FSDP v1, batch dispatching (one and two processes), TRL's helpers found by capability (1.14), the flag without a
value, and the lines the plugin logs. Loss settings (NaN, sft, the allow-list): test_token_budget_losses.py.

The comparisons use tests/plugins/token_budget_harness.py (float64 models, SGD, two optimizer steps of 2 x
2 pairs, the second the epoch's uneven last one, parameters to 1e-6 of a step's change, logs to 1e-6).
"""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest
import torch

import trl_ext
from trl_ext import UsageError
from trl_ext.plugins.token_budget.cut import pair_length
from trl_ext.plugins.token_budget.hooks import (
    check_trainer,
)
from trl_ext.testing import make_model, make_preference_dataset

from .. import helpers
from ..equivalence import one_thread, sharpen
from .token_budget_harness import (
    BUDGET,
    LOG_ATOL,
    LOG_RTOL,
    PLUGIN,
    TIMINGS,
    _assert_same_run,
    _records,
    _state,
    _train,
)

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=LOG_RTOL, abs_tol=LOG_ATOL)


# ---------------------------------------------------------------------------------------------------------------------
# No `args=`: TRL's default DPOConfig
# ---------------------------------------------------------------------------------------------------------------------


def test_without_args_uses_trls_default_config(tokenizer, tmp_path, monkeypatch):
    """`DPOTrainer(model, ...)` without `args=` trains with the `DPOConfig` TRL builds; token_budget reads that one.
    TRL's default asks for bf16 (no GPU here), so the test gives TRL's module a DPOConfig whose defaults run on CPU
    in float64 with SGD: the path through TRL's own default construction is the same."""
    import dataclasses

    import trl.trainer.dpo_trainer as dpo_module
    from trl import DPOConfig, DPOTrainer

    defaults = dict(
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", optim="sgd", learning_rate=0.05,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=1, logging_steps=1,
        max_grad_norm=0.0,
    )  # fmt: skip
    fields = [(name, type(value), dataclasses.field(default=value)) for name, value in defaults.items()]
    monkeypatch.setattr(
        dpo_module, "DPOConfig", dataclasses.make_dataclass("CpuDPOConfig", fields, bases=(DPOConfig,))
    )
    monkeypatch.chdir(tmp_path)

    def train(install):
        with trl_ext.install(**install):
            trainer = DPOTrainer(
                sharpen(make_model(dtype=torch.float64, hidden_size=32)),
                ref_model=sharpen(make_model(dtype=torch.float64, hidden_size=32, seed=1)),
                train_dataset=make_preference_dataset(7, seed=15, prompt_median=6, completion_median=5, max_prompt=24),
                processing_class=tokenizer,
            )
            trainer.train()
        return trainer

    stock, plugin = train({}), train({PLUGIN: BUDGET})
    assert type(plugin.args).__name__ == "CpuDPOConfig"  # TRL built it
    assert sum(_state(plugin).micro_batch_counts) != 4
    for s_log, p_log in zip(stock.state.log_history, plugin.state.log_history, strict=True):
        assert all(_same(v, p_log[k]) for k, v in s_log.items() if k not in TIMINGS), (s_log, p_log)
    initial = dict(sharpen(make_model(dtype=torch.float64, hidden_size=32)).named_parameters())
    stock_params, plugin_params = dict(stock.model.named_parameters()), dict(plugin.model.named_parameters())
    change = max((stock_params[n] - initial[n]).abs().max().item() for n in initial)
    worst = max((stock_params[n] - plugin_params[n]).abs().max().item() for n in initial)
    assert change > 1e-4 and worst <= 1e-6 * change, (change, worst)


# ---------------------------------------------------------------------------------------------------------------------
# pad_to_multiple_of: the budget counts the padded width the model sees
# ---------------------------------------------------------------------------------------------------------------------


def test_budget_counts_the_width_padded_to_a_multiple(dpo_args, tokenizer):
    example = {"prompt_ids": [1] * 5, "chosen_ids": [2] * 4, "rejected_ids": [3] * 9}
    assert pair_length(example, False, None, 16) == 16 and pair_length(example, False, 10, 16) == 16
    assert pair_length(example, False, None, None) == 14 and pair_length(example, True, None, 16) == 23
    # Every pair is at most 47 tokens: padded to 64, a micro-batch of 2 pairs is 2 x 2 x 64 = 256 tokens.
    args = {"pad_to_multiple_of": 64}
    seen: list[int] = []
    from trl import DPOTrainer

    original = DPOTrainer._compute_loss

    def record(self, model, inputs, return_outputs=False):
        seen.append(inputs["input_ids"].numel())
        return original(self, model, inputs, return_outputs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DPOTrainer, "_compute_loss", record)
        plugin = _train(dpo_args, tokenizer, {PLUGIN: 255}, **args)
    state = _state(plugin[0])
    assert state.multiple == 64 and state.micro_batch_counts == [4, 3]  # 256 > 255: one pair per micro-batch
    assert max(seen) == 128 and max(state.max_tokens) == 128  # what the model saw is what the budget counted
    _assert_same_run(_train(dpo_args, tokenizer, None, **args), plugin)


# ---------------------------------------------------------------------------------------------------------------------
# FSDP v1 refused (FSDP2 is covered by tests/scale)
# ---------------------------------------------------------------------------------------------------------------------


def test_fsdp_v1_is_refused_fsdp2_is_not():
    def trainer(fsdp: bool, fsdp2: bool):
        return SimpleNamespace(
            args=SimpleNamespace(use_weighting=False, use_liger_kernel=False),
            loss_types=["sigmoid"],
            is_fsdp_enabled=fsdp,
            aux_loss_enabled=False,  # DPOTrainer sets it in `__init__`
            accelerator=SimpleNamespace(is_fsdp2=fsdp2),
        )

    with pytest.raises(UsageError, match="FSDP v1"):
        check_trainer(trainer(True, False))
    check_trainer(trainer(True, True))
    check_trainer(trainer(False, False))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="accelerate's FSDP needs an accelerator")
def test_fsdp_v1_trainer_is_refused_when_built(tmp_path):
    """A real FSDP v1 DPOTrainer (one process under torchrun) is refused before training."""
    script = tmp_path / "fsdp1.py"
    script.write_text(
        "import torch, trl_ext\n"
        "from trl import DPOConfig, DPOTrainer\n"
        "from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer\n"
        f"args = DPOConfig(output_dir={str(tmp_path / 'out')!r}, bf16=False, report_to=[],\n"
        "                 save_strategy='no', fsdp='full_shard', fsdp_config={'fsdp_version': 1})\n"
        "try:\n"
        "    with trl_ext.install(token_budget=64):\n"
        "        DPOTrainer(make_model(), ref_model=make_model(seed=1), args=args,\n"
        "                   train_dataset=make_preference_dataset(4), processing_class=make_tokenizer())\n"
        "except trl_ext.UsageError as error:\n"
        "    print('REFUSED', error)\n"
    )
    out = helpers.launch(script, nproc=1)
    assert "REFUSED `token_budget` does not support FSDP v1" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------------
# Batch dispatching on two processes
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("loss", ["sigmoid", "sft"])
def test_dispatch_batches_two_processes(tmp_path, loss):
    """torchrun, 2 CPU processes (gloo), `dispatch_batches=True`: training and evaluation on an IterableDataset with
    token_budget log what stock logs and end with stock's parameters, on every rank."""
    out = helpers.launch(helpers.PLUGIN_SCRIPTS / "token_budget_dispatch.py", tmp_path, loss)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("DISPATCH OK") == 2, out.stdout[-3000:]


def test_dispatch_batches_one_process_equals_stock(dpo_args, tokenizer):
    """`dispatch_batches=True` on one process: the loader dispatches (the examples travel encoded), and training
    equals stock."""
    args = dict(max_length=64, pad_to_multiple_of=64, accelerator_config={"dispatch_batches": True})
    plugin = _train(dpo_args, tokenizer, {PLUGIN: 128}, **args)
    _assert_same_run(_train(dpo_args, tokenizer, None, **args), plugin)
    assert _state(plugin[0]).micro_batch_counts == [4, 3]  # one pair per micro-batch (2 x 64 tokens)
    from trl_ext.plugins.token_budget.cut import EXAMPLES_KEY, dispatches

    loader = plugin[0].get_train_dataloader()
    assert dispatches(loader) and isinstance(next(iter(loader))[EXAMPLES_KEY]["rows"], torch.Tensor)


def test_dispatched_examples_survive_concatenation_and_slicing(dpo_args, tokenizer):
    """The examples travel as tensors whose rows follow the batch's: after accelerate joins two processes' batches
    and slices them, each process decodes its own pairs, which collate to its own batch (truncation included)."""
    from accelerate.utils import concatenate, slice_tensors

    from trl_ext.plugins.token_budget.cut import EXAMPLES_KEY, Encoder, KeepExamples, examples_of

    for mode in ("keep_start", "keep_end"):
        # one padded width, as stock TRL needs for accelerate to join its batches
        args = dict(max_length=20, pad_to_multiple_of=20, truncation_mode=mode, max_steps=1)
        trainer, _, _ = _train(dpo_args, tokenizer, None, **args)
        keep = KeepExamples(trainer.data_collator)
        keep.encoder = Encoder(20, mode, None)
        examples = [trainer.train_dataset[i] for i in range(4)]
        examples = [{k: e[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for e in examples]
        batches = [keep(examples[:2]), keep(examples[2:])]
        both = concatenate(batches, dim=0)
        for rank in (0, 1):
            part = slice_tensors(both, slice(4 * rank, 4 * rank + 4))
            decoded = examples_of(part[EXAMPLES_KEY])
            again = trainer.data_collator(decoded)
            for key in ("input_ids", "attention_mask", "completion_mask"):
                assert torch.equal(again[key], batches[rank][key]), (mode, key)
        with pytest.raises(UsageError, match="not one whole batch"):
            examples_of(slice_tensors(both, slice(2, 6))[EXAMPLES_KEY])


# ---------------------------------------------------------------------------------------------------------------------
# What the plugin says (issue 35)
# ---------------------------------------------------------------------------------------------------------------------


def test_batches_the_trainers_loader_did_not_build_or_that_count_labels_are_usage_errors(dpo_args, tokenizer):
    """Two settings of the user's own that token_budget cannot cut by, each refused with its fix: a training batch
    that does not come from the trainer's `get_train_dataloader` (no examples), and batches with `labels` that the
    Trainer counts for loss scaling (`num_items_in_batch`)."""
    from trl import DPOTrainer

    from trl_ext.plugins.token_budget.step import TokenBudgetState

    with pytest.raises(UsageError, match="get_train_dataloader"):
        TokenBudgetState.cut(None, [{"input_ids": torch.ones(2, 3, dtype=torch.long)}])  # refused before `self`
    with trl_ext.install(**{PLUGIN: BUDGET}):
        trainer = DPOTrainer(
            make_model(dtype=torch.float64, hidden_size=32),
            ref_model=make_model(dtype=torch.float64, hidden_size=32, seed=1),
            args=dpo_args(),
            train_dataset=make_preference_dataset(8),
            processing_class=tokenizer,
        )
        trainer.model_accepts_loss_kwargs = True  # as a model whose forward takes `num_items_in_batch`
        batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.ones(2, 3, dtype=torch.long)}
        with pytest.raises(UsageError, match="no `labels` key, or disable token_budget"):
            trainer.get_batch_samples(iter([batch]), 1, trainer.args.device)


def test_flag_needs_a_value():
    from trl_ext.app.job_args import split_argv
    from trl_ext.config import load_config

    flags, rest = split_argv(["--trl-ext-token-budget", "--lr", "1"])
    assert rest == ["--lr", "1"]
    with pytest.raises(UsageError, match='bare `--trl-ext-token-budget`: give a number of tokens or "auto"'):
        load_config(None, flags=flags, sources={"token_budget": "the command line"})
    assert load_config(None, flags=split_argv(["--trl-ext-token-budget", "auto"])[0]).token_budget == "auto"
    assert load_config(None, flags=split_argv(["--trl-ext-token-budget=512"])[0]).token_budget == 512


def test_summary_says_a_long_pair_ran_alone(dpo_args, tokenizer):
    with _records() as records:
        trainer, _, _ = _train(dpo_args, tokenizer, {PLUGIN: BUDGET})
    state = _state(trainer)
    lines = [r.getMessage() for r in records if r.getMessage().startswith("token_budget: 2 optimizer step(s)")]
    assert state.over_budget == [0, 1] or state.over_budget == [1, 0], state.over_budget
    largest = max(state.max_tokens)
    rows, width = max(state.stock_largest, key=lambda shape: shape[0] * shape[1])
    assert lines == [
        f"token_budget: 2 optimizer step(s) ran {sum(state.micro_batch_counts)} micro-batches (stock: 4) within the "
        f"budget of {BUDGET} padded tokens; a pair of {largest} tokens is over the budget of {BUDGET} and ran alone; "
        f"stock TRL's largest micro-batch from the same batches: {rows * width} padded tokens ({rows} rows x {width})"
    ]


def test_sync_metrics_notice_counts_stocks_batches(dpo_args, tokenizer):
    """With sync_metrics on one process, its notice that stock's per-batch means differ names stock's batches (the
    re-cut micro-batches are not stock's), and its counts add up: only the epoch's last step (2 + 1 pairs) is
    uneven."""
    with _records() as records:
        trainer, _, _ = _train(dpo_args, tokenizer, {PLUGIN: BUDGET, "sync_metrics": True})
    assert _state(trainer).micro_batch_counts != [2, 2]
    lines = [r.getMessage() for r in records if "sync_metrics: the train batches" in r.getMessage()]
    assert len(lines) == 1 and "held 2 / 1 pairs (3 in all)" in lines[0], lines


# ---------------------------------------------------------------------------------------------------------------------
# TRL's helpers found by capability (1.14 calls a joint log-prob/entropy helper and imports no `entropy_from_logits`)
# ---------------------------------------------------------------------------------------------------------------------


def test_entropy_helper_found_by_capability(monkeypatch):
    """The entropy of the logits path comes from TRL's DPO module's `entropy_from_logits` (1.10-1.13) or, on a module
    without it, its `selective_log_softmax_and_entropy` (1.14); with neither, a clear error."""
    import types

    from trl_ext import _compat
    from trl_ext.plugins.token_budget import metrics

    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    labels = torch.randint(0, 5, (2, 3))
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    expected = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    calls = []

    def joint(logits, index, entropy_requires_grad=True, row_mask=None):
        calls.append(entropy_requires_grad)
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        return logits.log_softmax(-1).gather(-1, index[..., None])[..., 0], entropy.masked_fill(row_mask == 0, 0.0)

    fake = types.ModuleType("fake_dpo")
    monkeypatch.setitem(sys.modules, "fake_dpo", fake)
    monkeypatch.setattr(_compat, "DPO_LOGITS_MODULE", "fake_dpo")
    with pytest.raises(UsageError, match="neither `entropy_from_logits` nor `selective_log_softmax_and_entropy`"):
        metrics.logits_entropy(logits, labels, mask)
    fake.selective_log_softmax_and_entropy = joint
    assert torch.equal(metrics.logits_entropy(logits, labels, mask), expected.masked_fill(mask == 0, 0.0))
    assert calls == [False]
    fake.entropy_from_logits = lambda logits: -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    assert torch.equal(metrics.logits_entropy(logits, labels, mask), expected) and calls == [False]
