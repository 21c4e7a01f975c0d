"""Random numbers a model draws in training mode (`trl_ext.toolkit.randomness`): found by the generator they
advance, named by layer, and acted on by the packing plugins. PhiMoE's router samples its experts in training
(`sparsemixer`), which is not dropout; padding_free trains it with one notice that says what equals stock and what
does not, prompt_sharing refuses it naming the router. The self-checks run in the mode training uses."""

from __future__ import annotations

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from trl_ext import UsageError
from trl_ext.toolkit.randomness import random_draws, training_draws

_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)


def _phimoe(vocab: int = 128, seed: int = 0, pad: int = 0):
    """A tiny float64 PhiMoE (4 experts, top-2). `router_aux_loss_coef=0`: transformers' PhiMoE reads a
    `config.num_experts` it does not have when the auxiliary loss is on (research note equivalence_floors.md)."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    config = PhimoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.0, pad_token_id=pad, bos_token_id=2, eos_token_id=1, sliding_window=None,
    )  # fmt: skip
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    return eq.sharpen(PhimoeForCausalLM(config).to(torch.float64)).eval()  # eval, as `from_pretrained` gives it


def _llama(vocab: int = 128, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(seed)
    return eq.sharpen(LlamaForCausalLM(config).to(torch.float64)).eval()


# -------------------------------------------------------------------------------------------------------------------
# The detector
# -------------------------------------------------------------------------------------------------------------------


def test_phimoe_router_draws_in_training_mode_only():
    """PhiMoE's routers advance the generator in training mode (Gumbel sampling, the random Heun mask), even where
    no two experts tie and the draws leave the values unchanged; in eval mode nothing is drawn."""
    model = _phimoe().eval()
    draws = training_draws(model)
    assert [(d.name, d.cls, d.dropout) for d in draws] == [
        (f"model.layers.{i}.mlp.router", "PhimoeTopKRouter", False) for i in range(2)
    ]
    assert not model.training  # modes restored
    ids = torch.randint(3, 128, (2, 8))
    assert random_draws(model, lambda: model(input_ids=ids), training=False) == []


def test_a_deterministic_model_draws_nothing_and_dropout_is_named_dropout():
    model = _llama()
    assert training_draws(model) == []
    model.model.layers[1].mlp.register_forward_hook(
        lambda module, args, out: torch.nn.functional.dropout(out, 0.1, training=module.training)
    )  # dropout applied outside any dropout module: attributed to the layer that ran it
    assert [d.name for d in training_draws(model)] == ["model.layers.1.mlp"]
    from transformers import OPTConfig, OPTForCausalLM

    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                   num_attention_heads=2, word_embed_proj_dim=16, dropout=0.1))  # fmt: skip
    draws = training_draws(opt)
    assert [(d.cls, d.dropout) for d in draws] == [("OPTDecoderLayer", True)]  # functional `config.dropout`


def test_the_generator_state_of_the_caller_is_kept():
    model = _phimoe()
    torch.manual_seed(5)
    before = torch.get_rng_state()
    training_draws(model)
    assert torch.equal(before, torch.get_rng_state())


# -------------------------------------------------------------------------------------------------------------------
# padding_free: a notice naming the router; equal to stock where nothing is drawn
# -------------------------------------------------------------------------------------------------------------------


def _trainer(model_fn, dpo_args, tokenizer, **args):
    from trl import DPOTrainer

    from trl_ext.testing import make_preference_dataset

    vocab, pad = len(tokenizer), tokenizer.pad_token_id
    return DPOTrainer(
        model_fn(vocab=vocab, seed=0, **({"pad": pad} if model_fn is _phimoe else {})),
        ref_model=model_fn(vocab=vocab, seed=1, **({"pad": pad} if model_fn is _phimoe else {})),
        args=dpo_args(bf16=False, optim="sgd", max_grad_norm=0.0, **args),
        train_dataset=make_preference_dataset(8, seed=0),
        processing_class=tokenizer,
    )


def test_padding_free_trains_phimoe_with_a_notice_and_equals_stock_without_draws(dpo_args, tokenizer, caplog):
    """PhiMoE under padding_free: one warning names the routers, says the training steps are not equal to stock
    step for step and what is; the self-check (`self_check: true`) runs in eval mode, where nothing is drawn; and
    there the packed log-probs, loss and gradients equal stock TRL's in float64."""
    stock = _trainer(_phimoe, dpo_args, tokenizer)
    with trl_ext.install(padding_free=True, plugins={"padding_free": {"self_check": True}}):
        with caplog.at_level("INFO", logger="trl_ext"):
            packed = _trainer(_phimoe, dpo_args, tokenizer)
        state = packed._trl_ext.state["padding_free"]
        notices = [r.getMessage() for r in caplog.records if "draws random numbers" in r.getMessage()]
        assert len(notices) == 1
        assert "`model.layers.0.mlp.router` (PhimoeTopKRouter)" in notices[0]
        assert "not equal to stock's step for step" in notices[0] and "is equal to stock" in notices[0]
        assert [d.cls for d in state.random_draws["policy"]] == ["PhimoeTopKRouter"] * 2
        assert "ref" not in state.random_draws  # the reference model runs in the eval mode it was given
        assert "PhimoeForCausalLM, `phimoe`, torch.float64, eval mode" in caplog.text
        stock.model.eval()
        packed.model.eval()
        eq.compare(
            stock, packed, eq.examples(stock, 4), batch_key="trl_ext_packing", calls=lambda: state.packed_calls,
            misses=lambda: state.unpacked_calls, logps_rtol=1e-6, loss_rtol=1e-6, grad_rtol=1e-6,
        )  # fmt: skip


def test_a_reference_model_given_in_training_mode_is_checked_in_training_mode(dpo_args, tokenizer, caplog):
    """TRL never changes a separate reference model's mode: one given in training mode samples its experts when it
    scores, so it gets the notice (padding_free) or the refusal (prompt_sharing) as well."""
    from trl import DPOTrainer

    from trl_ext.testing import make_preference_dataset

    def build():
        vocab, pad = len(tokenizer), tokenizer.pad_token_id
        return DPOTrainer(
            _llama(vocab=vocab), ref_model=_phimoe(vocab=vocab, seed=1, pad=pad).train(), args=dpo_args(bf16=False),
            train_dataset=make_preference_dataset(8, seed=0), processing_class=tokenizer,
        )  # fmt: skip

    with trl_ext.install(padding_free=True):
        with caplog.at_level("INFO", logger="trl_ext"):
            trainer = build()
    assert set(trainer._trl_ext.state["padding_free"].random_draws) == {"ref"}
    assert "the ref model (PhimoeForCausalLM, `phimoe`) draws random numbers" in caplog.text
    with trl_ext.install(prompt_sharing=True):
        with pytest.raises(
            UsageError, match=r"`phimoe` model \(ref model PhimoeForCausalLM\): its forward draws random"
        ):
            build()


def test_padding_free_self_check_runs_a_deterministic_policy_in_training_mode(dpo_args, tokenizer, caplog):
    with trl_ext.install(padding_free=True, plugins={"padding_free": {"self_check": True}}):
        with caplog.at_level("INFO", logger="trl_ext"):
            trainer = _trainer(_llama, dpo_args, tokenizer)
    assert "for the policy model (LlamaForCausalLM, `llama`, torch.float64, training mode)" in caplog.text
    assert "for the ref model (LlamaForCausalLM, `llama`, torch.float64, eval mode)" in caplog.text
    assert "draws random numbers" not in caplog.text
    assert trainer._trl_ext.state["padding_free"].random_draws == {}


def test_padding_free_self_check_in_training_mode_sees_a_training_only_leak():
    """A layer that mixes the row only in training mode (here: a hook that adds the row's mean in training) is
    invisible to an eval-mode self-check; run in training mode, as the policy trains, the self-check names it."""
    from trl_ext.plugins import padding_free as pf
    from trl_ext.plugins.padding_free.selfcheck import self_check

    model = _llama()
    mlp = model.model.layers[0].mlp
    mlp.register_forward_hook(lambda m, a, out: out + out.mean(dim=(0, 1), keepdim=True) if m.training else out)
    state = pf.PaddingFreeState()
    with _packed(model, state) as forward:
        assert self_check(model, forward, lengths=(12, 9, 11), training=False).leak is None
        leak = self_check(model, forward, lengths=(12, 9, 11), training=True).leak
    assert leak is not None and "model.layers.0.mlp (LlamaMLP)" in leak


def _packed(model, state):
    from tests.plugins import sweep

    return sweep.packed_forward(model, state)


# -------------------------------------------------------------------------------------------------------------------
# prompt_sharing: refused, naming the router
# -------------------------------------------------------------------------------------------------------------------


def test_prompt_sharing_refuses_phimoe_naming_its_router(dpo_args, tokenizer):
    with trl_ext.install(prompt_sharing=True):
        with pytest.raises(UsageError) as refusal:
            _trainer(_phimoe, dpo_args, tokenizer)
    message = str(refusal.value)
    assert "draws random numbers in training mode" in message
    assert "`model.layers.0.mlp.router` (PhimoeTopKRouter)" in message and "samples" in message
    assert "one random sample" in message
