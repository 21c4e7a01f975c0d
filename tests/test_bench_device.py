"""`trl-ext bench --device`: the GPU proof command (issue 39, point 5). On CPU: `--device cuda` without CUDA is a
one-line error, so is `--model` given a file; the kernel probe is recorded as missing where the build has none; the
targets are verdicts computed from the numbers; and `--device cpu --preset tiny` runs every part end to end (slow)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from trl_ext.app import cli
from trl_ext.app.bench import device, device_parts

REPO = Path(__file__).resolve().parents[1]


def _one_line_error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trl-ext: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_device_cuda_without_cuda_is_a_one_line_error(capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _one_line_error(capsys, ["bench", "--device", "cuda", "--out", str(tmp_path / "out")])
    assert "sees no CUDA device" in err and "--device cpu --preset tiny" in err
    assert not (tmp_path / "out").exists()


def test_model_that_is_a_file_is_a_one_line_error(capsys, tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not a model directory")
    err = _one_line_error(capsys, ["bench", "--model", str(weights), "--out", str(tmp_path / "out")])
    assert f"`--model {weights}`: a file" in err
    err = _one_line_error(capsys, ["bench", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert "not found" in err


def test_device_options_are_checked(capsys, tmp_path):
    assert "GPU workload" in _one_line_error(capsys, ["bench", "--device", "cpu", "--preset", "1b"])
    assert "go with `--device`" in _one_line_error(capsys, ["bench", "--preset", "tiny"])
    assert device.check("cpu", None, None) == "tiny"


def _probe_opts() -> argparse.Namespace:
    return argparse.Namespace(device="cpu")


def test_kernel_probe_missing_from_the_build_is_recorded(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl_ext.toolkit.packing.probe", None)  # importing it raises ImportError
    record = device_parts.kernel_probe(_probe_opts(), {})
    assert record == {"kernel_probe": "not available in this build"}


def test_kernel_probe_results_are_recorded(monkeypatch):
    seen = []
    results = [
        {"kernel": "varlen_attn", "dtype": "bfloat16", "pattern": "causal", "error": 1e-3, "tolerance": 5e-3,
         "passed": True, "exception": None},
        {"kernel": "varlen_attn", "dtype": "float16", "pattern": "shared", "error": 0.4, "tolerance": 5e-3,
         "passed": False, "exception": None},
    ]  # fmt: skip
    fake = types.ModuleType("trl_ext.toolkit.packing.probe")
    fake.probe_installed_kernels = lambda device="cuda": seen.append(device) or results  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "trl_ext.toolkit.packing.probe", fake)
    record = device_parts.kernel_probe(_probe_opts(), {})
    assert seen == ["cpu"] and record["kernels"] == results and record["passed"] is False
    report = {"parts": {"kernel_probe": {**record, "status": "done"}}}
    table = device.markdown(_header(report))
    assert "| varlen_attn | float16 | shared | False | 4.00e-01 | 5.00e-03 |  |" in table


def _ratio(median: float, baseline: str = "stock") -> dict:
    return {"median": median, "q1": median * 0.95, "q3": median * 1.05, "ratios": [median], "baseline": baseline}


def _entry(seconds: float, speedup: float | None = None, peak: float | None = None, baseline: str = "stock") -> dict:
    return {
        "step_median_s": seconds,
        "tokens_per_s": 1000 / seconds,
        "step_peak_gb": None if peak is None else 10 * peak,
        "peak_ratio": peak,
        "attention": None,
        "verified_timed_steps": 0,
        **({"speedup": _ratio(speedup, baseline)} if speedup is not None else {}),
    }


def _header(report: dict) -> dict:
    versions = {"trl_ext": "0", "torch": "2.11", "cuda": "13.0", "transformers": "5.24", "trl": "1.16"}
    return {"device": "H100", "preset": "1b", "dtype": "bfloat16", "rounds": 10, "warmup": 2, "versions": versions,
            **report}  # fmt: skip


def test_targets_are_verdicts_computed_from_the_numbers(tmp_path):
    ps = _entry(0.2, 1.5, 0.5)
    ps["speedup_vs_padding_free"] = _ratio(1.25, "padding_free")
    report = _header(
        {
            "parts": {
                "packing": {
                    "status": "done",
                    "token_bound": 2.0,
                    "settings": {"checkpointing_off": {"stock": _entry(0.3), "padding_free": _entry(0.25, 1.5, 0.6),
                                                       "prompt_sharing": ps}},
                },
                "fused_logprobs": {
                    "status": "done",
                    "settings": {"checkpointing_on": {"stock": _entry(0.3), "fused_logprobs": _entry(0.31, 0.97)}},
                },
                "token_budget": {
                    "status": "done",
                    "settings": {"checkpointing_on": {"padding_free": _entry(0.5),
                                                      "token_budget": _entry(0.4, 1.25, 1.2, "padding_free")}},
                },
                "gpu_tests": {"status": "timeout", "summary": "", "seconds": 120.0},
            }
        }
    )  # fmt: skip
    got = {(t["variant"], t["target"]): (t["value"], t["met"]) for t in device.targets(report)}
    assert got == {
        ("padding_free", "speed-up >= 0.8 x the token bound"): (0.75, False),  # 1.5x of a 2.0x bound
        ("prompt_sharing", "speed-up over padding_free >= 1.2"): (1.25, True),
        ("fused_logprobs", "speed >= 0.95 x stock"): (0.97, True),
        ("fused_logprobs", "step peak <= 0.5 x stock's"): (None, None),  # not measured: no verdict
        ("token_budget", "speed-up over padding_free >= 1.3"): (1.25, False),
        ("token_budget", "step peak <= 1.10 x padding_free's"): (1.2, False),
    }
    report["targets"] = device.targets(report)
    table = device.markdown(report)
    assert "| padding_free: speed-up >= 0.8 x the token bound | packing | off | 0.75 | NO |" in table
    assert "| fused_logprobs: step peak <= 0.5 x stock's | fused_logprobs | on | - | not measured |" in table
    assert "| gpu_tests | timeout | 120 |  |" in table and "Token bound of the packing step: 2.00" in table
    if device.matplotlib_missing() is None:
        device.plot(report, tmp_path / "bench.png")
        assert (tmp_path / "bench.png").stat().st_size > 0


@pytest.mark.parametrize("checked", [1, None], ids=["verified-timed-step", "run-before-the-fix"])
def test_no_verdict_where_verify_checked_the_timed_steps(checked):
    """A plugin's step that also ran `verify`'s stock forwards is not the plugin's time: no verdict, and the table
    says why. A run that does not record it (the first H200 run) is taken as checked."""
    entry = _entry(0.25, 1.5, 0.6)
    if checked is None:
        del entry["verified_timed_steps"]
    else:
        entry["verified_timed_steps"] = checked
    settings = {"checkpointing_off": {"stock": _entry(0.3), "padding_free": entry}}
    report = _header({"parts": {"packing": {"status": "done", "token_bound": 2.0, "settings": settings}}})
    report["targets"] = device.targets(report)
    assert [(t["value"], t["met"], t["why"]) for t in report["targets"]] == [(None, None, device.VERIFIED_TIMED)]
    table = device.markdown(report)
    assert f"| off | - | not measured ({device.VERIFIED_TIMED}) |" in table
    assert "**Not the plugins' own times:**" in table


@pytest.mark.slow  # launches a process and waits for its timeout
def test_a_part_past_its_timeout_is_killed_and_keeps_its_json(tmp_path, monkeypatch):
    """The part's process group is killed at its timeout; what it wrote before stays in the report."""
    script = tmp_path / "part.py"
    script.write_text(
        "import json, subprocess, sys, time\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "json.dump({'settings': {'checkpointing_off': {}}}, open(out, 'w'))\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "time.sleep(60)\n"
    )
    real = subprocess.Popen

    def popen(command, **kwargs):
        return real([sys.executable, str(script), *command[3:]], **kwargs)

    monkeypatch.setattr(device.subprocess, "Popen", popen)
    result = device._worker("packing", "cpu", "tiny", None, tmp_path / "packing.json", limit=3)
    assert result["status"] == "timeout" and result["settings"] == {"checkpointing_off": {}}
    assert 3 <= result["seconds"] < 30


@pytest.mark.slow
def test_device_tiny_runs_every_part_end_to_end(tmp_path):
    """`trl-ext bench --device cpu --preset tiny`: the GPU pipeline on a CPU, as CI proves it runs."""
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "trl_ext", "bench", "--device", "cpu", "--preset", "tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    parts = report["parts"]
    assert list(parts) == list(device.PARTS) and report["complete"] is True
    assert {name: p["status"] for name, p in parts.items()} == dict.fromkeys(device.PARTS, "done")
    assert parts["gpu_tests"]["counts"].get("skipped", 0) > 0 and "failed" not in parts["gpu_tests"]["counts"]
    probe = parts["kernel_probe"]
    assert probe.get("kernel_probe") == "not available in this build" or isinstance(probe.get("kernels"), list)
    for name, variants in (("packing", 3), ("fused_logprobs", 2), ("token_budget", 2)):
        assert (out / "parts" / f"{name}.json").exists()
        settings = parts[name]["settings"]
        assert list(settings) == ["checkpointing_off", "checkpointing_on"]
        for setting in settings.values():
            assert len(setting) == variants
            assert all(e["step_median_s"] > 0 and e["tokens_per_s"] > 0 for e in setting.values())
            # the same first step as the baseline (float32 on CPU: the plugins are exact)
            assert all(e["first_loss_rel_diff"] < 1e-4 for e in setting.values()), setting
            # `verify` checked the first step only, as in train(): its stock forwards are in no timed step
            assert all(e["verified_timed_steps"] == 0 for e in setting.values()), setting
    assert parts["packing"]["token_bound"] > 1
    assert parts["packing"]["padded_tokens"] / parts["packing"]["real_tokens"] == parts["packing"]["token_bound"]
    assert parts["token_budget"]["micro_batches_per_step"]["padding_free"] == 2
    assert len(report["targets"]) == 12 and all(t["met"] is None for t in report["targets"] if "peak" in t["target"])
    assert (out / "table.md").read_text().startswith("# trl-ext bench --device: cpu, preset tiny")
    if device.matplotlib_missing() is None:
        assert (out / "bench.png").stat().st_size > 0


@pytest.mark.slow  # 7 s: builds and steps a bench trainer; the end-to-end run checks `verified_timed_steps` too
def test_a_stepper_advances_the_step_as_the_trainers_loop_does(tmp_path):
    """The first GPU run timed `verify`'s two extra stock forwards in every padding_free step: the bench's steps left
    `state.global_step` at 0, so every step was "the first". A `Stepper` step now advances it, as `train()` does, and
    only the first (untimed) step is checked."""
    opts = argparse.Namespace(device="cpu", preset="tiny", tmp=str(tmp_path))
    preset, models, data = device_parts._dpo_setup(opts)
    stepper = device_parts.Stepper(device_parts.dpo_trainer(preset, models, data, opts, {"padding_free": True}), "cpu")
    for index in range(3):
        stepper.step(index)
    assert stepper.trainer.state.global_step == 3 and stepper.checked == [True, False, False]


@pytest.mark.slow  # builds and profiles three tiny DPO trainers (about 20 s)
def test_gpu_profile_runs_its_pipeline_on_a_cpu(tmp_path):
    """`benchmarks/gpu_profile.py --device cpu --preset tiny`: each packing variant timed by phase and profiled, its
    table written; on a CPU there is no device time to report."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_profile", REPO / "benchmarks" / "gpu_profile.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "prof"
    assert script.main(["--device", "cpu", "--preset", "tiny", "--parts", "packing", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for name in ("stock", "padding_free", "prompt_sharing"):
        entry = summary[name]
        phases = entry["get_batch_samples"] + entry["training_step"] + entry["optimizer"]
        assert entry["step"] > 0 and entry["training_step"] > 0 and abs(entry["step"] - phases) < 0.5 * entry["step"]
        assert entry["device_busy_per_step_s"] is None and entry["profiled_steps"] == len(entry["steps"]) > 0
        assert "aten::mm" in [row[0] for row in entry["top_host_self_ms_per_step"]]
        assert (out / f"{name}.txt").read_text().startswith(f"# {name}: ")
    assert summary["stock"]["attention"] is None
    assert summary["padding_free"]["attention"].startswith("per-segment loop (cpu")


def test_the_docs_quote_a_recorded_gpu_run_or_say_not_measured(tmp_path):
    """docs/benchmarks.md's `gpu` part: "not measured" while no run is recorded; the recorded report's table once
    `benchmarks/results/gpu_bench.json` exists."""
    from trl_ext.app import docs

    assert docs.gpu_table(tmp_path, "").startswith("**Not measured:** no `trl-ext bench --device cuda` run")
    report = _header({"parts": {"packing": {"status": "done", "token_bound": 2.0,
                                            "settings": {"checkpointing_off": {"stock": _entry(0.3)}}}}})  # fmt: skip
    report["targets"] = device.targets(report)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / docs.GPU_RESULT).write_text(json.dumps(report))
    table = docs.gpu_table(tmp_path, "")
    assert table.startswith("trl-ext ") and "| packing | off | stock | 0.300 s |" in table
    assert "Token bound of the packing step: 2.00" in table and not table.startswith("#")
