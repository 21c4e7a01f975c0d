"""Launched by tests/plugins/test_prompt_sharing.py under torchrun (2 CPU processes, gloo).

`python prompt_sharing_dispatch.py OUT_DIR`: a stock DPOTrainer and one with `prompt_sharing`, both with
`accelerator_config={"dispatch_batches": True}` (rank 0 loads two batches, concatenates them and sends each rank its
rows), float64 models, SGD: three training steps, then evaluate() and predict() on an IterableDataset. Every rank
checks that the shared run logged what the stock run logged, with every scoring forward shared, and prints
`DISPATCH OK`.
"""

from __future__ import annotations

import math
import os
import sys

OUT = sys.argv[1]
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from accelerate import PartialState  # noqa: E402

state = PartialState(cpu=True, backend="gloo")

import torch  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer  # noqa: E402

torch.set_num_threads(1)
tok = make_tokenizer()
data = make_preference_dataset(16, seed=0, prompt_median=14, completion_median=8)


def trainer(run: str) -> DPOTrainer:
    args = DPOConfig(
        output_dir=os.path.join(OUT, run),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=3,
        logging_steps=1,
        learning_rate=0.1,
        optim="sgd",
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        bf16=False,
        # dispatching concatenates the batches of both ranks along dim 0, which needs one padded length
        max_length=64,
        pad_to_multiple_of=64,
        accelerator_config={"dispatch_batches": True},
    )
    policy = make_model(dtype=torch.float64, seed=0)
    ref = make_model(dtype=torch.float64, seed=1)
    with torch.no_grad():
        policy.get_output_embeddings().weight.mul_(8)
        ref.get_output_embeddings().weight.mul_(8)
    return DPOTrainer(policy, ref_model=ref, args=args, train_dataset=data, processing_class=tok)


def run(t: DPOTrainer) -> list[dict]:
    t.train()
    logs = [log for log in t.state.log_history if "loss" in log]
    eval_data = t.train_dataset.select(range(8)).to_iterable_dataset()
    logs.append(t.evaluate(eval_dataset=eval_data))
    logs.append(t.predict(t.train_dataset.select(range(8)).to_iterable_dataset()).metrics)
    return logs


stock_logs = run(trainer("stock"))
with trl_ext.install(prompt_sharing=True):
    shared = trainer("shared")
    shared_logs = run(shared)
    summary = shared._trl_ext.state["prompt_sharing"].summary()
    assert summary["shared_calls"] >= 3 * 2 + 2 * 2, summary
    assert summary["unshared_calls"] == 0 and summary["unshared_sequences"] == 0, summary

bad = []
assert len(stock_logs) == len(shared_logs) == 5
for s, p in zip(stock_logs, shared_logs, strict=True):
    for key in s:
        if key.endswith(("runtime", "per_second")) or key == "epoch":
            continue
        if not math.isclose(p[key], s[key], rel_tol=1e-6, abs_tol=1e-5):
            bad.append((key, s[key], p[key]))
if bad:
    raise SystemExit(f"rank {state.process_index}: shared != stock: {bad}")
print(f"rank {state.process_index}: {len(stock_logs)} logs equal; DISPATCH OK", flush=True)
state.wait_for_everyone()
torch.distributed.destroy_process_group()

# gloo's threads can outlive the interpreter's teardown and abort a rank that succeeded.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
