"""Launched by tests/patches/test_native_precompute_cache.py under torchrun (2 processes, DDP on gloo).

`python native_precompute_dist.py OUT_DIR`: stock DPOTrainers on the patched TRL with `precompute_ref_log_probs=True`
on an in-memory dataset (stock TRL 1.16 crashes the non-main rank there, bug B7):

1. `memory`: no cache directory, the values stay in memory;
2. `cache_dir`: `precompute_ref_cache_dir=OUT_DIR/cache`, written by the main process;
3. `cached`: the same again on a freshly built dataset: read from the cache, with no reference forward.

Each rank writes what it got to OUT_DIR/rank<R>.json; the test compares with single-process values.
"""

from __future__ import annotations

import json
import os
import sys

OUT = sys.argv[1]
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from accelerate import PartialState  # noqa: E402

state = PartialState(cpu=True, backend="gloo")

import torch  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer  # noqa: E402

# Same data, models and settings as the `build` fixture of the test
tok = make_tokenizer()


def build(name, **overrides):
    ref_model = make_model(seed=1, dtype=torch.float64)
    calls = [0]
    ref_model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    args = DPOConfig(
        output_dir=os.path.join(OUT, name),
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=2,
        precompute_ref_log_probs=True,
        precompute_ref_batch_size=2,
        max_length=32,
        truncation_mode="keep_end",
        save_strategy="no",
        seed=0,
        bf16=False,
        **overrides,
    )
    trainer = DPOTrainer(
        make_model(dtype=torch.float64),
        args=args,
        train_dataset=make_preference_dataset(14, seed=5, max_prompt=24, max_completion=24),
        processing_class=tok,
        ref_model=ref_model,
    )
    ds = trainer.train_dataset
    return {
        "prompt_ids": list(ds["prompt_ids"]),
        "chosen": list(ds["ref_chosen_logps"]),
        "rejected": list(ds["ref_rejected_logps"]),
        "cache_files": [f["filename"] for f in ds.cache_files],
        "forwards": calls[0],
    }


result = {"rank": state.process_index, "world": state.num_processes}
result["memory"] = build("memory")
result["cache_dir"] = build("cache_dir", precompute_ref_cache_dir=os.path.join(OUT, "cache"))
result["cached"] = build("cached", precompute_ref_cache_dir=os.path.join(OUT, "cache"))
with open(os.path.join(OUT, f"rank{state.process_index}.json"), "w") as f:
    json.dump(result, f)
state.wait_for_everyone()
torch.distributed.destroy_process_group()

# gloo's threads can outlive the interpreter's teardown and abort a rank that succeeded (research/deepspeed_cpu.md).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
