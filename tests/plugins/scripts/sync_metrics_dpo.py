"""2-process (gloo, CPU) DPO training and evaluation, with or without trl-ext's `sync_metrics`.

Launched by tests/plugins/test_sync_metrics.py as `torchrun --nproc_per_node 2 sync_metrics_dpo.py OUT_DIR WHICH`:
WHICH `both` runs stock TRL and then the plugin in the same two processes; `zero3` runs the plugin under DeepSpeed
ZeRO-3 (learning rate 0, no weight dumps).

Deliberately uneven data: 9 training pairs with 2 pairs per rank and micro-batch (accelerate adds 3 duplicate pairs to
the last batch of each epoch: rank 0 gets 1 real pair, rank 1 none), gradient accumulation 2, two epochs, a log at
every optimizer step; then two evaluations, of 3 pairs (rank 1 gets 1 real pair and 1 duplicate) and of 1 pair
(smaller than the world size: rank 1 sees only a duplicate).

Each rank writes `OUT_DIR/<mode>.rank<r>.pt` with everything the test needs to recompute every logged value in a
single process: the logs, every batch `compute_loss` saw (phase, optimizer step), the policy weights each optimizer
step ran with, and the number of torch.distributed collectives issued per optimizer step, per logging step and inside
each `trainer.log` call (Python-level calls; DDP's C++ gradient all-reduce is not counted, it is the same in both
modes).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
ZERO3 = len(sys.argv) > 2 and sys.argv[2] == "zero3"
if ZERO3:
    # /work/shared/research/deepspeed_cpu.md: DeepSpeed on CPU needs an explicit gloo state before accelerate computes
    # one, and the shm op it would JIT-compile (65 s) is never used by ZeRO.
    import importlib

    os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    from accelerate import PartialState

    PartialState(backend="gloo")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# -- count collectives (reentrancy-guarded: one collective may call another) ------------------------------------------
from trl_ext.testing import count_collectives  # noqa: E402

COUNT = count_collectives()

from transformers import TrainerCallback  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer  # noqa: E402


class Timeline(TrainerCallback):
    def __init__(self, events):
        self.events = events

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(("step_begin", state.global_step, COUNT.total))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step, COUNT.total))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("on_log", state.global_step, COUNT.total))


def run(out_dir: str, mode: str) -> None:
    tokenizer = make_tokenizer()
    model_kwargs = {}
    train = make_preference_dataset(9, seed=1)
    cfg = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=1e-2)
    if ZERO3:
        # ZeRO-3 with the plugin; learning rate 0 so that every window is recomputed with the initial weights (the
        # ZeRO-3 parameters are partitioned and not dumped).
        cfg["learning_rate"] = 0.0
        cfg["deepspeed"] = {
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": 3, "overlap_comm": False},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        cfg["accelerator_config"] = {"use_configured_state": True}
    args = DPOConfig(
        output_dir=os.path.join(out_dir, f"run-{mode}"),
        per_device_eval_batch_size=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast; fp32 so that the single-process recomputation is exact
        save_strategy="no",
        seed=0,
        dataloader_drop_last=False,
        disable_tqdm=True,
        **cfg,
    )
    installation = trl_ext.install(sync_metrics=True) if mode in ("plugin", "zero3") else None
    trainer = DPOTrainer(
        model=make_model(seed=0, **model_kwargs),
        ref_model=make_model(seed=1, **model_kwargs),
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
    )
    rank = trainer.accelerator.process_index
    events, logs, batches, weights = [], [], [], {}
    trainer.add_callback(Timeline(events))

    original_log = trainer.log

    def log(entry, *a, **kw):
        events.append(("log_enter", trainer.state.global_step, COUNT.total))
        original_log(entry, *a, **kw)
        events.append(("log_exit", trainer.state.global_step, COUNT.total))
        logs.append((trainer.state.global_step, "train" if trainer.model.training else "eval", dict(entry)))

    trainer.log = log

    original_compute_loss = trainer.compute_loss
    phase = {"name": "train"}

    def compute_loss(model, inputs, *a, **kw):
        key = phase["name"] if phase["name"] != "train" else trainer.state.global_step
        if key not in weights and not ZERO3:
            weights[key] = {
                k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(model).state_dict().items()
            }
        cpu = {k: v.detach().cpu().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        batches.append({"phase": phase["name"], "step": trainer.state.global_step, "inputs": cpu})
        return original_compute_loss(model, inputs, *a, **kw)

    trainer.compute_loss = compute_loss

    trainer.train()
    for name, n in (("eval3", 3), ("eval1", 1)):
        phase["name"] = name
        trainer.evaluate(make_preference_dataset(n, seed=7))
    state = trainer._trl_ext.state.get("sync_metrics") if hasattr(trainer, "_trl_ext") else None
    torch.save(
        {
            "rank": rank,
            "logs": logs,
            "events": events,
            "batches": batches,
            "weights": weights if rank == 0 else {},
            "total_flos": trainer.state.total_flos,
            "plugin_collectives": getattr(state, "collectives", None),
            "final_params": {}
            if ZERO3
            else {
                k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()
            },
        },
        os.path.join(out_dir, f"{mode}.rank{rank}.pt"),
    )
    if installation is not None:
        installation.uninstall()


def main(out_dir: str, which: str) -> None:
    for mode in ("stock", "plugin") if which == "both" else (which,):
        run(out_dir, mode)
        dist.barrier()
    dist.destroy_process_group()
    if ZERO3:  # a gloo thread finishing a ZeRO-3 all-gather can abort interpreter exit (deepspeed_cpu.md)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
