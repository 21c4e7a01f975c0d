"""Patch 0005 (`bounded-zero3-generation`): `unwrap_model_for_generation(..., gather_deepspeed3_params=False)` really
bounds memory under DeepSpeed ZeRO-3, on a real 2-process run (torchrun, gloo, CPU).

The launched script (tests/patches/scripts/native_bounded_generation_dist.py) trains a tiny Llama for two steps with
DeepSpeed's default coordinator settings (prefetch bucket 5e7, reuse distance 1e9, live parameters 1e9; under those,
stock TRL's no-gather mode keeps the whole model resident: 723200 of 723200 bytes, checked), then generates greedily
in both modes, sampling the full-size parameter bytes resident on the rank (`ds_status` AVAILABLE) inside every
module's forward, and injects an exception during a no-gather generation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]


def test_bounded_zero3_generation_two_processes(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1", OMP_NUM_THREADS="1", DS_BUILD_OPS="0")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(SCRIPTS / "native_bounded_generation_dist.py")]
    proc = subprocess.run(cmd + [str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]

    for result in ranks:
        # DeepSpeed's defaults were in force: the case where stock TRL holds the whole model
        assert result["user_limits"] == {
            "_PartitionedParameterCoordinator__max_reuse_dist_in_numel": 1_000_000_000,
            "_PartitionedParameterCoordinator__prefetch_bucket_sz": 50_000_000,
            "_PartitionedParameterCoordinator__max_n_available_params": 1_000_000_000,
        }
        # Gathering holds the whole model; not gathering holds one module at a time (the largest, the embedding or
        # the LM head, is 65536 of 723200 bytes), well below half the model
        assert result["gathered_peak"] == result["model_bytes"]
        assert 0 < result["bounded_peak"] < result["model_bytes"] / 2, result
        # Same greedy tokens in both modes, and again after the exception
        assert result["bounded_tokens"] == result["gathered_tokens"]
        assert result["tokens_again"] == result["gathered_tokens"]
        # The user's settings come back after generation and after an exception raised during it
        assert result["limits_after"] == result["user_limits"]
        assert result["exception"] == "injected during generation"
        assert result["limits_after_exception"] == result["user_limits"]
        assert result["loss_after"] > 0
    assert ranks[0]["bounded_tokens"] == ranks[1]["bounded_tokens"]
