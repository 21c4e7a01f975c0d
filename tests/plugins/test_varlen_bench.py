"""benchmarks/gpu_packing.py (the GPU benchmark of the packing plugins' attention): its arguments, and one round of
its `--tiny` CPU smoke run (the timing itself needs a GPU and is not run here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_packing.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_packing", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments(bench):
    args = bench.parse_args([])
    assert (args.device, args.pairs, args.batches, args.max_length) == ("cuda", 8, 6, 2048)
    assert (args.rounds, args.warmup, args.checkpointing, args.optimizer) == (20, 2, "both", True)
    assert bench.variants(args) == ("stock", "padding_free", "prompt_sharing")
    assert bench.MODEL == dict(
        hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4, intermediate_size=5632, vocab_size=32000
    )
    args = bench.parse_args(["--segments", "--no-optimizer", "--checkpointing", "on", "--rounds", "3"])
    assert len(bench.variants(args)) == 5 and not args.optimizer and args.rounds == 3
    tiny = bench.parse_args(["--tiny"])
    assert (tiny.device, tiny.rounds, tiny.warmup, tiny.pairs, tiny.max_length) == ("cpu", 1, 0, 2, 128)
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--checkpointing", "sometimes"])


def test_lengths_follow_the_measured_distribution(bench):
    rows = bench.make_rows(200, 32000, bench.DATA, seed=0)
    prompts = [len(r["prompt"].split()) for r in rows]
    completions = [len(r[k].split()) for r in rows for k in ("chosen", "rejected")]
    assert 32 <= min(prompts) and max(prompts) <= 512 and 16 <= min(completions) and max(completions) <= 1024
    assert sorted(prompts)[100] in range(96, 170) and sorted(completions)[200] in range(140, 250)  # the medians


@pytest.mark.slow  # ~30 s: six tiny trainers' steps
def test_tiny_smoke_round(bench, tmp_path):
    out = tmp_path / "gpu_packing.json"
    assert bench.main(["--tiny", "--checkpointing", "both", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["settings"]) == {"checkpointing_off", "checkpointing_on"}
    for setting in report["settings"].values():
        assert set(setting) == {"stock", "padding_free", "prompt_sharing"}
        for name, entry in setting.items():
            assert len(entry["step_s"]) == 1 and entry["step_median_s"] > 0
            assert entry["first_loss_rel_diff"] < 1e-4  # float32: the plugins' first loss is stock's
            if name != "stock":
                assert entry["speedup"]["rounds"] == 1
                assert entry["attention"].startswith("per-segment loop (cpu, float32")
    assert all(b["real"] < b["padded"] for b in report["batches"])
