"""Patch 0004 (`dpo-single-collective-metrics`): DPO metrics reduced with one collective per log, on a real 2-process
run (torchrun, gloo, CPU), equal to a single-process computation over the same pairs.

The 2-process run (tests/patches/scripts/native_metrics_sync_dist.py) trains 2 steps of 2 pairs per rank (one logging
window of all 8 pairs) with `learning_rate=0` and evaluates the same 8 pairs. The reference is the same patched TRL in
this process with one batch of all 8 pairs, i.e. a single micro-step, where the window value is TRL's per-step value
(the mean over the batch's pairs, or over its tokens). Collectives are counted by wrapping the `torch.distributed`
functions (all_reduce, all_gather, all_gather_into_tensor, ...): 0 inside `_compute_loss`, exactly 1 inside every
`DPOTrainer.log`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]

METRICS = [
    "entropy",
    "logits/chosen",
    "logits/rejected",
    "logps/chosen",
    "logps/rejected",
    "mean_token_accuracy",
    "rewards/accuracies",
    "rewards/chosen",
    "rewards/margins",
    "rewards/rejected",
]


def _single_process(tmp_path):
    from trl import DPOConfig, DPOTrainer

    # Same data, models and settings as the launched script, with one batch of all 8 pairs
    args = DPOConfig(
        output_dir=str(tmp_path / "single"),
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        max_steps=1,
        logging_steps=1,
        learning_rate=0.0,
        max_length=48,
        save_strategy="no",
        seed=0,
        bf16=False,
    )
    data = make_preference_dataset(8, seed=3, max_prompt=16, max_completion=24)
    trainer = DPOTrainer(
        make_model(),
        args=args,
        train_dataset=data,
        eval_dataset=data,
        processing_class=make_tokenizer(),
        ref_model=make_model(seed=1),
    )
    trainer.train()
    trainer.evaluate()
    (train,) = [log for log in trainer.state.log_history if "rewards/chosen" in log]
    (evaluation,) = [log for log in trainer.state.log_history if "eval_rewards/chosen" in log]
    return train, evaluation


def _assert_metrics_equal(got, expected, prefix=""):
    for name in METRICS:
        key = prefix + name
        torch.testing.assert_close(
            torch.tensor(got[key], dtype=torch.float64),
            torch.tensor(expected[key], dtype=torch.float64),
            rtol=1e-4,
            atol=1e-5,
            msg=key,
        )
    assert got[prefix + "num_tokens"] == expected[prefix + "num_tokens"]


def test_two_processes_one_collective_per_log(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(SCRIPTS / "native_metrics_sync_dist.py")]
    proc = subprocess.run(cmd + [str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]

    single_train, single_eval = _single_process(tmp_path)
    assert single_train["num_tokens"] > 0
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert result["world"] == 2
        # 2 training steps and 2 evaluation batches per rank; no collective while computing the loss and metrics
        assert result["in_compute_loss"] == [0, 0, 0, 0]
        # the logging step, the training summary and the evaluation: exactly one collective each
        assert result["in_log"] == [1, 1, 1]
        (train,) = [log for log in result["log_history"] if "rewards/chosen" in log]
        (evaluation,) = [log for log in result["log_history"] if "eval_rewards/chosen" in log]
        assert train["step"] == 2
        _assert_metrics_equal(train, single_train)
        _assert_metrics_equal(evaluation, single_eval, prefix="eval_")
    # every rank logs the same values
    for key in METRICS + ["num_tokens"]:
        train0, train1 = ([log for log in r["log_history"] if "rewards/chosen" in log][0] for r in results)
        assert train0[key] == train1[key], key
