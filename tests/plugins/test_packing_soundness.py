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
from tests import equivalence as eq
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


def _endings() -> list:
    """(plugin, ending) pairs: the fast loop keeps each ending once, each with another plugin (the mechanism, the
    attention registration held by the models that still use it, is the plugins' shared packing code); CI runs all."""
    fast = {("padding_free", "detach"), ("prompt_sharing", "uninstall")}
    return [
        pytest.param(plugin, ending, marks=() if (plugin, ending) in fast else pytest.mark.slow)
        for plugin in PLUGINS
        for ending in ("detach", "uninstall")
    ]


@pytest.mark.parametrize(("plugin", "ending"), _endings())
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


def _mask_window_model(window: int, seed: int = 0):
    """A custom decoder (model type outside every table) whose attention layers apply a sliding window only through
    the 4D mask tensor they receive: as `trust_remote_code` code that derives its locality from the padded mask.
    Nothing in the config or the layer arguments says so; only a measurement can see it."""
    model = make_model(seed=seed, dtype=torch.float64)
    model.config.model_type = "my_mask_window_llama"
    model.config.local_span = window  # declared under a name that says neither window nor chunk
    return eq.add_mask_window(model, window)


def _packed(model):
    from trl_ext.plugins import padding_free as pf
    from trl_ext.toolkit.packing.attention import register_varlen_attention, varlen_attention_name

    register_varlen_attention()
    state = pf.PaddingFreeState()
    model.config._attn_implementation_internal = varlen_attention_name("sdpa")
    model.base_model.forward = pf._make_backbone_forward(model.base_model.forward, state)
    return pf._make_causal_lm_forward(model.forward, state)


def test_self_check_sees_a_window_that_lives_only_in_the_mask():
    """Driven directly: the sized probe (one sequence as long as training's) finds the window the packed call loses;
    the old fixed probe of 9/6/11 tokens, shorter than the window, passed it."""
    from trl_ext.plugins.padding_free.selfcheck import self_check
    from trl_ext.toolkit.probe import declared_localities, probe_lengths

    model = _mask_window_model(16).eval()
    lengths = probe_lengths(40, declared_localities(model.config), 2048)
    assert lengths[0] == 40
    forward = _packed(model)
    old = self_check(model, forward, lengths=(9, 6, 11))
    assert old.leak is None  # the defect: a probe shorter than the window cannot see it
    sized = self_check(model, forward, lengths=lengths)
    assert sized.leak is not None and "stock padded forward" in sized.leak, sized.leak
    assert sized.max_position_error > 1e-3


def test_a_mask_only_window_is_refused_before_the_first_step(tokenizer, dpo_args):
    """Through a real DPOTrainer: the custom model is refused with a UsageError before the first step, because
    training feeds sequences longer than its window (the probe is sized from the dataset's longest pair)."""
    from trl import DPOTrainer

    dataset = make_preference_dataset(8, prompt_median=24, completion_median=12)
    with trl_ext.install(padding_free=True):
        with pytest.raises(UsageError, match="self-check failed .*stock padded forward"):
            DPOTrainer(
                _mask_window_model(16),
                ref_model=_mask_window_model(16, seed=1),
                args=dpo_args(bf16=False, max_length=64),
                train_dataset=dataset,
                processing_class=tokenizer,
            )


def test_a_window_longer_than_training_is_admitted(tokenizer, dpo_args):
    """The same model with a window longer than every training sequence trains exactly as stock: the window never
    acts, so the self-check (sized from training) passes it."""
    from trl import DPOTrainer

    dataset = make_preference_dataset(8)
    with trl_ext.install(padding_free=True):
        trainer = DPOTrainer(
            _mask_window_model(1000),
            ref_model=_mask_window_model(1000, seed=1),
            args=dpo_args(bf16=False, max_length=64),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        checks = trainer._trl_ext.state["padding_free"].self_checks
        assert checks["policy"].leak is None and checks["policy"].lengths[0] <= 64


def test_probe_lengths_follow_training():
    from trl_ext.toolkit.probe import declared_localities, probe_lengths

    class Config:
        def __init__(self):
            self.sliding_window = 4096
            self.attention_chunk_size = 100
            self.use_sliding_window = True  # a flag, not a length
            self.layer_types = ["sliding_attention", "full_attention"]
            self.compress_rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

    found = declared_localities(Config())
    assert found == {"sliding_window": 4096, "attention_chunk_size": 100, "compress_rates": 128}
    assert probe_lengths(512, found) == (512, 129, 131)  # the 4096 window never acts on 512 tokens
    assert probe_lengths(64, {}) == (64, 9, 11)
    assert probe_lengths(5000, {}, max_positions=2048)[0] == 2048


@pytest.mark.slow  # the fast loop has the same split, against stock: test_padding_free_mechanisms.py (docstring)
def test_a_batch_longer_than_mpts_alibi_table_trains_in_several_packed_rows(tokenizer, dpo_args):
    """MPT's ALiBi table covers `max_seq_len` keys of one row: a batch of 8 sequences of up to 32 tokens with
    `max_seq_len=64` trains (stock trains it: each padded row is within the table), its packed batches split into
    packed rows of at most 64 tokens (it was refused before). Equality with stock: test_padding_free_mechanisms.py
    `test_mpt_through_a_dpo_trainer_with_batches_longer_than_its_table`."""
    from transformers import AutoModelForCausalLM, MptConfig
    from trl import DPOTrainer

    def mpt(seed):
        config = MptConfig(vocab_size=len(tokenizer), d_model=32, n_heads=4, n_layers=2, max_seq_len=64)
        config.pad_token_id = tokenizer.pad_token_id
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")

    with trl_ext.install(padding_free=True):
        trainer = DPOTrainer(
            mpt(0),
            ref_model=mpt(1),
            args=dpo_args(bf16=False, max_length=32, per_device_train_batch_size=4, max_steps=1),
            train_dataset=make_preference_dataset(8),
            processing_class=tokenizer,
        )
        state = trainer._trl_ext.state["padding_free"]
        calls = state.packed_calls
        trainer.train()
    assert state.packed_calls - calls >= 2 * 2  # reference and policy forwards, each in at least two packed rows
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 1 and losses[0] == losses[0] and abs(losses[0]) < 1e3  # a finite loss was logged


class _AttentionWithoutModule(torch.nn.Module):
    """An attention layer whose modeling module (this test file) defines no `eager_attention_forward`."""


def test_eager_attention_without_its_module_function_is_a_usage_error():
    from transformers.models.llama import modeling_llama

    from trl_ext.toolkit.packing.attention import base_attention

    layer = modeling_llama.LlamaAttention(make_model().config, layer_idx=0)
    assert base_attention("eager", layer) is modeling_llama.eager_attention_forward
    with pytest.raises(UsageError, match='_AttentionWithoutModule runs `eager`.*attn_implementation="sdpa"'):
        base_attention("eager", _AttentionWithoutModule())


def test_a_float64_model_computing_in_float32_is_judged_at_float32_round_off(tokenizer, dpo_args):
    """MPT computes its attention softmax in float32 inside a float64 model, so its packed and padded rows differ by
    float32 round-off (measured 1.6e-7 at 256 wide over a 128-token probe, 6.2e-7 at 512 wide over 256 tokens: above
    the 1e-7 a float64 forward allows). The self-check observes the lowest precision the stock forward computes in
    and judges at that precision's tolerance (1e-4), so a real DPOTrainer with padding_free attaches; GPT-2, float64
    throughout, keeps float64's 1e-7."""
    from transformers import GPT2Config, GPT2LMHeadModel, MptConfig, MptForCausalLM
    from trl import DPOTrainer

    from trl_ext.plugins.padding_free.selfcheck import _LowestFloat

    torch.manual_seed(0)
    mpt = MptForCausalLM(
        MptConfig(vocab_size=256, d_model=256, n_heads=16, n_layers=2, expansion_ratio=2, max_seq_len=512)
    ).to(torch.float64)
    dataset = make_preference_dataset(6, seed=0, prompt_median=60, completion_median=40)
    with trl_ext.install(padding_free=True, plugins={"padding_free": {"self_check": True}}):
        trainer = DPOTrainer(
            mpt,
            ref_model=copy.deepcopy(mpt),
            args=dpo_args(bf16=False, max_length=128),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    result = trainer._trl_ext.state["padding_free"].self_checks["policy"]
    assert result.leak is None and result.tolerance == 1e-4 and result.max_position_error < 1e-5, result
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4)).to(torch.float64).eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    for model, lowest in ((gpt2, torch.float64), (mpt.eval(), torch.float32)):
        with torch.no_grad(), _LowestFloat() as observed:
            model(input_ids=ids)
        assert observed.lowest == lowest
