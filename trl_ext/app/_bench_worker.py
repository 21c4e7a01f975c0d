"""Worker for `trl-ext bench` runs that need several processes (launched with torchrun; gloo on CPU).

`collectives`: trains a tiny DPO model for a few steps, stock and with `sync_metrics`, in interleaved rounds in the
same processes, and counts every `torch.distributed` collective issued during training (per optimizer step and per
logging step) and the mean step time of each run. `benchmarks/metric_sync.py` and `trl-ext bench` both run it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time


def _collectives(args: argparse.Namespace) -> None:
    os.environ.setdefault("TQDM_DISABLE", "1")
    from accelerate import PartialState

    # `cpu=True` is what makes accelerate treat a torchrun launch on CPU as MULTI_CPU (gloo); without it (even with
    # backend="gloo") accelerate 1.15 reports DistributedType.NO and its gathers silently do nothing.
    state = PartialState(cpu=True)
    assert state.num_processes > 1 and state.distributed_type.name == "MULTI_CPU", state
    from .bench.stats import interleave
    from .bench.workload import count_collectives

    counter = count_collectives()
    counter.enabled = False
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    import trl_ext

    from .bench.workload import make_model, make_preference_dataset, make_tokenizer

    steps = args.steps or (4 if args.quick else 8)
    tokenizer = make_tokenizer()

    class Window(TrainerCallback):
        def __init__(self) -> None:
            self.step_times: list[float] = []

        def on_train_begin(self, *a, **k):
            counter.reset()
            counter.enabled = True

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.step_times.append(time.perf_counter() - self._t)

        def on_train_end(self, *a, **k):
            counter.enabled = False

    counts: dict[str, dict[str, int]] = {}

    def train(mode: str, index: int) -> float:
        """One training run; its mean step time. The collectives of each mode's first run are kept."""
        window = Window()
        config = DPOConfig(
            output_dir=args.out + ".runs",
            per_device_train_batch_size=args.batch_size,
            max_steps=steps,
            logging_steps=args.logging_steps,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
            disable_tqdm=True,
            accelerator_config={"use_configured_state": True},
        )
        with trl_ext.install(sync_metrics=mode == "trl_ext"):
            trainer = DPOTrainer(
                make_model(seed=0),
                ref_model=make_model(seed=0),
                args=config,
                train_dataset=make_preference_dataset(10 * args.batch_size * state.num_processes),
                processing_class=tokenizer,
                callbacks=[window],
            )
            trainer.train()
        counts.setdefault(mode, dict(counter.by_name))
        times = window.step_times[1:] or window.step_times
        return sum(times) / len(times)

    # A fixed number of interleaved rounds in the same processes: per-round step-time ratios.
    modes = {mode: functools.partial(train, mode) for mode in ("stock", "trl_ext")}
    seconds = interleave(modes, rounds=args.rounds, what="collectives", report=None)
    logging_steps = steps // args.logging_steps
    result = {"world_size": state.num_processes, "rounds": len(seconds["stock"])}
    for mode in ("stock", "trl_ext"):
        total = sum(counts[mode].values())
        result[mode] = {
            "world_size": state.num_processes,
            "optimizer_steps": steps,
            "logging_steps": logging_steps,
            "collectives": counts[mode],
            "collectives_total": total,
            "collectives_per_step": total / steps,
            "step_seconds": seconds[mode],
        }
    if state.is_main_process:
        with open(args.out, "w") as f:
            json.dump(result, f)
    state.wait_for_everyone()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m trl_ext.app._bench_worker")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collectives")
    c.add_argument("--out", required=True)
    c.add_argument("--quick", action="store_true")
    c.add_argument("--steps", type=int, default=None, help="optimizer steps per training run (quick: 4, else 8)")
    c.add_argument("--logging-steps", type=int, default=2)
    c.add_argument("--batch-size", type=int, default=4, help="pairs per rank and step")
    c.add_argument("--rounds", type=int, default=3, help="interleaved rounds (a fixed count)")
    args = parser.parse_args()
    code = 1
    try:
        _collectives(args)
        code = 0
    except BaseException:  # printed here: os._exit below skips the interpreter's own report
        import traceback

        traceback.print_exc()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # gloo can abort at interpreter exit after a successful run


if __name__ == "__main__":
    main()
