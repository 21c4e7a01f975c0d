"""Launched by tests/plugins/test_token_budget_settings.py under torchrun (2 CPU processes, gloo).

`python token_budget_dispatch.py OUT_DIR [sft]`: a stock DPOTrainer and one with `token_budget`, both with
`accelerator_config={"dispatch_batches": True}` (process 0 loads both processes' batches, joins them with accelerate's
`concatenate` and sends each process its rows), float64 models, SGD, gradient accumulation 2: one epoch of training,
then evaluate() on an IterableDataset (dispatched too) with batches over the budget. With `sft`, `loss_type` is RPO's
`["sigmoid", "sft"]`. Every rank checks that the token_budget run logged what the stock run logged and ended with the
same parameters, that micro-batches were re-cut, and prints `DISPATCH OK`.
"""

from __future__ import annotations

import os
import sys

from _launched import differing, finish, sharpened_models, start

OUT = sys.argv[1]
SFT = "sft" in sys.argv[2:]
state = start()

import torch  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.testing import make_preference_dataset, make_tokenizer  # noqa: E402

tok = make_tokenizer()
#: 16 pairs, 2 per process and micro-batch, gradient accumulation 2: two steps of 8 pairs
data = make_preference_dataset(16, seed=1, max_prompt=24, max_completion=24)
#: padded tokens at the fixed width 64 (`pad_to_multiple_of`): one pair per micro-batch (2 x 64)
BUDGET = 128


def trainer(run: str) -> DPOTrainer:
    args = DPOConfig(
        output_dir=os.path.join(OUT, run),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        logging_steps=1,
        learning_rate=0.1,
        optim="sgd",
        max_grad_norm=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        bf16=False,
        # dispatching concatenates the batches of both ranks along dim 0, which needs one padded length (stock too)
        max_length=64,
        pad_to_multiple_of=64,
        accelerator_config={"dispatch_batches": True},
        loss_type=["sigmoid", "sft"] if SFT else ["sigmoid"],
    )
    policy, ref = sharpened_models()
    return DPOTrainer(policy, ref_model=ref, args=args, train_dataset=data, processing_class=tok)


def run(t: DPOTrainer) -> tuple[list[dict], dict[str, torch.Tensor]]:
    initial.update({n: p.detach().clone() for n, p in t.model.named_parameters()})
    t.train()
    logs = [log for log in t.state.log_history if "loss" in log]
    logs.append(t.evaluate(eval_dataset=t.train_dataset.select(range(8)).to_iterable_dataset()))
    return logs, {n: p.detach().clone() for n, p in t.model.named_parameters()}


initial: dict[str, torch.Tensor] = {}
stock_logs, stock_params = run(trainer("stock"))
with trl_ext.install(token_budget=BUDGET):
    cut = trainer("cut")
    cut_logs, cut_params = run(cut)
    budget_state = cut._trl_ext.state["token_budget"]

assert len(stock_logs) == len(cut_logs) == 3, (stock_logs, cut_logs)


def rewards_floor(key: str, log: dict) -> float:
    """Rewards are differences of log-probs (~100 here) scored in float32 by TRL >= 1.15's fused head: their floor is
    beta x 1e-6 x |logps| (tests/plugins/test_token_budget_losses.py `_assert_same_run_sft`)."""
    logps = max(abs(log.get(k, 0.0)) for k in ("logps/chosen", "logps/rejected", "eval_logps/chosen"))
    return max(1e-8, 0.1 * 1e-6 * logps if "rewards/" in key else 0.0)


bad = differing(stock_logs, cut_logs, rel=1e-6, abs_tol=rewards_floor)
# the float32 floor of a float64 run with float32 RMSNorm (tests/plugins/test_token_budget.py): 1e-6 of the change
change = max((stock_params[n] - initial[n]).abs().max().item() for n in stock_params)
worst = max((cut_params[n] - stock_params[n]).abs().max().item() for n in stock_params)
if not change > 1e-4 or worst > 1e-6 * change:
    bad.append(("parameters", change, worst))
# 8 pairs per step over 2 ranks, one per micro-batch: 4 per rank, where stock runs 2
if budget_state.micro_batch_counts != [4, 4] or max(budget_state.eval_micro_batch_counts) < 2:
    bad.append(("counts", budget_state.micro_batch_counts, budget_state.eval_micro_batch_counts))
finish(state, bad, "token_budget != stock", f"{len(stock_logs)} logs equal; DISPATCH OK")
