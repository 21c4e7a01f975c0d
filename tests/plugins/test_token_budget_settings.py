"""`token_budget` against stock TRL in the settings of issue 33 §2 and issue 35: NaN metrics, no `args=`, `loss_type`
"sft" (RPO) and the allow-list of loss types, `pad_to_multiple_of`, FSDP v1, batch dispatching on two processes, the
flag without a value, and the lines the plugin logs.

The comparisons use the harness of tests/plugins/test_token_budget.py (float64 models, SGD, two optimizer steps of 2 x
2 pairs, the second the epoch's uneven last one, parameters to 1e-6 of a step's change, logs to 1e-6).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import trl_ext
from trl_ext import UsageError
from trl_ext.plugins.token_budget.cut import pair_length
from trl_ext.plugins.token_budget.hooks import (
    ACCEPTED_LOSS_TYPES,
    COUPLED_LOSS_TYPES,
    PER_PAIR_LOSS_TYPES,
    check_loss_types,
    check_trainer,
    trl_loss_types,
)
from trl_ext.testing import make_model, make_preference_dataset

from ..equivalence import one_thread, sharpen
from .test_token_budget import (
    BUDGET,
    LOG_ATOL,
    LOG_RTOL,
    MEAN_OVER_PAIRS,
    PARAM_RTOL,
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
# NaN metrics (issue 33 §2): stock logs NaN and goes on; so does token_budget, with the same values
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [BUDGET, 100_000], ids=["cut", "one_micro_batch"])
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


def test_unverified_loss_types_are_refused():
    with pytest.raises(UsageError, match="has not been verified with `loss_type='brand_new'`"):
        check_loss_types(["sigmoid", "brand_new"], False)
    with pytest.raises(UsageError, match="use_weighting=True"):
        check_loss_types(["sigmoid", "sft"], True)
    check_loss_types(sorted(ACCEPTED_LOSS_TYPES), False)


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
    out = _launch([str(script)], nproc=1)
    assert "REFUSED `token_budget` does not support FSDP v1" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------------
# Batch dispatching on two processes
# ---------------------------------------------------------------------------------------------------------------------


def _launch(argv: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    repo = str(Path(trl_ext.__file__).parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    env.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", f"--nproc_per_node={nproc}", *argv]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("loss", ["sigmoid", "sft"])
def test_dispatch_batches_two_processes(tmp_path, loss):
    """torchrun, 2 CPU processes (gloo), `dispatch_batches=True`: training and evaluation on an IterableDataset with
    token_budget log what stock logs and end with stock's parameters, on every rank."""
    script = Path(__file__).parent / "scripts" / "token_budget_dispatch.py"
    out = _launch([str(script), str(tmp_path), loss])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("DISPATCH OK") == 2, out.stdout[-3000:]


def test_dispatch_batches_one_process_equals_stock(dpo_args, tokenizer):
    """`dispatch_batches=True` on one process: the loader dispatches (the examples travel encoded), and training
    equals stock."""
    args = dict(max_length=64, pad_to_multiple_of=64, accelerator_config={"dispatch_batches": True})
    plugin = _train(dpo_args, tokenizer, {PLUGIN: 128}, **args)
    _assert_same_run(_train(dpo_args, tokenizer, None, **args), plugin)
    assert _state(plugin[0]).micro_batch_counts == [4, 3]  # one pair per micro-batch (2 x 64 tokens)
    from trl_ext.plugins.token_budget.cut import EXAMPLES_KEY
    from trl_ext.plugins.token_budget.dispatch import dispatches

    loader = plugin[0].get_train_dataloader()
    assert dispatches(loader) and isinstance(next(iter(loader))[EXAMPLES_KEY]["rows"], torch.Tensor)


def test_dispatched_examples_survive_concatenation_and_slicing(dpo_args, tokenizer):
    """The examples travel as tensors whose rows follow the batch's: after accelerate joins two processes' batches
    and slices them, each process decodes its own pairs, which collate to its own batch (truncation included)."""
    from accelerate.utils import concatenate, slice_tensors

    from trl_ext.plugins.token_budget.cut import EXAMPLES_KEY, KeepExamples
    from trl_ext.plugins.token_budget.dispatch import Encoder, examples_of

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
        with pytest.raises(RuntimeError, match="not one whole batch"):
            examples_of(slice_tensors(both, slice(2, 6))[EXAMPLES_KEY])


# ---------------------------------------------------------------------------------------------------------------------
# What the plugin says (issue 35)
# ---------------------------------------------------------------------------------------------------------------------


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
    assert lines == [
        f"token_budget: 2 optimizer step(s) ran {sum(state.micro_batch_counts)} micro-batches (stock: 4) within the "
        f"budget of {BUDGET} padded tokens; a pair of {largest} tokens is over the budget of {BUDGET} and ran alone"
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
    with pytest.raises(RuntimeError, match="neither `entropy_from_logits` nor `selective_log_softmax_and_entropy`"):
        metrics.logits_entropy(logits, labels, mask)
    fake.selective_log_softmax_and_entropy = joint
    assert torch.equal(metrics.logits_entropy(logits, labels, mask), expected.masked_fill(mask == 0, 0.0))
    assert calls == [False]
    fake.entropy_from_logits = lambda logits: -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    assert torch.equal(metrics.logits_entropy(logits, labels, mask), expected) and calls == [False]
