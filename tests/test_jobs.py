"""`trl-ext dpo` / `trl-ext online-dpo`: TRL's scripts with plugins, from a YAML recipe, in 1 and 2 processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import helpers
from trl_ext import UsageError
from trl_ext.app.job_args import split_argv, split_yaml_config
from trl_ext.manager import builtin_plugin_modules
from trl_ext.testing import make_model, make_tokenizer, preference_rows

CPU_LINE = "[trl-ext] no accelerator found: training on CPU in"

#: The plugins this job test switches on through the recipe (those that are built in this release).
RECIPE_FLAGS = {k: v for k, v in {"padding_free": True, "sync_metrics": True}.items() if k in builtin_plugin_modules()}


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
        # no `use_cpu` / `bf16`: on a machine without an accelerator the job picks CPU and fp32 itself
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


def _run(cmd: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """`cmd` in the jobs' environment (`_env`); it must succeed."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout, **kwargs)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _expect_active(stdout: str, trainer: str, flags: dict) -> None:
    line = next(line for line in stdout.splitlines() if line.startswith(f"[trl-ext] {trainer} ran with plugins:"))
    for name in flags:
        assert name in line, (name, line)


@pytest.mark.slow
def test_dpo_job_one_process_from_yaml_recipe(assets, tmp_path):
    recipe = _recipe(assets, tmp_path / "run1", RECIPE_FLAGS)
    proc = _run([sys.executable, "-m", "trl_ext", "dpo", "--config", str(recipe), "--learning_rate", "1e-3"])
    _expect_active(proc.stdout, "DPOTrainer", RECIPE_FLAGS)
    assert CPU_LINE + " fp32 (--use_cpu true, --bf16 false;" in proc.stderr
    assert (tmp_path / "run1" / "model.safetensors").exists()  # TRL's script saved the model
    assert "'loss'" in proc.stdout or '"loss"' in proc.stdout or "loss" in proc.stdout


@pytest.mark.distributed
def test_dpo_job_two_processes_with_cli_flags(assets, tmp_path):
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists():
        pytest.fail("torchrun is part of torch and must be on PATH")
    recipe = _recipe(assets, tmp_path / "run2", {})
    # dashed spellings, as TRL's own flags; boolean flags given with no value mean true
    cli_flags = [f"--trl-ext-{name.replace('_', '-')}" for name in RECIPE_FLAGS]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = _run([torchrun, "--nproc_per_node", "2", "-m", "trl_ext", "dpo", "--config", str(recipe), *cli_flags])
    _expect_active(proc.stdout, "DPOTrainer", RECIPE_FLAGS)
    assert proc.stdout.count("ran with plugins:") == 1  # reported by the main process only
    assert proc.stderr.count(CPU_LINE) == 1  # use_cpu chosen on every rank (MULTI_CPU), said once


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_dpo_job_under_accelerate_launch_with_deepspeed_zero3(assets, tmp_path):
    """`accelerate launch --use_deepspeed ... trl-ext dpo`: 2 processes, ZeRO-3, on CPU (gloo)."""
    ds_config = tmp_path / "ds_z3.json"
    ds_config.write_text(json.dumps(helpers.deepspeed_config(3, bf16={"enabled": False})))
    recipe = _recipe(assets, tmp_path / "run-ds", RECIPE_FLAGS)
    # No `use_cpu` (it would switch DeepSpeed off) and no `bf16`: the job sets bf16 false itself.
    accelerate = str(Path(sys.executable).parent / "accelerate")
    cmd = [accelerate, "launch", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    cmd += ["--dynamo_backend", "no", "--use_deepspeed", "--deepspeed_config_file", str(ds_config)]
    cmd += ["-m", "trl_ext", "dpo", "--config", str(recipe)]
    proc = _run(cmd, timeout=900)
    _expect_active(proc.stdout, "DPOTrainer", RECIPE_FLAGS)
    assert "DeepSpeed on CPU: gloo backend" in proc.stderr
    assert proc.stderr.count(CPU_LINE + " fp32 (--bf16 false;") == 1  # use_cpu left alone under DeepSpeed
    assert proc.stdout.count("ran with plugins:") == 1


@pytest.mark.slow
def test_online_dpo_job_from_console_script_with_reward_module_in_cwd(assets, tmp_path):
    """As the README says: `--reward_funcs my_rewards:score` from the directory holding my_rewards.py, no PYTHONPATH
    for it, no `--use_cpu` / `--bf16` on this CPU machine."""
    data_dir = assets / "prompts"
    data_dir.mkdir(exist_ok=True)
    shutil.copy(assets / "prompts.jsonl", data_dir / "train.jsonl")
    (tmp_path / "my_rewards.py").write_text(
        "def score(completions, **kwargs):\n    return [float(len(str(c))) for c in completions]\n"
    )
    args = [
        str(Path(sys.executable).with_name("trl-ext")),
        "online-dpo",
        "--model_name_or_path",
        str(assets / "model"),
        "--dataset-name",  # dashed, as TRL accepts
        str(data_dir),
        "--reward_funcs",
        "my_rewards:score",
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
        "--save_strategy",
        "no",
    ]
    proc = _run(args, cwd=tmp_path)
    line = next(line for line in proc.stdout.splitlines() if "[trl-ext] OnlineDPOTrainer ran with plugins:" in line)
    # no plugin applies (trl-ext did not attach): the job's line says the peak, once, and no `train()` line does
    assert line.startswith("[trl-ext] OnlineDPOTrainer ran with plugins: none; peak memory "), line
    assert line.endswith(" during the job (model loading included)"), line
    assert (proc.stdout + proc.stderr).count("peak memory") == 1
    assert CPU_LINE in proc.stderr and "TRLExperimentalWarning" not in proc.stderr
    assert str(tmp_path) not in sys.path and "my_rewards" not in sys.modules  # this process was not touched


def test_missing_reward_module_is_a_usage_error(tmp_path):
    from trl_ext.app.jobs import _load_reward

    with pytest.raises(UsageError, match=r"`--reward_funcs no_such_module:f`: cannot import .* current directory"):
        _load_reward("no_such_module:f")
    (tmp_path / "here_rewards.py").write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert _load_reward("here_rewards:f")(["a"]) == [0.0]
    finally:
        os.chdir(cwd)
        sys.modules.pop("here_rewards", None)
    assert str(tmp_path) not in sys.path  # only on the path for the lookup


@pytest.mark.parametrize(
    ("argv", "deepspeed", "expect", "note"),
    [
        ([], False, {"use_cpu": True, "bf16": False}, "fp32 (--use_cpu true, --bf16 false"),
        (["--bf16", "true"], False, {"use_cpu": True, "bf16": True}, "bf16 (--use_cpu true;"),  # explicit flag wins
        (["--use-cpu", "false", "--bf16=false"], False, {"use_cpu": False, "bf16": False}, None),
        ([], True, {"use_cpu": False, "bf16": False}, "fp32 (--bf16 false;"),  # DeepSpeed: use_cpu would turn it off
    ],
)
def test_cpu_and_fp32_are_defaults_without_accelerator_and_user_flags_win(
    argv, deepspeed, expect, note, monkeypatch, capsys, tmp_path
):
    from trl import DPOConfig, ModelConfig, ScriptArguments, TrlParser

    from trl_ext.app import job_args

    monkeypatch.setattr(job_args, "_has_accelerator", lambda: False)
    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig), prog="trl-ext dpo")
    if deepspeed:
        argv = [*argv, "--use_cpu", "false"]  # what a DeepSpeed user has; checked: it stays false
    _, training_args, _ = job_args.parse_job_args(parser, "dpo", [*argv, "--output_dir", str(tmp_path)], deepspeed)
    assert {key: getattr(training_args, key) for key in expect} == expect
    err = capsys.readouterr().err
    if note is None:
        assert CPU_LINE not in err
    else:
        assert err.count(CPU_LINE) == 1 and note in err


def test_cpu_defaults_yield_to_the_recipe(monkeypatch, tmp_path):
    from trl import DPOConfig, ModelConfig, ScriptArguments, TrlParser

    from trl_ext.app import job_args

    monkeypatch.setattr(job_args, "_has_accelerator", lambda: False)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path}\nbf16: true\n")
    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig), prog="trl-ext dpo")
    _, training_args, _ = job_args.parse_job_args(parser, "dpo", ["--config", str(recipe)], False)
    assert training_args.bf16 is True and training_args.use_cpu is True


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


# -------------------------------------------------------------------------------------------------------------------
# Precedence of the job's sources: command line > TRL_EXT_* environment > recipe > defaults, for every pair
# -------------------------------------------------------------------------------------------------------------------

_SOURCES = ("cli", "env", "recipe")
_PAIRS = [(high, low) for i, high in enumerate(_SOURCES) for low in (*_SOURCES[i + 1 :], "default")]


def _job_config(monkeypatch, tmp_path, flag: str, values: dict[str, bool]):
    """Resolve `flag` as `trl-ext dpo` does from `values` by source, install it as the job does, return the value
    the installation has."""
    from trl_ext.app import job_args, jobs

    argv = ["--output_dir", str(tmp_path)]
    if "cli" in values:
        argv += [f"--trl-ext-{flag.replace('_', '-')}", str(values["cli"]).lower()]
    if "env" in values:
        monkeypatch.setenv(f"TRL_EXT_{flag.upper()}", "1" if values["env"] else "0")
    else:
        monkeypatch.delenv(f"TRL_EXT_{flag.upper()}", raising=False)
    if "recipe" in values:
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(yaml.safe_dump({"learning_rate": 0.1, "trl_ext": {flag: values["recipe"]}}))
        argv = ["--config", str(recipe), *argv]
    config, _, stripped = job_args.resolve_config(argv)
    if stripped:
        os.unlink(stripped)
    with jobs._installed_for_job(config, cpu_deepspeed=False, trainer_class="DPOTrainer") as installation:
        return getattr(installation.config, flag)


@pytest.fixture
def third_party_flag(monkeypatch):
    import types

    from trl_ext.spec import Flag, PluginSpec, boolean

    from ._fakes import install_fake_plugin

    module = types.ModuleType("_trl_ext_fake_turbo")
    module.TRL_EXT_PLUGIN = PluginSpec(name="turbo", flags=(Flag("turbo", default=False, parse=boolean, help="x"),))
    install_fake_plugin(monkeypatch, "turbo", module)
    return "turbo"


@pytest.mark.parametrize("flag", ["padding_free", "third_party"])
@pytest.mark.parametrize(("high", "low"), _PAIRS)
def test_job_precedence_command_line_over_environment_over_recipe(flag, high, low, monkeypatch, tmp_path, request):
    if flag == "third_party":
        flag = request.getfixturevalue("third_party_flag")
    for value in (True, False):
        values = {high: value} if low == "default" else {high: value, low: not value}
        assert _job_config(monkeypatch, tmp_path, flag, values) is value, (flag, values)


def test_cpu_line_names_the_precision_it_trains_in(monkeypatch, capsys, tmp_path):
    from trl import DPOConfig, ModelConfig, ScriptArguments, TrlParser

    from trl_ext.app import job_args

    monkeypatch.setattr(job_args, "_has_accelerator", lambda: False)
    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig), prog="trl-ext dpo")
    job_args.parse_job_args(parser, "dpo", ["--bf16", "true", "--output_dir", str(tmp_path)], False)
    err = capsys.readouterr().err
    assert "[trl-ext] no accelerator found: training on CPU in bf16 (--use_cpu true;" in err and "fp32" not in err


def test_job_ends_without_an_uninstall_line(monkeypatch, tmp_path, tokenizer, dpo_args, caplog, plain_dpo):
    """The job's trainers are done when it ends: no "trainers keep their plugins" line."""
    import logging

    from trl_ext.app import jobs
    from trl_ext.config import load_config

    root = logging.getLogger("trl_ext")
    root.addHandler(caplog.handler)
    try:
        with jobs._installed_for_job(
            load_config(flags={"sync_metrics": True}), cpu_deepspeed=False, trainer_class="DPOTrainer"
        ):
            trainer = plain_dpo()
    finally:
        root.removeHandler(caplog.handler)
    assert "_trl_ext" not in vars(trainer)  # detached: stock again
    assert not [r for r in caplog.records if "uninstalled" in r.getMessage() and r.levelno >= 25], caplog.text


@pytest.mark.slow
def test_dpo_job_command_line_beats_environment_beats_recipe(assets, tmp_path):
    """As users run it: `TRL_EXT_PADDING_FREE=0 trl-ext dpo --trl-ext-padding-free true` packs, and the environment's
    `TRL_EXT_SYNC_METRICS=1` beats the recipe's `sync_metrics: false`."""
    recipe = _recipe(assets, tmp_path / "run-precedence", {"padding_free": False, "sync_metrics": False})
    env = dict(_env(), TRL_EXT_PADDING_FREE="0", TRL_EXT_SYNC_METRICS="1", TRL_EXT_LOG_LEVEL="notice")
    cmd = [sys.executable, "-m", "trl_ext", "dpo", "--config", str(recipe), "--trl-ext-padding-free", "true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("[trl-ext] DPOTrainer ran with plugins:"))
    assert line == "[trl-ext] DPOTrainer ran with plugins: padding_free, sync_metrics", line
    # the peak memory, once: in the line the trainer logs when `train()` returns
    assert proc.stderr.count("peak memory") == 1 and proc.stderr.count(" during train()") == 1, proc.stderr[-3000:]
    assert "uninstalled" not in proc.stderr  # the job's trainers are detached at its end


# -------------------------------------------------------------------------------------------------------------------
# Data and path mistakes, a `save_to_disk` folder, the peak memory said once (issue 35, items 2, 6 and 8; issue 41)
# -------------------------------------------------------------------------------------------------------------------


def _saved(root: Path, name: str, rows: list[dict], as_dict: bool = False) -> str:
    import datasets

    dataset = datasets.Dataset.from_list(rows)
    if not rows:
        dataset = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}]).filter(lambda r: False)
    (datasets.DatasetDict({"train": dataset}) if as_dict else dataset).save_to_disk(str(root / name))
    return str(root / name)


def _job_argv(assets: Path, out: Path, dataset: str, model: str | None = None) -> list[str]:
    return [
        *("--model_name_or_path", model or str(assets / "model")),
        *("--dataset_name", dataset, "--output_dir", str(out)),
        *("--per_device_train_batch_size", "2", "--max_steps", "1", "--logging_steps", "1", "--max_length", "64"),
        *("--report_to", "none", "--save_strategy", "no"),
    ]


def _usage_error_line(command: str, argv: list[str], capsys) -> str:
    from trl_ext.app.cli import main

    assert main([command, *argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trl-ext: error: ")]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("command", ["dpo", "online-dpo"])
def test_data_and_path_mistakes_are_one_line_before_any_model_loads(command, assets, tmp_path, monkeypatch, capsys):
    """A missing column, an empty dataset, an output folder that cannot be written, a model folder that does not
    exist: exit code 2 and one line that names the fix, before trl-ext is installed and a model is loaded."""
    from trl_ext.app import jobs

    def installed(*args, **kwargs):
        raise AssertionError("the job went on to install trl-ext and load the model")

    monkeypatch.setattr(jobs, "_installed_for_job", installed)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # a model path mistake must not wait for the Hub either
    monkeypatch.chdir(tmp_path)
    rows = preference_rows(4, seed=1)
    extra = (
        ["--reward_funcs", "trl_ext.testing:length_reward", "--max_new_tokens", "4"] if command == "online-dpo" else []
    )
    missing = "rejected" if command == "dpo" else "prompt"
    no_column = _saved(tmp_path, "no_column", [{k: v for k, v in r.items() if k != missing} for r in rows])
    line = _usage_error_line(command, [*_job_argv(assets, tmp_path / "o", no_column), *extra], capsys)
    assert f"has no `{missing}` column (its columns: " in line and "rename the column" in line
    empty = _saved(tmp_path, "empty", [])
    line = _usage_error_line(command, [*_job_argv(assets, tmp_path / "o", empty), *extra], capsys)
    assert "has no rows in its `train` split" in line
    (tmp_path / "a_file").write_text("")
    line = _usage_error_line(command, [*_job_argv(assets, tmp_path / "a_file" / "out", no_column), *extra], capsys)
    assert f"`--output_dir {tmp_path / 'a_file' / 'out'}` cannot be written (" in line
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        line = _usage_error_line(command, [*_job_argv(assets, locked / "out", no_column), *extra], capsys)
        assert "cannot be written (Permission denied)" in line
    (tmp_path / "models").mkdir()
    for model in ("models/tiny", str(tmp_path / "nowhere"), "./tiny"):
        line = _usage_error_line(command, [*_job_argv(assets, tmp_path / "o", no_column, model), *extra], capsys)
        assert f"`--model_name_or_path {model}`: the folder " in line and "does not exist" in line
    split = ["--dataset_train_split", "training"]
    as_dict = _saved(tmp_path, "as_dict", rows, as_dict=True)
    line = _usage_error_line(command, [*_job_argv(assets, tmp_path / "o", as_dict), *split, *extra], capsys)
    assert "has no split `training` (its splits: train). Set `--dataset_train_split`" in line


def test_save_to_disk_folders_load_as_the_training_split(tmp_path):
    from trl_ext.app.job_checks import load_job_dataset

    rows = preference_rows(3, seed=1)
    for as_dict in (False, True):
        folder = _saved(tmp_path, f"saved-{as_dict}", rows, as_dict=as_dict)
        dataset = load_job_dataset(folder, None, "train")
        assert list(dataset) == ["train"] and dataset["train"].to_list() == rows


def test_dpo_job_trains_on_a_save_to_disk_folder_and_says_its_peak_memory_once(assets, tmp_path, capsys):
    """The job's end lines name the plugins; the peak memory is said once per `train()`, in the line the trainer logs
    when it returns (`trl_ext.build`), not again in the job's lines (issue 41, point 5)."""
    from trl_ext._shared import rss_mib
    from trl_ext.app.cli import main

    folder = _saved(tmp_path, "saved", preference_rows(8, seed=1), as_dict=False)
    with helpers.trl_ext_records() as records:
        assert main(["dpo", *_job_argv(assets, tmp_path / "out", folder), "--trl-ext-padding-free"]) == 0
    out = capsys.readouterr().out
    assert "peak memory" not in out, out
    assert [line for line in out.splitlines() if " ran with plugins: " in line] == [
        "[trl-ext] DPOTrainer ran with plugins: padding_free"
    ]
    peaks = [r.getMessage() for r in records if "peak memory" in r.getMessage()]
    assert len(peaks) == 1, peaks
    expected = (
        r"trl-ext: DPOTrainer trained with plugins padding_free; peak memory ([\d.]+) (MiB|GiB) resident \(CPU\) "
        r"during train\(\)"
    )
    match = re.fullmatch(expected, peaks[0])
    assert match, peaks[0]
    mib = float(match.group(1)) * (1024 if match.group(2) == "GiB" else 1)
    # the process' resident set: torch and the models at least (a GiB figure is rounded to 0.01 GiB)
    assert 50 < mib <= rss_mib("VmPeak") + 10
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_a_job_without_plugins_says_its_peak_memory_in_its_own_line(assets, tmp_path, capsys):
    """No plugin applies, so trl-ext attaches to nothing and no `train()` line says the peak: the job's line does,
    measured over the whole job, once."""
    from trl_ext._shared import rss_mib
    from trl_ext.app.cli import main

    folder = _saved(tmp_path, "saved", preference_rows(8, seed=1), as_dict=False)
    with helpers.trl_ext_records() as records:
        assert main(["dpo", *_job_argv(assets, tmp_path / "out", folder)]) == 0
    out = capsys.readouterr().out
    assert not [r for r in records if "peak memory" in r.getMessage()]
    lines = [line for line in out.splitlines() if "peak memory" in line]
    assert len(lines) == 1, out
    match = re.fullmatch(
        r"\[trl-ext\] DPOTrainer ran with plugins: none; peak memory ([\d.]+) (MiB|GiB) resident \(CPU\) during the "
        r"job \(model loading included\)",
        lines[0],
    )
    assert match, lines[0]
    mib = float(match.group(1)) * (1024 if match.group(2) == "GiB" else 1)
    assert 50 < mib <= rss_mib("VmPeak") + 10


def test_recipe_mistakes_name_the_recipe(tmp_path, capsys):
    """A bad value or key in the recipe is reported against the recipe's file, with the command line's own values
    still reported against the command line; a misspelled `trl_ext:` key gets its right spelling."""
    recipe = tmp_path / "my_recipe.yaml"
    recipe.write_text(f"learning_rate: fast\noutput_dir: {tmp_path / 'o'}\n")
    line = _usage_error_line("dpo", ["--config", str(recipe)], capsys)
    assert f"invalid float value: 'fast' (from the recipe {recipe})" in line
    line = _usage_error_line("dpo", ["--config", str(recipe), "--learning_rate", "slow"], capsys)
    assert "invalid float value: 'slow' (from the command line)" in line
    recipe.write_text(f"lerning_rate: 0.1\noutput_dir: {tmp_path / 'o'}\n")
    line = _usage_error_line("dpo", ["--config", str(recipe)], capsys)
    assert f"The recipe {recipe} sets ['lerning_rate']" in line and "Did you mean `learning_rate`?" in line
    recipe.write_text(f"learning_rate: 0.1\noutput_dir: {tmp_path / 'o'}\ntrl-ext:\n  padding_free: true\n")
    line = _usage_error_line("online-dpo", ["--config", str(recipe)], capsys)
    assert f"The recipe {recipe} has a key `trl-ext:`. Did you mean `trl_ext:`?" in line
    recipe.write_text(f"output_dir: {tmp_path / 'o'}\ntrl_ext:\n  fused_logprobs: 1\n  padding_free: 256.5\n")
    line = _usage_error_line("dpo", ["--config", str(recipe)], capsys)
    assert (
        f"`padding_free` must be true or false, got 256.5 (from the `trl_ext:` section of the recipe {recipe})" in line
    )
