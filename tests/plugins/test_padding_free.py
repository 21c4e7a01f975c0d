"""padding_free: packed DPO equals padded DPO on stock TRL (1.12 logits path, 1.16 fused LM head).

Every equivalence test runs a stock `DPOTrainer` (trl-ext not installed) and a trainer with the plugin on the same
weights and the same examples, and compares per-sequence log-probs, losses, gradients and logged metrics.
"""

from __future__ import annotations

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from tests import helpers
from trl_ext import UsageError
from trl_ext.context import live_contexts

# fp32: per-sequence summed log-probs agree to float32 round-off (measured max 1.1e-7 relative); a real packing
# bug (a token scored from the wrong sequence, a position off by one, attention across sequences) moves them by >1e-2.
LOGPS_RTOL = 1e-5
GRAD_RTOL = 2e-5  # max |grad diff| relative to max |grad| (measured ~1e-6)


_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)


@pytest.fixture
def build(dpo_args, tokenizer, dataset):
    """Build a DPOTrainer: policy seed 0, reference seed 1 (unless PEFT or precompute), both from `make_model`."""
    return eq.dpo_builder(dpo_args, tokenizer, dataset)


def _state(trainer):
    return trainer._trl_ext.state["padding_free"]


def _compare(stock, packed, examples, logps=True):
    """Per-sequence logps (policy), loss and gradients of a stock and a packed trainer on the same examples."""
    tolerances = dict(logps_rtol=LOGPS_RTOL, loss_rtol=1e-5, grad_rtol=GRAD_RTOL, logps=logps)
    return eq.compare_plugin(stock, packed, examples, "padding_free", **tolerances)


# -------------------------------------------------------------------------------------------------------------------
# Equivalence: every loss type and loss option, through TRL's real `compute_loss`
# -------------------------------------------------------------------------------------------------------------------

LOSS_CASES = eq.LOSS_CASES


@pytest.mark.slow  # a few seconds: kept out of the fast loop's 90 s
def test_every_loss_type_and_option(build):
    # exo_pair needs label_smoothing > 0 at construction (both TRL versions check it in `__init__`)
    stock = build(use_weighting=True, label_smoothing=1e-3, loss_type=["exo_pair"])
    with trl_ext.install(padding_free=True):
        packed = build(use_weighting=True, label_smoothing=1e-3, loss_type=["exo_pair"])
        examples = eq.examples(stock)
        assert stock.data_collator(examples)["attention_mask"].eq(0).float().mean() > 0.3  # mostly padding
        _compare(stock, packed, examples)  # per-sequence logps, and the loss/grads of exo_pair with WPO weights
        eq.assert_every_loss_case((stock, packed), lambda: _compare(stock, packed, examples, logps=False), LOSS_CASES)


def test_use_weighting_from_config(build):
    """WPO weighting enabled through `DPOConfig` (TRL 1.16 then asks its fused head for `log_sum_sq_probs`)."""
    stock = build(use_weighting=True, loss_type=["sigmoid", "ipo"])
    with trl_ext.install(padding_free=True):
        packed = build(use_weighting=True, loss_type=["sigmoid", "ipo"])
        _compare(stock, packed, eq.examples(stock))


def test_keep_end_truncation_first_token_is_completion(build):
    """`truncation_mode="keep_end"` cuts whole prompts, so a sequence can start with a completion token: it must not
    be scored from the previous sequence's last token in the packed row."""
    data = eq.keep_end_data()
    stock = build(train_dataset=data, max_length=10, truncation_mode="keep_end")
    with trl_ext.install(padding_free=True):
        packed = build(train_dataset=data, max_length=10, truncation_mode="keep_end")
        examples = eq.examples(stock, 3)
        batch, _ = _compare(stock, packed, examples)
    assert batch["completion_mask"][:, 0].any() and batch["attention_mask"].eq(0).any()


def test_fp64_logps_match_to_roundoff(build):
    """fp64 model: the packed per-sequence log-probs equal the padded ones to round-off (TRL 1.16's fused LM head
    computes in fp32 whatever the model dtype, so there the bound is fp32's)."""
    from trl_ext import _compat

    stock = build(model_kwargs={"dtype": torch.float64})
    with trl_ext.install(padding_free=True):
        packed = build(model_kwargs={"dtype": torch.float64})
        examples = eq.examples(stock)
        a = stock.compute_ref_log_probs(stock.model, stock.data_collator(examples))
        b = packed.compute_ref_log_probs(packed.model, packed.data_collator(examples))
    tol = 1e-6 if _compat.dpo_uses_fused_lm_head() else 1e-12
    for x, y in zip(a, b, strict=True):
        assert eq.max_rel(y, x) <= tol


# -------------------------------------------------------------------------------------------------------------------
# Training, evaluation, TRL's own flag, precompute, PEFT
# -------------------------------------------------------------------------------------------------------------------


def test_train_steps_and_metrics_match_with_trl_flag(build, dataset):
    """Three optimizer steps + evaluate: same losses and logged metrics. The plugin is enabled by TRL's own
    `DPOConfig(padding_free=True)` and runs with gradient checkpointing (which must not change anything)."""
    kwargs = dict(max_steps=3, eval_dataset=dataset.select(range(8)), eval_strategy="no")
    stock = build(**kwargs)
    stock_logs, stock_eval = eq.train_logs(stock), stock.evaluate()
    with trl_ext.install():
        packed = build(padding_free=True, gradient_checkpointing=True, **kwargs)
        assert packed.args.padding_free is True  # the user's config is left as it was
        assert "padding_free" in packed._trl_ext.enabled
        packed_logs, packed_eval = eq.train_logs(packed), packed.evaluate()
        assert _state(packed).packed_calls >= 3 * 2 + 2  # policy + ref per step, and evaluation
    assert len(stock_logs) == len(packed_logs) == 3
    eq.assert_same_logs([*stock_logs, stock_eval], [*packed_logs, packed_eval], rel=1e-4, abs=1e-6)
    assert packed_logs[-1]["num_tokens"] == stock_logs[-1]["num_tokens"]  # real tokens, exactly


def test_precompute_ref_log_probs(build):
    """`precompute_ref_log_probs=True` without a reference model: the precompute runs packed (inside `__init__`) and
    gives the same reference columns and the same loss."""
    stock, packed = eq.stock_and_plugin(build, dict(padding_free=True), ref=False, precompute_ref_log_probs=True)
    assert _state(packed).packed_calls > 0  # the precompute ran through the packed forward, not a cache file
    for a, b in eq.ref_columns(stock, packed):
        assert eq.max_rel(b, a) <= LOGPS_RTOL
    _compare(stock, packed, eq.examples(stock))


def test_with_precompute_ref_batch_size_plugin(build, tmp_path):
    """Together with the `precompute_ref_batch_size` plugin, which runs the precompute with its own batches: those
    batches are packed too (from their attention masks) and give the same reference columns."""
    # a fresh cache directory, so that the precompute runs instead of reading an earlier run's cache entry
    plugins = {"precompute_ref_batch_size": {"cache_dir": str(tmp_path / "ref_cache")}}
    install = dict(padding_free=True, precompute_ref_batch_size=3, plugins=plugins)
    stock, packed = eq.stock_and_plugin(build, install, ref=False, precompute_ref_log_probs=True)
    assert set(packed._trl_ext.enabled) >= {"padding_free", "precompute_ref_batch_size"}
    assert _state(packed).packed_calls > 0
    for a, b in eq.ref_columns(stock, packed):
        assert eq.max_rel(b, a) <= LOGPS_RTOL


def test_peft_lora_policy(build):
    """LoRA policy whose reference is the adapter-disabled base model: both forwards run packed."""
    stock = build(ref=False, peft_config=eq.lora())
    with trl_ext.install(padding_free=True):
        packed = build(ref=False, peft_config=eq.lora())
        assert set(_state(packed).attn_implementations) == {"policy"}
        _compare(stock, packed, eq.examples(stock))


# -------------------------------------------------------------------------------------------------------------------
# Isolation: a packed row never mixes sequences
# -------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["varlen", "dense"])
def test_isolation(build, attention, monkeypatch):
    with trl_ext.install(padding_free=True, plugins={"padding_free": {"attention": attention}}):
        trainer = build()
        examples = eq.examples(trainer)
        base = torch.cat(trainer.compute_ref_log_probs(trainer.model, trainer.data_collator(examples)))
        # Same lengths, other tokens: the chosen completion of pair 2 (row 2) and the prompt of pair 4 (rows 4 and
        # 10, its chosen and rejected sequences). Rows are packed in order, so rows 3 and 5 follow changed tokens.
        changed = [dict(e) for e in examples]
        changed[2]["chosen_ids"] = [(t + 7) % 250 + 4 for t in changed[2]["chosen_ids"]]
        changed[4]["prompt_ids"] = [(t + 3) % 250 + 4 for t in changed[4]["prompt_ids"]]
        after = torch.cat(trainer.compute_ref_log_probs(trainer.model, trainer.data_collator(changed)))
        touched = [2, 4, 10]
        others = [i for i in range(len(base)) if i not in touched]
        assert ((after[touched] - base[touched]).abs() > 1e-3).all()  # the changed sequences did change
        assert torch.equal(after[others], base[others])

        # Negative control: the same check fails when the row is handed to the model as one sequence (one varlen
        # segment, positions running on), i.e. when sequences attend to each other.
        from trl_ext.plugins.padding_free import hooks as pf

        pack_kwargs = pf._pack_kwargs

        def leaky(kwargs, meta):
            packed, info = pack_kwargs(kwargs, meta)
            n = info.num_tokens
            packed["position_ids"] = torch.arange(n)[None]
            packed["cu_seq_lens_q"] = packed["cu_seq_lens_k"] = torch.tensor([0, n], dtype=torch.int32)
            return packed, info

        monkeypatch.setattr(pf, "_pack_kwargs", leaky)
        leak_base = torch.cat(trainer.compute_ref_log_probs(trainer.model, trainer.data_collator(examples)))
        leak_after = torch.cat(trainer.compute_ref_log_probs(trainer.model, trainer.data_collator(changed)))
        assert not torch.allclose(leak_after[others], leak_base[others], rtol=0, atol=1e-4)


# -------------------------------------------------------------------------------------------------------------------
# Architectures (the allowlist), attention modes, non-packed calls
# -------------------------------------------------------------------------------------------------------------------


def _padded_batch(lengths, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


def _seq_logps(logits, ids, mask):
    logps = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    # `where`, not a product: a fully masked padded query row of eager + sliding window is NaN in the padded reference
    return torch.where(mask[:, 1:].bool(), logps, 0.0).sum(1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", helpers.DENSE_MODEL_TYPES)
def test_architectures(model_type, attn):
    """fp64: the packed forward of every allowlisted architecture equals running each sequence alone (varlen and dense
    attention, sliding windows shorter than the sequences), through the causal-LM wrapper and the backbone wrapper."""
    from trl_ext.plugins import padding_free as pf
    from trl_ext.plugins.padding_free import PaddingFreeState
    from trl_ext.plugins.padding_free.hooks import VERIFIED_MODEL_TYPES
    from trl_ext.toolkit.packing.attention import (
        register_varlen_attention,
        unregister_varlen_attention,
        varlen_attention_name,
    )

    assert model_type in VERIFIED_MODEL_TYPES
    model = helpers.windowed_model(model_type, attn)
    ids, mask = _padded_batch([13, 5, 9, 1, 11])
    # Reference: each sequence alone (no padding at all). A padded eager reference is not usable here: with a sliding
    # window in fp64, transformers' eager path turns fully masked padded rows into NaN, which then reaches real tokens.
    ref_logits = torch.zeros(*ids.shape, model.config.vocab_size, dtype=torch.float64)
    ref_hidden = torch.zeros(*ids.shape, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        for i, n in enumerate(mask.sum(1).tolist()):
            ref_logits[i, :n] = model(input_ids=ids[i : i + 1, :n], use_cache=False).logits[0]
            ref_hidden[i, :n] = model.base_model(input_ids=ids[i : i + 1, :n], use_cache=False).last_hidden_state[0]
    expected = _seq_logps(ref_logits, ids, mask)
    # eager attention takes its softmax in fp32 even for fp64 models (modeling_llama.py `eager_attention_forward`),
    # while the varlen path runs SDPA in fp64: the bound is fp32 round-off there (|logps| ~ 50, a bug moves them >1e-3)
    tol = 1e-10 if attn == "sdpa" else 1e-6
    register_varlen_attention()
    try:
        for mode in ("varlen", "dense"):
            state = PaddingFreeState()
            if mode == "varlen":
                model.config._attn_implementation_internal = varlen_attention_name(attn)
            forward = pf._make_causal_lm_forward(model.forward, state)
            backbone_forward = pf._make_backbone_forward(model.base_model.forward, state)
            with torch.no_grad():
                logits = forward(input_ids=ids, attention_mask=mask, use_cache=False).logits
                hidden = backbone_forward(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            assert state.packed_calls == 2
            got = _seq_logps(logits, ids, mask)
            assert (got - expected).abs().max().item() < tol, mode
            real = mask.bool()
            assert (hidden[real] - ref_hidden[real]).abs().max().item() < tol, mode
            model.config._attn_implementation_internal = attn
    finally:
        model.config._attn_implementation_internal = attn
        unregister_varlen_attention()


def test_generation_unchanged_and_uninstall_restores(build, tokenizer):
    """While installed, calls that are not packed (generation with a cache and a left-padded mask) behave exactly as
    stock; uninstalling restores every patched object."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    ids, mask = _padded_batch([7, 3, 5], vocab=200, seed=1)
    ids, mask = ids.flip(1), mask.flip(1)  # left padding, for generation
    stock = build()
    gen_kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    expected = stock.model.generate(**gen_kwargs)
    with trl_ext.install(padding_free=True) as installation:
        trainer = build()
        model, backbone = trainer.model, trainer.model.base_model
        before = {"forward": model.forward, "backbone": backbone.forward, "collator": trainer.data_collator}
        assert model.config._attn_implementation == "trl_ext_varlen_sdpa"
        assert torch.equal(model.generate(**gen_kwargs), expected)
        assert "trl_ext_varlen_sdpa" in AttentionInterface._global_mapping
        installation.uninstall()
        # TRL is stock again, but the trainer keeps its plugins for its whole life (issue 15) until detached.
        assert model.config._attn_implementation == "trl_ext_varlen_sdpa"
        assert "trl_ext_varlen_sdpa" in AttentionInterface._global_mapping
        installation.detach(trainer)
        assert model.config._attn_implementation == "sdpa"
        assert "forward" not in backbone.__dict__
        assert model.forward != before["forward"] and backbone.forward != before["backbone"]
        assert type(trainer.data_collator).__name__ == "DataCollatorForPreference"
        # The registration is process-wide: it goes when the last attached trainer holding it is detached (trainers
        # of earlier tests may still be alive and attached).
        for ctx in live_contexts():
            ctx.detach()
        assert "trl_ext_varlen_sdpa" not in AttentionInterface._global_mapping
        assert "trl_ext_varlen_sdpa" not in AttentionMaskInterface._global_mapping
        assert torch.equal(model.generate(**gen_kwargs), expected)


def test_batches_without_metadata_are_packed(build):
    """A batch from another collator (no metadata) is packed from its attention mask, with the same results."""
    stock = build()
    with trl_ext.install(padding_free=True):
        packed = build()
        examples = eq.examples(stock)
        batch = stock.data_collator(examples)  # the stock collator: no `trl_ext_packing`
        calls = _state(packed).packed_calls
        a = stock.compute_ref_log_probs(stock.model, batch)
        b = packed.compute_ref_log_probs(packed.model, batch)
        assert _state(packed).packed_calls == calls + 1
        for x, y in zip(a, b, strict=True):
            assert eq.max_rel(y, x) <= LOGPS_RTOL


# -------------------------------------------------------------------------------------------------------------------
# Refusals
# -------------------------------------------------------------------------------------------------------------------


def test_refuses_bad_options():
    with pytest.raises(UsageError, match="Unknown option"):
        trl_ext.install(padding_free=True, plugins={"padding_free": {"atention": "varlen"}})
    with pytest.raises(UsageError, match="attention"):
        trl_ext.install(padding_free=True, plugins={"padding_free": {"attention": "flash"}})


# OPT (self-checked, then exact) and the MoE router auxiliary loss (equal to stock) are no longer refused: see
# test_padding_free_coverage.py and test_padding_free_sweep.py
@pytest.mark.parametrize("case", eq.PACKING_REFUSALS)
def test_refusals(build, case):
    with trl_ext.install(padding_free=True):
        eq.assert_refused(build, case)


def test_collator_refusals(build):
    with trl_ext.install(padding_free=True):
        trainer = build()
        collator = trainer.data_collator
        examples = eq.examples(trainer, 2)
        inner = collator.collator
        collator.collator = lambda ex: {**inner(ex), "pixel_values": torch.zeros(1)}
        with pytest.raises(UsageError, match="vision"):
            collator(examples)
        collator.collator = lambda ex: {k: v for k, v in inner(ex).items() if k != "attention_mask"}
        with pytest.raises(UsageError, match="attention_mask"):
            collator(examples)
        collator.collator = inner


def test_the_end_line_says_how_much_padding_was_not_computed(build):
    """`summary()` (the end line of `trl-ext dpo`): the packed calls, the padded batch's tokens and the packed row's,
    counted from the batches the model was called with; "did nothing" before any packed call."""
    with trl_ext.install(padding_free=True):
        packed = build()
    state = _state(packed)
    assert state.summary() == "did nothing: no scoring call was packed"
    batch = packed.data_collator(eq.examples(packed))
    packed.compute_ref_log_probs(packed.model, batch)
    assert state.packed_calls == 1 and 0 < state.packed_tokens < state.padded_tokens
    saved = 1 - state.packed_tokens / state.padded_tokens
    assert state.summary() == (
        f"1 scoring calls packed: {state.padded_tokens} padded tokens computed as {state.packed_tokens} "
        f"({saved:.0%} padding not computed)"
    )


def test_a_run_ends_saying_the_padding_not_computed(build):
    """Issue 41, point 5, as a user meets it: after `train()` the end line gives the padded tokens of the scoring
    calls, the tokens packed, and the fraction of padding not computed, counted from the batches the collator built
    (each scored by the policy and by the reference)."""
    batches = []
    with trl_ext.install(padding_free=True):
        packed = build(max_steps=2)
        collator = packed.data_collator
        inner = collator.collator

        def recording(examples):
            batch = inner(examples)
            batches.append(batch)
            return batch

        collator.collator = recording
        try:
            packed.train()
        finally:
            collator.collator = inner
    state = _state(packed)
    # accelerate's loader collates one batch ahead of the one it yields: the first two are those the steps ran
    assert len(batches) >= 2 and state.packed_calls == 4 and not state.unpacked_calls
    batches = batches[:2]
    padded = 2 * sum(b["input_ids"].numel() for b in batches)
    real = 2 * sum(int(b["attention_mask"].sum()) for b in batches)
    assert (state.padded_tokens, state.packed_tokens) == (padded, real) and real < padded
    assert state.summary() == (
        f"4 scoring calls packed: {padded} padded tokens computed as {real} ({1 - real / padded:.0%} padding not "
        "computed)"
    )
