"""`trl-ext dpo` / `trl-ext online-dpo`: TRL's scripts with plugins, from a YAML recipe, in 1 and 2 processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trl_ext import UsageError
from trl_ext.app.jobs import split_argv, split_yaml_config
from trl_ext.plugins import BUILTIN_PLUGINS
from trl_ext.testing import make_model, make_tokenizer, preference_rows

#: The plugins this job test switches on through the recipe (those that are built in this release).
RECIPE_FLAGS = {k: v for k, v in {"padding_free": True, "sync_metrics": True}.items() if k in BUILTIN_PLUGINS}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("job")
    model_dir = root / "model"
    make_model(seed=0).save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    data_dir = root / "data"
    data_dir.mkdir()
    with open(data_dir / "train.jsonl", "w") as f:
        for row in preference_rows(12, seed=1):
            f.write(json.dumps(row) + "\n")
    with open(root / "prompts.jsonl", "w") as f:
        for row in preference_rows(8, seed=2, prompt_median=5):
            f.write(json.dumps({"prompt": [{"role": "user", "content": row["prompt"]}]}) + "\n")
    return root


def _recipe(assets: Path, out: Path, trl_ext_section: dict) -> Path:
    recipe = {
        "model_name_or_path": str(assets / "model"),
        "dataset_name": str(assets / "data"),
        "output_dir": str(out),
        "per_device_train_batch_size": 2,
        "max_steps": 2,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "max_length": 64,
        "trl_ext": trl_ext_section,
    }
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _env():
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TRL_EXT_LOG_LEVEL="info", OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def _expect_active(stdout: str, trainer: str, flags: dict) -> None:
    line = next(line for line in stdout.splitlines() if line.startswith(f"[trl-ext] {trainer} ran with plugins:"))
    for name in flags:
        assert name in line, (name, line)


@pytest.mark.slow
def test_dpo_job_one_process_from_yaml_recipe(assets, tmp_path):
    recipe = _recipe(assets, tmp_path / "run1", RECIPE_FLAGS)
    proc = subprocess.run(
        [sys.executable, "-m", "trl_ext", "dpo", "--config", str(recipe), "--learning_rate", "1e-3"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    _expect_active(proc.stdout, "DPOTrainer", RECIPE_FLAGS)
    assert (tmp_path / "run1" / "model.safetensors").exists()  # TRL's script saved the model
    assert "'loss'" in proc.stdout or '"loss"' in proc.stdout or "loss" in proc.stdout


@pytest.mark.distributed
def test_dpo_job_two_processes_with_cli_flags(assets, tmp_path):
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists():
        pytest.fail("torchrun is part of torch and must be on PATH")
    recipe = _recipe(assets, tmp_path / "run2", {})
    cli_flags = [f"--trl_ext_{name}" for name in RECIPE_FLAGS]  # boolean flags given with no value mean true
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "torchrun"),
            "--nproc_per_node",
            "2",
            "-m",
            "trl_ext",
            "dpo",
            "--config",
            str(recipe),
            *cli_flags,
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    _expect_active(proc.stdout, "DPOTrainer", RECIPE_FLAGS)
    assert proc.stdout.count("ran with plugins:") == 1  # reported by the main process only


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_dpo_job_under_accelerate_launch_with_deepspeed_zero3(assets, tmp_path):
    """`accelerate launch --use_deepspeed ... trl-ext dpo`: 2 processes, ZeRO-3, on CPU (gloo)."""
    ds_config = tmp_path / "ds_z3.json"
    ds_config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": {"stage": 3, "overlap_comm": False},
                "bf16": {"enabled": False},
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 10**9,
            }
        )
    )
    recipe = _recipe(assets, tmp_path / "run-ds", RECIPE_FLAGS)
    text = yaml.safe_load(recipe.read_text())
    del text["use_cpu"]  # `use_cpu` / `accelerate launch --cpu` would switch DeepSpeed off
    text["bf16"] = False
    recipe.write_text(yaml.safe_dump(text))
    accelerate = str(Path(sys.executable).parent / "accelerate")
    cmd = [accelerate, "launch", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    cmd += ["--dynamo_backend", "no", "--use_deepspeed", "--deepspeed_config_file", str(ds_config)]
    cmd += ["-m", "trl_ext", "dpo", "--config", str(recipe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    _expect_active(proc.stdout, "DPOTrainer", RECIPE_FLAGS)
    assert "DeepSpeed on CPU: gloo backend" in proc.stderr
    assert proc.stdout.count("ran with plugins:") == 1


@pytest.mark.slow
def test_online_dpo_job(assets, tmp_path):
    data_dir = assets / "prompts"
    data_dir.mkdir(exist_ok=True)
    shutil.copy(assets / "prompts.jsonl", data_dir / "train.jsonl")
    args = [
        sys.executable,
        "-m",
        "trl_ext",
        "online-dpo",
        "--model_name_or_path",
        str(assets / "model"),
        "--dataset_name",
        str(data_dir),
        "--reward_funcs",
        "trl_ext.testing:length_reward",
        "--output_dir",
        str(tmp_path / "online"),
        "--per_device_train_batch_size",
        "2",
        "--max_steps",
        "1",
        "--logging_steps",
        "1",
        "--max_new_tokens",
        "4",
        "--report_to",
        "none",
        "--use_cpu",
        "true",
        "--save_strategy",
        "no",
    ]
    proc = subprocess.run(args, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[trl-ext] OnlineDPOTrainer ran with plugins:" in proc.stdout


def test_split_argv_and_yaml_section(tmp_path):
    flags, rest = split_argv(
        ["--lr", "1", "--trl_ext_padding_free", "--trl_ext_precompute_ref_batch_size=auto", "--x"]
    )
    assert flags == {"padding_free": True, "precompute_ref_batch_size": "auto"}  # a bare flag takes its cli_const
    assert rest == ["--lr", "1", "--x"]
    flags, rest = split_argv(["--trl-ext-sync-metrics", "--trl-ext-precompute-ref-batch-size", "8", "--y"])
    assert flags == {"sync_metrics": True, "precompute_ref_batch_size": "8"} and rest == ["--y"]
    with pytest.raises(
        UsageError, match=r"Unknown trl-ext flag `padding_fre` \(from the command line \(--trl-ext-padding-fre\)\)"
    ):
        split_argv(["--trl-ext-padding-fre"])
    with pytest.raises(UsageError, match="Did you mean `sync_metrics`"):
        split_argv(["--trl_ext_sync_metric", "true"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 0.1\ntrl_ext:\n  padding_free: true\n")
    section, argv, stripped = split_yaml_config(["--config", str(recipe), "--y"])
    assert section == {"padding_free": True}
    assert yaml.safe_load(Path(stripped).read_text()) == {"learning_rate": 0.1}
    assert argv == ["--config", stripped, "--y"]
