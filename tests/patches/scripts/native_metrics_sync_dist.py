"""Launched by tests/patches/test_native_metrics_sync.py under torchrun (2 processes, DDP on gloo, CPU).

`python native_metrics_sync_dist.py OUT_DIR`: a stock DPOTrainer on the patched TRL (0004) trains 2 steps (each rank
2 pairs per step, so the one logging window holds all 8 pairs) and evaluates the same 8 pairs, with `learning_rate=0`
so every step sees the same weights as the single-process reference. Every `torch.distributed` collective is counted,
separately inside `_compute_loss` and inside `DPOTrainer.log`. Each rank writes its log history and counts to
OUT_DIR/rank<R>.json.
"""

from __future__ import annotations

import json
import os
import sys

OUT = sys.argv[1]
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch.distributed as dist  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

from trl_ext.testing import count_collectives, make_model, make_preference_dataset, make_tokenizer  # noqa: E402

# Same data, models and settings as `_single_process` in the test


def main():
    # `use_cpu=True` makes accelerate see MULTI_CPU under torchrun (it initializes the gloo process group itself)
    args = DPOConfig(
        output_dir=os.path.join(OUT, "run"),
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=2,
        logging_steps=2,
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
    assert trainer.accelerator.num_processes == 2, trainer.accelerator.state

    count = count_collectives()

    in_compute_loss, in_log = [], []
    compute_loss, log = trainer._compute_loss, trainer.log

    def counting_compute_loss(*a, **kw):
        before = count.total
        result = compute_loss(*a, **kw)
        in_compute_loss.append(count.total - before)
        return result

    def counting_log(*a, **kw):
        before = count.total
        log(*a, **kw)
        in_log.append(count.total - before)

    trainer._compute_loss = counting_compute_loss
    trainer.log = counting_log
    trainer.train()
    trainer.evaluate()

    rank = dist.get_rank()
    result = {
        "world": dist.get_world_size(),
        "log_history": trainer.state.log_history,
        "in_compute_loss": in_compute_loss,
        "in_log": in_log,
    }
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
