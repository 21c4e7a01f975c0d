"""Worker for `trl-ext bench` runs that need several processes (launched with torchrun; gloo on CPU).

`collectives`: trains a tiny DPO model for a few steps and counts every `torch.distributed` collective issued during
training, per optimizer step and per logging step.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

# Every collective (and point-to-point call) `torch.distributed` 2.13 exposes; newer names such as
# `all_gather_single` matter, since recent code prefers them.
_COLLECTIVES = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
)


def count_collectives(counter: dict[str, int]) -> None:
    """Wrap the `torch.distributed` collectives so each call increments `counter[name]` (while `counter['on']`)."""
    import torch.distributed as dist

    for name in _COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*args, __original=original, __name=name, **kwargs):
            if counter.get("on"):
                counter[__name] = counter.get(__name, 0) + 1
            return __original(*args, **kwargs)

        setattr(dist, name, functools.wraps(original)(wrapper))


def _collectives(args: argparse.Namespace) -> None:
    os.environ.setdefault("TQDM_DISABLE", "1")
    from accelerate import PartialState

    # `cpu=True` is what makes accelerate treat a torchrun launch on CPU as MULTI_CPU (gloo); without it (even with
    # backend="gloo") accelerate 1.15 reports DistributedType.NO and its gathers silently do nothing.
    state = PartialState(cpu=True)
    assert state.num_processes > 1 and state.distributed_type.name == "MULTI_CPU", state
    counter: dict[str, int] = {}
    count_collectives(counter)
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    import trl_ext
    from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer

    steps = 4 if args.quick else 8
    tokenizer = make_tokenizer()

    class Window(TrainerCallback):
        def __init__(self) -> None:
            self.step_times: list[float] = []

        def on_train_begin(self, *a, **k):
            counter.clear()
            counter["on"] = 1

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.step_times.append(time.perf_counter() - self._t)

        def on_train_end(self, *a, **k):
            counter["on"] = 0

    window = Window()
    config = DPOConfig(
        output_dir=args.out + ".runs",
        per_device_train_batch_size=4,
        max_steps=steps,
        logging_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        accelerator_config={"use_configured_state": True},
    )
    with trl_ext.install(sync_metrics=args.sync_metrics):
        trainer = DPOTrainer(
            make_model(seed=0),
            ref_model=make_model(seed=0),
            args=config,
            train_dataset=make_preference_dataset(40),
            processing_class=tokenizer,
            callbacks=[window],
        )
        trainer.train()
    total = sum(v for k, v in counter.items() if k != "on")
    logging_steps = steps // 2
    result = {
        "world_size": state.num_processes,
        "optimizer_steps": steps,
        "logging_steps": logging_steps,
        "collectives": {k: v for k, v in counter.items() if k != "on"},
        "collectives_total": total,
        "collectives_per_step": total / steps,
        "step_seconds": sorted(window.step_times[1:])[len(window.step_times[1:]) // 2],
    }
    if state.is_main_process:
        with open(args.out, "w") as f:
            json.dump(result, f)
    state.wait_for_everyone()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m trl_ext._bench_worker")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collectives")
    c.add_argument("--out", required=True)
    c.add_argument("--sync-metrics", action="store_true")
    c.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    code = 1
    try:
        _collectives(args)
        code = 0
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # gloo sometimes aborts at interpreter exit; see research/deepspeed_cpu.md


if __name__ == "__main__":
    main()
