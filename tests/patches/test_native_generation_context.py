"""patches/0002-unwrap-for-generation-exception-safe.patch: TRL's own generation context restores the model.

Runs only against the patched TRL (`TRL_EXT_PATCHED_TRL=1`, see conftest.py and patches/check.sh). On the patched TRL,
without trl-ext, a stock `OnlineDPOTrainer`:

- gets gradient checkpointing back after every generation with the user's `gradient_checkpointing_kwargs` (stock
  TRL 1.16 re-enables it with transformers' defaults: B12);
- gets it back, with the same kwargs, when generation raises (TRL #6659);
- trains exactly like the trl-ext `generation` plugin (`ds3_gather_for_generation=False`), which does the same from
  the outside.

The ZeRO-3 hook restoration is covered by the TRL-style test in the patch (tests/test_unwrap_model_for_generation.py).
"""

from __future__ import annotations

import inspect

import pytest

from tests.helpers import USER_GC_KWARGS
from tests.helpers import gc_online_trainer as _online_trainer


def _gc_kwargs(model) -> list[dict]:
    funcs = [vars(m).get("_gradient_checkpointing_func") for m in model.modules()]
    return [f.keywords for f in funcs if f is not None]


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trl_is_patched():
    """Fails (never skips) when run against a TRL without 0002-unwrap-for-generation-exception-safe.patch."""
    from trl.experimental.online_dpo import online_dpo_trainer
    from trl.models import utils

    assert "finally:" in inspect.getsource(utils._unwrap_model_for_generation), "TRL is not patched (0002)"
    assert "gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs" in inspect.getsource(
        online_dpo_trainer.OnlineDPOTrainer
    )


def test_training_keeps_user_kwargs_and_equals_plugin(online_dpo_args, tokenizer):
    native = _online_trainer(online_dpo_args, tokenizer)
    native.train()
    kwargs = _gc_kwargs(native.model)
    assert kwargs and all(k == USER_GC_KWARGS for k in kwargs)  # B12 fixed natively

    from trl_ext.manager import builtin_plugin_modules

    if "generation" not in builtin_plugin_modules():
        pytest.fail("trl-ext has no built-in plugin 'generation': nothing to compare the patch with")
    import trl_ext

    with trl_ext.install(ds3_gather_for_generation=False):
        plugin = _online_trainer(online_dpo_args, tokenizer)
        plugin.train()
    assert len(_losses(native)) == 2
    assert _losses(plugin) == _losses(native)
    assert _gc_kwargs(plugin.model) == kwargs


def test_exception_during_generation_restores_gradient_checkpointing(online_dpo_args, tokenizer):
    from trl.experimental.online_dpo import online_dpo_trainer as odt

    trainer = _online_trainer(online_dpo_args, tokenizer, max_steps=1)
    trainer.train()
    model = trainer.model
    before = _gc_kwargs(model)
    with pytest.raises(RuntimeError, match="boom"):
        with odt.unwrap_model_for_generation(
            model,
            trainer.accelerator,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as unwrapped:
            assert not unwrapped.is_gradient_checkpointing  # off for generation
            raise RuntimeError("boom")
    assert model.is_gradient_checkpointing
    assert _gc_kwargs(model) == before and before

    # ...and the trainer keeps training afterwards, with checkpointing as the user configured it
    trainer.args.max_steps = 2
    trainer.train()
    assert len(_losses(trainer)) == 2 and all(k == USER_GC_KWARGS for k in _gc_kwargs(model))
