"""Every plugin in the dtypes users train in: bf16 and fp16 autocast (TRL's default is `bf16=True`), against stock
TRL in the same dtype, DPO and Online DPO.

The float64 equivalence tests of each plugin prove the arithmetic; these prove the plugin keeps stock's *dtype flow*
under mixed precision: where stock's log-probs come out of accelerate's autocast wrapper as float32 and are reduced in
float32, the plugin's must too. A plugin that rounds a value stock keeps in float32 moves every per-token log-prob by
up to half a bf16 step (1/32 at |log-prob| ~ 10), which these tests see.

What "equal within what stock's own dtype allows" means here, per logged value `key` at the first step:
`|plugin16 - stock16| <= max(4 * |stock16 - stock32|, REL[dtype] * |stock16|, ABS)`: four times stock's own 16-bit
round-off on that value, measured on the same model and batch (stock in float32 against stock in 16 bits), or a
floor of four 16-bit ulps where stock's round-off happens to be smaller. The packed and padded forwards multiply
matrices of other shapes, so 16-bit rounding may flip single bits; a plugin that rounds what stock does not moves the
values by far more (the Online DPO regression these tests were written for: `objective/kl` 0.060 where stock logs 0).
Online DPO additionally checks that the completion log-probs `_forward` returns have stock's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from trl_ext.testing import length_reward, make_model, make_preference_dataset, make_prompt_dataset

_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: A few ulps of the 16-bit format, relative (bf16: 8 bits of mantissa, fp16: 11).
REL = {"bf16": 4 * 2.0**-8, "fp16": 4 * 2.0**-11}
ABS = 1e-6
#: Online DPO's per-token completion log-probs: the plugin's mean distance to stock in 16 bits, as a fraction of
#: stock's own 16-bit round-off (stock in 16 bits against stock in float32). Rounding what stock keeps in float32
#: adds an error as large as the round-off itself (ratio ~1); computing the same values in another order flips bits
#: at a few tokens only.
PER_TOKEN = 0.25
#: On CPU, `fp16=True` trains in float32 (accelerate autocasts float16 only on accelerators: stock's round-off is 0
#: there), so the per-token floor is float32 round-off relative to the mean |log-prob|.
FLOAT32_ROUND_OFF = 1e-6
#: Logged values that are not computed from the model (timings, the schedule) or are counts.
NOT_COMPARED = ("runtime", "per_second", "learning_rate", "epoch", "step", "num_tokens", "beta")

DPO_PLUGINS: dict[str, dict[str, Any]] = {
    "padding_free": {"padding_free": True},
    "prompt_sharing": {"prompt_sharing": True},
    "token_budget": {"token_budget": 56},
    "fused_logprobs": {"fused_logprobs": True},
    "sync_metrics": {"sync_metrics": True},
    "precompute_ref_batch_size": {"precompute_ref_batch_size": 3},
}
ONLINE_PLUGINS: dict[str, dict[str, Any]] = {
    "prompt_sharing": {"prompt_sharing": True},
    "fused_logprobs": {"fused_logprobs": True},
    "fused_logprobs+prompt_sharing": {"fused_logprobs": True, "prompt_sharing": True},
    "sync_metrics": {"sync_metrics": True},
}


#: Stock's runs, shared by the tests of every plugin (same model, batch and settings): (trainer, precision, ...) ->
#: result. A run under an installation is never cached.
_STOCK: dict[tuple, Any] = {}


def _stock_once(key: tuple, run: Any) -> Any:
    from trl_ext import installation as _installation

    if _installation.current() is not None:
        return run()
    if key not in _STOCK:
        _STOCK[key] = run()
    return _STOCK[key]


def _first_log(trainer: Any) -> dict[str, float]:
    """The first training log of `trainer`, with `"plugins"` holding the plugins that attached to it (compared
    separately: a plugin that silently did not attach would compare stock with stock)."""
    plugins = tuple(sorted(getattr(getattr(trainer, "_trl_ext", None), "enabled", ())))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs, "no training log"
    first = {k: float(v) for k, v in logs[0].items() if not any(k.endswith(s) for s in NOT_COMPARED)}
    return {**first, "plugins": plugins}  # type: ignore[dict-item]


def _assert_within_stock_round_off(plugin: dict, stock16: dict, stock32: dict, dtype: str, attached: set[str]) -> None:
    assert stock16.pop("plugins") == stock32.pop("plugins") == ()  # stock is stock
    assert attached <= set(plugin.pop("plugins")), attached  # every plugin asked for attached to the trainer
    assert plugin.keys() == stock16.keys()
    for key, expected in stock16.items():
        got = plugin[key]
        if math.isnan(expected):
            assert math.isnan(got), key
            continue
        tolerance = max(4 * abs(expected - stock32[key]), REL[dtype] * abs(expected), ABS)
        assert abs(got - expected) <= tolerance, (
            f"{key}: plugin {got!r} vs stock {expected!r} in {dtype} (stock float32: {stock32[key]!r}; tolerance "
            f"{tolerance:.3g})"
        )


# --------------------------------------------------------------------------------------------------------------------
# DPO


@pytest.fixture(scope="module")
def dpo_dataset():
    return make_preference_dataset(8, seed=3)


@pytest.fixture
def dpo_run(dpo_args, tokenizer, dpo_dataset):
    def run(precision: str | None, precompute: bool) -> dict[str, float]:
        return _stock_once(("dpo", precision, precompute), lambda: build_and_train(precision, precompute))

    def build_and_train(precision: str | None, precompute: bool) -> dict[str, float]:
        from trl import DPOTrainer

        args: dict[str, Any] = dict(max_steps=1, per_device_train_batch_size=4, optim="sgd", learning_rate=0.1)
        args[precision or "bf16"] = precision is not None
        if precompute:  # TRL's reference precompute, on in stock's runs too
            args["precompute_ref_log_probs"] = True
        trainer = DPOTrainer(
            eq.sharpen(make_model()),
            ref_model=eq.sharpen(make_model(seed=1)),
            args=dpo_args(**args),
            train_dataset=dpo_dataset,
            processing_class=tokenizer,
        )
        return _first_log(trainer)

    return run


def _cases(plugins: dict, fast: tuple[str, str]) -> list:
    """(plugin, dtype) pairs; all but `fast` are marked slow (the fast loop keeps one case per trainer; CI runs all,
    on every TRL release of the version matrix too)."""
    return [
        pytest.param(plugin, dtype, marks=() if (plugin, dtype) == fast else pytest.mark.slow)
        for plugin in sorted(plugins)
        for dtype in sorted(DTYPES)
    ]


@pytest.mark.parametrize(("plugin", "dtype"), _cases(DPO_PLUGINS, ("padding_free", "bf16")))
def test_dpo_first_step_equals_stock_in_16_bits(dpo_run, plugin, dtype):
    from trl_ext import UsageError, _compat

    flags = DPO_PLUGINS[plugin]
    precompute = "precompute_ref_batch_size" in flags
    fact = _compat.dpo_training_refusal()
    if fact is not None:  # stock DPO cannot train on this TRL here (tests/versions proves it): the plugin refuses
        with pytest.raises(UsageError, match=fact.name):
            with trl_ext.install(**flags):
                dpo_run(dtype, precompute)
        return
    stock32 = dict(dpo_run(None, precompute))
    stock16 = dict(dpo_run(dtype, precompute))
    with trl_ext.install(**flags):
        got = dpo_run(dtype, precompute)
    _assert_within_stock_round_off(got, stock16, stock32, dtype, {plugin})


# --------------------------------------------------------------------------------------------------------------------
# Online DPO


@pytest.fixture
def online_run(online_dpo_args, tokenizer, monkeypatch):
    import inspect

    from trl.experimental.online_dpo import OnlineDPOTrainer

    arity = 5 if "vision_inputs = self._generate(" in inspect.getsource(OnlineDPOTrainer.training_step) else 4

    def run(precision: str | None) -> tuple[dict[str, float], list[torch.Tensor]]:
        return _stock_once(("online", precision), lambda: build_and_train(precision))

    def build_and_train(precision: str | None) -> tuple[dict[str, float], list[torch.Tensor]]:
        args: dict[str, Any] = dict(
            max_steps=1, per_device_train_batch_size=3, optim="sgd", learning_rate=0.1, max_length=64
        )
        args[precision or "bf16"] = precision is not None
        batch = (*eq.online_generation(), None)[:arity]
        # the same completions for every run; set on the class before the trainer is built, so that plugins which
        # wrap the trainer's `_generate` (sync_metrics counts the step's calls) wrap this one
        monkeypatch.setattr(OnlineDPOTrainer, "_generate", lambda self, model, prompts, images=None: batch)
        trainer = OnlineDPOTrainer(
            model=eq.sharpen(make_model()),
            ref_model=eq.sharpen(make_model(seed=1)),
            reward_funcs=length_reward,
            args=online_dpo_args(**args),
            train_dataset=make_prompt_dataset(6),
            processing_class=tokenizer,
        )
        scored: list[torch.Tensor] = []
        forward = trainer._forward

        def recording(*a: Any, **k: Any) -> torch.Tensor:
            out = forward(*a, **k)
            scored.append(out.detach().clone())
            return out

        trainer._forward = recording
        log = _first_log(trainer)
        assert len(scored) == 2  # the policy's and the reference's completion log-probs
        return log, scored

    return run


@pytest.mark.parametrize(("plugin", "dtype"), _cases(ONLINE_PLUGINS, ("prompt_sharing", "bf16")))
def test_online_dpo_first_step_equals_stock_in_16_bits(online_run, plugin, dtype):
    stock32, logps32 = online_run(None)
    stock16, logps16 = online_run(dtype)
    stock32, stock16 = dict(stock32), dict(stock16)  # the cached runs stay whole
    with trl_ext.install(**ONLINE_PLUGINS[plugin]):
        got, logps = online_run(dtype)
    real = eq.online_generation()[3].bool()
    for want32, want, have in zip(logps32, logps16, logps, strict=True):
        assert have.dtype == want.dtype  # what TRL reduces: stock's dtype (float32 out of accelerate's autocast)
        own = (want - want32)[real].abs().mean().item()  # stock's own 16-bit round-off, per token
        off = (have - want)[real].abs().mean().item()
        floor = FLOAT32_ROUND_OFF * want[real].abs().mean().item()
        assert off <= max(PER_TOKEN * own, floor), (off, own, floor)
    _assert_within_stock_round_off(got, stock16, stock32, dtype, set(plugin.split("+")))
