"""prompt_sharing on `OnlineDPOTrainer`: the scoring forwards over generated completions share each prompt and equal
stock Online DPO at the same completions.

Generation is replaced, on both trainers, by one stored batch (left-padded prompts repeated twice as TRL does, and
completions of different lengths, padded after their end), so both score exactly the same tokens; the models are
float64 and the optimizer SGD. Tolerances as in test_prompt_sharing.py (Llama's RMSNorm runs in float32).
"""

from __future__ import annotations

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from tests.helpers import ONLINE_GRAD_RTOL as GRAD_RTOL
from tests.helpers import ONLINE_LOGPS_RTOL as LOGPS_RTOL
from tests.helpers import online_step as _step
from trl_ext.testing import length_reward, make_model, make_prompt_dataset


@pytest.fixture
def build(online_build):
    return online_build


@pytest.mark.parametrize("max_length", [None, 12])
def test_training_step_equals_stock(build, max_length, monkeypatch):
    """One training step (policy and reference scoring, the loss, the backward), prompts shared; with `max_length=12`
    TRL cuts the prompts on the left first (the same columns for every row, so they still share). The self-check is
    forced on (the model type is verified). The completion log-probs come from the packed logits: no shared call
    unpacks its outputs into padded logits."""
    from trl_ext.plugins.prompt_sharing import forward

    kwargs = {} if max_length is None else {"max_length": max_length}
    stock = build(**kwargs)
    with trl_ext.install(prompt_sharing=True, plugins={"prompt_sharing": {"self_check": True}}):
        shared = build(**kwargs)
        assert "prompt_sharing" in shared._trl_ext.enabled
        unpacked = []
        original_unpack = forward.repad_outputs  # how the shared causal-LM forward unpacks its outputs
        monkeypatch.setattr(forward, "repad_outputs", lambda *a: unpacked.append(1) or original_unpack(*a))
        prompt_ids, prompt_mask, completion_ids, completion_mask = eq.online_generation()
        # TRL's own per-token log-probs of the completions, from the wrapped `_forward`
        a = stock._forward(stock.model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        b = shared._forward(shared.model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        real = completion_mask.bool()
        assert (a[real] - b[real]).abs().max().item() <= LOGPS_RTOL * a[real].abs().max().item()
        stock_loss, stock_grads = _step(stock)
        shared_loss, shared_grads = _step(shared)
        state = shared._trl_ext.state["prompt_sharing"]
        assert state.shared_calls >= 3 and state.unshared_rows == 0 and state.unshared_calls == 0
        if max_length is None:
            # per call: each prompt's first P - 1 tokens once, then per completion the last prompt token and all 6
            # completion columns (the padding after an end too: TRL logs metrics over it)
            per_call = sum(p - 1 for p in (5, 9, 2)) + 6 * (1 + 6)
            assert state.shared_tokens == state.shared_calls * per_call
        assert state.checked == {"policy", "ref"}  # the self-check ran on both models, before the step
        assert not unpacked
    assert shared_loss.item() == pytest.approx(stock_loss.item(), rel=1e-9)
    eq.assert_same_grads(stock_grads, shared_grads, GRAD_RTOL)


def test_train_logs_equal_stock(build):
    """Two SGD steps through `trainer.train()`: every logged metric equal."""
    stock = build(max_steps=2)
    stock.train()
    with trl_ext.install(prompt_sharing=True):
        shared = build(max_steps=2, gradient_checkpointing=True)
        shared.train()
    logs = [[h for h in t.state.log_history if "loss" in h] for t in (stock, shared)]
    assert len(logs[0]) == len(logs[1]) == 2
    eq.assert_same_logs(*logs, rel=1e-6, abs=1e-6)


def test_peft_reference_is_adapter_disabled_model(build):
    stock = build(ref=False, peft_config=eq.lora())
    with trl_ext.install(prompt_sharing=True):
        shared = build(ref=False, peft_config=eq.lora())
        stock_loss, stock_grads = _step(stock)
        shared_loss, shared_grads = _step(shared)
        assert shared._trl_ext.state["prompt_sharing"].shared_calls >= 2
    assert shared_loss.item() == pytest.approx(stock_loss.item(), rel=1e-9)
    eq.assert_same_grads(stock_grads, shared_grads, GRAD_RTOL)


def test_generation_is_not_shared(online_dpo_args, tokenizer):
    """Real generation runs untouched (cache, left-padded mask): the same completions as stock, greedy."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    def make():
        return OnlineDPOTrainer(
            model=make_model(),
            reward_funcs=length_reward,
            args=online_dpo_args(bf16=False, generation_kwargs={"do_sample": False}),
            train_dataset=make_prompt_dataset(4),
            processing_class=tokenizer,
        )

    prompts = [[{"role": "user", "content": "w1 w2 w3"}], [{"role": "user", "content": "w4"}]]
    stock = make()
    expected = stock._generate(stock.model, prompts)
    with trl_ext.install(prompt_sharing=True):
        shared = make()
        got = shared._generate(shared.model, prompts)
        assert shared._trl_ext.state["prompt_sharing"].shared_calls == 0
    for x, y in zip(expected[:4], got[:4], strict=True):
        assert torch.equal(x, y)


def test_unverified_model_type_is_admitted_by_the_self_check(build):
    """A model type outside the verified table (TRL's `test_trust_remote_code` case for Online DPO) is admitted
    through the self-check before the first step, and its training step then equals stock."""
    stock = build()
    with trl_ext.install(prompt_sharing=True):
        shared = build(model_type="my_custom_llama")
        state = shared._trl_ext.state["prompt_sharing"]
        assert state.checked == {"policy", "ref"} and state.self_checks["policy"].failure is None
        stock_loss, stock_grads = _step(stock)
        shared_loss, shared_grads = _step(shared)
        assert state.shared_calls >= 2 and state.unshared_calls == 0
    assert shared_loss.item() == pytest.approx(stock_loss.item(), rel=1e-9)
    eq.assert_same_grads(stock_grads, shared_grads, GRAD_RTOL)


@pytest.mark.parametrize("case", ["bloom", "falcon_alibi", "flex_attention", "self_check"])
def test_refusal_advice_works_for_online_dpo(online_dpo_args, tokenizer, build, monkeypatch, case):
    """On an OnlineDPOTrainer no refusal advises padding_free (it does not apply to Online DPO): each one says to
    disable prompt_sharing, which runs stock Online DPO (or names a setting that shares)."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    from trl_ext import UsageError

    with trl_ext.install(prompt_sharing=True):
        with pytest.raises(UsageError) as refused:
            if case == "bloom":
                from transformers import BloomConfig, BloomForCausalLM

                config = BloomConfig(vocab_size=256, hidden_size=32, n_layer=1, n_head=4, pad_token_id=0)
                model = BloomForCausalLM(config)
            elif case == "falcon_alibi":  # refused by padding_free's inspection, whose advice is about padding_free
                from transformers import FalconConfig, FalconForCausalLM

                config = FalconConfig(
                    vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, alibi=True,
                    pad_token_id=0,
                )  # fmt: skip
                model = FalconForCausalLM(config)
            elif case == "flex_attention":
                model = make_model(attn_implementation="flex_attention")
            if case != "self_check":
                OnlineDPOTrainer(
                    model=model,
                    reward_funcs=length_reward,
                    args=online_dpo_args(bf16=False),
                    train_dataset=make_prompt_dataset(6),
                    processing_class=tokenizer,
                )
            else:  # a shared attention that lets a completion see the other: the self-check refuses it
                from trl_ext.plugins.prompt_sharing import attention

                original = attention._attend
                monkeypatch.setattr(
                    attention, "_attend", lambda b, m, q, k, v, offset, *a: original(b, m, q, k, v, 0, *a)
                )
                build(model_type="my_custom_llama")
    message = str(refused.value)
    assert "padding_free" not in message, message
    assert "Online DPO then scores padded" in message, message
    if case == "flex_attention":
        assert 'attn_implementation="sdpa"' in message


@pytest.mark.parametrize("trailing_padding", [True, False])
def test_online_score_equals_unpacked_logits(trailing_padding):
    """`OnlineScore` (TRL's completion log-probs from the packed logits) against TRL's steps on the unpacked padded
    logits, values and gradients, float64: rows that are runs of the packed row (split, the Online DPO layout) and
    rows with positions the packed row does not compute (gathered, zero logits there)."""
    from types import SimpleNamespace

    from trl_ext.plugins.prompt_sharing.forward import OnlineScore, _row_runs
    from trl_ext.plugins.prompt_sharing.layout import build_layout, unpack
    from trl_ext.toolkit.packing.positions import PackedPositions

    prompt_ids, prompt_mask, completion_ids, completion_mask = eq.online_generation()
    ids, mask = torch.cat((prompt_ids, completion_ids), 1), torch.cat((prompt_mask, completion_mask), 1)
    p, vocab = prompt_ids.size(1), 11
    layout = build_layout(ids, mask, [p] * ids.size(0), trailing_padding=trailing_padding)
    positions = PackedPositions(layout.rows, layout.length, layout.real_flat, layout.real_shared)
    packed_len = int(layout.real_shared.max()) + 1
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, packed_len, vocab, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(completion_ids.shape, dtype=torch.float64, generator=g)
    targets = completion_ids % vocab

    padded = unpack(logits, layout)[:, p - 1 : -1]
    expected = torch.take_along_dim(padded.log_softmax(-1), targets.unsqueeze(-1), dim=2).squeeze(-1)
    (expected_grad,) = torch.autograd.grad((expected * weight).sum(), logits)
    outputs = SimpleNamespace(logits=logits)
    score = OnlineScore(targets, ids.size(1), p - 1, -1)
    assert score.accepts(outputs, positions)
    score.capture(positions)
    assert score.calls == 1 and not score.accepts(outputs, positions)
    scored = score.finish(outputs.logits)
    (grad,) = torch.autograd.grad((scored * weight).sum(), logits)

    split = _row_runs(positions.index()[:, p - 1 : -1]) is not None
    assert split == trailing_padding  # without the padding computed, rows have positions the packed row lacks
    torch.testing.assert_close(scored, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)
