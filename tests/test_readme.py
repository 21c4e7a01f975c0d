"""The README runs as written: every shell command in its code blocks is run here, or listed below with the reason.

Placeholders are filled from a fixture: a tiny local model (`MODEL`), a preference dataset and a prompt dataset
saved to disk (`PROMPTS`), a `recipe.yaml` that points at them (instead of the hub names the README shows), a
ZeRO-3 `ds_z3.json`, and `my_rewards.py` in the working directory. A README command that is neither run nor
listed fails `test_every_readme_command_is_run_or_listed`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trl_ext.testing import make_model, make_tokenizer, preference_rows

README = Path(__file__).resolve().parents[1] / "README.md"

#: Commands that cannot run here, by the start of the command, with the reason.
NOT_RUN = {
    "python3 -m venv .venv": "installs from the package registry (network); test_install_lines_resolve checks it",
    "pip install -c constraints.txt": "the package registry (network); test_install_lines_resolve checks it",
    "trl-ext bench": "minutes on its own; tests/test_bench.py runs `trl-ext bench --quick` (every section)",
    "python -m pytest -q": "the test suite itself",
    "accelerate launch --num_processes 8": "8 processes: a GPU machine",
    "accelerate launch --use_deepspeed --deepspeed_config_file ds_z3.json --num_processes 8": "8 processes: GPUs",
    "python benchmarks/": "a benchmark of several minutes; its numbers are in the README tables",
    "bash patches/check.sh": "downloads the trl sdist and installs into a fresh environment (network)",
}

#: Extra arguments so the runnable training commands stay short here (2 steps of a tiny model).
_RECIPE_OVERRIDES = {"max_steps": 2, "per_device_train_batch_size": 2, "max_length": 64, "report_to": "none"}


def readme_commands(text: str) -> list[str]:
    """Shell commands in ```bash blocks: one per line (backslash continuations joined), comments dropped."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S):
        block = block.replace("\\\n", " ")
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def _not_run_reason(command: str) -> str | None:
    return next((reason for prefix, reason in NOT_RUN.items() if command.startswith(prefix)), None)


def _runnable() -> list[str]:
    return [c for c in readme_commands(README.read_text()) if _not_run_reason(c) is None]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    make_model(seed=0).save_pretrained(root / "model")
    make_tokenizer().save_pretrained(root / "model")
    (root / "data").mkdir()
    with open(root / "data" / "train.jsonl", "w") as f:
        for row in preference_rows(12, seed=1):
            f.write(json.dumps(row) + "\n")
    (root / "prompts").mkdir()
    with open(root / "prompts" / "train.jsonl", "w") as f:
        for row in preference_rows(8, seed=2, prompt_median=5):
            f.write(json.dumps({"prompt": [{"role": "user", "content": row["prompt"]}]}) + "\n")
    # The README's recipe, with the hub names replaced by the fixture and a short run.
    recipe_text = re.search(r"```yaml\n# recipe.yaml\n(.*?)```", README.read_text(), flags=re.S).group(1)
    recipe = yaml.safe_load(recipe_text)
    recipe.update(model_name_or_path=str(root / "model"), dataset_name=str(root / "data"), **_RECIPE_OVERRIDES)
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (root / "ds_z3.json").write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": {"stage": 3, "overlap_comm": False},
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 10**9,
            }
        )
    )
    (root / "my_rewards.py").write_text(
        "def score(completions, **kwargs):\n    return [float(len(str(c))) for c in completions]\n"
    )
    return root


def test_every_readme_command_is_run_or_listed():
    commands = readme_commands(README.read_text())
    assert len(commands) >= 8, commands  # the extraction finds the README's commands
    unused = [prefix for prefix in NOT_RUN if not any(c.startswith(prefix) for c in commands)]
    assert not unused, f"NOT_RUN lists commands the README no longer has: {unused}"
    assert _runnable(), "nothing to run"


def test_readme_states_test_time_fast_loop_and_log_level():
    text = README.read_text()
    assert 'pytest -q -m "not slow"' in text and "TRL_EXT_LOG_LEVEL" in text
    assert re.search(r"\d+ (s|min)", text[text.index("## Tests") :]), "the Tests section says how long they take"


@pytest.mark.slow
@pytest.mark.parametrize("command", _runnable())
def test_readme_command_runs(command, workdir):
    filled = command.replace("MODEL", str(workdir / "model")).replace("PROMPTS", str(workdir / "prompts"))
    if filled.startswith(("trl-ext online-dpo", "accelerate launch")) and "online-dpo" in filled:
        filled += " --per_device_train_batch_size 2 --report_to none"
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", DS_BUILD_OPS="0")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `python`, `trl-ext` of this environment
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", filled],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # `| head` may close the pipe early (SIGPIPE, 141) once it has its lines; anything else must succeed.
    ok = proc.returncode == 0 or ("| head" in filled and proc.returncode == 141)
    assert ok, f"{filled}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    if "--output_dir" in filled:  # a training run: it reports the plugins it ran with
        assert "ran with plugins:" in proc.stdout, proc.stdout[-2000:]
    if "--help" in filled:
        assert "trl-ext flags:" in proc.stdout


def _install_lines() -> list[str]:
    """The README's pip install lines (the first one after the venv step)."""
    lines = []
    for command in readme_commands(README.read_text()):
        for part in command.split("&&"):
            part = part.strip()
            if part.startswith("pip install"):
                lines.append(part)
    return lines


def test_install_lines_for_users_and_for_tests():
    """Users install trl-ext alone (plus DeepSpeed if they want it); the test extras are for the tests only."""
    import tomllib

    lines = _install_lines()
    assert lines[0] == "pip install -c constraints.txt -e ."
    assert 'pip install -c constraints.txt -e ".[deepspeed]"' in lines
    assert 'pip install -c constraints.txt -e ".[test]"' in lines
    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"deepspeed", "test"} <= set(extras) and "pytest>=8" not in extras["deepspeed"]
    assert "torch==2.13.0" in (README.parent / "constraints.txt").read_text()


@pytest.mark.slow
def test_install_lines_resolve():
    """Each README install line resolves as printed against this environment (offline: `--dry-run --no-index`)."""
    for line in _install_lines():
        args = line.split()[2:]  # after `pip install`
        args = [a.strip('"') for a in args]
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation", *args]
        proc = subprocess.run(cmd, cwd=README.parent, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert "Would install trl-ext" in proc.stdout, proc.stdout[-2000:]


def _readme_block(language: str, first_line: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)
    return next(block for block in blocks if block.startswith(first_line))


@pytest.mark.slow
def test_writing_a_plugin_example_installs_and_runs_as_printed(tmp_path):
    """The "Writing a plugin" files, written out as printed, `pip install`, and the plugin is found and enabled as
    the README says: from Python with its flag and options, from the environment, and listed by `trl-ext plugins`."""
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "trl_ext_fused.py").write_text(_readme_block("python", "# my_package/trl_ext_fused.py"))
    (package / "pyproject.toml").write_text(_readme_block("toml", "# my_package/pyproject.toml"))
    site = tmp_path / "site"
    # As printed, but offline: no build isolation (setuptools is here), no dependency resolution (trl-ext is here),
    # and into its own directory so this environment is left as it is.
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
    proc = subprocess.run([*cmd, "."], cwd=package, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    script = """
import trl_ext
from trl import DPOConfig, DPOTrainer
from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer

with trl_ext.install(fused_loss=True, plugins={"fused_loss": {"chunk": 512}}) as installation:
    assert "fused_loss" not in installation.plugin_manager.catalog.builtin
    trainer = DPOTrainer(
        make_model(seed=0), ref_model=make_model(seed=0),
        args=DPOConfig(output_dir="out", use_cpu=True, report_to=[], max_steps=1, per_device_train_batch_size=2),
        train_dataset=make_preference_dataset(2), processing_class=make_tokenizer(),
    )
    assert trainer._trl_ext.enabled == ("fused_loss",), trainer._trl_ext.enabled
    assert trainer._trl_ext.config.options("fused_loss").chunk == 512
print("enabled", trainer._trl_ext.enabled)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "enabled ('fused_loss',)" in proc.stdout, proc.stderr[-4000:]
    check = "import trl_ext; i = trl_ext.install(); print(i.enabled_plugins('DPOTrainer')); i.uninstall()"
    proc = subprocess.run(
        [sys.executable, "-c", check],
        env=dict(env, TRL_EXT_FUSED_LOSS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "['fused_loss']" in proc.stdout, proc.stderr[-3000:]
    exe = Path(sys.executable).with_name("trl-ext")
    proc = subprocess.run([exe, "plugins"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "  option plugins.fused_loss.chunk: a positive integer; default 1024. Tokens per chunk." in proc.stdout
