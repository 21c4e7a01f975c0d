"""patches/0001-dpo-padding-free.patch: TRL's native `DPOConfig(padding_free=True)` equals padded TRL, and the plugin.

Runs only against the patched TRL (`TRL_EXT_PATCHED_TRL=1`, see conftest.py and patches/check.sh). Three trainers on
the same weights and the same examples:

- stock: the same (patched) TRL with `padding_free=False`, i.e. TRL's padded code path, unchanged by the patch;
- native: `DPOConfig(padding_free=True)`, the patch's packed collator and `_compute_loss`, no trl-ext installed;
- plugin: `trl_ext.install(padding_free=True)` with `DPOConfig(padding_free=False)` (when the plugin exists).

Compared: per-sequence chosen/rejected log-probs, the loss and the gradients for every loss type and loss option, and
the metrics logged by `train()` and `evaluate()`.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests import equivalence as eq
from tests.equivalence import TRL_LOSS_TYPES
from trl_ext.testing import make_model, make_preference_dataset

# fp32: per-sequence summed log-probs agree to float32 summation noise (~1e-7 relative). A packing bug (a token scored
# from the wrong sequence, a position off by one, attention across sequences) moves them by more than 1e-2.
LOGPS_RTOL = 1e-5
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4  # max |grad diff| relative to max |grad|

# Loss options as `DPOTrainer.__init__` stores them from `DPOConfig` (trl 1.16.0): each case sets them on both
# trainers, which runs TRL's real `_compute_loss` for every case without building a trainer per case.
LOSS_CASES = [{"loss_types": [t]} for t in TRL_LOSS_TYPES]
LOSS_CASES += [{"loss_types": ["exo_pair"], "label_smoothing": 1e-3}, *eq.LOSS_OPTION_CASES]
LOSS_CASES += [
    {"loss_types": ["sigmoid_norm", "bco_pair"], "use_weighting": True, "ld_alpha": 0.5, "loss_weights": [0.7, 0.3]},
]


def _plugin_available() -> bool:
    from trl_ext.manager import builtin_plugin_modules

    return "padding_free" in builtin_plugin_modules()


@pytest.fixture(scope="module")
def dataset():
    return make_preference_dataset(16, seed=0)


@pytest.fixture
def build(dpo_args, tokenizer, dataset):
    """Build a DPOTrainer: policy seed 0, reference seed 1 (unless PEFT or precompute), both from `make_model`."""
    return eq.dpo_builder(dpo_args, tokenizer, dataset, sharpened=False)


def _assert_packed(batch) -> None:
    """The native padding-free batch: one row, no attention mask, positions restarting per sequence."""
    assert "attention_mask" not in batch
    assert batch["input_ids"].shape[0] == 1 and batch["position_ids"].shape == batch["input_ids"].shape
    assert batch["cu_seq_lens_q"][-1].item() == batch["input_ids"].shape[1]


def _compare(expected, actual, examples, logps=True):
    """Per-sequence logps, loss and gradients of two trainers on the same examples, each with its own collator."""
    expected_batch = expected.data_collator(examples)
    actual_batch = actual.data_collator(examples)
    if logps:  # `compute_ref_log_probs(model, batch)` is TRL's own per-sequence scoring (the precompute's)
        expected_logps = expected.compute_ref_log_probs(expected.model, expected_batch)
        actual_logps = actual.compute_ref_log_probs(actual.model, actual_batch)
        for a, b in zip(expected_logps, actual_logps, strict=True):
            assert a.shape == b.shape == (len(examples),)
            assert eq.max_rel(b, a) <= LOGPS_RTOL
    expected_loss, expected_grads = eq.loss_and_grads(expected, expected_batch)
    actual_loss, actual_grads = eq.loss_and_grads(actual, actual_batch)
    assert abs(actual_loss.item() - expected_loss.item()) <= LOSS_RTOL * max(1.0, abs(expected_loss.item()))
    eq.assert_same_grads(expected_grads, actual_grads, GRAD_RTOL)
    return expected_batch, actual_batch


def _set_loss(trainer, case):
    trainer.loss_types = case["loss_types"]
    trainer.loss_weights = case.get("loss_weights", [1.0] * len(case["loss_types"]))
    # exo_pair is infinite without label smoothing (TRL refuses it in `__init__`)
    trainer.label_smoothing = case.get("label_smoothing", 1e-3 if "exo_pair" in case["loss_types"] else 0.0)
    trainer.ld_alpha = case.get("ld_alpha")
    trainer.use_weighting = case.get("use_weighting", False)


def _train_logs(trainer):
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


def _assert_same_logs(expected: list[dict], actual: list[dict]) -> None:
    assert len(expected) == len(actual) > 0
    for e, a in zip(expected, actual, strict=True):
        assert e.keys() == a.keys()
        for key in e:
            if key.endswith("runtime") or key.endswith("per_second"):
                continue
            assert a[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), key


# ---------------------------------------------------------------------------------------------------------------------
# The patch is applied
# ---------------------------------------------------------------------------------------------------------------------


def test_trl_is_patched():
    """Fails (never skips) when run against a TRL without 0001-dpo-padding-free.patch."""
    from trl import DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    assert "temporarily unavailable" not in inspect.getsource(DPOTrainer.__init__), "TRL is not patched (0001)"
    assert "padding_free" in DataCollatorForPreference.__dataclass_fields__


def test_native_flag_is_honoured(build, caplog):
    from trl_ext.installation import Installation

    native = build(padding_free=True)
    assert Installation._active is None or not Installation._active.installed  # TRL alone, no trl-ext involved
    assert native.padding_free is True and native.data_collator.padding_free is True
    assert "temporarily unavailable" not in caplog.text
    _assert_packed(native.data_collator(eq.examples(native)))


# ---------------------------------------------------------------------------------------------------------------------
# Native padding-free == stock padded TRL
# ---------------------------------------------------------------------------------------------------------------------


def test_every_loss_type_and_option(build):
    # exo_pair needs label_smoothing > 0 at construction; use_weighting=True makes the fused head return
    # `log_sum_sq_probs` so every case below can turn WPO weighting on or off.
    kwargs = dict(use_weighting=True, label_smoothing=1e-3, loss_type=["exo_pair"])
    stock = build(**kwargs)
    native = build(padding_free=True, **kwargs)
    examples = eq.examples(stock)
    stock_batch, native_batch = _compare(stock, native, examples)
    assert stock_batch["attention_mask"].eq(0).float().mean() > 0.3  # the padded batch is mostly padding
    _assert_packed(native_batch)
    assert native_batch["input_ids"].shape[1] == stock_batch["attention_mask"].sum()
    compare = lambda: _compare(stock, native, examples, logps=False)  # noqa: E731
    eq.assert_every_loss_case((stock, native), compare, LOSS_CASES, set_loss=_set_loss)


@pytest.mark.parametrize("config", [{"ld_alpha": 0.5}, {"use_weighting": True, "loss_type": ["sigmoid", "ipo"]}])
def test_loss_options_from_config(build, config):
    """`ld_alpha` and `use_weighting` set through `DPOConfig` (the precompute path and the fused head's outputs)."""
    stock = build(**config)
    native = build(padding_free=True, **config)
    _compare(stock, native, eq.examples(stock))


def test_keep_end_truncation_first_token_is_completion(build):
    """`truncation_mode="keep_end"` cuts whole prompts, so a sequence can start with a completion token. In the packed
    row, that token must not be scored from the previous sequence's last token, and `ipo`/`sigmoid_norm`, which count
    the completion tokens of the unshifted mask, must count it like padded TRL does."""
    data = eq.keep_end_data()
    kwargs = dict(train_dataset=data, max_length=10, truncation_mode="keep_end", loss_type=["ipo", "sigmoid_norm"])
    stock = build(**kwargs)
    native = build(padding_free=True, **kwargs)
    stock_batch, _ = _compare(stock, native, eq.examples(stock, 3))
    assert stock_batch["completion_mask"][:, 0].any() and stock_batch["attention_mask"].eq(0).any()


def test_sequences_are_isolated(build):
    """Changing one sequence of the packed row changes its log-prob and no other (no attention across sequences)."""
    native = build(padding_free=True)
    examples = eq.examples(native)
    base = torch.cat(native.compute_ref_log_probs(native.model, native.data_collator(examples)))
    changed = [dict(e) for e in examples]
    changed[2]["chosen_ids"] = [(t + 7) % 250 + 4 for t in changed[2]["chosen_ids"]]  # same length, other tokens
    changed[2]["prompt_ids"] = [(t + 3) % 250 + 4 for t in changed[2]["prompt_ids"]]
    after = torch.cat(native.compute_ref_log_probs(native.model, native.data_collator(changed)))
    # chosen 2 and rejected 2 share the changed prompt
    others = [i for i in range(len(base)) if i not in (2, 2 + len(examples))]
    assert (after[2] - base[2]).abs() > 1e-2
    assert torch.allclose(after[others], base[others], rtol=1e-6, atol=1e-5)


def test_train_and_evaluate_metrics(build, dataset):
    """Three optimizer steps + evaluate: same losses and logged metrics; `num_tokens` counts real tokens exactly."""
    kwargs = dict(max_steps=3, eval_dataset=dataset.select(range(8)))
    stock = build(**kwargs)
    stock_logs, stock_eval = _train_logs(stock), stock.evaluate()
    native = build(padding_free=True, gradient_checkpointing=True, **kwargs)
    native_logs, native_eval = _train_logs(native), native.evaluate()
    assert len(stock_logs) == 3
    _assert_same_logs([*stock_logs, stock_eval], [*native_logs, native_eval])
    assert native_logs[-1]["num_tokens"] == stock_logs[-1]["num_tokens"]


def test_precompute_ref_log_probs(build):
    """`precompute_ref_log_probs=True` without a reference model: the precompute runs on packed batches."""
    stock = build(ref=False, precompute_ref_log_probs=True)
    native = build(ref=False, precompute_ref_log_probs=True, padding_free=True)
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        a, b = torch.tensor(stock.train_dataset[column]), torch.tensor(native.train_dataset[column])
        assert eq.max_rel(b, a) <= LOGPS_RTOL
    _compare(stock, native, eq.examples(stock))


def test_peft_lora_policy(build):
    """LoRA policy whose reference is the adapter-disabled base model: both forwards run packed."""
    from peft import LoraConfig

    def lora():
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)

    stock = build(ref=False, peft_config=lora())
    native = build(ref=False, peft_config=lora(), padding_free=True)
    _compare(stock, native, eq.examples(stock))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_qwen2_attention_implementations(build, attn):
    model_kwargs = {"arch": "qwen2", "attn_implementation": attn}
    stock = build(model_kwargs=model_kwargs)
    native = build(padding_free=True, model_kwargs=model_kwargs)
    _compare(stock, native, eq.examples(stock))


# ---------------------------------------------------------------------------------------------------------------------
# Native padding-free == the trl-ext plugin
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def plugin_build(build):
    if not _plugin_available():
        pytest.fail("trl-ext has no built-in plugin 'padding_free': nothing to compare the patch with")

    def make(**kwargs):
        import trl_ext

        # DPOConfig(padding_free=False): the patched TRL then pads, and the plugin packs from the outside. (With
        # padding_free=True the patched TRL would pack by itself, and the plugin would see a batch without padding.)
        installation = trl_ext.install(padding_free=True)
        return installation, build(**kwargs)

    return make


# The plugin is compared with stock TRL for every loss type in tests/plugins/test_padding_free.py; here the native
# patch is compared with the plugin on the cases that read the per-token outputs in different ways.
PLUGIN_LOSS_CASES = [case for case in LOSS_CASES if len(case) > 1 or case["loss_types"] in (["ipo"], ["sft"])]


def test_equals_plugin_loss_options(build, plugin_build):
    kwargs = dict(use_weighting=True, label_smoothing=1e-3, loss_type=["exo_pair"])
    native = build(padding_free=True, **kwargs)
    installation, plugin = plugin_build(**kwargs)
    try:
        assert plugin.padding_free is False and "padding_free" in plugin._trl_ext.enabled
        examples = eq.examples(native)
        _compare(plugin, native, examples)
        compare = lambda: _compare(plugin, native, examples, logps=False)  # noqa: E731
        eq.assert_every_loss_case((plugin, native), compare, PLUGIN_LOSS_CASES, set_loss=_set_loss, every_type=False)
    finally:
        installation.uninstall()


def test_equals_plugin_train_and_evaluate(build, plugin_build, dataset):
    kwargs = dict(max_steps=3, eval_dataset=dataset.select(range(8)))
    native = build(padding_free=True, **kwargs)
    native_logs, native_eval = _train_logs(native), native.evaluate()
    installation, plugin = plugin_build(**kwargs)
    try:
        plugin_logs, plugin_eval = _train_logs(plugin), plugin.evaluate()
    finally:
        installation.uninstall()
    _assert_same_logs([*plugin_logs, plugin_eval], [*native_logs, native_eval])


# ---------------------------------------------------------------------------------------------------------------------
# Refusals: combinations the patch cannot do correctly raise ValueError
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pad_to_multiple_of": 8}, "pad_to_multiple_of"),
        ({"accelerator_config": {"dispatch_batches": True}}, "dispatch_batches"),
        ({"accelerator_config": {"split_batches": True}}, "split_batches"),
    ],
)
def test_refusals(build, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build(padding_free=True, **kwargs)


def test_refuses_custom_collator(dpo_args, tokenizer, dataset):
    from trl import DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    with pytest.raises(ValueError, match="custom data collator"):
        DPOTrainer(
            make_model(),
            ref_model=make_model(seed=1),
            args=dpo_args(padding_free=True),
            data_collator=DataCollatorForPreference(pad_token_id=0),
            train_dataset=dataset,
            processing_class=tokenizer,
        )


def test_refuses_prompt_learning_peft(build):
    from peft import PromptTuningConfig

    with pytest.raises(ValueError, match="prompt-learning"):
        peft_config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
        build(ref=False, padding_free=True, peft_config=peft_config)
