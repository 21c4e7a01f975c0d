"""Benchmark of trl-ext's `sync_metrics`: collectives and step time of 2-process DPO training on CPU, stock vs plugin.

Run:

    python benchmarks/metric_sync.py [--steps 30] [--reps 3] [--logging-steps 1] [--batch-size 4]

It relaunches itself with `torchrun --nproc_per_node 2` (gloo, CPU, one thread per process). In the same two
processes it trains fresh tiny Llama DPO models `--reps` times per mode, alternating stock TRL and trl-ext with
`sync_metrics=True` (stock, plugin, plugin, stock, ...) so that machine load affects both alike, and reports, from
rank 0:

- torch.distributed collectives issued from Python per optimizer step and per logging step (DDP's C++ gradient
  all-reduce is the same in both modes and not counted);
- the median wall time of an optimizer step (from one `on_step_end` to the next, so logging is included);
- the ratios plugin / stock, measured in this one run.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time


def _parse():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per training run")
    parser.add_argument("--reps", type=int, default=3, help="training runs per mode (alternating)")
    parser.add_argument("--logging-steps", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per rank and step")
    parser.add_argument("--hidden-size", type=int, default=128)
    return parser.parse_args()


def _relaunch() -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__, *sys.argv[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
    return subprocess.call(cmd, env=env)


def _worker(opts) -> None:
    import torch.distributed as dist

    count = {"n": 0, "depth": 0}

    def counting(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if count["depth"] == 0:
                count["n"] += 1
            count["depth"] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                count["depth"] -= 1

        return wrapper

    for name in (
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "broadcast",
        "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
        "all_to_all_single", "gather", "gather_object", "scatter", "barrier",
    ):  # fmt: skip
        if hasattr(dist, name):
            setattr(dist, name, counting(getattr(dist, name)))

    import transformers
    from transformers import PrinterCallback, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    import trl_ext
    from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer

    transformers.logging.set_verbosity_error()

    class Probe(TrainerCallback):
        def __init__(self):
            self.step_counts, self.log_counts, self.step_times = [], [], []
            self._begin = self._end = self._t = None

        def on_step_begin(self, args, state, control, **kwargs):
            self._begin = count["n"]

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self._t is not None:
                self.step_times.append(now - self._t)
            self._t = now
            self.step_counts.append(count["n"] - self._begin)
            self._end = count["n"]

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in (logs or {}):
                self.log_counts.append(count["n"] - self._end)

    tokenizer = make_tokenizer()
    model_kwargs = dict(hidden_size=opts.hidden_size, num_layers=2, num_heads=4, num_kv_heads=2)
    n_pairs = 2 * opts.batch_size * opts.steps  # one epoch covers the run: no epoch-end duplicates
    dataset = make_preference_dataset(n_pairs, seed=1)
    results = {"stock": [], "plugin": []}
    order = [m for rep in range(opts.reps) for m in (("stock", "plugin") if rep % 2 == 0 else ("plugin", "stock"))]
    for i, mode in enumerate(order):
        args = DPOConfig(
            output_dir=f"/tmp/trl_ext_bench_metric_sync/{mode}{i}",
            per_device_train_batch_size=opts.batch_size,
            max_steps=opts.steps,
            logging_steps=opts.logging_steps,
            learning_rate=1e-4,
            report_to=[],
            use_cpu=True,
            bf16=False,
            save_strategy="no",
            seed=0,
            disable_tqdm=True,
        )
        installation = trl_ext.install(sync_metrics=True) if mode == "plugin" else None
        try:
            trainer = DPOTrainer(
                model=make_model(seed=0, **model_kwargs),
                ref_model=make_model(seed=1, **model_kwargs),
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
            )
            probe = Probe()
            trainer.add_callback(probe)
            trainer.remove_callback(PrinterCallback)  # keep the output to the summary table
            trainer.train()
        finally:
            if installation is not None:
                installation.uninstall()
        results[mode].append(probe)
        dist.barrier()

    if dist.get_rank() == 0:
        summary = {}
        for mode, probes in results.items():
            times = [t for p in probes for t in p.step_times[2:]]  # skip warm-up steps
            summary[mode] = {
                "collectives/step": statistics.mean(c for p in probes for c in p.step_counts),
                "collectives/logging step": statistics.mean(c for p in probes for c in p.log_counts),
                "median step (ms)": 1e3 * statistics.median(times),
            }
        print(
            f"\nsync_metrics benchmark: 2 processes (gloo, CPU), {opts.steps} steps x {opts.reps} runs per mode, "
            f"{opts.batch_size} pairs/rank/step, logging every {opts.logging_steps} step(s), hidden {opts.hidden_size}"
        )
        print(f"{'':28s}{'stock':>12s}{'plugin':>12s}{'plugin/stock':>14s}")
        for key in summary["stock"]:
            s, p = summary["stock"][key], summary["plugin"][key]
            ratio = f"{p / s:.3f}" if s else "-"
            print(f"{key:28s}{s:12.2f}{p:12.2f}{ratio:>14s}")
        per_rep = [
            statistics.median(p.step_times[2:]) / statistics.median(s.step_times[2:])
            for s, p in zip(results["stock"], results["plugin"], strict=True)
        ]
        print(f"step-time ratio per paired run (plugin/stock): {', '.join(f'{r:.3f}' for r in per_rep)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    options = _parse()
    if "LOCAL_RANK" not in os.environ:
        sys.exit(_relaunch())
    _worker(options)
