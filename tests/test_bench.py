"""`trl-ext bench --quick`, run as a user runs it: the report's fields, and a real PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_ext.plugins import BUILTIN_PLUGINS


@pytest.mark.slow
def test_bench_quick_writes_report_and_plot(tmp_path):
    exe = Path(sys.executable).with_name("trl-ext")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", TQDM_DISABLE="1")
    proc = subprocess.run(
        [str(exe), "bench", "--quick", "--only", "padding_free", "--only", "sync_metrics", "--only", "generation"]
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["quick"] is True and report["trl"] and report["model"].startswith("llama")
    sections = report["sections"]
    if "padding_free" in BUILTIN_PLUGINS:
        pf = sections["padding_free"]
        assert 0.2 < pf["padding_fraction"] < 0.9
        assert abs(pf["bound"] - 1 / (1 - pf["padding_fraction"])) < 1e-9
        assert pf["speedup"] > 0 and pf["fraction_of_bound"] > 0  # reported; speed is judged by benchmarks, not tests
        assert len(pf["stock"]["loss"]) == len(pf["trl_ext"]["loss"]) > 0
        assert pf["max_abs_loss_diff"] < 1e-4  # fp32 on both sides: the curves lie on top of each other
    if "sync_metrics" in BUILTIN_PLUGINS:
        co = sections["sync_metrics"]
        assert co["stock"]["world_size"] == 2
        assert co["stock"]["collectives_per_step"] > 5  # TRL gathers each metric every micro-step
        # exactly one per logging step, plus one for the Trainer's final summary log
        assert co["trl_ext"]["collectives_total"] == co["trl_ext"]["logging_steps"] + 1
    if "generation" in BUILTIN_PLUGINS:
        modes = {m["mode"]: m for m in sections["generation"]["modes"]}
        assert all(m["same_tokens"] for m in modes.values())  # greedy tokens identical in every mode
        assert max(modes["ext False"]["peak_bytes_per_rank"]) < 0.5 * max(modes["trl gather"]["peak_bytes_per_rank"])
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(tmp_path / "bench.png")
    assert image.shape[0] > 200 and image.shape[1] > 600
    assert "trl-ext bench" in proc.stdout and "ratio" in proc.stdout
