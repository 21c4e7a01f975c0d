"""Launched by tests/plugins/test_padding_free_coverage.py and tests/plugins/test_prompt_sharing.py under torchrun (2
CPU processes, gloo).

`python packing_dispatch.py PLUGIN OUT_DIR` (PLUGIN: `padding_free` or `prompt_sharing`): a stock DPOTrainer and one
with the plugin, both with `accelerator_config={"dispatch_batches": True}` (rank 0 loads two batches, concatenates
them and sends each rank its rows), float64 models, SGD: three training steps, then evaluate() and predict() on an
IterableDataset. Every rank checks that the plugin's run logged what the stock run logged (prompt_sharing: with every
scoring forward shared) and prints `DISPATCH OK`.
"""

from __future__ import annotations

import os
import sys

from _launched import differing, dpo_args, finish, sharpened_models, start

PLUGIN, OUT = sys.argv[1], sys.argv[2]
state = start()

from trl import DPOTrainer  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.testing import make_preference_dataset, make_tokenizer  # noqa: E402

SHARING = PLUGIN == "prompt_sharing"
tok = make_tokenizer()
data = (
    make_preference_dataset(16, seed=0, prompt_median=14, completion_median=8)
    if SHARING
    else (make_preference_dataset(16, seed=0))
)


def trainer(run: str) -> DPOTrainer:
    # dispatching concatenates the batches of both ranks along dim 0, which needs one padded length (64)
    dispatch = dict(pad_to_multiple_of=64, accelerator_config={"dispatch_batches": True})
    batches = dict(per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=3)
    args = dpo_args(os.path.join(OUT, run), learning_rate=0.1 if SHARING else 1e-2, **batches, **dispatch)
    policy, ref = sharpened_models()
    return DPOTrainer(policy, ref_model=ref, args=args, train_dataset=data, processing_class=tok)


def run(t: DPOTrainer) -> list[dict]:
    t.train()
    logs = [log for log in t.state.log_history if "loss" in log]
    eval_data = t.train_dataset.select(range(8)).to_iterable_dataset()
    logs.append(t.evaluate(eval_dataset=eval_data))
    logs.append(t.predict(t.train_dataset.select(range(8)).to_iterable_dataset()).metrics)
    return logs


stock_logs = run(trainer("stock"))
with trl_ext.install(**{PLUGIN: True}):
    plugin = trainer(PLUGIN)
    plugin_logs = run(plugin)
    if SHARING:
        summary = plugin._trl_ext.state["prompt_sharing"].counts()
        assert summary["shared_calls"] >= 3 * 2 + 2 * 2, summary
        assert summary["unshared_calls"] == 0 and summary["unshared_sequences"] == 0, summary
    else:
        calls = plugin._trl_ext.state["padding_free"].packed_calls
        assert calls >= 3 * 2 + 2, calls

assert len(stock_logs) == len(plugin_logs) == 5
bad = differing(stock_logs, plugin_logs, rel=1e-6, abs_tol=1e-5 if SHARING else 1e-9, skip=("epoch",))
finish(state, bad, f"{PLUGIN} != stock", f"{len(stock_logs)} logs equal; DISPATCH OK")
