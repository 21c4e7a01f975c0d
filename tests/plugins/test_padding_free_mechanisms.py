"""padding_free on the attention mechanisms the verified table did not cover: ALiBi (Bloom, MPT; Falcon's is
refused), Falcon's own rotary multi-query attention, windows that live only in the mask (PhiMoE), chunked attention
(Llama-4), attention computed outside transformers' attention interface (GPT-NeoX-Japanese, OpenAI-GPT), dynamic
masks (Doge), looped layers (Dory), and the names inspection gives to what it refuses.

Each model is a tiny float64 model built from its config. "Exact" means the plugin's packed forward gives the same
loss (weighted per-sequence log-probs, plus the MoE auxiliary loss) and the same gradients as the stock padded
forward, within 1e-6 relative; "refused" means `inspect_model` names the layer and the mechanism before any step.
Sequences are longer than every window and chunk (13 and 7 tokens, longer than the self-check's old 11-token probe),
so a window or chunk lost in the packed row shows in the numbers.
"""

from __future__ import annotations

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from tests import helpers
from tests.plugins import sweep
from trl_ext import UsageError
from trl_ext.plugins.padding_free.hooks import VERIFIED_MODEL_TYPES, inspect_model

REL = 1e-6
WINDOW = 13  # > 11, the longest sequence of the old self-check probe
CHUNK = 7
# Right-padded rows; each sequence has a real token in the last window/chunk of the padded row, so that no padded
# query row is fully masked in the stock forward (fully masked rows are NaN in fp64 eager/SDPA and poison the grads).
LENGTHS = (30, 20, 25, 30)
CHUNK_LENGTHS = (30, 29, 30, 29)
_BASE = dict(vocab_size=128, max_position_embeddings=128, pad_token_id=0, bos_token_id=2, eos_token_id=1)

_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)


def _tiny(model_type: str, impl: str = "sdpa", **overrides):
    """A float64 model of `model_type` from its config: 2 layers, hidden 32, 4 heads, LM head sharpened."""
    from transformers import AutoConfig, AutoModelForCausalLM

    aliases = dict(n_layer=2, n_head=4, n_embd=32, d_model=32, n_heads=4, n_layers=2)  # the same, other names
    moe = dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5, output_router_logits=True)
    sizes = {**helpers.TINY_SIZES, **aliases, **moe}
    default = AutoConfig.for_model(model_type)
    kwargs = {k: v for k, v in {**_BASE, **sizes}.items() if hasattr(default, k)}
    config = AutoConfig.for_model(model_type, **{**kwargs, **overrides})
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float64).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def _loss_and_grads(model, forward, ids, mask):
    model.zero_grad(set_to_none=True)
    moe = hasattr(model.config, "output_router_logits") and getattr(model.config, "num_local_experts", 0) > 1
    out = forward(
        input_ids=ids, attention_mask=mask, use_cache=False, **({"output_router_logits": True} if moe else {})
    )
    logps = out.logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    per_seq = torch.where(mask[:, 1:].bool(), logps, 0.0).sum(1)
    weights = torch.linspace(0.5, 1.5, ids.shape[0], dtype=per_seq.dtype)
    loss = -(per_seq * weights).sum() / mask.sum()
    aux = getattr(out, "aux_loss", None) if moe else None
    if aux is not None:
        loss = loss + 0.5 * aux
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), None if aux is None else aux.item(), grads


def _packed_forward(model, state, limit=None):
    """The plugin's packed causal-LM forward for `model`, as `_configure_model` sets it up (varlen attention
    registered, backbone wrapped), with the row `limit` given (none by default); undone on exit."""
    return sweep.packed_forward(model, state, limit, install=False)


def _assert_packs_exactly(model, lengths=LENGTHS):
    from trl_ext.plugins import padding_free as pf

    inspection = inspect_model(model)
    assert inspection.refusal is None, inspection.refusal
    ids, mask = sweep.padded_batch(model.config.vocab_size, lengths)
    stock_loss, stock_aux, stock_grads = _loss_and_grads(model, model.forward, ids, mask)
    state = pf.PaddingFreeState()
    with _packed_forward(model, state) as forward:
        loss, aux, grads = _loss_and_grads(model, forward, ids, mask)
    assert state.packed_calls == 1
    assert abs(loss - stock_loss) <= REL * max(1.0, abs(stock_loss)), (loss, stock_loss)
    assert (aux is None) == (stock_aux is None)
    if aux is not None:
        assert abs(aux - stock_aux) <= REL * max(1.0, abs(stock_aux)), (aux, stock_aux)
    eq.assert_same_grads(stock_grads, grads, REL)
    return inspection


def _refusal(model) -> str:
    refusal = inspect_model(model).refusal
    assert refusal is not None
    return refusal


# -------------------------------------------------------------------------------------------------------------------
# ALiBi and Falcon
# -------------------------------------------------------------------------------------------------------------------

ALIBI = [
    pytest.param("bloom", "eager", {}, id="bloom"),
    pytest.param("mpt", "eager", {}, id="mpt"),
]


@pytest.mark.parametrize(("model_type", "impl", "extra"), ALIBI)
def test_alibi_packs_exactly(model_type, impl, extra):
    """Within one packed sequence the ALiBi bias differs from the padded one by a per-query constant (it grows with
    the key's index in the row), which softmax ignores; the model's own attention gets the per-sequence mask."""
    inspection = _assert_packs_exactly(_tiny(model_type, impl, **extra))
    assert "alibi (per-sequence mask)" in inspection.mechanisms


def test_falcon_rotary_multi_query_packs_exactly():
    """Falcon's attention adds the mask itself (it raised `Tensor + NoneType` on the packed row without one)."""
    model = _tiny("falcon", "sdpa", multi_query=True)
    assert model.config.alibi is False
    _assert_packs_exactly(model)
    _assert_packs_exactly(_tiny("falcon", "sdpa", new_decoder_architecture=True, num_kv_heads=2))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_falcon_alibi_is_refused_naming_its_bfloat16_biases(impl):
    """Falcon builds its ALiBi biases as bfloat16 slopes times the key's index in the row: past 256 packed tokens
    they round differently from the padded batch's (a ~300-token packed DPO batch moved the attention gradients by
    1.5%)."""
    refusal = _refusal(_tiny("falcon", impl, alibi=True))
    assert "`transformer.h.0.self_attention` (FalconAttention) adds ALiBi biases" in refusal
    assert "computes in bfloat16 from each key's index in the row" in refusal


def test_bloom_in_16_bits_is_refused_naming_its_bias_dtype():
    refusal = _refusal(_tiny("bloom", "eager").to(torch.bfloat16))
    assert "`transformer.h.0.self_attention` (BloomAttention)" in refusal and "torch.bfloat16" in refusal


def test_mpt_packs_in_rows_no_longer_than_its_alibi_table():
    """MPT computes its ALiBi biases for rows of at most `max_seq_len` tokens: a batch of 105 real tokens with
    `max_seq_len=56` runs as two packed rows (30 + 20 | 25 + 30 tokens), each within the table, and equals the stock
    padded forward (loss, gradients) in float64; the batch within the limit runs as one packed row."""
    from trl_ext.plugins import padding_free as pf

    model = _tiny("mpt", "eager", max_seq_len=56)
    limit = pf.row_limit(model)
    assert limit == 56
    ids, mask = sweep.padded_batch(model.config.vocab_size, LENGTHS)
    info = pf.packing_metadata(mask)
    assert pf._row_groups(info, limit) == [(0, 2), (2, 4)]
    stock_loss, _, stock_grads = _loss_and_grads(model, model.forward, ids, mask)
    state = pf.PaddingFreeState()
    with _packed_forward(model, state, limit) as forward:
        loss, _, grads = _loss_and_grads(model, forward, ids, mask)
        assert state.packed_calls == 2
        short = mask.clone()
        short[:, 14:] = 0  # 4 x 14 = 56 tokens: one packed row
        forward(input_ids=ids, attention_mask=short, use_cache=False)
        assert state.packed_calls == 3
    assert abs(loss - stock_loss) <= REL * max(1.0, abs(stock_loss)), (loss, stock_loss)
    eq.assert_same_grads(stock_grads, grads, REL)


def test_mpt_row_longer_than_its_alibi_table_without_the_row_limit_is_refused():
    """Without the row limit (a wrapper that does not split), the attention refuses a packed row longer than the
    table instead of reading past it."""
    from trl_ext.plugins import padding_free as pf

    model = _tiny("mpt", "eager", max_seq_len=40)
    ids, mask = sweep.padded_batch(model.config.vocab_size, LENGTHS)
    model(input_ids=ids, attention_mask=mask, use_cache=False)  # padded: 30 <= 40, fine
    with _packed_forward(model, pf.PaddingFreeState()) as forward:
        with pytest.raises(UsageError, match=r"longer than this model's ALiBi bias table \(`max_seq_len=40`\)"):
            forward(input_ids=ids, attention_mask=mask, use_cache=False)


def test_mpt_through_a_dpo_trainer_with_batches_longer_than_its_table(dpo_args, tokenizer):
    """Through `trl.DPOTrainer` (float64, the self-check included, in training mode): an MPT whose `max_seq_len` is
    the longest sequence of the batch trains where stock trains (it was refused before the first step): packed
    log-probs, loss and gradients equal stock's, the batch split into several packed rows. Tolerances of MPT's float32
    attention softmax (as in `test_alibi_through_a_real_dpo_trainer_step`)."""
    from trl import DPOTrainer

    from trl_ext.testing import make_preference_dataset

    dataset = make_preference_dataset(8, seed=0)
    probe = DPOTrainer(
        _mpt(tokenizer, 0, 1024), ref_model=_mpt(tokenizer, 1, 1024), args=dpo_args(bf16=False),
        train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    batch = probe.data_collator(eq.examples(probe, 4))
    longest = int(batch["attention_mask"].sum(1).max())
    assert int(batch["attention_mask"].sum()) > 2 * longest  # at least three packed rows

    def build():
        args = dpo_args(bf16=False, per_device_train_batch_size=4, max_length=longest)
        policy, ref = _mpt(tokenizer, 0, longest), _mpt(tokenizer, 1, longest)
        return DPOTrainer(policy, ref_model=ref, args=args, train_dataset=dataset, processing_class=tokenizer)

    stock = build()
    with trl_ext.install(padding_free=True):
        packed = build()
        state = packed._trl_ext.state["padding_free"]
        assert state.self_checks["policy"].leak is None
        eq.compare(
            stock, packed, eq.examples(stock, 4), batch_key="trl_ext_packing", calls=lambda: state.packed_calls,
            misses=lambda: state.unpacked_calls, logps_rtol=1e-6, loss_rtol=1e-6, grad_rtol=1e-6,
        )  # fmt: skip
        assert state.packed_calls >= 3 * 2  # several packed rows per forward (reference log-probs, loss)


def _mpt(tokenizer, seed: int, max_seq_len: int):
    from transformers import AutoModelForCausalLM, MptConfig

    config = MptConfig(vocab_size=len(tokenizer), d_model=32, n_heads=4, n_layers=2, max_seq_len=max_seq_len)
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float64)
    return eq.sharpen(model)


@pytest.mark.parametrize("model_type", ["bloom", "mpt"])
def test_alibi_model_unchanged_outside_packed_calls(model_type):
    """Switched to the varlen attention, an unpacked forward (generation's, with a cache) of a model with its own
    attention is the stock one: the mask interface hands it transformers' eager mask."""
    from trl_ext.plugins import padding_free as pf

    model = _tiny(model_type, "eager")
    ids, mask = sweep.padded_batch(model.config.vocab_size, LENGTHS)
    stock = model(input_ids=ids, attention_mask=mask, use_cache=True).logits
    state = pf.PaddingFreeState()
    with _packed_forward(model, state):
        switched = model(input_ids=ids, attention_mask=mask, use_cache=True).logits  # with a cache: not packed
    assert state.packed_calls == 0
    real = mask.bool()
    assert torch.equal(switched[real], stock[real])


@pytest.mark.slow
def test_alibi_through_a_real_dpo_trainer_step(dpo_args, tokenizer):
    """MPT (ALiBi, its own attention) through `trl.DPOTrainer`, the self-check included: packed log-probs, loss and
    gradients equal stock, and two SGD steps log the same losses. In float32: MPT (like Bloom) takes its attention
    softmax in float32 whatever the model dtype, so packed and padded agree to float32 round-off (the float64 tests
    above measure 1e-6), beyond the self-check's float64 tolerance."""
    from trl import DPOTrainer

    from trl_ext.testing import make_preference_dataset

    dataset = make_preference_dataset(8, seed=0)

    def mpt(seed):
        from transformers import AutoModelForCausalLM, MptConfig

        config = MptConfig(vocab_size=len(tokenizer), d_model=32, n_heads=4, n_layers=2, max_seq_len=1024)
        config.pad_token_id = tokenizer.pad_token_id
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
        return eq.sharpen(model)

    def build():
        args = dpo_args(bf16=False, max_steps=2, optim="sgd", learning_rate=0.1, per_device_train_batch_size=4)
        return DPOTrainer(mpt(0), ref_model=mpt(1), args=args, train_dataset=dataset, processing_class=tokenizer)

    stock = build()
    with trl_ext.install(padding_free=True):
        packed = build()
        state = packed._trl_ext.state["padding_free"]
        assert "policy" in state.self_checks  # not in the verified table: measured before the first step
        # float32 round-off, as in test_padding_free.py; a token scored from the wrong sequence moves them by > 1e-2
        eq.compare(
            stock,
            packed,
            eq.examples(stock, 4),
            batch_key="trl_ext_packing",
            calls=lambda: state.packed_calls,
            misses=lambda: state.unpacked_calls,
            logps_rtol=1e-5,
            loss_rtol=1e-5,
            grad_rtol=2e-5,
        )
        packed.train()
    stock.train()
    stock_losses = [log["loss"] for log in stock.state.log_history if "loss" in log]
    packed_losses = [log["loss"] for log in packed.state.log_history if "loss" in log]
    assert len(stock_losses) == len(packed_losses) == 2
    assert packed_losses == pytest.approx(stock_losses, rel=1e-5)


# -------------------------------------------------------------------------------------------------------------------
# Windows that live only in the mask, chunked attention
# -------------------------------------------------------------------------------------------------------------------


def test_window_only_in_the_mask_packs_exactly():
    """PhiMoE's layers never receive `sliding_window`: the window lives only in the mask that
    `create_sliding_window_causal_mask` builds. Packed, the varlen attention applies that mask per sequence."""
    model = _tiny("phimoe", sliding_window=WINDOW)
    inspection = _assert_packs_exactly(model)
    assert "sliding window (per-sequence mask)" in inspection.mechanisms


def test_window_only_in_the_mask_is_refused_under_flash_attention():
    model = _tiny("phimoe", sliding_window=WINDOW)
    model.config._attn_implementation_internal = "flash_attention_2"
    refusal = _refusal(model)
    assert "`model.layers.0.self_attn` (PhimoeAttention) never receives `sliding_window=13`" in refusal
    assert "lives only in the attention mask" in refusal and 'attn_implementation="sdpa"' in refusal


def test_window_passed_to_the_layers_packs_exactly():
    """Mistral hands its window to the attention function as well; the mask's window and the layer's agree."""
    inspection = _assert_packs_exactly(_tiny("mistral", sliding_window=WINDOW))
    assert "sliding window" in inspection.mechanisms


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("mistral", {}),
        ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}),
        ("gemma3_text", {"layer_types": ["sliding_attention", "full_attention"]}),
    ],
)
def test_window_handed_to_the_layers_is_accepted_under_flash_attention(model_type, extra):
    """Under flash-attention the kernels apply the window the layers hand them; only mask-only windows are refused."""
    model = _tiny(model_type, sliding_window=WINDOW, **extra)
    model.config._attn_implementation_internal = "flash_attention_2"
    inspection = inspect_model(model)
    assert inspection.refusal is None and "sliding window" in inspection.mechanisms


def test_chunked_attention_packs_exactly():
    """Llama-4's chunked attention (`attention_chunk_size`) lives only in the mask; transformers remaps the chunks to
    each sequence's positions, and the varlen attention applies the mask per sequence."""
    model = _tiny("llama4_text", attention_chunk_size=CHUNK, no_rope_layers=[1, 1])
    inspection = _assert_packs_exactly(model, CHUNK_LENGTHS)
    assert "chunked attention (per-sequence mask)" in inspection.mechanisms


def test_chunked_attention_refusals():
    model = _tiny("llama4_text", attention_chunk_size=CHUNK, no_rope_layers=[1, 1])
    model.config._attn_implementation_internal = "flash_attention_2"
    refusal = _refusal(model)
    assert "`model.layers.0.self_attn` (Llama4TextAttention)" in refusal
    assert "(`attention_chunk_size=7`) only through the attention mask" in refusal
    # NoPE layers with attention temperature tuning scale queries by the row index
    refusal = _refusal(_tiny("llama4_text", attention_chunk_size=CHUNK, no_rope_layers=[1, 0]))
    assert "`attn_temperature_tuning`" in refusal and "index in the row" in refusal


# -------------------------------------------------------------------------------------------------------------------
# The decoders that passed inspection but packed wrongly
# -------------------------------------------------------------------------------------------------------------------


def test_gpt_neox_japanese_packs_exactly():
    """Its attention adds the mask itself, outside transformers' attention interface."""
    inspection = _assert_packs_exactly(_tiny("gpt_neox_japanese", "eager"))
    assert "own attention (per-sequence mask)" in inspection.mechanisms


def test_dory_looped_layers_pack_exactly():
    """Dory runs its recurrent layers several times over the same row with sliding-window attention."""
    layers = dict(num_hidden_layers=4, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1)
    model = _tiny("dory", sliding_window=WINDOW, head_dim=8, **layers)
    _assert_packs_exactly(model)


def test_openai_gpt_is_refused_naming_its_attention():
    refusal = _refusal(_tiny("openai-gpt", "eager"))
    assert "`transformer.h.0.attn` (Attention)" in refusal
    assert "outside transformers' attention interface" in refusal


def test_doge_is_refused_naming_its_dynamic_mask():
    refusal = _refusal(_tiny("doge"))
    assert "`model.layers.0.self_attn` (DogeAttention) builds a dynamic mask" in refusal


def test_mamba_refusal_names_the_mixer():
    refusal = _refusal(_tiny("mamba", "eager"))
    assert "its layer `backbone.layers.0.mixer` (MambaMixer)" in refusal


def test_verified_table_holds_the_exact_types():
    assert {"phimoe", "gpt_neox_japanese", "dory", "llama4_text"} <= set(VERIFIED_MODEL_TYPES)
    # Bloom builds its ALiBi biases in the model's dtype from the index in the row (larger in a packed row, so coarser
    # in bfloat16) and takes its softmax in float32; MPT adds a float32 bias table; Falcon is not buildable by the
    # sweep. Packed, their round-off differs from the padded one: the self-check measures it in the training dtype.
    assert not {"bloom", "mpt", "falcon"} & set(VERIFIED_MODEL_TYPES)
