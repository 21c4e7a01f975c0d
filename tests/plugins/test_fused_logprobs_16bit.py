"""fused_logprobs' self-check on 16-bit heads (issue 39, point 4): its tolerance comes from stock's own 16-bit
round-off on the probe (the log-probs of the head's bf16/fp16 logits against the same head in float32), not the
float32 1e-5.

A correct plugin whose chunked head matmuls round every logit one ulp away from the full matmul's (what another
kernel or accumulation order does on a GPU) passes in bf16 and fp16, while the old 1e-5 would refuse it; a planted
fault (a wrong head row, a shifted target, a logit scale or soft-cap the fused path misses) is still refused in both.
A float32 head keeps the float32 tolerance (a bf16 rounding of its chunks is refused). Tiny sharpened Llamas on CPU.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests import equivalence as eq
from trl_ext.plugins.fused_logprobs import online, selfcheck
from trl_ext.plugins.fused_logprobs.online import head_forward
from trl_ext.plugins.fused_logprobs.selfcheck import LOGPROB_RTOL, self_check
from trl_ext.testing import make_model

VOCAB = 253
CHUNK = 7
DTYPES = [torch.bfloat16, torch.float16]


def _model(dtype, monkeypatch, after_head=None):
    """A tiny sharpened Llama in `dtype` whose output head runs the self-check's requests (as attach installs it);
    `after_head(logits)` is applied by the model's forward after its head (no config attribute says so)."""
    model = eq.sharpen(make_model(vocab_size=VOCAB, dtype=torch.float32)).to(dtype)
    head = model.get_output_embeddings()
    monkeypatch.setattr(head, "forward", head_forward(head), raising=False)
    if after_head is not None:
        original = model.forward

        def forward(*args, **kwargs):
            outputs = original(*args, **kwargs)
            outputs.logits = after_head(outputs.logits)
            return outputs

        monkeypatch.setattr(model, "forward", forward, raising=False)
    return model


def _check(model):
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(max_length=64))  # sizes the probe (rows <= 32 tokens)
    return self_check(model, trainer, "policy", CHUNK)


def _one_ulp_apart(monkeypatch, seed=0):
    """Every logit of the chunked head matmuls one ulp up or down (random, seeded) from the head's own: a different
    but correct kernel."""
    g = torch.Generator().manual_seed(seed)
    original = online.head_chunk

    def chunk(forward, hidden):
        out = original(forward, hidden)
        up = torch.rand(out.shape, generator=g) < 0.5
        toward = torch.where(up, torch.full_like(out, float("inf")), torch.full_like(out, -float("inf")))
        return torch.nextafter(out, toward)

    monkeypatch.setattr(online, "head_chunk", chunk)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_round_off_passes(dtype, monkeypatch):
    model = _model(dtype, monkeypatch)
    exact = _check(model)
    assert exact.failure is None and exact.roundoff is not None and exact.roundoff > 0
    _one_ulp_apart(monkeypatch)
    result = _check(model)
    # the old tolerance (1e-5, float32's) would refuse this correct plugin; the derived one passes it
    assert result.logprob_error > LOGPROB_RTOL[torch.float32]
    assert result.failure is None, result.failure
    assert result.roundoff == exact.roundoff and result.tolerance >= selfcheck.ROUNDOFF_MARGIN * result.roundoff
    assert result.logprob_error <= 0.5 * result.tolerance  # margin left: the worst of one ulp per logit
    assert "round-off" in result.basis and "unit round-offs of the largest logit" in result.basis


def _wrong_row(monkeypatch):
    """The chunked path reads the first scored target's logit from the next row of the head."""
    original = online.token_logprobs

    def token_logprobs(hidden, targets, head, **kwargs):
        t = int(targets.reshape(-1)[0])

        def wrong(h):
            out = head(h).clone()
            out[..., t] = out[..., (t + 1) % VOCAB]
            return out

        return original(hidden, targets, wrong, **kwargs)

    monkeypatch.setattr(online, "token_logprobs", token_logprobs)


def _shifted_target(monkeypatch):
    """The chunked path scores each position's target one column late (an off-by-one in the columns)."""
    original = online.token_logprobs
    monkeypatch.setattr(
        online, "token_logprobs", lambda hidden, targets, head, **kw: original(hidden, targets.roll(1, 1), head, **kw)
    )


def _scale_in_chunks(monkeypatch):
    """The chunked path applies a logit scale of 0.9 that the full head does not: the head check cannot see it (the
    recorded head output is right), the log-prob comparison must. (In bf16 a systematic change within the floor, a
    logit scale within about 3 %, cannot be told from round-off: 0.98 passes there.)"""
    original = online.head_chunk
    monkeypatch.setattr(online, "head_chunk", lambda forward, hidden: original(forward, hidden) * 0.9)


FAULTS = {"wrong_row": _wrong_row, "shifted_target": _shifted_target, "scale_in_chunks": _scale_in_chunks}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_planted_fault_is_refused(dtype, fault, monkeypatch):
    model = _model(dtype, monkeypatch)
    _one_ulp_apart(monkeypatch)  # on top of the round-off a correct kernel may add
    FAULTS[fault](monkeypatch)
    result = _check(model)
    assert result.failure is not None and "fused log-probs differ from the stock log_softmax" in result.failure
    assert result.logprob_error > 2 * result.tolerance, (result.logprob_error, result.tolerance)


@pytest.mark.parametrize(
    "after_head",
    [lambda x: 0.8 * x, lambda x: 8 * torch.tanh(x / 8)],
    ids=["logit_scale", "softcap"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_missing_scale_or_softcap_is_refused(dtype, after_head, monkeypatch):
    """A model that scales or soft-caps its logits after the head with no config attribute saying so: the fused path
    (the head's log-probs) misses it. Refused by the head check, and the log-prob comparison alone would refuse it
    too: its round-off is measured on the head's own output, so the change does not widen the tolerance."""
    result = _check(_model(dtype, monkeypatch, after_head))
    assert result.failure is not None and "not its output head" in result.failure
    assert result.logprob_error > result.tolerance, (result.logprob_error, result.tolerance)


def test_float32_keeps_its_tolerance(monkeypatch):
    """A float32 head: the float32 tolerance (1e-5), nothing derived; chunks rounded to bf16 are refused."""
    model = _model(torch.float32, monkeypatch)
    result = _check(model)
    assert result.failure is None and result.tolerance == LOGPROB_RTOL[torch.float32]
    assert result.roundoff is None and result.basis == ""
    original = online.head_chunk
    monkeypatch.setattr(online, "head_chunk", lambda f, h: original(f, h).bfloat16().float())
    assert "differ from the stock log_softmax" in (_check(model).failure or "")


def test_the_check_needs_no_input_embeddings_and_puts_each_modules_mode_back(monkeypatch):
    """The check draws its ids from the config's vocabulary: a model whose `get_input_embeddings` fails (as some
    remote-code layouts do) is still checked, a planted fault still seen; afterwards every module is in its own
    mode again (one layer left in eval inside a model in training)."""

    def missing():
        raise NotImplementedError("no input embeddings")

    model = _model(torch.float32, monkeypatch)
    monkeypatch.setattr(model, "get_input_embeddings", missing)
    model.train()
    model.model.layers[0].eval()
    assert _check(model).failure is None
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    original = online.head_chunk
    monkeypatch.setattr(online, "head_chunk", lambda f, h: original(f, h).bfloat16().float())
    assert "differ from the stock log_softmax" in (_check(model).failure or "")


def test_a_head_that_is_not_a_plain_linear_gets_the_floor(monkeypatch):
    """The float32 computation of a head other than a plain `torch.nn.Linear` is not known: the floor alone."""

    class Head(torch.nn.Linear):
        pass

    model = _model(torch.bfloat16, monkeypatch)
    head = model.get_output_embeddings()
    head.__class__ = Head
    result = _check(model)
    assert result.failure is None and result.roundoff is None and "not measured" in result.basis


@pytest.mark.slow
def test_online_dpo_trainer_in_bf16_attaches(online_dpo_args, tokenizer, monkeypatch, caplog):
    """Through attach: bf16 policy and reference whose chunked head matmuls are one ulp off pass the self-check, and
    the log line says how the tolerance was derived."""
    import logging

    from trl.experimental.online_dpo import OnlineDPOTrainer

    import trl_ext
    from trl_ext.testing import length_reward, make_prompt_dataset

    _one_ulp_apart(monkeypatch)
    models = [eq.sharpen(make_model(vocab_size=VOCAB, seed=s, dtype=torch.float32)).bfloat16() for s in (0, 1)]
    with trl_ext.install(fused_logprobs=True), caplog.at_level(logging.INFO, logger="trl_ext"):
        trainer = OnlineDPOTrainer(
            model=models[0],
            ref_model=models[1],
            reward_funcs=length_reward,
            args=online_dpo_args(bf16=False, max_length=64),
            train_dataset=make_prompt_dataset(4),
            processing_class=tokenizer,
        )
    checks = trainer._trl_ext.state["fused_logprobs"].self_checks
    assert set(checks) == {"policy", "ref"}
    assert all(c.logprob_error > LOGPROB_RTOL[torch.float32] and c.roundoff for c in checks.values())
    passed = [r.getMessage() for r in caplog.records if "fused_logprobs: self-check passed" in r.getMessage()]
    assert len(passed) == 2 and all("bfloat16-vs-float32 round-off" in line for line in passed), passed
