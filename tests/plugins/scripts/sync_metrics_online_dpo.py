"""2-process (gloo, CPU) OnlineDPO training with a reward function, with or without trl-ext's `sync_metrics`.

Launched by tests/plugins/test_sync_metrics.py as
`torchrun --nproc_per_node 2 sync_metrics_online_dpo.py OUT_DIR both` (stock TRL, then the plugin, in the same two
processes).

Uneven data: 5 prompts, 2 per rank and step, one epoch of 2 steps, a log at every step. The last step holds 3
duplicate prompts: rank 0 gets 1 real prompt, rank 1 none. `missing_eos_penalty` is set so that TRL's in-place reward
penalty is exercised. Generation is sampled, so each rank records what `_generate` returned; the test replays those
completions through a single-process stock OnlineDPOTrainer to recompute every logged value.

Each rank writes `OUT_DIR/<mode>.rank<r>.pt`: the logs, every step's prompts and generation output, the policy weights
of every step, and the collective counts (as in sync_metrics_dpo.py).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# -- count collectives (reentrancy-guarded: one collective may call another) ------------------------------------------
from trl_ext.testing import count_collectives  # noqa: E402

COUNT = count_collectives()

from transformers import TrainerCallback  # noqa: E402
from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.testing import length_reward, make_model, make_prompt_dataset, make_tokenizer  # noqa: E402


class Timeline(TrainerCallback):
    def __init__(self, events):
        self.events = events

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(("step_begin", state.global_step, COUNT.total))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step, COUNT.total))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("on_log", state.global_step, COUNT.total))


def eos_prone_model():
    """A tiny Llama whose EOS logit is a scaled copy of another token's, so completions end at varied lengths (an
    untrained 256-word model almost never samples EOS, and every completion would score the same)."""
    model = make_model(seed=0)
    with torch.no_grad():
        model.lm_head.weight[1] = 40.0 * model.lm_head.weight[7]
    return model


def run(out_dir: str, mode: str) -> None:
    args = OnlineDPOConfig(
        output_dir=os.path.join(out_dir, f"run-{mode}"),
        per_device_train_batch_size=2,
        num_train_epochs=1,
        logging_steps=1,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast; fp32 so that the single-process recomputation is exact
        save_strategy="no",
        max_new_tokens=6,
        missing_eos_penalty=1.0,
        seed=0,
        disable_tqdm=True,
    )
    installation = trl_ext.install(sync_metrics=True) if mode == "plugin" else None
    trainer = OnlineDPOTrainer(
        model=eos_prone_model(),
        ref_model=eos_prone_model(),
        reward_funcs=length_reward,
        args=args,
        train_dataset=make_prompt_dataset(5, seed=3),
        processing_class=make_tokenizer(),
    )
    rank = trainer.accelerator.process_index
    events, logs, steps, weights = [], [], [], {}
    trainer.add_callback(Timeline(events))

    original_log = trainer.log

    def log(entry, *a, **kw):
        events.append(("log_enter", trainer.state.global_step, COUNT.total))
        original_log(entry, *a, **kw)
        events.append(("log_exit", trainer.state.global_step, COUNT.total))
        logs.append((trainer.state.global_step, dict(entry)))

    trainer.log = log

    original_training_step = trainer.training_step
    original_generate = trainer._generate

    def training_step(model, inputs, *a, **kw):
        step = trainer.state.global_step
        weights[step] = {
            k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(model).state_dict().items()
        }
        steps.append({"step": step, "prompts": list(inputs["prompt"]), "generated": None})
        return original_training_step(model, inputs, *a, **kw)

    def generate(*a, **kw):
        out = original_generate(*a, **kw)
        steps[-1]["generated"] = tuple(t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t for t in out)
        return out

    trainer.training_step = training_step
    trainer._generate = generate
    trainer.train()
    torch.save(
        {
            "rank": rank,
            "logs": logs,
            "total_flos": trainer.state.total_flos,
            "events": events,
            "steps": steps,
            "weights": weights if rank == 0 else {},
            "ref_weights": trainer.ref_model.state_dict() if rank == 0 else {},
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
    # gloo's threads can outlive the interpreter's teardown and abort a rank that succeeded (deepspeed_cpu.md).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
