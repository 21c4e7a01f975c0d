"""2-process (gloo, CPU, DDP) DPO training and evaluation, stock TRL and then `token_budget`, in the same processes.

Launched by tests/plugins/test_token_budget_ranks.py as `torchrun --nproc_per_node 2 token_budget_ranks.py OUT_DIR
ENGINE`, ENGINE `ddp` or `zero2` (DeepSpeed ZeRO-2, which steps the engine on the synchronised backward).
Float64 models, SGD without clipping, gradient accumulation 2 (so a step's micro-batches are spread over two Trainer
micro-steps) and an uneven last step, evaluation batches of 4 pairs per rank (so they are cut too). Each rank writes
`OUT_DIR/<mode>.rank<r>.pt` with the logs, the plugin's per-step and per-evaluation-batch micro-batch counts, and on
rank 0 the final parameters; `refused.rank<r>.pt` holds the message of the refused combination with `sync_metrics`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

OUT, ENGINE = Path(sys.argv[1]), sys.argv[2]
if ENGINE == "zero2":
    # research/deepspeed_cpu.md: skip the shm op JIT build (unused by ZeRO), and create the gloo state before
    # accelerate computes one for DeepSpeed on CPU.
    import importlib

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import PartialState  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer  # noqa: E402

STATE = PartialState(backend="gloo") if ENGINE == "zero2" else PartialState(cpu=True, backend="gloo")
RANK = STATE.process_index
#: padded tokens; the pairs are up to ~50 tokens long: a micro-batch holds 1 pair, or 2 short ones
BUDGET = 120
TOKENIZER = make_tokenizer()
#: 18 pairs, 2 per rank and micro-batch: 5 micro-batches per rank (accelerate completes the last with pairs from the
#: start), so one epoch is 2 steps of 2 micro-batches and a last step of 1
TRAIN = make_preference_dataset(18, seed=1, max_prompt=24, max_completion=24)
EVAL = make_preference_dataset(8, seed=2, max_prompt=24, max_completion=24)


def engine_args() -> dict:
    if ENGINE == "ddp":
        return {"use_cpu": True}
    return {
        "deepspeed": {
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": 2, "overlap_comm": False},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": False},
            "fp16": {"enabled": False},
            "steps_per_print": 10**9,
        },
        "accelerator_config": {"use_configured_state": True},
    }


def build(mode: str) -> DPOTrainer:
    AcceleratorState._reset_state(reset_partial_state=False)
    args = DPOConfig(
        output_dir=str(OUT / "run" / mode),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        max_length=64,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        **engine_args(),
    )
    return DPOTrainer(
        model=make_model(dtype=torch.float64, num_layers=2, seed=0),
        ref_model=make_model(dtype=torch.float64, num_layers=2, seed=1),
        args=args,
        train_dataset=TRAIN,
        eval_dataset=EVAL,
        processing_class=TOKENIZER,
    )


def run(mode: str) -> None:
    installation = trl_ext.install(token_budget=BUDGET) if mode == "plugin" else None
    try:
        trainer = build(mode)
        trainer.train()
        record: dict = {"logs": [dict(entry) for entry in trainer.state.log_history], "rank": RANK}
        record["distributed_type"] = str(trainer.accelerator.distributed_type)
        context = trainer.__dict__.get("_trl_ext")
        if mode == "plugin":
            state = context.state["token_budget"]
            record["micro_batch_counts"] = list(state.micro_batch_counts)
            record["local_micro_batch_counts"] = list(state.local_micro_batch_counts)
            record["eval_micro_batch_counts"] = list(state.eval_micro_batch_counts)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        record["params"] = {n: p.detach().clone() for n, p in policy.named_parameters()} if RANK == 0 else {}
        torch.save(record, OUT / f"{mode}.rank{RANK}.pt")
    finally:
        if installation is not None:
            installation.uninstall()


def refused() -> None:
    with trl_ext.install(token_budget=BUDGET, sync_metrics=True):
        try:
            build("refused")
        except trl_ext.UsageError as error:
            torch.save({"refused": str(error)}, OUT / f"refused.rank{RANK}.pt")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for mode in ("stock", "plugin"):
        run(mode)
        dist.barrier()
    refused()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
