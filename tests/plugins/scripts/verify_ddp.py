"""Launched by tests/test_verify.py under torchrun (2 CPU processes, gloo, DDP).

`python verify_ddp.py OUT_DIR`: `verify` with padding_free on a DDP DPOTrainer (float64, SGD, 2 steps).

1. A wrong path on rank 1 only (its packed attention's softmax scale 5% off): both ranks stop at the first step with
   the `UsageError` (rank 1 naming its sequence, rank 0 saying another rank's batch was out of tolerance), no
   parameter changed on either.
2. The right path with verify on and with verify off: the same parameters and logs, bit for bit, on every rank; rank 0
   logged the verify line of step 1.

Every rank prints `VERIFY DDP OK`.
"""

from __future__ import annotations

import logging
import os
import sys

from _launched import dpo_args, finish, sharpened_models, start

OUT = sys.argv[1]
state = start()

import torch  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from trl import DPOTrainer  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext import UsageError, _compat  # noqa: E402
from trl_ext.testing import make_preference_dataset, make_tokenizer  # noqa: E402

tok = make_tokenizer()
data = make_preference_dataset(16, seed=0)
lines: list[str] = []


class _Lines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        lines.append(record.getMessage())


logging.getLogger("trl_ext").addHandler(_Lines())


def trainer(run: str, **flags) -> DPOTrainer:
    args = dpo_args(
        os.path.join(OUT, run), per_device_train_batch_size=2, max_steps=2, learning_rate=0.1, max_grad_norm=0.0
    )
    policy, ref = sharpened_models()
    with trl_ext.install(padding_free=True, **flags):
        return DPOTrainer(policy, ref_model=ref, args=args, train_dataset=data, processing_class=tok)


def parameters(t: DPOTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.accelerator.unwrap_model(t.model).named_parameters()}


bad: list = []

# 1. a wrong path on one rank stops both
wrong = trainer("wrong")
registry = _compat.attention_registry(AttentionInterface)
right = registry["trl_ext_varlen_sdpa"]
if state.process_index == 1:

    def scaled(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        scaling = (query.shape[-1] ** -0.5 if scaling is None else scaling) * 1.05
        return right(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    registry["trl_ext_varlen_sdpa"] = scaled
before = parameters(wrong)
try:
    wrong.train()
    bad.append("the wrong path trained")
except UsageError as exc:
    text = str(exc)
    expected = "differs from stock by" if state.process_index == 1 else "batch of another rank was out of tolerance"
    if "trl-ext verify: DPOTrainer with padding_free" not in text or expected not in text:
        bad.append(f"unexpected refusal: {text}")
registry["trl_ext_varlen_sdpa"] = right
if wrong.state.global_step != 0 or any(not torch.equal(before[n], p) for n, p in parameters(wrong).items()):
    bad.append("a parameter changed before the refusal")

# 2. verify on and off train alike, bit for bit
runs = {}
for verify in (1, False):
    t = trainer(f"verify-{verify}", verify=verify)
    t.train()
    runs[verify] = (parameters(t), [h for h in t.state.log_history if "loss" in h])
(p_on, l_on), (p_off, l_off) = runs[1], runs[False]
if any(not torch.equal(p_on[n], p_off[n]) for n in p_on):
    bad.append("parameters differ between verify on and off")
strip = ("train_runtime", "train_samples_per_second", "train_steps_per_second")
if [{k: v for k, v in h.items() if k not in strip} for h in l_on] != [
    {k: v for k, v in h.items() if k not in strip} for h in l_off
]:
    bad.append(f"logs differ between verify on and off: {l_on} vs {l_off}")
verified = [line for line in lines if line.startswith("trl-ext verify: DPOTrainer step 1: padding_free equal")]
if state.process_index == 0 and len(verified) != 1:
    bad.append(f"rank 0 logged {len(verified)} verify lines: {lines}")

finish(state, bad, "verify under DDP", "VERIFY DDP OK")
