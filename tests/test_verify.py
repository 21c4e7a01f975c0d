"""`verify` (`trl_ext.verify`): the first training step of a trainer whose plugins change the math is checked against
stock TRL on the same batch. A planted wrong path is stopped before any parameter changes; the right path trains
as without verify, bit for bit (dropout included); stock's own 16-bit round-off passes; the option is spelled the
same in every source."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from tests import helpers
from trl_ext import UsageError, _compat
from trl_ext.api import current_call
from trl_ext.config import TrlExtConfig, load_config
from trl_ext.testing import make_model, make_preference_dataset

_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)

_FACT = _compat.dpo_training_refusal()
needs_dpo = pytest.mark.skipif(_FACT is not None, reason="stock DPOTrainer cannot train on this TRL here")


@pytest.fixture(scope="module")
def pairs():
    return make_preference_dataset(8, seed=3)


@pytest.fixture
def build(dpo_args, tokenizer, pairs):
    """A DPOTrainer on tiny sharpened models (float64 unless a 16-bit `precision` is asked: then float32 weights
    under autocast), SGD, batches of 4 pairs; `attention_dropout` in the policy's attention."""

    def make(precision: str | None = None, attention_dropout: float = 0.0, trainer_class: Any = None, **args: Any):
        from trl import DPOTrainer

        trainer_class = trainer_class or DPOTrainer

        kwargs: dict[str, Any] = {} if precision is not None else {"dtype": torch.float64}
        config = dict(optim="sgd", learning_rate=0.1, max_grad_norm=0.0, max_length=64, bf16=False)
        config.update(args)
        if precision is not None:
            config[precision] = True
        policy = eq.sharpen(make_model(**kwargs))
        if attention_dropout:  # drawn in training mode (TRL's `disable_dropout` zeroes `nn.Dropout` modules only)
            policy.config.attention_dropout = attention_dropout
            for module in policy.modules():
                if hasattr(module, "attention_dropout"):
                    module.attention_dropout = attention_dropout
        return trainer_class(
            policy,
            ref_model=eq.sharpen(make_model(**kwargs, seed=1)),
            args=dpo_args(**config),
            train_dataset=pairs,
            processing_class=tokenizer,
        )

    return make


def _plant_wrong_scale(request, name: str, factor: float) -> None:
    """The packed attention registered as `name` computes with its softmax scale off by `factor` (a wrong scale
    passed to a kernel): a path that stays silent everywhere but in its numbers."""
    right = None

    def wrong(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        scaling = (query.shape[-1] ** -0.5 if scaling is None else scaling) * factor
        return right(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    right = helpers.plant_attention(request, name, wrong)


def _parameters(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


# -------------------------------------------------------------------------------------------------------------------
# A wrong path is stopped before the optimizer step; the right one trains
# -------------------------------------------------------------------------------------------------------------------


@needs_dpo
@pytest.mark.parametrize(("flags", "attention"), [({"padding_free": True}, "trl_ext_varlen_sdpa")])
def test_a_planted_wrong_path_stops_before_any_parameter_changes(build, request, flags, attention):
    with trl_ext.install(**flags):
        trainer = build(max_steps=2)
    _plant_wrong_scale(request, attention, 1.05)
    before = _parameters(trainer)
    with pytest.raises(UsageError) as error:
        trainer.train()
    message = str(error.value)
    assert "trl-ext verify: DPOTrainer with padding_free does not compute stock TRL's log-probs" in message
    assert re.search(r"the (policy|reference) log-prob of sequence \d of the batch differs from stock by", message)
    assert "(tolerance " in message and "float32 floor" in message
    assert "Stopped before the optimizer step" in message
    assert trainer.state.global_step == 0
    after = _parameters(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.slow  # the control of the test above: a second trainer and step
@needs_dpo
def test_the_same_fault_passes_with_verify_off(build, request):
    """The control: without verify, the planted fault trains (what verify exists to stop)."""
    with trl_ext.install(padding_free=True, verify=False):
        trainer = build(max_steps=1)
    _plant_wrong_scale(request, "trl_ext_varlen_sdpa", 1.05)
    trainer.train()
    assert trainer.state.global_step == 1


@needs_dpo
@pytest.mark.parametrize(
    "flags",
    [
        {"padding_free": True},
        pytest.param({"prompt_sharing": True}, marks=pytest.mark.slow),
        pytest.param({"token_budget": 56}, marks=pytest.mark.slow),
        pytest.param({"fused_logprobs": True, "padding_free": True}, marks=pytest.mark.slow),
    ],
)
def test_verify_on_trains_bit_for_bit_as_verify_off(build, flags, caplog):
    """float64, SGD, 2 steps, attention dropout in training mode (the forward draws random numbers: verify compares
    in eval mode and puts the generators back): parameters and every logged value equal, bit for bit."""
    dropout = 0.1 if "padding_free" in flags else 0.0
    runs = []
    for verify in (False, 1):
        torch.manual_seed(0)
        with trl_ext.install(**flags, verify=verify):
            trainer = build(max_steps=2, attention_dropout=dropout)
        with caplog.at_level(logging.INFO, logger="trl_ext"):
            trainer.train()
        # what each plugin's end line says (padding_free: the calls packed and their tokens)
        ends = {n: s.summary() for n, s in trainer._trl_ext.state.items() if callable(getattr(s, "summary", None))}
        runs.append((_parameters(trainer), [h for h in trainer.state.log_history if "loss" in h], ends))
        assert trainer._trl_ext.math_plugins  # fused_logprobs: only where it scores (TRL < 1.15)
    (params_off, logs_off, ends_off), (params_on, logs_on, ends_on) = runs
    assert all(torch.equal(params_off[n], params_on[n]) for n in params_off)
    assert logs_off == logs_on
    assert ends_off == ends_on and ("padding_free" not in flags or ends_on), ends_on
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trl-ext verify:")]
    assert len(lines) == 1, lines  # step 1 only
    assert "step 1:" in lines[0] and "extra stock forward(s)" in lines[0] and " s, " in lines[0]
    if dropout:
        assert "eval mode: the forward draws random numbers in training" in lines[0]


def _tallying_trainer():
    """A user's DPOTrainer subclass that counts in the scoring method verify calls again, as a TRL release may (the
    patched TRL of patches/0004 sums its metrics in on-device tensors): an in-place tensor sum, an int, a list, and a
    list of objects that are not plain data, rebound on each call."""
    from trl import DPOTrainer

    name = _compat.VERIFIED_SCORING_METHODS["DPOTrainer"]

    def scoring(self, model, inputs, *args, **kwargs):
        if not hasattr(self, "tally"):
            self.tally, self.calls, self.lengths = torch.zeros(2, dtype=torch.float64), 0, []
        ids = inputs["input_ids"]
        self.tally.add_(torch.tensor([float(ids.sum()), float(ids.numel())], dtype=torch.float64))
        self.calls += 1
        self.lengths.append(inputs["input_ids"].shape[-1])
        self.markers = [*getattr(self, "markers", []), object()]
        return getattr(DPOTrainer, name)(self, model, inputs, *args, **kwargs)

    return type("TallyingDPOTrainer", (DPOTrainer,), {name: scoring})


@pytest.mark.slow  # TRL's own counts (`num_tokens`) are in the logs the bit-for-bit test above compares, fast
@needs_dpo
def test_what_the_scoring_method_counts_on_the_trainer_is_put_back(build):
    """verify's extra stock call leaves no count behind: the subclass's tensor sum, int and list, and TRL's own
    `num_tokens`, equal the run without verify (the failure CI caught on the patched TRL: `num_tokens` counted twice in
    the first step)."""
    runs = []
    for verify in (False, 1):
        with trl_ext.install(padding_free=True, verify=verify):
            trainer = build(max_steps=2, trainer_class=_tallying_trainer(), logging_steps=1)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        tokens = [h["num_tokens"] for h in logs]
        runs.append((trainer.tally.clone(), trainer.calls, list(trainer.lengths), tokens, len(trainer.markers)))
    (
        (tally_off, calls_off, lengths_off, tokens_off, marks_off),
        (tally_on, calls_on, lengths_on, tokens_on, marks_on),
    ) = runs
    assert calls_off == calls_on == 2 and lengths_off == lengths_on and marks_off == marks_on == 2
    assert torch.equal(tally_off, tally_on)
    assert tokens_off == tokens_on and len(tokens_on) == 2 and tokens_on[0] > 0


@needs_dpo
@pytest.mark.parametrize(
    ("flags", "precision"),
    [
        ({"padding_free": True}, "bf16"),
        pytest.param({"padding_free": True}, "fp16", marks=pytest.mark.slow),
        pytest.param({"prompt_sharing": True}, "bf16", marks=pytest.mark.slow),
        pytest.param({"token_budget": 56}, "bf16", marks=pytest.mark.slow),
    ],
)
def test_stock_round_off_in_16_bits_passes(build, flags, precision, caplog):
    with trl_ext.install(**flags, verify=2):
        trainer = build(precision, max_steps=2)
    with caplog.at_level(logging.INFO, logger="trl_ext"):
        trainer.train()
    assert trainer.state.global_step == 2
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trl-ext verify:")]
    assert [line.split(":")[1].split()[-1] for line in lines] == ["1", "2"]
    # bf16: stock's own 16-bit round-off on the batch; fp16 on CPU: accelerate does not autocast, float32 it is
    expected = "stock bf16 vs float32" if precision == "bf16" else "float32 floor"
    assert all(expected in line for line in lines), lines
    # the stock calls pass through the plugins' wrappers under accelerate's autocast, which count none of them
    assert not [r for r in caplog.records if "ran unshared" in r.getMessage() or "ran padded" in r.getMessage()]


@needs_dpo
def test_a_planted_wrong_path_is_stopped_in_bf16(build, request):
    with trl_ext.install(padding_free=True):
        trainer = build("bf16", max_steps=1)
    _plant_wrong_scale(request, "trl_ext_varlen_sdpa", 3.0)
    before = _parameters(trainer)
    with pytest.raises(UsageError, match=r"from stock bf16 vs float32\)\. Stopped before the optimizer step"):
        trainer.train()
    assert all(torch.equal(before[n], p) for n, p in _parameters(trainer).items())


@needs_dpo
def test_no_check_without_a_plugin_that_changes_the_math(build, caplog):
    with trl_ext.install(sync_metrics=True):
        trainer = build(max_steps=1)
    with caplog.at_level(logging.INFO, logger="trl_ext"):
        trainer.train()
    assert trainer._trl_ext.math_plugins == []
    assert not [r for r in caplog.records if r.getMessage().startswith("trl-ext verify:")]


# -------------------------------------------------------------------------------------------------------------------
# The option, spelled the same in every source
# -------------------------------------------------------------------------------------------------------------------


def test_the_option_in_every_source(tmp_path, monkeypatch):
    from trl_ext.app.job_args import resolve_config

    assert TrlExtConfig().verify == 1
    assert load_config(flags={"verify": False}).verify == 0
    assert load_config(flags={"verify": 3}).verify == 3
    assert load_config(flags={"verify": "true"}).verify == 1
    assert load_config(environ={"TRL_EXT_VERIFY": "off"}).verify == 0
    assert load_config(environ={"TRL_EXT_VERIFY": "2"}).verify == 2
    recipe = tmp_path / "trl_ext.yaml"
    recipe.write_text("trl_ext:\n  verify: 4\n")
    assert load_config(str(recipe), environ={}).verify == 4
    monkeypatch.delenv("TRL_EXT_VERIFY", raising=False)
    config, rest, _ = resolve_config(["--trl-ext-verify", "5", "--output_dir", "out"])
    assert (config.verify, rest) == (5, ["--output_dir", "out"])
    assert resolve_config(["--trl_ext_verify=false"])[0].verify == 0
    # precedence: keyword > environment > file
    assert load_config(str(recipe), flags={"verify": 1}, environ={"TRL_EXT_VERIFY": "2"}).verify == 1
    assert load_config(str(recipe), environ={"TRL_EXT_VERIFY": "2"}).verify == 2
    assert TrlExtConfig(verify=0) != TrlExtConfig() and TrlExtConfig(verify=True) == TrlExtConfig()
    assert TrlExtConfig(verify=0).changed() == {"verify": 0}
    for bad in ("sometimes", -1, 2.5):
        with pytest.raises(UsageError, match=r"`verify` must be true, false or a number of steps"):
            load_config(flags={"verify": bad})
    with pytest.raises(UsageError, match=r"Unknown trl-ext flag `verfy`.*Did you mean `verify`"):
        load_config(flags={"verfy": 1})


def test_the_option_is_documented(capsys):
    from trl_ext.app import cli

    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "verify: true, false or a number of steps; default true." in out


# -------------------------------------------------------------------------------------------------------------------
# Several processes
# -------------------------------------------------------------------------------------------------------------------


@needs_dpo
@pytest.mark.distributed
def test_ddp_two_processes(tmp_path):
    """torchrun, 2 CPU processes (gloo), DDP: a wrong path on one rank stops both before the optimizer step; the right
    path trains with verify as without it, bit for bit, on every rank (`scripts/verify_ddp.py`)."""
    from tests import helpers

    out = helpers.launch(helpers.PLUGIN_SCRIPTS / "verify_ddp.py", tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("VERIFY DDP OK") == 2, out.stdout[-3000:]


@pytest.mark.slow  # two training steps
@needs_dpo
def test_a_stock_call_that_does_not_fit_in_memory_is_not_checked_and_said(build, monkeypatch, caplog):
    """The stock call may not fit where the plugin's does (fused_logprobs saves the full logits): out of memory there,
    the step trains unchecked and one warning says so, instead of the run dying on step 1."""
    with trl_ext.install(padding_free=True):
        trainer = build(max_steps=2)
    ctx = trainer._trl_ext
    name = next(iter(ctx.stock_methods))
    stock = ctx.stock_methods[name]

    def out_of_memory(*args, **kwargs):
        if current_call().stock:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.77 GiB")
        return stock(*args, **kwargs)

    monkeypatch.setitem(ctx.stock_methods, name, out_of_memory)
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        trainer.train()
    assert trainer.state.global_step == 2
    warnings = [r.getMessage() for r in caplog.records if "does not fit in memory" in r.getMessage()]
    assert len(warnings) == 1 and "Tried to allocate 9.77 GiB" in warnings[0]
