"""prompt_sharing beyond dense Llama-likes: MoE with the router auxiliary loss on, sliding windows, attention sinks,
softcapping, learned positions; every model type of `setup.VERIFIED_MODEL_TYPES`; refusals whose advice works.

Architecture check: the architecture sweep (`tests/plugins/sweep.py`, `prompt_sharing_outcome`) builds a tiny float64
model of each type (2-4 layers, sliding windows of 4 tokens so that windows reach across the prompt/response
boundary, 4 experts / top-2 with the router auxiliary loss on), sets it up through the plugin's own path (configure,
dropout, wrapped forward, self-check where the plugin runs it) and runs three prompt/response pairs padded (stock) and
shared. The DPO loss (plus 0.5 x the MoE auxiliary loss), the per-sequence log-probs, the auxiliary loss and every
gradient must agree within 1e-6 relative (fp64 round-off is ~1e-15; the MoE auxiliary loss is accumulated in float32
by transformers; a response that sees the other response, a position off by one or an aux loss that counts a shared
prompt once moves them by > 1e-3). The whole sweep, every causal-LM type, runs in test_padding_free_sweep.py.
"""

from __future__ import annotations

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from tests.helpers import tiny
from tests.plugins import sweep
from tests.plugins.sweep import build_tiny
from trl_ext import UsageError
from trl_ext.plugins.prompt_sharing.setup import VERIFIED_MODEL_TYPES
from trl_ext.testing import make_preference_dataset

REL = 1e-6
# Mechanisms the quick suite covers: softcapping (gemma2), sinks + MoE + sliding (gpt_oss), MoE (mixtral, qwen3_moe,
# olmoe), mixed sliding/full layers (olmo3, cohere2), learned absolute positions (gpt2, opt), parallel blocks (phi).
NAMED = ("gemma2", "gpt_oss", "mixtral", "qwen3_moe", "olmoe", "olmo3", "cohere2", "gpt2", "opt", "phi")

_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)


@pytest.mark.parametrize("model_type", NAMED)
def test_named_architectures(model_type):
    outcome = sweep.row(model_type).prompt_sharing
    assert outcome.status == "exact", outcome.detail


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(set(VERIFIED_MODEL_TYPES) - set(NAMED)))
def test_verified_table(model_type):
    """Every model type prompt_sharing admits without its self-check: the shared forward equals the padded one."""
    outcome = sweep.row(model_type).prompt_sharing
    assert outcome.status == "exact", outcome.detail


def test_moe_aux_loss_counts_each_prompt_per_response():
    """Without the padded recomputation the shared row's own auxiliary loss (each prompt routed once) differs from
    the padded one; with it, they agree. Guards the recomputation against becoming a no-op."""
    from trl_ext.plugins.prompt_sharing import forward as fw
    from trl_ext.plugins.prompt_sharing.moe import MoeAuxLoss

    assert MoeAuxLoss.of(build_tiny("mixtral")) is not None and MoeAuxLoss.of(build_tiny("llama")) is None
    with sweep.single_thread_float64():
        assert sweep.prompt_sharing_outcome(build_tiny("mixtral"), moe=True).status == "exact"
    original = fw.make_causal_lm_forward

    def without_recompute(original_forward, state, aux_loss=None):
        return original(original_forward, state, None)

    fw.make_causal_lm_forward = without_recompute
    try:
        with sweep.single_thread_float64():
            outcome = sweep.prompt_sharing_outcome(build_tiny("mixtral"), moe=True)
    finally:
        fw.make_causal_lm_forward = original
    assert outcome.status == "FAIL" and "aux loss" in outcome.detail, outcome


# -------------------------------------------------------------------------------------------------------------------
# Real trainers: MoE (aux loss on) and sliding windows, every DPO path
# -------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset():
    return make_preference_dataset(16, seed=0, prompt_median=14, completion_median=8)


@pytest.fixture
def build(dpo_args, tokenizer, dataset):
    """`build(kind, ...)`: a DPOTrainer of two tiny float64 models of `kind` (tests/helpers.py `tiny`), SGD."""
    builder = eq.dpo_builder(dpo_args, tokenizer, dataset, sharpened=False, factory=tiny)

    def make(kind, **kwargs):
        kwargs.setdefault("optim", "sgd")
        return builder(model_kwargs={"kind": kind}, **kwargs)

    return make


def _state(trainer):
    return trainer._trl_ext.state["prompt_sharing"]


def _compare(stock, shared):
    eq.compare_plugin(
        stock, shared, eq.examples(stock), "prompt_sharing", logps_rtol=REL, loss_rtol=REL, grad_rtol=REL
    )


#: Mistral's cases (sliding windows) are `slow`: the fast loop keeps MoE (Mixtral) here, sliding windows per
#: architecture in test_prompt_sharing.py `test_architectures` and through a real DPOTrainer in
#: test_varlen_releases.py `test_a_wrong_kernel_never_trains`.
MISTRAL = pytest.param("mistral", marks=pytest.mark.slow)


@pytest.mark.parametrize("kind", [MISTRAL, "mixtral"])
def test_policy_ref_and_training_with_gradient_checkpointing(build, kind):
    """Per-sequence log-probs, loss (with 0.5 x the MoE aux loss) and gradients of one batch, then two SGD steps
    with gradient checkpointing: every logged value (`aux_loss` included) equals stock padded TRL."""
    stock = build(kind, max_steps=2, logging_steps=1, gradient_checkpointing=True)
    with trl_ext.install(prompt_sharing=True):
        shared = build(kind, max_steps=2, logging_steps=1, gradient_checkpointing=True)
        if kind == "mixtral":
            assert shared.aux_loss_enabled
        _compare(stock, shared)
        stock_logs, shared_logs = eq.train_logs(stock), eq.train_logs(shared)
        eq.assert_same_logs(stock_logs, shared_logs, rel=REL, abs=1e-5, skip=("epoch",))
        if kind == "mixtral":
            assert stock_logs[0]["aux_loss"] > 0
        assert _state(shared).unshared_calls == 0
        assert _state(shared).checked == set()  # a verified model type runs without the self-check by default


@pytest.mark.parametrize("kind", [MISTRAL, "mixtral"])
def test_precompute_and_lora(build, kind):
    """Reference precompute (shared), then a LoRA policy whose reference is the adapter-disabled base model; for the
    MoE model the adapter also targets the expert parameters."""
    install = dict(prompt_sharing=True)
    stock, shared = eq.stock_and_plugin(build, install, kind, ref=False, precompute_ref_log_probs=True)
    assert _state(shared).shared_calls > 0
    for a, b in eq.ref_columns(stock, shared):
        assert torch.allclose(b, a, rtol=REL, atol=0)

    stock = build(kind, ref=False, peft_config=eq.lora(experts=kind == "mixtral"))
    with trl_ext.install(prompt_sharing=True):
        shared = build(kind, ref=False, peft_config=eq.lora(experts=kind == "mixtral"))
        _compare(stock, shared)
        if kind == "mixtral":
            assert any("experts" in n and "lora" in n for n, p in shared.model.named_parameters() if p.requires_grad)


# -------------------------------------------------------------------------------------------------------------------
# Refusals, and that their advice works
# -------------------------------------------------------------------------------------------------------------------


def test_stateful_mixer_refused_naming_the_layer_and_advice_works(dpo_args, tokenizer, dataset, monkeypatch):
    """LFM2 (short convolutions): refused naming the layer; the advice (no prompt_sharing, no padding_free) trains."""
    from trl import DPOTrainer

    monkeypatch.setitem(sweep._SMALL, "vocab_size", 256)  # the test tokenizer's vocabulary

    def make():
        return DPOTrainer(
            build_tiny("lfm2"),
            ref_model=build_tiny("lfm2"),
            args=dpo_args(bf16=False, max_steps=1),
            train_dataset=dataset,
            processing_class=tokenizer,
        )

    with trl_ext.install(prompt_sharing=True):
        with pytest.raises(UsageError, match=r"prompt_sharing cannot share prompts .*lfm2.*conv.*Disable prompt_shar"):
            make().train()
    make().train()  # the advice: train it without prompt_sharing


def test_layer_that_drops_the_segments_is_refused_not_wrong():
    """StableLM's decoder layer does not hand keyword arguments to its attention, so the segments never arrive: the
    shared call raises instead of running the row as one causal sequence (it is outside the verified table too)."""
    from trl_ext.patching import Patcher
    from trl_ext.plugins.prompt_sharing import forward as fw
    from trl_ext.plugins.prompt_sharing.attention import register_shared_attention, unregister_shared_attention
    from trl_ext.plugins.prompt_sharing.layout import LAYOUT_KEY, build_layout
    from trl_ext.plugins.prompt_sharing.setup import PromptSharingState

    assert "stablelm" not in VERIFIED_MODEL_TYPES
    model = build_tiny("stablelm")
    ids, mask, prompt_end = sweep.prompt_pairs(model.config.vocab_size)
    patcher = Patcher("test")
    register_shared_attention()
    try:
        patcher.setattr(
            model.config, "_attn_implementation_internal", f"trl_ext_shared_{model.config._attn_implementation}"
        )
        forward = fw.make_causal_lm_forward(model.forward, PromptSharingState())
        with pytest.raises(UsageError, match="StableLmAttention was called without the shared layout's segments"):
            forward(
                input_ids=ids,
                attention_mask=mask,
                use_cache=False,
                **{LAYOUT_KEY: build_layout(ids, mask, prompt_end).to_batch()},
            )
    finally:
        patcher.undo()
        unregister_shared_attention()
