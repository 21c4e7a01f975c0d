"""Launched by tests/plugins/test_precompute_ref_batch_size.py under torchrun (2 processes).

`python precompute_dist.py {ddp|zero3|zero3-oom} OUT_DIR`: builds stock DPOTrainers with
`precompute_ref_log_probs=True`:

1. TRL native on a file-backed copy of the data (TRL's own precompute crashes on non-main ranks with an in-memory
   dataset, bug B7);
2. the plugin with `precompute_ref_batch_size=3` on the in-memory dataset;
3. the same again with a freshly built in-memory dataset: must come from the cache, with no model forward;
4. the plugin with `"auto"` and a tiny RAM budget (several probes, then planned batches).

Each rank writes what it got to OUT_DIR/rank<R>.json; the test compares.

`zero3-oom` builds only the `"auto"` trainer, and rank 1 runs out of memory in the middle of a forward (a decoder layer
raises `torch.OutOfMemoryError` on batches of more than 2 pairs) while rank 0's forward goes on through ZeRO-3's
parameter gathers: the run must fail at once, not hang in mismatched collectives.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

MODE, OUT = sys.argv[1], sys.argv[2]
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

if MODE.startswith("zero3"):
    # /work/shared/research/deepspeed_cpu.md: skip the shm op JIT build (ZeRO does not use it), and create the gloo
    # state first (accelerate computes backend=None for DeepSpeed on CPU otherwise).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import PartialState

    state = PartialState(backend="gloo")
else:
    from accelerate import PartialState

    state = PartialState(cpu=True, backend="gloo")

import torch  # noqa: E402
from _launched import leave  # noqa: E402
from datasets import load_from_disk  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer  # noqa: E402

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "overlap_comm": False, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
    "steps_per_print": 1000000,
}
ZERO3 = MODE.startswith("zero3")
DTYPE = torch.float32 if ZERO3 else torch.float64
rank = state.process_index
tok = make_tokenizer()


def dataset():
    return make_preference_dataset(37, seed=3, max_prompt=40, max_completion=40)


def eval_dataset():
    return make_preference_dataset(9, seed=4, max_prompt=40, max_completion=40)


def args(name):
    kwargs = dict(
        output_dir=os.path.join(OUT, name),
        report_to=[],
        per_device_train_batch_size=2,
        precompute_ref_log_probs=True,
        max_length=40,
        save_strategy="no",
        seed=0,
        bf16=False,
    )
    if ZERO3:
        kwargs.update(deepspeed=DS_CONFIG, accelerator_config={"use_configured_state": True})
    else:
        kwargs.update(use_cpu=True)
    return DPOConfig(**kwargs)


def build(name, train_dataset, eval_data, out_of_memory=False):
    if ZERO3:
        # accelerate refuses a second DeepSpeed `Accelerator` in one process; each trainer here is independent, so
        # drop the previous trainer's AcceleratorState (the process group, PartialState, stays).
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=False)
    # ZeRO-3: no ref_model, so TRL builds its DeepSpeed inference engine over the policy for the precompute.
    ref = None if ZERO3 else make_model(seed=1, dtype=DTYPE)
    model = make_model(seed=1 if not ZERO3 else 0, dtype=DTYPE)
    calls = [0]
    target = ref if ref is not None else model
    target.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    if out_of_memory and rank == 1:

        def oom(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.shape[0] > 4:
                raise torch.OutOfMemoryError("test: rank 1 ran out of memory in the middle of a forward")

        target.model.layers[1].register_forward_pre_hook(oom, with_kwargs=True)
    trainer = DPOTrainer(
        model,
        args=args(name),
        train_dataset=train_dataset,
        eval_dataset=eval_data,
        processing_class=tok,
        ref_model=ref,
    )
    td, ed = trainer.train_dataset, trainer.eval_dataset
    runs = (
        trainer.__dict__.get("_trl_ext").state["precompute_ref_batch_size"].runs
        if "_trl_ext" in trainer.__dict__
        else []
    )
    return {
        "chosen": list(td["ref_chosen_logps"]),
        "rejected": list(td["ref_rejected_logps"]),
        "prompt_ids": list(td["prompt_ids"]),
        "eval_chosen": list(ed["ref_chosen_logps"]),
        "eval_rejected": list(ed["ref_rejected_logps"]),
        "forwards": calls[0],
        "runs": [{k: v for k, v in r.items() if isinstance(v, (int, float, str, bool))} for r in runs],
        "precompute_engine": type(getattr(trainer, "_precompute_engine", None)).__name__,
    }


result = {"rank": rank, "world": state.num_processes}
if MODE == "zero3-oom":
    options = {"precompute_ref_batch_size": {"cache_dir": os.path.join(OUT, "cache-oom"), "ram_budget": "8GB"}}
    with trl_ext.install(precompute_ref_batch_size="auto", plugins=options):
        build("oom", dataset(), eval_dataset(), out_of_memory=True)
    raise SystemExit(f"rank {rank}: the out-of-memory error did not stop the run")

# 1. native, file-backed
path = os.path.join(OUT, "data")
if state.is_main_process:
    dataset().save_to_disk(path)
    eval_dataset().save_to_disk(path + "-eval")
state.wait_for_everyone()
result["native"] = build("native", load_from_disk(path), load_from_disk(path + "-eval"))

# 2./3. plugin, in-memory, then again from the cache
options = {"precompute_ref_batch_size": {"cache_dir": os.path.join(OUT, "cache"), "shard_size": 8}}
with trl_ext.install(precompute_ref_batch_size=3, plugins=options):
    result["plugin"] = build("plugin", dataset(), eval_dataset())
    result["cached"] = build("cached", dataset(), eval_dataset())

# 4. "auto" with a budget small enough to stop the probe early
options = {"precompute_ref_batch_size": {"cache_dir": os.path.join(OUT, "cache-auto"), "ram_budget": "2MB"}}
with trl_ext.install(precompute_ref_batch_size="auto", plugins=options):
    result["auto"] = build("auto", dataset(), eval_dataset())

with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
state.wait_for_everyone()
leave()
