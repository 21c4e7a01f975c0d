"""prompt_sharing: DPO with each prompt computed once equals stock padded DPO (TRL 1.16 fused LM head, 1.12 logits).

Every equivalence test runs a stock `DPOTrainer` (trl-ext not installed) and a trainer with the plugin, on the same
float64 weights and the same examples, and compares per-sequence log-probs, losses, gradients and logged metrics.
TRL >= 1.15's fused LM head computes its log-softmax in float32 whatever the model dtype, so there the bound is
float32 round-off (relative 1e-6 on the log-probs); on TRL 1.12 (logits path) it is float64 round-off.
"""

from __future__ import annotations

import gc

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from tests import helpers
from trl_ext import UsageError, _compat
from trl_ext.testing import make_model, make_preference_dataset

FUSED = _compat.dpo_uses_fused_lm_head()
# Per-sequence log-probs, relative to max(1, |x|): fp32 round-off of the fused head (1.16), fp64 round-off (1.12). A
# sharing bug (a response attending to the other response, a position off by one, a token scored from the wrong
# segment) moves them by > 1e-2 with these sharpened models.
LOGPS_RTOL = 1e-6 if FUSED else 1e-11
# Gradients (max |diff| relative to max |grad|), on both versions: Llama's RMSNorm computes in float32 whatever the
# model dtype (modeling_llama.py `LlamaRMSNorm.forward`, `hidden_states.to(torch.float32)`), and a shared prompt token
# receives the sum of both branches' gradients *before* that float32 backward, where the padded run sums after it.
# Measured 5e-8 (1.12: exactly 0 with padding_free, which sums nothing); a real bug moves gradients by > 1e-3.
GRAD_RTOL = 1e-6
# Logged metrics after SGD steps inherit that round-off; differences of log-probs (rewards/margins) lose the relative
# bound to cancellation, so they get an absolute one at the size of log-probs ~100 times 1e-7.
METRIC_RTOL = 1e-6
METRIC_ATOL = 1e-5


_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)


@pytest.fixture(scope="module")
def dataset():
    # prompts about as long as the responses, so that sharing matters
    return make_preference_dataset(16, seed=0, prompt_median=14, completion_median=8)


@pytest.fixture
def build(dpo_args, tokenizer, dataset):
    """A DPOTrainer on float64 models: policy seed 0, reference seed 1 (unless PEFT or precompute)."""
    return eq.dpo_builder(dpo_args, tokenizer, dataset, dtype=torch.float64)


def _state(trainer):
    return trainer._trl_ext.state["prompt_sharing"]


def _compare(stock, shared, examples, logps=True):
    """Per-sequence logps, loss and gradients of a stock and a sharing trainer on the same examples."""
    tolerances = dict(logps_rtol=LOGPS_RTOL, loss_rtol=METRIC_RTOL, grad_rtol=GRAD_RTOL, logps=logps)
    return eq.compare_plugin(stock, shared, examples, "prompt_sharing", **tolerances)


# -------------------------------------------------------------------------------------------------------------------
# Layout
# -------------------------------------------------------------------------------------------------------------------


def test_layout_shares_each_prompt_once(build):
    from trl_ext.plugins.prompt_sharing.layout import SharedLayout, build_layout

    with trl_ext.install(prompt_sharing=True):
        trainer = build()
        examples = eq.examples(trainer)
        batch = trainer.data_collator(examples)
    assert all(isinstance(v, torch.Tensor) for v in batch["trl_ext_prompt_sharing"].values())  # tensors only
    lay = SharedLayout.from_batch(batch["trl_ext_prompt_sharing"], batch["input_ids"])
    assert lay is not None
    prompts = [len(e["prompt_ids"]) for e in examples]
    responses = [len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in examples]
    # prompt[:-1] once, then (prompt[-1], response) per branch: P + C + R + 1 tokens per pair
    assert lay.gather.numel() == sum(p + r + 1 for p, r in zip(prompts, responses, strict=True))
    assert lay.unshared_rows == 0 and lay.padded_tokens == int(batch["attention_mask"].sum())
    for (ps, pe, branches), p in zip(lay.groups, prompts, strict=True):
        assert pe - ps == p - 1 and len(branches) == 2
        for bs, *_ in branches:  # both branches continue from the prompt
            assert lay.position_ids[0, bs].item() == p - 1
    # the serialized layout decodes to what the collator built
    again = build_layout(batch["input_ids"], batch["attention_mask"], lay.prompt_end)
    for name in ("gather", "position_ids", "real_flat", "real_shared", "shift_flat", "shift_shared", "label_starts"):
        assert torch.equal(getattr(lay, name), getattr(again, name)), name
    assert lay.groups == again.groups and lay.shared_rows == again.shared_rows
    # the unshared layout: every row one segment, positions from 0
    flat = build_layout(batch["input_ids"], batch["attention_mask"], None)
    assert flat.gather.numel() == int(batch["attention_mask"].sum()) and flat.shared_rows == 0


# -------------------------------------------------------------------------------------------------------------------
# Equivalence: every loss type and loss option, through TRL's real `compute_loss`
# -------------------------------------------------------------------------------------------------------------------

LOSS_CASES = eq.LOSS_CASES


def _loss_pair(build):
    # exo_pair needs label_smoothing > 0 at construction (both TRL versions check it in `__init__`)
    stock = build(use_weighting=True, label_smoothing=1e-3, loss_type=["exo_pair"])
    with trl_ext.install(prompt_sharing=True):
        shared = build(use_weighting=True, label_smoothing=1e-3, loss_type=["exo_pair"])
    return stock, shared, eq.examples(stock)


def test_wpo_weights_and_exo_pair(build):
    """Per-sequence logps, and the loss and gradients of exo_pair with WPO weights (read from the logits)."""
    stock, shared, examples = _loss_pair(build)
    _compare(stock, shared, examples)


@pytest.mark.slow  # ~6 s: kept out of the fast loop's 90 s; test_wpo_weights_and_exo_pair keeps the logits path
def test_every_loss_type_and_option(build):
    """Every loss type and loss option (`LOSS_CASES`) through TRL's real `compute_loss` on one pair of trainers."""
    stock, shared, examples = _loss_pair(build)
    eq.assert_every_loss_case((stock, shared), lambda: _compare(stock, shared, examples, logps=False), LOSS_CASES)


def test_fp64_per_sequence_logps(build):
    stock = build()
    with trl_ext.install(prompt_sharing=True):
        shared = build()
        examples = eq.examples(stock, 8)
        a = torch.cat(stock.compute_ref_log_probs(stock.model, stock.data_collator(examples)))
        b = torch.cat(shared.compute_ref_log_probs(shared.model, shared.data_collator(examples)))
        assert _state(shared).rows == 16 and _state(shared).unshared_rows == 0
    assert (a.abs() > 5).all()  # real, sizeable log-probs
    assert eq.max_rel(b, a) <= LOGPS_RTOL


# -------------------------------------------------------------------------------------------------------------------
# Training, evaluation, precompute, PEFT, gradient checkpointing, unshared pairs
# -------------------------------------------------------------------------------------------------------------------


def _assert_same_logs(stock_logs, shared_logs):
    eq.assert_same_logs(stock_logs, shared_logs, rel=METRIC_RTOL, abs=METRIC_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_train_steps_and_metrics_match(build, dataset, gradient_checkpointing):
    """Three SGD steps + evaluate: same losses and every logged metric, with and without gradient checkpointing."""
    kwargs = dict(max_steps=3, optim="sgd", learning_rate=0.1)
    stock = build(**kwargs)
    stock_logs = eq.train_logs(stock)
    stock_eval = stock.evaluate(dataset.select(range(8)))
    with trl_ext.install(prompt_sharing=True, plugins={"prompt_sharing": {"self_check": True}}):
        shared = build(gradient_checkpointing=gradient_checkpointing, **kwargs)
        assert set(_state(shared).checked) == {"policy", "ref"}  # the self-check ran on both, before training
        shared_logs = eq.train_logs(shared)
        shared_eval = shared.evaluate(dataset.select(range(8)))
        # policy + ref per step and per evaluation batch (8 pairs, 4 per batch); the self-check's probe not counted
        assert _state(shared).shared_calls == 3 * 2 + 2 * 2
    _assert_same_logs([*stock_logs, stock_eval], [*shared_logs, shared_eval])
    assert shared_logs[-1]["num_tokens"] == stock_logs[-1]["num_tokens"]  # real tokens, exactly


def test_precompute_ref_log_probs(build):
    """`precompute_ref_log_probs=True`: the precompute runs shared (inside `__init__`), same columns, same loss."""
    stock, shared = eq.stock_and_plugin(build, dict(prompt_sharing=True), ref=False, precompute_ref_log_probs=True)
    assert _state(shared).shared_calls > 0  # the precompute ran through the shared forward, not a cache file
    assert _state(shared).shared_tokens < _state(shared).padded_tokens
    for a, b in eq.ref_columns(stock, shared):
        assert eq.max_rel(b, a) <= LOGPS_RTOL
    _compare(stock, shared, eq.examples(stock))


def test_with_precompute_ref_batch_size_plugin(build, tmp_path):
    """Together with the `precompute_ref_batch_size` plugin, which batches the precompute itself (with the trainer's
    collator, so the batches carry the layout): shared, same reference columns."""
    plugins = {"precompute_ref_batch_size": {"cache_dir": str(tmp_path / "ref_cache")}}
    install = dict(prompt_sharing=True, precompute_ref_batch_size=3, plugins=plugins)
    stock, shared = eq.stock_and_plugin(build, install, ref=False, precompute_ref_log_probs=True)
    assert set(shared._trl_ext.enabled) >= {"prompt_sharing", "precompute_ref_batch_size"}
    state = _state(shared)
    assert state.shared_calls > 0 and state.unshared_calls == 0
    for a, b in eq.ref_columns(stock, shared):
        assert eq.max_rel(b, a) <= LOGPS_RTOL


def test_peft_lora_policy(build):
    """LoRA policy whose reference is the adapter-disabled base model: both forwards run shared."""
    stock = build(ref=False, peft_config=eq.lora())
    with trl_ext.install(prompt_sharing=True):
        shared = build(ref=False, peft_config=eq.lora())
        assert set(_state(shared).attn_implementations) == {"policy"}
        _compare(stock, shared, eq.examples(stock))


def test_with_padding_free_means_the_same(build, caplog):
    """Both flags: both serve `packing`; the core keeps prompt_sharing (higher precedence) and leaves padding_free out
    for this trainer, saying so."""
    stock = build()
    with trl_ext.install(prompt_sharing=True, padding_free=True):
        shared = build()
        assert shared._trl_ext.enabled == ("prompt_sharing",)
        assert "padding_free is left out: prompt_sharing serves the same role" in caplog.text
        assert type(shared.data_collator).__name__ == "PromptSharingCollator"
        assert shared.model.config._attn_implementation == "trl_ext_shared_sdpa"
        _compare(stock, shared, eq.examples(stock))


def test_keep_end_truncation_runs_unshared_and_says_so(build, caplog):
    """`truncation_mode="keep_end"` cuts prompts differently for the chosen and the rejected sequence: those pairs
    run unshared (and are counted), the others share, and everything still equals stock."""
    from datasets import Dataset

    words = lambda a, n: " ".join(f"w{a + i}" for i in range(n))  # noqa: E731
    rows = [
        {"prompt": words(1, 6), "chosen": " " + words(10, 9), "rejected": " " + words(30, 2)},  # cut differently
        {"prompt": words(40, 5), "chosen": " " + words(50, 3), "rejected": " " + words(60, 4)},  # fits: shared
        {"prompt": words(80, 6), "chosen": " " + words(90, 1), "rejected": " " + words(100, 3)},  # fits: shared
    ]
    data = Dataset.from_list(rows)
    stock = build(train_dataset=data, max_length=10, truncation_mode="keep_end")
    with trl_ext.install(prompt_sharing=True):
        shared = build(train_dataset=data, max_length=10, truncation_mode="keep_end")
        with caplog.at_level("WARNING"):
            _compare(stock, shared, eq.examples(stock, 3))
        state = _state(shared)
        assert state.unshared_rows > 0 and state.unshared_rows < state.rows
        assert state.counts()["unshared_fraction"] == pytest.approx(state.unshared_rows / state.rows)
        assert f"{state.unshared_rows} sequences shared no prompt and ran unshared" in state.summary()
    assert "run unshared" in caplog.text


# -------------------------------------------------------------------------------------------------------------------
# Batch dispatching (accelerate's DataLoaderDispatcher concatenates batches and slices every tensor along dim 0)
# -------------------------------------------------------------------------------------------------------------------


def test_layout_entry_survives_dispatch_slicing(build):
    """The batch entry is tensors only; after accelerate's concatenation and dim-0 slicing the serialized layout is
    recognized as cut and the layout is rebuilt from the row-major prompt ends, equal to the collator's."""
    from accelerate.utils import concatenate, slice_tensors

    from trl_ext.plugins.prompt_sharing.forward import _layout_for
    from trl_ext.plugins.prompt_sharing.layout import SharedLayout

    with trl_ext.install(prompt_sharing=True):
        trainer = build(max_length=48, pad_to_multiple_of=48)
        batches = [trainer.data_collator(eq.examples(trainer, 8)[i : i + 4]) for i in (0, 4)]
    both = concatenate(batches, dim=0)  # two processes' batches, as rank 0 gathers them
    for part, whole in ((slice(0, 8), batches[0]), (slice(8, 16), batches[1])):
        batch = slice_tensors(both, part)
        meta = batch["trl_ext_prompt_sharing"]
        assert SharedLayout.from_batch(meta, batch["input_ids"]) is None  # the serialized layout was cut
        rebuilt = _layout_for(dict(batch), meta, None)
        expected = SharedLayout.from_batch(whole["trl_ext_prompt_sharing"], whole["input_ids"])
        assert rebuilt is not None and expected is not None and rebuilt.shared_rows == 8
        assert rebuilt.groups == expected.groups and torch.equal(rebuilt.gather, expected.gather)


def _dispatch_run(trainer):
    logs = eq.train_logs(trainer)
    eval_data = trainer.train_dataset.select(range(8))
    logs.append(trainer.evaluate(eval_dataset=eval_data.to_iterable_dataset()))
    logs.append(trainer.predict(eval_data.to_iterable_dataset()).metrics)
    return logs


@pytest.mark.slow
def test_dispatch_batches_train_evaluate_predict(build):
    """`dispatch_batches=True` training, and evaluate()/predict() on an IterableDataset (dispatched too), one
    process: every logged metric equals stock, and every scoring forward ran shared."""
    kwargs = dict(max_steps=3, optim="sgd", learning_rate=0.1, accelerator_config={"dispatch_batches": True})
    stock_logs = _dispatch_run(build(**kwargs))
    with trl_ext.install(prompt_sharing=True):
        shared = build(**kwargs)
        shared_logs = _dispatch_run(shared)
        state = _state(shared)
        assert state.shared_calls >= 3 * 2 + 2 * 2 and state.unshared_calls == 0 and state.unshared_rows == 0
    _assert_same_logs(stock_logs, shared_logs)


@pytest.mark.slow
@pytest.mark.distributed
def test_dispatch_batches_two_processes(tmp_path):
    """torchrun, 2 CPU processes (gloo), `dispatch_batches=True`: train, evaluate and predict with prompt_sharing log
    what the stock run logs, on every rank."""
    from tests import helpers

    out = helpers.launch(helpers.PLUGIN_SCRIPTS / "packing_dispatch.py", "prompt_sharing", tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("DISPATCH OK") == 2, out.stdout[-3000:]


# -------------------------------------------------------------------------------------------------------------------
# Isolation and the self-check
# -------------------------------------------------------------------------------------------------------------------


def test_isolation(build):
    """Changing a rejected response changes no chosen log-prob (and no other sequence); changing a prompt changes both
    sequences of its pair and nothing else."""
    with trl_ext.install(prompt_sharing=True):
        trainer = build()
        examples = eq.examples(trainer)
        n = len(examples)

        def logps(exs):
            return torch.cat(trainer.compute_ref_log_probs(trainer.model, trainer.data_collator(exs)))

        base = logps(examples)
        changed = [dict(e) for e in examples]
        changed[2]["rejected_ids"] = [(t + 7) % 250 + 4 for t in changed[2]["rejected_ids"]]
        after = logps(changed)
        assert (after[n + 2] - base[n + 2]).abs() > 1e-3  # the changed rejected response did change
        others = [i for i in range(2 * n) if i != n + 2]
        assert torch.equal(after[others], base[others])  # its chosen response (row 2) included

        changed = [dict(e) for e in examples]
        changed[4]["prompt_ids"] = [(t + 3) % 250 + 4 for t in changed[4]["prompt_ids"]]
        after = logps(changed)
        touched = [4, n + 4]
        assert ((after[touched] - base[touched]).abs() > 1e-3).all()
        others = [i for i in range(2 * n) if i not in touched]
        assert torch.equal(after[others], base[others])


def test_self_check_names_what_differed(build, monkeypatch, caplog):
    """A shared attention that lets the rejected response see the chosen one is caught by the self-check before the
    first step, with a UsageError naming the model, the output and the position; the correct attention passes, with
    one log line giving the cost."""
    from trl_ext.plugins.prompt_sharing import attention

    check = {"prompt_sharing": {"self_check": True}}
    with trl_ext.install(prompt_sharing=True, plugins=check):
        with caplog.at_level("INFO", logger="trl_ext"):
            trainer = build()
        assert set(_state(trainer).checked) == {"policy", "ref"}
        assert _state(trainer).shared_calls == 0  # the probe is not counted as training
    passed = [r.getMessage() for r in caplog.records if "self-check passed" in r.getMessage()]
    assert len(passed) == 2 and all("cost 2 forwards" in m and "stock padded forward" in m for m in passed), passed

    original = attention._attend

    def leaky(base, module, query, key, value, offset, *args):
        if offset:  # a branch: also show it the keys just before it (the previous branch, for a rejected one)
            return original(base, module, query, key, value, 0, *args)
        return original(base, module, query, key, value, offset, *args)

    monkeypatch.setattr(attention, "_attend", leaky)
    match = r"self-check failed for the policy model \(LlamaForCausalLM, `llama`\): the shared forward's `logits` "
    match += r"differ .* at probe row \d+ \(the (chosen|rejected) sequence of pair \d\), token \d+"
    with trl_ext.install(prompt_sharing=True, plugins=check):
        with pytest.raises(UsageError, match=match):
            build()
    with trl_ext.install(prompt_sharing=True):
        build()  # a verified model type is not checked unless `self_check: true`


def _custom(seed: int, window: int | None = None):
    """A sharpened float64 Llama under a model type outside every table, as a `trust_remote_code` model would be; with
    `window`, its attention layers also apply a sliding window only through the 4D mask they receive (nothing in the
    config or the layer arguments says so: only a measurement sees it)."""
    model = eq.sharpen(make_model(dtype=torch.float64, seed=seed))
    model.config.model_type = "my_custom_llama"
    return model if window is None else eq.add_mask_window(model, window)


def test_unverified_model_type_is_admitted_by_the_self_check(build, dpo_args, tokenizer, dataset, caplog):
    """A model type outside the verified table (TRL's `test_trust_remote_code` case) is admitted through the
    self-check before the first step, and then equals stock: log-probs, loss and gradients."""
    from trl import DPOTrainer

    stock = build()
    with trl_ext.install(prompt_sharing=True):
        with caplog.at_level("INFO", logger="trl_ext"):
            shared = DPOTrainer(
                _custom(0), ref_model=_custom(1), args=dpo_args(bf16=False), train_dataset=dataset,
                processing_class=tokenizer,
            )  # fmt: skip
        assert set(_state(shared).checked) == {"policy", "ref"}
        assert _state(shared).self_checks["policy"].lengths[0] == 52  # the dataset's longest pair
        assert "self-check passed for the policy model (LlamaForCausalLM, `my_custom_llama`" in caplog.text
        _compare(stock, shared, eq.examples(stock))


@pytest.mark.slow  # building a bf16 trainer on CPU takes ~8 s
def test_self_check_runs_in_the_training_dtype(dpo_args, tokenizer, dataset, caplog):
    """Mixed precision (`bf16=True`, float32 weights): the probe runs under accelerate's autocast, as training does,
    and is judged at bfloat16 round-off."""
    from trl import DPOTrainer

    def custom(seed):
        model = make_model(seed=seed)
        model.config.model_type = "my_custom_llama"
        return model

    with trl_ext.install(prompt_sharing=True):
        with caplog.at_level("INFO", logger="trl_ext"):
            trainer = DPOTrainer(
                custom(0), ref_model=custom(1), args=dpo_args(bf16=True, max_length=16), train_dataset=dataset,
                processing_class=tokenizer,
            )  # fmt: skip
        result = _state(trainer).self_checks["policy"]
    assert result.lengths[0] == 16  # max_length, shorter than the dataset's longest pair
    assert result.failure is None and result.tolerance == 5e-2 and 0 < result.max_error <= 5e-2
    assert "(LlamaForCausalLM, `my_custom_llama`, bfloat16)" in caplog.text


def test_a_mask_only_window_is_refused_before_the_first_step(dpo_args, tokenizer, dataset):
    """A custom model whose window lives only in the padded mask (16 tokens, shorter than the dataset's longest pair)
    loses it in the shared row: refused before the first step, naming the model, the output and the position. With
    a window longer than every training sequence it never acts, and the model is admitted."""
    from trl import DPOTrainer

    def trainer(window):
        return DPOTrainer(
            _custom(0, window), ref_model=_custom(1, window), args=dpo_args(bf16=False), train_dataset=dataset,
            processing_class=tokenizer,
        )  # fmt: skip

    with trl_ext.install(prompt_sharing=True):
        match = r"self-check failed for the policy model \(LlamaForCausalLM, `my_custom_llama`\): the shared "
        match += r"forward's `logits` differ .* at probe row \d \(the \w+ sequence of pair 0\), token \d+"
        with pytest.raises(UsageError, match=match):
            trainer(16)
        assert set(_state(trainer(1000)).checked) == {"policy", "ref"}


def test_self_check_false_refuses_unverified_model_types(dpo_args, tokenizer, dataset):
    """`self_check: false` checks nothing, so a model type outside the verified table is refused (not run unchecked),
    with the setting that admits it; a bad value is an error."""
    from trl import DPOTrainer

    with trl_ext.install(prompt_sharing=True, plugins={"prompt_sharing": {"self_check": False}}):
        with pytest.raises(UsageError, match=r"not verified on `my_custom_llama` .*self_check: auto"):
            DPOTrainer(
                _custom(0), ref_model=_custom(1), args=dpo_args(bf16=False), train_dataset=dataset,
                processing_class=tokenizer,
            )  # fmt: skip
    with pytest.raises(UsageError, match="self_check"):
        trl_ext.install(prompt_sharing=True, plugins={"prompt_sharing": {"self_check": "sometimes"}})


# -------------------------------------------------------------------------------------------------------------------
# Dropout: every dropout site is turned off (disable_dropout=True) or refused; a self-check names dropout
# -------------------------------------------------------------------------------------------------------------------


def _opt(dropout: float, seed: int = 0):
    """A tiny float64 OPT with the dropout `facebook/opt-*` ships (`dropout=0.1`): applied with
    `nn.functional.dropout` and float attributes, which TRL's `disable_dropout` (nn.Dropout modules only) misses."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=256, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=32, max_position_embeddings=512, pad_token_id=0, bos_token_id=2, eos_token_id=1,
        dropout=dropout, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return eq.sharpen(OPTForCausalLM(config).to(torch.float64))


def _opt_trainer(dpo_args, tokenizer, dataset, dropout, **args):
    from trl import DPOTrainer

    return DPOTrainer(
        _opt(dropout),
        ref_model=_opt(dropout, seed=1),
        args=dpo_args(bf16=False, **args),
        train_dataset=dataset,
        processing_class=tokenizer,
    )


def test_opt_dropout_is_turned_off_not_refused(dpo_args, tokenizer, dataset, caplog):
    """OPT with dropout 0.1 (as shipped): with `disable_dropout=True` prompt_sharing zeroes the functional dropout TRL
    leaves on, the self-check passes in training mode, and the loss and gradients equal stock TRL on the same OPT
    with its dropout 0 (what `disable_dropout=True` asks for); detaching restores the dropout."""
    stock = _opt_trainer(dpo_args, tokenizer, dataset, 0.0)
    with trl_ext.install(prompt_sharing=True, plugins={"prompt_sharing": {"self_check": True}}) as installation:
        with caplog.at_level("INFO", logger="trl_ext"):
            shared = _opt_trainer(dpo_args, tokenizer, dataset, 0.1)
        counts = _state(shared).counts()  # the self-check's probe is not in the end-of-run counts
        assert (counts["shared_calls"], counts["unshared_calls"], counts["sequences"], counts["padded_tokens"]) == (
            0,
        ) * 4
        shared.model.train()
        examples = eq.examples(stock)
        stock_loss, stock_grads = eq.loss_and_grads(stock, stock.data_collator(examples))
        loss, grads = eq.loss_and_grads(shared, shared.data_collator(examples))
        assert set(_state(shared).checked) >= {"policy"}
        assert abs(loss.item() - stock_loss.item()) <= METRIC_RTOL * max(1.0, abs(stock_loss.item()))
        eq.assert_same_grads(stock_grads, grads, GRAD_RTOL)
        assert "OPTDecoderLayer.dropout" in caplog.text and "leaves on" in caplog.text

        from trl_ext.plugins.prompt_sharing.dropout import dropout_sites

        assert dropout_sites(shared.model) == [] and dropout_sites(shared.ref_model) == []
        installation.detach(shared)
    assert {label for _, _, label in dropout_sites(shared.model)} == {"OPTDecoderLayer.dropout", "OPTDecoder.dropout"}


def test_dropout_with_disable_dropout_false_is_refused(dpo_args, tokenizer, dataset):
    with trl_ext.install(prompt_sharing=True):
        match = r"dropout on in training \(.*OPTDecoderLayer\.dropout.*disable_dropout=True"
        with pytest.raises(UsageError, match=match):
            _opt_trainer(dpo_args, tokenizer, dataset, 0.1, disable_dropout=False)


def test_self_check_names_dropout_it_cannot_turn_off(dpo_args, tokenizer, dataset):
    """Dropout read inside `forward` (no module attribute to zero; here a forward hook) draws random numbers in
    training mode: the refusal names the layer that draws them and says it may be dropout, not a wrong shared
    prompt (`trl_ext.toolkit.randomness`)."""
    from trl import DPOTrainer

    model = _opt(0.0)
    model.model.decoder.layers[0].fc2.register_forward_hook(
        lambda module, args, out: torch.nn.functional.dropout(out, 0.1, training=module.training)
    )
    with trl_ext.install(prompt_sharing=True, plugins={"prompt_sharing": {"self_check": True}}):
        match = r"(?s)policy model .*draws random numbers in training mode, in `model.decoder.layers.0.fc2` .*dropout"
        with pytest.raises(UsageError, match=match):
            DPOTrainer(
                model, ref_model=_opt(0.0, seed=1), args=dpo_args(bf16=False), train_dataset=dataset,
                processing_class=tokenizer,
            )  # fmt: skip


# -------------------------------------------------------------------------------------------------------------------
# Architectures: sliding windows, both attention bases
# -------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", helpers.DENSE_MODEL_TYPES)
def test_architectures(model_type, attn):
    """fp64: the shared forward of dense architectures (sliding windows shorter than prompt + response) equals running
    each sequence alone, through the causal-LM wrapper and the backbone wrapper, with both attention bases (the other
    verified architectures, MoE included: tests/plugins/test_prompt_sharing_architectures.py)."""

    from trl_ext.patching import Patcher
    from trl_ext.plugins.prompt_sharing import forward as fw
    from trl_ext.plugins.prompt_sharing.attention import unregister_shared_attention
    from trl_ext.plugins.prompt_sharing.layout import build_layout
    from trl_ext.plugins.prompt_sharing.setup import PromptSharingState, configure_model

    model = helpers.windowed_model(model_type, attn)
    # Three pairs: prompts of 9, 4 and 1 tokens (the last one: nothing to share), responses of various lengths.
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g) for n in (9, 4, 1)]
    responses = [[torch.randint(3, 128, (n,), generator=g) for n in pair] for pair in ((5, 8), (1, 6), (3, 2))]
    seqs = [torch.cat([p, r[0]]) for p, r in zip(prompts, responses, strict=True)]
    seqs += [torch.cat([p, r[1]]) for p, r in zip(prompts, responses, strict=True)]
    length = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    prompt_end = [len(p) for p in prompts] * 2
    with torch.no_grad():
        expected = [model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        expected_hidden = [model.base_model(input_ids=s[None], use_cache=False).last_hidden_state[0] for s in seqs]

    class Ctx:
        patcher = Patcher("test")

        @staticmethod
        def patch(scope, apply, key=None):  # a trainer context holds the registration; here the test releases it
            apply(Patcher("test: held"))

    layout = build_layout(ids, mask, prompt_end)
    assert layout.shared_rows == 4 and layout.unshared_rows == 2
    try:
        assert configure_model(Ctx, "policy", model) == f"trl_ext_shared_{attn}"
        state = PromptSharingState()
        forward = fw.make_causal_lm_forward(model.forward, state)
        backbone = fw.make_backbone_forward(model.base_model.forward, state)
        with torch.no_grad():
            kwargs = dict(
                input_ids=ids, attention_mask=mask, use_cache=False, trl_ext_prompt_sharing=layout.to_batch()
            )
            logits = forward(**kwargs).logits
            kwargs["trl_ext_prompt_sharing"] = layout.to_batch()
            hidden = backbone(**kwargs).last_hidden_state
        assert state.shared_calls == 2
    finally:
        Ctx.patcher.undo()
        unregister_shared_attention()
    assert model.config._attn_implementation == attn
    # eager takes its softmax in fp32 for fp64 models on some architectures; the shared path runs SDPA in fp64
    tol = 1e-10 if attn == "sdpa" else 1e-6
    for i, s in enumerate(seqs):
        n = len(s)
        assert (logits[i, :n] - expected[i]).abs().max().item() < tol * 100, i
        assert (hidden[i, :n] - expected_hidden[i]).abs().max().item() < tol, i


# -------------------------------------------------------------------------------------------------------------------
# Generation, uninstall, refusals
# -------------------------------------------------------------------------------------------------------------------


def test_generation_unchanged_and_uninstall_restores(build):
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding, for generation
    mask[2, :2] = 0
    stock = build()
    gen_kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    expected = stock.model.generate(**gen_kwargs)
    with trl_ext.install(prompt_sharing=True) as installation:
        trainer = build()
        model, backbone = trainer.model, trainer.model.base_model
        wrapped = model.forward
        assert model.config._attn_implementation == "trl_ext_shared_sdpa"
        assert torch.equal(model.generate(**gen_kwargs), expected)
        installation.uninstall()
        # TRL is stock again, but the trainer keeps its plugins for its whole life (issue 15) until detached.
        assert model.config._attn_implementation == "trl_ext_shared_sdpa"
        # models of earlier trainers that were never detached keep the registration while they live
        gc.collect()
        installation.detach(trainer)
        assert model.config._attn_implementation == "sdpa"
        # TRL 1.16's fused head sets an instance `forward` of its own: ours is gone, theirs is back
        assert "forward" not in backbone.__dict__ and model.forward != wrapped
        assert type(trainer.data_collator).__name__ == "DataCollatorForPreference"
        assert "trl_ext_shared_sdpa" not in AttentionInterface._global_mapping
        assert "trl_ext_shared_sdpa" not in AttentionMaskInterface._global_mapping
        assert torch.equal(model.generate(**gen_kwargs), expected)


def test_refuses_bad_options():
    with pytest.raises(UsageError, match="self_chek"):
        trl_ext.install(prompt_sharing=True, plugins={"prompt_sharing": {"self_chek": False}})


@pytest.mark.parametrize("case", ["bloom", *eq.PACKING_REFUSALS])
def test_refusals(build, dpo_args, tokenizer, dataset, case):
    from trl import DPOTrainer

    with trl_ext.install(prompt_sharing=True):
        if case == "bloom":  # ALiBi biases from the padded mask: refused by mechanism, naming it
            from transformers import BloomConfig, BloomForCausalLM

            config = BloomConfig(vocab_size=256, hidden_size=32, n_layer=1, n_head=4, pad_token_id=0)
            with pytest.raises(UsageError, match="`bloom` model .*ALiBi.*Disable prompt_sharing"):
                DPOTrainer(
                    BloomForCausalLM(config),
                    ref_model=make_model(),
                    args=dpo_args(bf16=False),
                    train_dataset=dataset,
                    processing_class=tokenizer,
                )
        else:
            eq.assert_refused(build, case)


def test_the_end_line_is_words_and_says_when_nothing_was_shared(build):
    """Issue 41, point 5, as a user meets it: after `train()` the end line says in words what sharing computed
    (the figures those of `counts()`); a trainer that shared no scoring call says it did nothing."""
    with trl_ext.install(prompt_sharing=True):
        idle = build()
        assert _state(idle).summary() == "did nothing: no scoring call was shared"
        shared = build(max_steps=1)
        shared.train()
    counts = _state(shared).counts()
    line = _state(shared).summary()
    assert "{" not in line and "'" not in line, line
    saved = 1 - counts["shared_tokens"] / counts["padded_tokens"]
    assert line.startswith(
        f"{counts['shared_calls']} scoring calls shared their prompts: {counts['sequences']} sequences, "
        f"{counts['padded_tokens']} padded tokens computed as {counts['shared_tokens']} ({saved:.0%} fewer)"
    ), line
    assert counts["shared_calls"] == 2 and 0 < counts["shared_tokens"] < counts["padded_tokens"]
