"""Exact or refused around the verified table: models that outlive their trainer, and a self-check sized from training.

- The notebook sequence: trainer A on model M under `install(...)`, A dropped without `detach`, trainer B on another
  model, `detach(B)` (then `uninstall(detach=True)`): M still runs, equal to a stock model with the same weights.
- A model whose sliding window lives only in the padded attention mask (its layers never receive `sliding_window`),
  with a window longer than the old fixed probe: the self-check, sized from the trainer's `max_length` and the
  config's windows, sees the window and refuses; with the old fixed probe it did not.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import trl_ext
from trl_ext import UsageError
from trl_ext.testing import make_model, make_preference_dataset

PLUGINS = ("padding_free", "prompt_sharing")


def _trainer(model, tokenizer, dpo_args, dataset):
    from trl import DPOTrainer

    return DPOTrainer(
        model,
        ref_model=make_model(seed=1),
        args=dpo_args(bf16=False, max_length=64),
        train_dataset=dataset,
        processing_class=tokenizer,
    )


def _assert_stock_equal(model, twin):
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(input_ids=ids).logits  # a plain call (a cache): never packed, needs a valid attention
        want = twin(input_ids=ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("ending", ["detach", "uninstall"])
def test_a_model_outlives_its_trainer(plugin, ending, tokenizer, dpo_args):
    dataset = make_preference_dataset(8)
    model = make_model()
    twin = copy.deepcopy(model)  # the same weights, never given to trl-ext
    gc.collect()
    installation = trl_ext.install(**{plugin: True})
    try:
        first = _trainer(model, tokenizer, dpo_args, dataset)
        assert model.config._attn_implementation.startswith("trl_ext_")
        del first
        gc.collect()  # trainer A is gone, never detached: its model keeps the plugin's attention
        second = _trainer(make_model(seed=2), tokenizer, dpo_args, dataset)
        if ending == "detach":
            installation.detach(second)
            _assert_stock_equal(model, twin)
    finally:
        installation.uninstall(detach=True)
    _assert_stock_equal(model, twin)


def _windowed_moe(window: int):
    """PhiMoE: its decoder builds a sliding-window mask, its attention layers never receive `sliding_window`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "phimoe",
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        max_position_embeddings=256,
        sliding_window=window,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.float64)


def test_self_check_sees_a_window_that_lives_only_in_the_mask():
    """Driven directly: the sized probe (one sequence as long as training's, the others longer than the window)
    finds the lost window; the old fixed probe of 9/6/11 tokens, shorter than the window, passed it."""
    from trl_ext.plugins import padding_free as pf
    from trl_ext.plugins._packing import register_varlen_attention, varlen_attention_name
    from trl_ext.plugins._probe import declared_localities, probe_lengths
    from trl_ext.plugins.padding_free.self_check import self_check

    model = _windowed_moe(16).eval()
    assert declared_localities(model.config)["sliding_window"] == 16
    lengths = probe_lengths(40, declared_localities(model.config), 256)
    assert lengths[0] == 40 and min(lengths) > 16
    register_varlen_attention()
    state = pf.PaddingFreeState()
    model.config._attn_implementation_internal = varlen_attention_name("sdpa")
    model.base_model.forward = pf._make_backbone_forward(model.base_model.forward, state)
    forward = pf._make_causal_lm_forward(model.forward, state)
    old = self_check(model, forward, lengths=(9, 6, 11), moe=True)
    assert old.leak is None  # the defect: a probe shorter than the window cannot see it
    sized = self_check(model, forward, lengths=lengths, moe=True)
    assert sized.leak is not None and "stock padded forward" in sized.leak, sized.leak
    assert sized.max_position_error > 1e-3


def test_a_mask_only_window_is_refused_before_the_first_step(tokenizer, dpo_args):
    """Through a real DPOTrainer: a model type outside the verified table whose window lives only in the mask is
    refused with a UsageError before the first step (by the inspection, or the sized self-check)."""
    from trl import DPOTrainer

    model, ref = _windowed_moe(16), _windowed_moe(16)
    for m in (model, ref):
        m.config.model_type = "my_windowed_moe"  # as a trust_remote_code model would be: not in any table
    dataset = make_preference_dataset(8, prompt_median=24, completion_median=12)
    with trl_ext.install(padding_free=True):
        with pytest.raises(UsageError, match="window|stock padded forward"):
            DPOTrainer(
                model,
                ref_model=ref,
                args=dpo_args(bf16=False, max_length=64),
                train_dataset=dataset,
                processing_class=tokenizer,
            )


def test_probe_lengths_follow_training():
    from trl_ext.plugins._probe import declared_localities, probe_lengths

    class Config:
        def __init__(self):
            self.sliding_window = 4096
            self.attention_chunk_size = 100
            self.use_sliding_window = True  # a flag, not a length
            self.layer_types = ["sliding_attention", "full_attention"]

    found = declared_localities(Config())
    assert found == {"sliding_window": 4096, "attention_chunk_size": 100}
    assert probe_lengths(512, found) == (512, 101, 103)  # the 4096 window never acts on 512 tokens
    assert probe_lengths(64, {}) == (64, 9, 11)
    assert probe_lengths(5000, {}, max_positions=2048)[0] == 2048
