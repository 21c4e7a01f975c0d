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
        [str(exe), "bench", "--quick", "--rounds", "3", "--seconds", "0", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["quick"] is True and report["trl"] and report["model"].startswith("llama")
    sections = report["sections"]
    assert report["rounds"] == 3 and report["load_average"]["cores"] == os.cpu_count()
    if "padding_free" in BUILTIN_PLUGINS:
        pf = sections["padding_free"]
        assert 0.2 < pf["padding_fraction"] < 0.9
        assert pf["bound"] == max(pf["token_bound"], pf["attention_bound"]) >= 1 / (1 - pf["padding_fraction"]) - 1e-9
        _check_ratio(pf["speedup"], bound=pf["bound"])
        assert len(pf["stock"]["pass_seconds"]) == len(pf["trl_ext"]["pass_seconds"]) == pf["speedup"]["rounds"]
        assert len(pf["stock"]["loss"]) == len(pf["trl_ext"]["loss"]) == pf["batches"] > 0
        assert len(set(pf["stock"]["loss"])) > 1  # the losses depend on the batch (policy != reference)
        assert pf["max_abs_loss_diff"] < 1e-4  # fp32 on both sides: the same losses on the same batches
    if "sync_metrics" in BUILTIN_PLUGINS:
        co = sections["sync_metrics"]
        assert co["stock"]["world_size"] == 2
        assert co["stock"]["collectives_per_step"] > 5  # TRL gathers each metric every micro-step
        # exactly one per logging step, plus one for the Trainer's final summary log
        assert co["trl_ext"]["collectives_total"] == co["trl_ext"]["logging_steps"] + 1
        _check_ratio(co["step_time_ratio"], bound=None)
        assert report["headline"]["sync_metrics_collectives_per_step"] == co["trl_ext"]["collectives_per_step"]
    if "generation" in BUILTIN_PLUGINS:
        modes = {m["mode"]: m for m in sections["generation"]["modes"]}
        assert all(m["same_tokens"] for m in modes.values())  # greedy tokens identical in every mode
        assert max(modes["ext False"]["peak_bytes_per_rank"]) < 0.5 * max(modes["trl gather"]["peak_bytes_per_rank"])
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(tmp_path / "bench.png")
    assert image.shape[0] > 200 and image.shape[1] > 600
    assert "trl-ext bench" in proc.stdout and "median of per-round" in proc.stdout and "load average" in proc.stdout


def _check_ratio(r, bound):
    """A ratio is reported as the median of per-round ratios with its spread, and flagged when it looks wrong."""
    assert r["rounds"] >= 3 and len(r["ratios"]) == r["rounds"]
    assert r["min"] <= r["q1"] <= r["median"] <= r["q3"] <= r["max"]
    assert ("ABOVE BOUND" in " ".join(r["flags"])) == (bound is not None and r["median"] > 1.02 * bound)
    assert ("WIDE SPREAD" in " ".join(r["flags"])) == (r["spread"] > 0.15)


def test_summarize_flags_ratios_above_bound_below_one_and_wide():
    from trl_ext.app.bench import summarize

    ok = summarize([2.0, 2.1, 1.9, 2.0], bound=3.0)
    assert ok["median"] == 2.0 and ok["flags"] == [] and ok["q1"] <= 2.0 <= ok["q3"]
    assert any("ABOVE BOUND" in f for f in summarize([4.1, 4.2, 4.0], bound=2.2)["flags"])
    assert any("SLOWER" in f for f in summarize([0.8, 0.9, 0.85])["flags"])
    assert any("WIDE SPREAD" in f for f in summarize([1.0, 2.0, 3.0])["flags"])


def test_interleave_alternates_arms_and_stops_when_the_ratios_agree():
    from trl_ext.app.bench import interleave

    calls = []

    def arm(name, seconds):
        def run(index):
            calls.append((index, name))
            return seconds

        return run

    times = interleave({"stock": arm("stock", 2.0), "ext": arm("ext", 1.0)}, rounds=3, seconds=60, what="t")
    assert times == {"stock": [2.0] * 3, "ext": [1.0] * 3}  # equal ratios: stops after the minimum
    assert calls == [(0, "stock"), (0, "ext"), (1, "ext"), (1, "stock"), (2, "stock"), (2, "ext")]
    noisy = iter([1.0, 3.0, 1.0, 1.5, 1.0] * 20)
    times = interleave(
        {"stock": lambda i: next(noisy), "ext": lambda i: 1.0}, rounds=3, seconds=60, what="t", max_rounds=7
    )
    assert len(times["stock"]) == 7  # the spread never settles: rounds are added up to the cap
