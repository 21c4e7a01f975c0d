"""Benchmark of the `generation` plugin (every mode, per-rank resident parameter bytes and time, in one run).

    TRL_EXT_LOG_LEVEL=info torchrun --standalone --nproc_per_node 2 benchmarks/generation.py [--json out.json]

The code lives in `trl_ext/app/_bench_generation.py`, so that `trl-ext bench` can run it from an installed package.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.app._bench_generation", run_name="__main__")
