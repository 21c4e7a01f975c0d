"""Launched by tests/plugins/test_precompute_ref_batch_size.py: one reference precompute, in its own process.

`python precompute_interrupt.py CACHE_DIR OUT_JSON SHARD_INTERVAL SLEEP`: builds a stock DPOTrainer with
`precompute_ref_log_probs=True` on 300 pairs under `precompute_ref_batch_size=2` (default `shard_size`), with each
reference forward slowed by SLEEP seconds so that the test can interrupt it part way; writes what the precompute did
to OUT_JSON when it finishes. The test sends SIGINT (Ctrl-C) to a first run and lets a second one finish.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

# The test's SIGINT must act as a Ctrl-C in a terminal does (KeyboardInterrupt), even when this process inherited
# SIGINT as ignored (children of a shell's background job do, and Python then installs no handler).
signal.signal(signal.SIGINT, signal.default_int_handler)

CACHE, OUT, INTERVAL, SLEEP = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer  # noqa: E402

ref_model = make_model(seed=1, dtype=torch.float64)
forwards = {"n": 0}


def slow(module, args, kwargs):
    forwards["n"] += 1
    time.sleep(SLEEP)


ref_model.register_forward_pre_hook(slow, with_kwargs=True)
args = DPOConfig(
    output_dir=os.path.join(CACHE, "..", "out"),
    per_device_train_batch_size=4,
    max_steps=1,
    report_to=[],
    use_cpu=True,
    precompute_ref_log_probs=True,
    bf16=False,
    max_length=40,
    dataloader_num_workers=0,
)
options = {"cache_dir": CACHE, "shard_interval": INTERVAL}
with trl_ext.install(precompute_ref_batch_size=2, plugins={"precompute_ref_batch_size": options}):
    trainer = DPOTrainer(
        make_model(dtype=torch.float64),
        args=args,
        train_dataset=make_preference_dataset(300, seed=21, max_prompt=24, max_completion=24),
        processing_class=make_tokenizer(),
        ref_model=ref_model,
    )
    run = trainer._trl_ext.state["precompute_ref_batch_size"].runs[0]
with open(OUT, "w") as f:
    json.dump({"forwards": forwards["n"], **{k: v for k, v in run.items() if isinstance(v, (int, float, str))}}, f)
