"""padding_free beyond the dense allow-list: batch dispatching, MoE with its router auxiliary loss, sliding windows,
the self-check, and refusals by mechanism. Every equivalence runs a stock `DPOTrainer` and one with the plugin on the
same float64 weights and data, and compares losses, gradients and logged metrics."""

from __future__ import annotations

import logging

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from tests import helpers
from tests.helpers import tiny
from trl_ext import UsageError

REL = 1e-6  # fp64 weights; TRL 1.16's fused LM head computes log-probs in fp32 (measured deviations <= 2e-7)


_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)


@pytest.fixture
def build(dpo_args, tokenizer, dataset):
    """`build(kind, ...)`: a DPOTrainer of two tiny float64 models of `kind` (tests/helpers.py `tiny`), SGD."""
    builder = eq.dpo_builder(dpo_args, tokenizer, dataset, sharpened=False, factory=tiny)

    def make(kind="llama", **kwargs):
        kwargs.setdefault("optim", "sgd")
        return builder(model_kwargs={"kind": kind}, **kwargs)

    return make


def _state(trainer):
    return trainer._trl_ext.state["padding_free"]


def _assert_logs_equal(stock_logs, packed_logs, rel=REL):
    eq.assert_same_logs(stock_logs, packed_logs, rel=rel, abs=1e-9, skip=("epoch",))


def _compare_step(stock, packed, n=6):
    examples = [stock.train_dataset[i] for i in range(n)]
    calls = _state(packed).packed_calls
    stock_loss, stock_grads = eq.loss_and_grads(stock, stock.data_collator(examples))
    packed_loss, packed_grads = eq.loss_and_grads(packed, packed.data_collator(examples))
    assert _state(packed).packed_calls > calls and _state(packed).unpacked_calls == 0
    assert packed_loss.item() == pytest.approx(stock_loss.item(), rel=REL)
    eq.assert_same_grads(stock_grads, packed_grads, REL)


# -------------------------------------------------------------------------------------------------------------------
# Batch dispatching (accelerate's DataLoaderDispatcher slices every batch tensor along dim 0)
# -------------------------------------------------------------------------------------------------------------------


def test_metadata_survives_dim0_slicing_and_is_checked():
    from accelerate.utils import concatenate, slice_tensors

    from trl_ext.toolkit.packing.metadata import PackInfo, packing_metadata

    masks = [torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])]
    metas = [{"attention_mask": m, "meta": packing_metadata(m).to_batch()} for m in masks]
    both = concatenate(metas, dim=0)
    for sl in (slice(0, 2), slice(1, 3), slice(2, 4)):
        part = slice_tensors(both, sl)
        mask = part["attention_mask"]
        info = PackInfo.from_batch(part["meta"], torch.zeros_like(mask), mask)
        ref = packing_metadata(mask)
        assert info is not None and torch.equal(info.indices, ref.indices)
        assert torch.equal(info.cu_seq_lens, ref.cu_seq_lens)
    # metadata of another batch is refused (the caller rebuilds from the mask), never used
    wrong = packing_metadata(masks[0]).to_batch()
    assert PackInfo.from_batch(wrong, torch.zeros_like(masks[1]), masks[1]) is None
    assert PackInfo.from_batch({"indices": torch.zeros(3)}, torch.zeros_like(masks[1]), masks[1]) is None


@pytest.mark.slow  # a few seconds: kept out of the fast loop's 90 s
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_dispatch_batches_train_evaluate_predict(build, dataset, kind):
    """`dispatch_batches=True` training, and evaluate()/predict() on an IterableDataset: same as stock."""
    kwargs = dict(max_steps=3, accelerator_config={"dispatch_batches": True})
    stock = build(kind, **kwargs)
    stock_logs = eq.train_logs(stock)
    eval_data = stock.train_dataset.select(range(8))
    stock_eval = stock.evaluate(eval_dataset=eval_data.to_iterable_dataset())
    stock_pred = stock.predict(eval_data.to_iterable_dataset())
    with trl_ext.install(padding_free=True):
        packed = build(kind, **kwargs)
        packed_logs = eq.train_logs(packed)
        packed_eval = packed.evaluate(eval_dataset=eval_data.to_iterable_dataset())
        packed_pred = packed.predict(eval_data.to_iterable_dataset())
        assert _state(packed).packed_calls >= 3 * 2 + 2 + 2 and _state(packed).unpacked_calls == 0
    _assert_logs_equal(stock_logs, packed_logs)
    _assert_logs_equal([stock_eval], [packed_eval])
    _assert_logs_equal([stock_pred.metrics], [packed_pred.metrics])
    if kind == "mixtral":
        assert "aux_loss" in stock_logs[0] and stock_logs[0]["aux_loss"] > 0


@pytest.mark.distributed
def test_dispatch_batches_two_processes(tmp_path):
    """torchrun, 2 CPU processes (gloo), `dispatch_batches=True`: the packed run logs what the stock run logs."""
    out = helpers.launch(helpers.PLUGIN_SCRIPTS / "packing_dispatch.py", "padding_free", tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("DISPATCH OK") == 2, out.stdout[-3000:]


# -------------------------------------------------------------------------------------------------------------------
# MoE with the router auxiliary loss on, sliding windows: every path
# -------------------------------------------------------------------------------------------------------------------


#: Mistral's cases of the DPO paths below (sliding windows) are `slow`: the fast loop keeps MoE (Mixtral) and partial
#: rotary (StableLM) here, sliding windows per architecture in test_padding_free.py `test_architectures` and through a
#: real DPOTrainer in test_varlen_releases.py `test_a_wrong_kernel_never_trains`.
MISTRAL = pytest.param("mistral", marks=pytest.mark.slow)


@pytest.mark.parametrize("kind", [MISTRAL, "mixtral", "stablelm"])
def test_policy_ref_and_training_with_gradient_checkpointing(build, kind):
    stock = build(kind, max_steps=2, gradient_checkpointing=True)
    with trl_ext.install(padding_free=True):
        packed = build(kind, max_steps=2, gradient_checkpointing=True)
        _compare_step(stock, packed)
        if kind == "mixtral":
            assert packed.aux_loss_enabled
        _assert_logs_equal(eq.train_logs(stock), eq.train_logs(packed))


@pytest.mark.parametrize("kind", [MISTRAL, "mixtral"])
def test_precompute(build, kind):
    stock, packed = eq.stock_and_plugin(build, dict(padding_free=True), kind, ref=False, precompute_ref_log_probs=True)
    assert _state(packed).packed_calls > 0
    for a, b in eq.ref_columns(stock, packed):
        assert torch.allclose(b, a, rtol=REL, atol=0)
    _compare_step(stock, packed)


@pytest.mark.parametrize("kind", [MISTRAL, "mixtral"])
def test_peft_lora(build, kind):
    """LoRA policy, reference = the adapter-disabled base model; for the MoE model the adapter also targets the
    expert parameters (peft's `target_parameters`)."""
    stock = build(kind, ref=False, peft_config=eq.lora(experts=kind == "mixtral"))
    with trl_ext.install(padding_free=True):
        packed = build(kind, ref=False, peft_config=eq.lora(experts=kind == "mixtral"))
        _compare_step(stock, packed)
        names = [n for n, p in packed.model.named_parameters() if p.requires_grad]
        assert any("lora" in n for n in names)
        if kind == "mixtral":
            assert any("experts" in n and "lora" in n for n in names), names


# -------------------------------------------------------------------------------------------------------------------
# Self-check and refusals
# -------------------------------------------------------------------------------------------------------------------


class _TokenShift(torch.nn.Module):
    """A per-layer "mixer" that adds the previous token's hidden state: it leaks across packed sequence bounds."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x) + 0.5 * torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_check_catches_a_leak(build, dtype, caplog):
    """A deliberately leaking model (a token shift hidden in an MLP, which no inspection recognises) fails the
    self-check, in float32 and in bfloat16, naming the layer; the same model without the shift passes."""
    from trl_ext.plugins.padding_free.selfcheck import self_check

    with trl_ext.install(padding_free=True, plugins={"padding_free": {"self_check": True}}):
        with caplog.at_level(logging.INFO, logger="trl_ext"):
            trainer = build()
        state = _state(trainer)
        assert set(state.self_checks) == {"policy", "ref"}
        assert any("self-check passed" in r.getMessage() for r in caplog.records)
        # the probe's forwards are not training forwards: nothing of them in the end-of-run counts
        assert (state.packed_calls, state.unpacked_calls, state.padded_tokens, state.packed_tokens) == (0, 0, 0, 0)
        model = trainer.model.to(dtype)
        assert self_check(model, model.forward).leak is None
        model.model.layers[1].mlp = _TokenShift(model.model.layers[1].mlp)
        result = self_check(model, model.forward)
        assert result.leak is not None and "model.layers.1.mlp (_TokenShift)" in result.leak, result.leak


def test_self_check_refuses_an_unverified_leaking_model(dpo_args, tokenizer, dataset):
    """A model that is not in the verified table runs the self-check automatically; a leak refuses the trainer."""
    from trl import DPOTrainer

    model, ref = tiny(), tiny(seed=1)
    model.config.model_type = ref.config.model_type = "my_custom_llama"  # as a trust_remote_code model would be
    for m in (model, ref):
        m.model.layers[0].mlp = _TokenShift(m.model.layers[0].mlp)
    with trl_ext.install(padding_free=True):
        with pytest.raises(UsageError, match=r"self-check failed .*layers\.0\.mlp \(_TokenShift\)"):
            DPOTrainer(
                model, ref_model=ref, args=dpo_args(bf16=False), train_dataset=dataset, processing_class=tokenizer
            )


def _tiny_from_config(model_type, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=256, **helpers.TINY_SIZES, **extra)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "model_type, extra, match",
    [
        ("lfm2", {"layer_types": ["conv", "full_attention"]}, r"conv.*Lfm2ShortConv|Lfm2ShortConv"),
        ("falcon", {"alibi": True}, "ALiBi biases that Falcon computes in bfloat16"),
    ],
)
def test_refusals_by_mechanism(dpo_args, tokenizer, dataset, model_type, extra, match):
    from trl import DPOTrainer

    with trl_ext.install(padding_free=True):
        with pytest.raises(UsageError, match=match) as info:
            DPOTrainer(
                _tiny_from_config(model_type, **extra),
                ref_model=_tiny_from_config(model_type, **extra),
                args=dpo_args(bf16=False),
                train_dataset=dataset,
                processing_class=tokenizer,
            )
        assert "without padding_free" in str(info.value)
