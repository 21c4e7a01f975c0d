"""Benchmark of the `precompute_ref_batch_size` plugin: TRL's reference precompute vs trl-ext's, side by side.

    python benchmarks/precompute.py [--repeats 3] [--pairs 256] ...   (`--help` lists the options)

The code lives in `trl_ext/app/_bench_precompute.py`, where `trl-ext bench` uses the same measurement.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.app._bench_precompute", run_name="__main__")
