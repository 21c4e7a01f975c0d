"""Benchmark of trl-ext's `sync_metrics`: collectives and step time of 2-process DPO training on CPU, stock vs plugin.

    python benchmarks/metric_sync.py [--steps 30] [--rounds 3] [--logging-steps 1] [--batch-size 4]

It launches `torchrun --nproc_per_node 2` (gloo, CPU, one thread per process) on the measuring code that
`trl-ext bench` also runs (`trl_ext/app/_bench_worker.py collectives`): in the same two processes it trains fresh tiny
Llama DPO models, alternating stock TRL and trl-ext with `sync_metrics=True` (stock, plugin, plugin, stock, ...) so
that machine load affects both alike, and reports from rank 0:

- torch.distributed collectives per optimizer step and per logging step (DDP's C++ gradient all-reduce is the same in
  both modes and not counted);
- the median over rounds of the per-round step-time ratio stock / plugin, with its spread.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per training run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (a fixed count)")
    parser.add_argument("--logging-steps", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per rank and step")
    args = parser.parse_args()
    from trl_ext.app.bench.sections import run_collectives
    from trl_ext.app.bench.stats import ratio_text, summarize

    out = Path(tempfile.mkdtemp(prefix="trl-ext-metric-sync-")) / "collectives.json"
    extra = ["--steps", str(args.steps), "--logging-steps", str(args.logging_steps)]
    extra += ["--batch-size", str(args.batch_size), "--rounds", str(args.rounds)]
    report = run_collectives(out, extra)
    stock, ext = report["stock"], report["trl_ext"]
    speed = summarize([a / b for a, b in zip(stock["step_seconds"], ext["step_seconds"], strict=True)])
    print(f"2 processes, {args.steps} steps, logging every {args.logging_steps}, {report['rounds']} rounds")
    for name, r in (("stock", stock), ("sync_metrics", ext)):
        per_log = r["collectives_total"] / max(1, r["logging_steps"])
        print(
            f"{name:13s} collectives/step {r['collectives_per_step']:6.2f}  per logging step {per_log:6.2f}  "
            f"{dict(sorted(r['collectives'].items()))}"
        )
    print(f"step time stock / sync_metrics: {ratio_text(speed)}")
    for flag in speed["flags"]:
        print(f"  !! {flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
