"""fused_logprobs on `DPOTrainer` with TRL < 1.15 (no fused LM head there): scoring inside the output head's call
equals stock TRL's full-logit `_compute_loss` in float64 for every loss type and loss option: per-sequence log-probs,
loss, gradients and every logged metric (entropy, logits/chosen|rejected, mean_token_accuracy, rewards, logps); no
`[2B, L, V]` tensor; the head module is called once per forward and computes each chunk of completion positions once
(metrics included), plus once in the backward. The same with padding_free and prompt_sharing, whose packed forwards
announce the packed positions the head reads.

On TRL >= 1.15 DPO runs TRL's own fused head and the plugin leaves it (tests/plugins/test_fused_logprobs.py::
test_dpo_trainer); these tests run with trl 1.12.
"""

from __future__ import annotations

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from trl_ext import _compat
from trl_ext.plugins.fused_logprobs import online
from trl_ext.testing import make_preference_dataset

pytestmark = pytest.mark.skipif(
    _compat.dpo_uses_fused_lm_head(), reason="TRL >= 1.15: DPOTrainer runs TRL's own fused LM head"
)

LOGPS_RTOL = 1e-10
RTOL = 1e-8

LOSS_CASES = eq.LOSS_CASES


@pytest.fixture(scope="module")
def dataset():
    return make_preference_dataset(8, seed=0)


@pytest.fixture
def build(dpo_args, tokenizer, dataset):
    return eq.dpo_builder(dpo_args, tokenizer, dataset, dtype=torch.float64)


def _loss_grads_metrics(trainer, batch):
    trainer._metrics["train"].clear()
    trainer._total_train_tokens = 0  # `num_tokens` counts every batch a trainer has seen
    loss, grads = eq.loss_and_grads(trainer, batch)
    return loss, grads, {k: list(v) for k, v in trainer._metrics["train"].items()}


def _compare(stock, fused, batch, logps=True, fused_batch=None, grad_rtol=RTOL):
    fused_batch = batch if fused_batch is None else fused_batch
    if logps:
        stock_logps = stock.compute_ref_log_probs(stock.model, batch)
        fused_logps = fused.compute_ref_log_probs(fused.model, fused_batch)
        for a, b in zip(stock_logps, fused_logps, strict=True):
            assert (a - b).abs().max().item() <= LOGPS_RTOL * a.abs().max().item()
    calls = fused._trl_ext.state["fused_logprobs"].fused_calls
    stock_loss, stock_grads, stock_metrics = _loss_grads_metrics(stock, batch)
    fused_loss, fused_grads, fused_metrics = _loss_grads_metrics(fused, fused_batch)
    assert fused._trl_ext.state["fused_logprobs"].fused_calls == calls + 2  # policy and reference were fused
    assert fused_loss.item() == pytest.approx(stock_loss.item(), rel=RTOL)
    eq.assert_same_grads(stock_grads, fused_grads, grad_rtol)
    assert stock_metrics.keys() == fused_metrics.keys()
    assert {"entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy"} <= stock_metrics.keys()
    for key, values in stock_metrics.items():
        assert fused_metrics[key] == pytest.approx(values, rel=RTOL, abs=1e-12), key


@pytest.mark.slow
def test_every_loss_type_and_option(build):
    stock = build(use_weighting=True, label_smoothing=1e-3, loss_type=["exo_pair"])
    with trl_ext.install(fused_logprobs=True, plugins={"fused_logprobs": {"chunk": 5}}):
        fused = build(use_weighting=True, label_smoothing=1e-3, loss_type=["exo_pair"])
    batch = stock.data_collator(eq.examples(stock))
    assert batch["attention_mask"].eq(0).any()  # padding, prompts: positions that are not scored
    _compare(stock, fused, batch)
    eq.assert_every_loss_case((stock, fused), lambda: _compare(stock, fused, batch, logps=False), LOSS_CASES)


@pytest.mark.slow
def test_never_allocates_full_logits(build):
    """Loss (with WPO weights and sft: every reduction of the logits), backward: no `[2B, L, V]` tensor."""
    case = {"loss_types": ["sigmoid", "ipo", "apo_down"], "use_weighting": True}
    stock = build(use_weighting=True)
    with trl_ext.install(fused_logprobs=True, plugins={"fused_logprobs": {"chunk": 4}}):
        fused = build(use_weighting=True)
    batch = stock.data_collator(eq.examples(stock))
    full = batch["input_ids"].numel() * stock.model.config.vocab_size
    for trainer in (stock, fused):
        eq.set_loss(trainer, case)
    with eq.LargestTensor() as sizes:
        eq.loss_and_grads(stock, batch)
    assert sizes.largest >= full
    with eq.LargestTensor() as sizes:
        eq.loss_and_grads(fused, batch)
        eq.set_loss(fused, {"loss_types": ["sft"]})
        eq.loss_and_grads(fused, batch)
    assert sizes.largest < full


@pytest.mark.slow
def test_train_with_gradient_checkpointing_and_precompute(build):
    """Two SGD steps through `trainer.train()`, gradient checkpointing on, reference log-probs precomputed (through
    the fused `compute_ref_log_probs`): every logged metric and the trained weights equal."""
    kwargs = dict(max_steps=2, gradient_checkpointing=True, precompute_ref_log_probs=True, optim="sgd")
    stock = build(**kwargs)
    stock.train()
    with trl_ext.install(fused_logprobs=True):
        fused = build(**kwargs)
        fused.train()
    _assert_trained_alike(stock, fused)


def _assert_trained_alike(stock, fused) -> None:
    """Two logged steps each, every logged value (timings aside) and every trained weight equal."""
    logs = [[h for h in t.state.log_history if "loss" in h] for t in (stock, fused)]
    assert len(logs[0]) == len(logs[1]) == 2
    for s, p in zip(*logs, strict=True):
        assert s.keys() == p.keys()
        for key in s:
            if not (key.endswith("runtime") or key.endswith("per_second")):
                assert p[key] == pytest.approx(s[key], rel=RTOL, abs=1e-12), key
    stock_weights = dict(stock.model.named_parameters())
    for name, value in fused.model.named_parameters():
        assert torch.allclose(value, stock_weights[name], rtol=RTOL, atol=1e-12), name


class _HeadCalls:
    """Counts the calls of a model's output head module."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.get_output_embeddings().register_forward_hook(self._count)

    def _count(self, *args):
        self.calls += 1


class _HeadChunks:
    """Counts the chunks of logits each output head computes inside its call (forward and backward's recompute)."""

    def __init__(self, monkeypatch, **models):
        self.heads = {role: model.get_output_embeddings() for role, model in models.items()}
        self.calls = dict.fromkeys(models, 0)
        original = online.head_chunk

        def head_chunk(forward, hidden):
            for role, head in self.heads.items():
                if getattr(forward, "__self__", None) is head:
                    self.calls[role] += 1
            return original(forward, hidden)

        monkeypatch.setattr(online, "head_chunk", head_chunk)


@pytest.mark.slow
def test_head_runs_once_per_chunk(build, monkeypatch):
    """Loss with every reduction TRL applies to the logits (log-probs, sft, WPO weights, entropy, mean logits, token
    accuracy) and its backward: each model calls its head module once per forward, as stock (the scoring runs inside
    that call); inside it the policy's head computes each chunk of completion positions once in the forward and once
    in the backward (the recompute), the reference's once."""
    chunk = 4
    with trl_ext.install(fused_logprobs=True, plugins={"fused_logprobs": {"chunk": chunk}}):
        fused = build(use_weighting=True)
    batch = fused.data_collator(eq.examples(fused))
    chunks = -(-int(batch["completion_mask"][:, 1:].sum()) // chunk)
    # (TRL 1.12's `sft` loss with `use_weighting` fails in stock TRL: an in-place product on an expanded tensor.)
    for case in ({"loss_types": ["sigmoid", "ipo"], "use_weighting": True}, {"loss_types": ["sigmoid", "sft"]}):
        eq.set_loss(fused, case)
        policy, ref = _HeadCalls(fused.model), _HeadCalls(fused.ref_model)
        chunks_seen = _HeadChunks(monkeypatch, policy=fused.model, ref=fused.ref_model)
        eq.loss_and_grads(fused, batch)
        policy.handle.remove()
        ref.handle.remove()
        assert (policy.calls, ref.calls) == (1, 1), case
        assert (chunks_seen.calls["policy"], chunks_seen.calls["ref"]) == (2 * chunks, chunks), case


PACKING = ["padding_free", "prompt_sharing"]
#: prompt_sharing alone differs from stock by its own float64 floor on gradients (the shared prompt's gradient is
#: summed over both responses in another order): fused + prompt_sharing is compared with stock at that floor and
#: with prompt_sharing alone at RTOL.
PACKING_GRAD_RTOL = {"padding_free": RTOL, "prompt_sharing": 1e-6}
#: The loss cases run with packing (the first comparison runs `exo_pair` with label smoothing and WPO weights).
PACKING_CASES = [
    {"loss_types": ["sigmoid"]},
    {"loss_types": ["ipo"]},
    {"loss_types": ["aot", "aot_unpaired"], "label_smoothing": 0.1},
    {"loss_types": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
    {"loss_types": ["sigmoid_norm", "ipo"], "ld_alpha": 0.3, "loss_weights": [1.0, 0.5]},
    {"loss_types": ["sigmoid", "ipo", "apo_down"], "use_weighting": True},
]


@pytest.mark.slow
@pytest.mark.parametrize("packing", PACKING)
def test_with_packing_equals_stock(build, packing, monkeypatch):
    """fused_logprobs + padding_free / prompt_sharing (TRL < 1.15: the packing plugin announces the packed positions
    and the fused head, inside its call, scores the completion positions from the packed row): log-probs, loss,
    gradients and metrics equal stock for the loss cases, and the packing plugin alone at RTOL; no `[2B, L, V]`
    tensor."""
    from trl_ext.plugins.fused_logprobs import online  # `ScoreCall.scored_columns`, which DpoScoreCall runs

    announced = []
    original = online.current_packed_positions

    def current_packed_positions():
        positions = original()
        announced.append(positions is not None)
        return positions

    stock = build(use_weighting=True, label_smoothing=1e-3, loss_type=["exo_pair"])
    with trl_ext.install(**{packing: True}):
        packed = build(use_weighting=True, label_smoothing=1e-3, loss_type=["exo_pair"])
    with trl_ext.install(fused_logprobs=True, **{packing: True}, plugins={"fused_logprobs": {"chunk": 5}}):
        fused = build(use_weighting=True, label_smoothing=1e-3, loss_type=["exo_pair"])
    # after the builds: the self-check's scoring calls (stock, unpacked) also read it
    monkeypatch.setattr(online, "current_packed_positions", current_packed_positions)
    batch = stock.data_collator(eq.examples(stock))
    fused_batch = fused.data_collator(eq.examples(fused))
    assert set(fused_batch) > set(batch)  # the packing plugin's metadata
    runs = fused._trl_ext.state[packing]
    runs_before = getattr(runs, "packed_calls", None), getattr(runs, "shared_calls", None)
    _compare(stock, fused, batch, fused_batch=fused_batch, grad_rtol=PACKING_GRAD_RTOL[packing])
    assert (getattr(runs, "packed_calls", None), getattr(runs, "shared_calls", None)) != runs_before
    assert announced and all(announced), announced  # every fused head call read the packed row

    def compare():
        _compare(stock, fused, batch, logps=False, fused_batch=fused_batch, grad_rtol=PACKING_GRAD_RTOL[packing])
        _compare(packed, fused, fused_batch, logps=False)

    eq.assert_every_loss_case((stock, packed, fused), compare, PACKING_CASES, every_type=False)
    full = batch["input_ids"].numel() * stock.model.config.vocab_size
    with eq.LargestTensor() as sizes:
        for case in ({"loss_types": ["sigmoid", "ipo"], "use_weighting": True}, {"loss_types": ["sft"]}):
            eq.set_loss(fused, case)
            eq.loss_and_grads(fused, fused_batch)
    assert sizes.largest < full


@pytest.mark.slow
def test_train_with_padding_free(build):
    """Two SGD steps through `trainer.train()` with padding_free: every logged metric and the trained weights equal
    stock."""
    kwargs = dict(max_steps=2, optim="sgd")
    stock = build(**kwargs)
    stock.train()
    with trl_ext.install(fused_logprobs=True, padding_free=True):
        fused = build(**kwargs)
        fused.train()
    assert fused._trl_ext.state["padding_free"].packed_calls >= 4
    _assert_trained_alike(stock, fused)


@pytest.mark.slow
@pytest.mark.parametrize("packing", [None, "padding_free"])
def test_peft_reference_is_adapter_disabled_model(build, packing):
    """PEFT policy without a reference model: TRL's reference is the adapter-disabled policy (its forward is fused
    too, packed with padding_free); sigmoid loss, log-probs, loss, gradients and metrics equal."""
    pytest.importorskip("peft")
    stock = build(ref=False, peft_config=eq.lora())
    plugins = {"fused_logprobs": True, **({packing: True} if packing else {})}
    with trl_ext.install(**plugins, plugins={"fused_logprobs": {"chunk": 3}}):
        fused = build(ref=False, peft_config=eq.lora())
    assert set(fused._trl_ext.state["fused_logprobs"].self_checks) == {"policy"}
    batch = stock.data_collator(eq.examples(stock))
    _compare(stock, fused, batch, fused_batch=fused.data_collator(eq.examples(fused)))
    if packing:
        assert fused._trl_ext.state[packing].packed_calls >= 3  # reference log-probs, then the loss: policy and ref
