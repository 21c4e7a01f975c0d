"""fused_logprobs on `OnlineDPOTrainer`: the scoring forwards of policy and reference equal stock Online DPO at the
same completions (float64, SGD): per-token log-probs (every column, the padding after an end too), loss, every logged
metric, gradients; refusals named before the first step; no `[rows, length, vocab]` tensor in a training step.

Generation is replaced, on both trainers, by one stored batch (left-padded prompts repeated twice as TRL does,
completions of different lengths padded after their end), so both score exactly the same tokens.
"""

from __future__ import annotations

import logging

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from trl_ext.testing import length_reward, make_model, make_prompt_dataset

LOGPS_RTOL = 1e-10
RTOL = 1e-8
VOCAB = 253  # not a multiple of any chunk used here


def _fixed_generation(prompt_lens=(5, 9, 2), completion_lens=(6, 3, 1, 4, 6, 2), width=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = max(prompt_lens)
    prompt_ids = torch.zeros(len(prompt_lens), p, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, n in enumerate(prompt_lens):
        prompt_ids[i, p - n :] = torch.randint(4, VOCAB, (n,), generator=g)
        prompt_mask[i, p - n :] = 1
    prompt_ids, prompt_mask = prompt_ids.repeat(2, 1), prompt_mask.repeat(2, 1)
    completion_ids = torch.randint(4, VOCAB, (len(completion_lens), width), generator=g)
    completion_mask = (torch.arange(width)[None] < torch.tensor(completion_lens)[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _generate_arity() -> int:
    """`OnlineDPOTrainer._generate` returns 4 tensors on TRL 1.12 and those plus `vision_inputs` on 1.16."""
    import inspect

    from trl.experimental.online_dpo import OnlineDPOTrainer

    return 5 if "vision_inputs = self._generate(" in inspect.getsource(OnlineDPOTrainer.training_step) else 4


def _first_token_reward(completion_ids, **kwargs):
    return [float(ids[0] % 7) for ids in completion_ids]


@pytest.fixture
def build(online_dpo_args, tokenizer, monkeypatch):
    from trl.experimental.online_dpo import OnlineDPOTrainer

    # the same completions for both trainers, on the class so that every plugin's wrapper of `_generate` sees them
    batch = (*_fixed_generation(), None)[: _generate_arity()]
    monkeypatch.setattr(OnlineDPOTrainer, "_generate", lambda self, model, prompts, images=None: batch)

    def make(*, ref=True, peft_config=None, rewards=1, model_hook=None, **overrides):
        overrides.setdefault("bf16", False)
        overrides.setdefault("max_length", 64)
        args = online_dpo_args(per_device_train_batch_size=3, optim="sgd", learning_rate=0.1, **overrides)
        if peft_config is not None:
            torch.manual_seed(123)
        model = eq.sharpen(make_model(vocab_size=VOCAB, dtype=torch.float64))
        ref_model = eq.sharpen(make_model(vocab_size=VOCAB, seed=1, dtype=torch.float64)) if ref else None
        for m in (model, ref_model):
            if model_hook is not None and m is not None:
                model_hook(m)
        trainer = OnlineDPOTrainer(
            model=model,
            ref_model=ref_model,
            reward_funcs=[length_reward, _first_token_reward][:rewards] if rewards > 1 else length_reward,
            args=args,
            train_dataset=make_prompt_dataset(6),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        return trainer

    return make


def _step(trainer):
    trainer.model.zero_grad(set_to_none=True)
    for values in trainer.stats.values():
        values.clear()
    loss = trainer.training_step(trainer.model, {"prompt": ["w1 w2"] * 3})
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss, grads, {k: list(v) for k, v in trainer.stats.items() if v}


def _compare(stock, fused, generation=None):
    prompt_ids, prompt_mask, completion_ids, completion_mask = generation or _fixed_generation()
    for model in (stock.model, stock.ref_model):
        if model is None:
            continue
        a = stock._forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        fused_model = fused.model if model is stock.model else fused.ref_model
        head_calls: list[torch.Size] = []
        hook = fused_model.get_output_embeddings().register_forward_hook(
            lambda m, i, o, calls=head_calls: calls.append(o.shape)
        )
        try:
            b = fused._forward(fused_model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        finally:
            hook.remove()
        # scored inside the head module's one call (as stock calls it once), which returned the log-probs
        assert head_calls == [completion_ids.shape]
        assert a.shape == b.shape  # every column: TRL sums the padding after an end into its KL and entropy
        assert (a - b).abs().max().item() <= LOGPS_RTOL * a.abs().max().item()
    stock_loss, stock_grads, stock_stats = _step(stock)
    calls = fused._trl_ext.state["fused_logprobs"].fused_calls
    fused_loss, fused_grads, fused_stats = _step(fused)
    assert fused._trl_ext.state["fused_logprobs"].fused_calls == calls + 2  # policy and reference were fused
    assert fused_loss.item() == pytest.approx(stock_loss.item(), rel=RTOL)
    eq.assert_same_grads(stock_grads, fused_grads, RTOL)
    assert stock_stats.keys() == fused_stats.keys() and len(stock_stats) >= 10
    for key, values in stock_stats.items():
        assert fused_stats[key] == pytest.approx(values, rel=RTOL, abs=1e-12), key


@pytest.mark.slow
def test_training_step_equals_stock(build):
    """Reference model, 1 reward function, chunk 4 (crosses rows and completion ends)."""
    stock = build()
    with trl_ext.install(fused_logprobs=True, plugins={"fused_logprobs": {"chunk": 4}}):
        fused = build()
    assert fused._trl_ext.state["fused_logprobs"].chunks == {"policy": 4, "ref": 4}
    assert set(fused._trl_ext.state["fused_logprobs"].self_checks) == {"policy", "ref"}
    _compare(stock, fused)


@pytest.mark.slow
def test_two_reward_functions(build):
    stock = build(rewards=2)
    with trl_ext.install(fused_logprobs=True, plugins={"fused_logprobs": {"chunk": 5}}):
        fused = build(rewards=2)
    _compare(stock, fused)


@pytest.mark.slow
@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_peft_reference_is_adapter_disabled_model(build, targets):
    """PEFT policy, reference = the policy with its adapter disabled; also with a LoRA adapter on the output head
    (the head's own forward, run chunk by chunk, calls the adapter's modules)."""
    pytest.importorskip("peft")
    stock = build(ref=False, peft_config=eq.lora(targets))
    with trl_ext.install(fused_logprobs=True, plugins={"fused_logprobs": {"chunk": 3}}):
        fused = build(ref=False, peft_config=eq.lora(targets))
    assert set(fused._trl_ext.state["fused_logprobs"].self_checks) == {"policy"}
    if "lm_head" in targets:
        assert any("lm_head.lora_A" in n for n, p in fused.model.named_parameters() if p.requires_grad)
    _compare(stock, fused)


@pytest.mark.slow
@pytest.mark.parametrize("others", [{}, {"prompt_sharing": True, "sync_metrics": True}])
def test_train_logs_equal_stock(build, others):
    """Two SGD steps through `trainer.train()` with gradient checkpointing (alone, and with prompt_sharing and
    sync_metrics): every logged metric equal, and the trained weights. The reference runs the same other plugins
    (each is proved against stock in its own tests; prompt_sharing to ~1e-6 since Llama's RMSNorm runs in float32,
    sync_metrics reduces in float64 where stock averages accuracies in float32): what differs is fused_logprobs."""
    with trl_ext.install(**others):
        stock = build(max_steps=2, gradient_checkpointing=True)
    stock.train()
    with trl_ext.install(fused_logprobs=True, **others):
        fused = build(max_steps=2, gradient_checkpointing=True)
        assert set(fused._trl_ext.enabled) == {"fused_logprobs", *others}
        fused.train()
    assert fused._trl_ext.state["fused_logprobs"].fused_calls == 4
    logs = [[h for h in t.state.log_history if "loss" in h] for t in (stock, fused)]
    assert len(logs[0]) == len(logs[1]) == 2
    eq.assert_same_logs(*logs, rel=1e-8, abs=1e-12)
    stock_weights = dict(stock.model.named_parameters())
    for name, value in fused.model.named_parameters():
        assert torch.allclose(value, stock_weights[name], rtol=1e-8, atol=1e-12), name


@pytest.mark.slow
@pytest.mark.parametrize("others", [{}, {"prompt_sharing": True}])
def test_training_step_never_allocates_full_logits(build, others):
    """A whole training step (policy and reference scoring, loss, backward): no tensor of `rows * length * vocab`
    elements, where stock allocates one (prompt_sharing alone keeps the shared row's logits without unpacking them:
    with it, the fused step is held to the same bound)."""
    prompt_ids, _, completion_ids, _ = _fixed_generation()
    full = completion_ids.size(0) * (prompt_ids.size(1) + completion_ids.size(1)) * VOCAB
    with trl_ext.install(**others):
        stock = build()
    with eq.LargestTensor() as sizes:
        _step(stock)
    if not others:
        assert sizes.largest >= full
    # verify (on for the first step by default) runs stock's own scoring once more, full logits included, by design
    with trl_ext.install(fused_logprobs=True, plugins={"fused_logprobs": {"chunk": 4}}, verify=False, **others):
        fused = build()
    with eq.LargestTensor() as sizes:
        _step(fused)
    assert sizes.largest < full


@pytest.mark.slow
@pytest.mark.parametrize("prompt_lens", [(5, 9, 2), (5, 9, 0)])
def test_prompt_sharing_equals_prompt_sharing_alone(build, prompt_lens, monkeypatch):
    """With prompt_sharing the model runs on one packed row and the head scores the completion columns from it, inside
    its one call: log-probs, loss, gradients and metrics equal prompt_sharing alone (float64; rows share their
    prompts, chunk 4 crosses rows and branches). A row without prompt tokens has no packed position at the column
    that predicts its first completion token: prompt_sharing gives it zero logits, the head -log(vocab)."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    generation = _fixed_generation(prompt_lens)
    batch = (*generation, None)[: _generate_arity()]
    monkeypatch.setattr(OnlineDPOTrainer, "_generate", lambda self, model, prompts, images=None: batch)
    with trl_ext.install(prompt_sharing=True):
        stock = build()
    with trl_ext.install(fused_logprobs=True, prompt_sharing=True, plugins={"fused_logprobs": {"chunk": 4}}):
        fused = build()
    shared = fused._trl_ext.state["prompt_sharing"]
    calls = shared.shared_calls
    _compare(stock, fused, generation)
    assert shared.shared_calls >= calls + 4  # every scoring call ran on the shared row (2 forwards, 2 in the step)


@pytest.mark.slow
def test_head_mechanism_refused(build):
    def softcap(model):
        model.config.final_logit_softcapping = 30.0

    with trl_ext.install(fused_logprobs=True):
        with pytest.raises(trl_ext.UsageError, match=r"final_logit_softcapping=30.0.*after the output head"):
            build(model_hook=softcap)


@pytest.mark.slow
def test_self_check_refuses_what_acts_after_the_head(build):
    """A model whose forward changes the logits after its head (no config attribute says so): the self-check."""

    def tanh_after_head(model):
        original = model.forward

        def forward(*args, **kwargs):
            outputs = original(*args, **kwargs)
            outputs.logits = 3 * torch.tanh(outputs.logits / 3)
            return outputs

        model.forward = forward

    with trl_ext.install(fused_logprobs=True):
        with pytest.raises(trl_ext.UsageError, match=r"self-check failed for the policy model.*not its output head"):
            build(model_hook=tanh_after_head)


@pytest.mark.slow
def test_dpo_trainer(dpo_args, tokenizer, caplog):
    """DPOTrainer: TRL >= 1.15 runs its own fused LM head (said, and left); on older TRL the plugin scores DPO
    (test_fused_logprobs_dpo.py) and its models passed the self-check."""
    from trl import DPOTrainer

    from trl_ext import _compat
    from trl_ext.testing import make_preference_dataset

    def build():
        return DPOTrainer(
            model=make_model(),
            ref_model=make_model(seed=1),
            args=dpo_args(max_steps=1),
            train_dataset=make_preference_dataset(2),
            processing_class=tokenizer,
        )

    with trl_ext.install(fused_logprobs=True) as installation:
        installation.keep_records = True  # as `trl-ext dpo` does, for its end-of-run lines
        if _compat.dpo_uses_fused_lm_head():
            with caplog.at_level(logging.INFO, logger="trl_ext"):
                trainer = build()
            assert "fused_logprobs" in trainer._trl_ext.enabled
            assert any("already scores with its own fused LM head" in r.getMessage() for r in caplog.records)
        else:
            trainer = build()
            assert set(trainer._trl_ext.state["fused_logprobs"].self_checks) == {"policy", "ref"}
        trainer.train()
        (record,) = installation.records
    # The end-of-run line says what ran: on TRL >= 1.15 that the plugin left TRL's fused head in place (issue 35).
    summary = record["summaries"]["fused_logprobs"]
    if _compat.dpo_uses_fused_lm_head():
        assert summary.startswith("did nothing: left TRL's own fused LM head in place")
        assert trainer._trl_ext.state["fused_logprobs"].fused_calls == 0
    else:
        chunks = trainer._trl_ext.state["fused_logprobs"].chunks
        # one step: the policy's forward and the reference's
        assert summary.startswith(
            f"2 scoring forwards fused (chunk: policy {chunks['policy']}, ref {chunks['ref']}); largest logits tensor "
            "not built (one scoring forward): "
        ), summary


@pytest.mark.slow
def test_mixed_precision_train(build):
    """float32 models trained under bf16 autocast: the head runs under the same autocast as stock's (inside the
    prepared forward); the logged log-probs agree to bf16 precision (the fused log-sum-exp runs in float32, stock's
    log_softmax returns bf16)."""

    def float32(model):
        model.to(torch.float32)

    stock = build(max_steps=1, bf16=True, model_hook=float32)
    stock.train()
    with trl_ext.install(fused_logprobs=True):
        fused = build(max_steps=1, bf16=True, model_hook=float32)
        fused.train()
    # float32 models: checked at the float32 tolerance, except where a model's forward already runs under bf16
    # autocast at attach (TRL 1.16 prepares the reference model in `__init__`): its head computes in bf16, and the
    # tolerance comes from that head's measured bf16-vs-float32 round-off (issue 39)
    checks = fused._trl_ext.state["fused_logprobs"].self_checks
    assert checks["policy"].tolerance == 1e-5 and checks["policy"].basis == ""
    for check in checks.values():
        assert check.tolerance == 1e-5 or (check.roundoff and "bfloat16-vs-float32 round-off" in check.basis)
    s, f = ([h for h in t.state.log_history if "loss" in h][0] for t in (stock, fused))
    for key in ("logps/chosen", "logps/rejected", "objective/kl", "objective/entropy"):
        assert f[key] == pytest.approx(s[key], rel=2e-2, abs=2e-2), key


class _Namespace:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def _engine_setup(trainer_class, *, zero_stage=None, fsdp=False, head_adapter=False):
    """A trainer and context carrying only what `hooks._check_engine` reads (its engine flags, the models' heads)."""
    from trl_ext.plugins.fused_logprobs.online import FusedState

    model = make_model(vocab_size=VOCAB)
    if head_adapter:
        model.lm_head.adapter = torch.nn.Linear(2, 2)
    plugin = _Namespace(zero_stage=zero_stage)
    trainer = _Namespace(
        is_deepspeed_enabled=zero_stage is not None,
        is_fsdp_enabled=fsdp,
        accelerator=_Namespace(state=_Namespace(deepspeed_plugin=plugin)),
    )
    context = _Namespace(trainer_class=trainer_class, models=lambda: {"policy": model})
    state = FusedState()
    return trainer, context, state


@pytest.mark.parametrize(
    "trainer_class,setup,match",
    [
        ("OnlineDPOTrainer", {"zero_stage": 3}, None),
        ("OnlineDPOTrainer", {"fsdp": True}, None),
        ("OnlineDPOTrainer", {"zero_stage": 2, "head_adapter": True}, None),
        ("OnlineDPOTrainer", {"fsdp": True, "head_adapter": True}, None),
        ("OnlineDPOTrainer", {"zero_stage": 3, "head_adapter": True}, r"ZeRO-3 with the policy.*\['adapter'\]"),
        ("DPOTrainer", {"zero_stage": 3}, None),
        ("DPOTrainer", {"fsdp": True}, None),
        ("DPOTrainer", {"zero_stage": 3, "head_adapter": True}, r"ZeRO-3 with the policy.*\['adapter'\]"),
    ],
)
def test_engines(trainer_class, setup, match):
    """Online DPO and DPO (TRL < 1.15) score inside the head's call under ZeRO-3 and FSDP (with packing too); refused
    there: a ZeRO-3 head with parameterized sub-modules."""
    from trl_ext.plugins.fused_logprobs.hooks import _check_engine

    trainer, context, state = _engine_setup(trainer_class, **setup)
    if match is None:
        _check_engine(trainer, context, state)
    else:
        with pytest.raises(trl_ext.UsageError, match=match):
            _check_engine(trainer, context, state)


def test_head_scores_from_announced_packed_positions():
    """Inside a packed call the head gathers the scored columns from the packed row through the announced positions
    (two rows sharing packed positions, one column the packed row does not compute): equal to the padded head's
    log-probs, -log(vocab) where nothing computes the column, and the output is marked padded."""
    from trl_ext.plugins.fused_logprobs.online import ScoreCall
    from trl_ext.toolkit.packing.positions import PackedPositions, packed_positions

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(4, 11, dtype=torch.float64)
    rows, length, n = 2, 5, 7
    packed_hidden = torch.randn(1, n, 4, dtype=torch.float64, generator=g)
    padded = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])  # row 0 column 0 is not computed
    packed = torch.tensor([0, 1, 2, 3, 0, 1, 4, 5, 6])  # row 1 shares packed positions 0, 1 with row 0
    targets = torch.randint(0, 11, (rows, 3), generator=g)
    scored = torch.tensor([[True, True, False], [True, False, False]])
    positions = PackedPositions(rows, length, padded, packed)
    request = ScoreCall("policy", targets, scored, length, 0, 3, chunk=2)
    with packed_positions(positions):
        got = request.run(head, head.forward, packed_hidden, (), {})
    index = positions.index()
    assert index[0, 0] == -1 and index[1, 1] == 1
    hidden = packed_hidden[0][index.clamp(min=0)]
    want = head(hidden[:, :3]).log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    want[0, 0] = -torch.log(torch.tensor(11.0, dtype=torch.float64))
    assert positions.padded_output
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    with packed_positions(PackedPositions(rows, length + 1, padded, packed)):
        with pytest.raises(trl_ext.UsageError, match=r"packed call for 2 rows of 6 positions"):
            ScoreCall("policy", targets, scored, length, 0, 3, chunk=2).run(head, head.forward, packed_hidden, (), {})


@pytest.mark.slow
def test_frozen_head_bf16_equals_stock(build):
    """LoRA on the backbone, the output head frozen: the fused path computes each chunk's d(hidden) in the forward
    (`chunked._frozen_head_chunk`, no recompute). Under bf16 autocast, loss and LoRA gradients equal stock's in bf16
    up to a few bf16 ulps (the float32 step is the yardstick of what bf16 round-off moves)."""
    pytest.importorskip("peft")
    stock = build(ref=False, peft_config=eq.lora(), bf16=True)
    with trl_ext.install(fused_logprobs=True, plugins={"fused_logprobs": {"chunk": 3}}):
        fused = build(ref=False, peft_config=eq.lora(), bf16=True)
    assert not any(p.requires_grad for p in fused.model.get_output_embeddings().parameters())
    stock_loss, stock_grads, _ = _step(stock)
    fused_loss, fused_grads, _ = _step(fused)
    assert fused_grads and all("lora_" in name for name in fused_grads)
    rel = 4 * 2.0**-8
    assert fused_loss.item() == pytest.approx(stock_loss.item(), rel=rel)
    eq.assert_same_grads(stock_grads, fused_grads, rel)


def test_end_line_says_the_largest_logits_not_built(build, monkeypatch):
    """Issue 41, point 5, as a user meets it: after `train()` the end line says the largest logits tensor stock's
    scoring forward would have built, `rows x positions x vocab` in its dtype: measured here by running stock's own
    `_forward` on the inputs of every fused call and reading the `logits` its model call returned."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    from trl_ext._shared import size_text

    with trl_ext.install(fused_logprobs=True):
        fused = build(max_steps=1)
        calls = []
        plugin_forward = fused._forward

        def recording(model, *inputs, **kwargs):
            calls.append((model, inputs, kwargs))
            return plugin_forward(model, *inputs, **kwargs)

        monkeypatch.setattr(fused, "_forward", recording)
        fused.train()
        state = fused._trl_ext.state["fused_logprobs"]
        assert len(calls) == state.fused_calls == 2  # the policy's and the reference's
        stock_logits = []
        for model, inputs, kwargs in calls:
            hook = model.register_forward_hook(lambda m, i, o: stock_logits.append(o.logits))
            try:
                with torch.no_grad():
                    OnlineDPOTrainer._forward(fused, model, *inputs, **kwargs)  # stock's, full logits
            finally:
                hook.remove()
    largest = max(stock_logits, key=lambda t: t.numel() * t.element_size())
    rows, positions, vocab = largest.shape
    assert vocab == VOCAB and largest.dtype == torch.float64
    size = rows * positions * vocab * largest.element_size()
    assert size == largest.numel() * largest.element_size()
    chunks = ", ".join(f"{role} {chunk}" for role, chunk in state.chunks.items())
    assert state.summary() == (
        f"2 scoring forwards fused (chunk: {chunks}); largest logits tensor not built (one scoring forward): "
        f"{size_text(size)} ({rows} x {positions} x {vocab} float64)"
    )
