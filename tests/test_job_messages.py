"""What `trl-ext dpo` / `online-dpo` tell a user who makes a mistake, or whose plugins had nothing to do (issue 41),
run as users run them: subprocesses of the installed console script.

A mistake is answered with exit code 2 and one `trl-ext: error:` line, no traceback. Where the mistake is not the
model, the model folder given is empty (`not_a_model/`): a check that ran only after the model load would then end in
a traceback about the missing `config.json`, so the one line proves the check ran before any model loads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trl_ext import _compat
from trl_ext.testing import write_demo

pytestmark = pytest.mark.slow

#: Proxy variables: with one set, the Hub's reachability is left to the Hub client, so the tests clear them.
PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = write_demo(tmp_path_factory.mktemp("demo"))
    (root / "not_a_model").mkdir()
    (root / "empty").mkdir()
    (root / "empty" / "train.jsonl").write_text("")
    (root / "a_file").write_text("not a model\n")
    return root


def _trl_ext(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("trl-ext")
    base = {k: v for k, v in os.environ.items() if k not in PROXIES and k != "HF_HUB_OFFLINE"}
    base.update(TQDM_DISABLE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env)
    command = [str(exe) if exe.exists() else str(shutil.which("trl-ext")), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=base, cwd=root)


def _dpo(model: str = "not_a_model", data: str = "preferences") -> list[str]:
    return ["dpo", "--model_name_or_path", model, "--dataset_name", data, "--max_steps", "1"]


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("trl-ext: error: "), proc.stderr[-3000:]
    return line


_OPTIONS = '{"padding_free": {"attention": "segments"}}'
#: `(argv after the common ones, environment, what the line says)`.
MISTAKES = {
    # point 2: tracebacks left
    "empty data file": (
        _dpo(model="model", data="empty"),
        {"HF_HUB_OFFLINE": "1"},
        "The dataset `empty` has no rows (train.jsonl is empty)",
    ),
    "model path is a file": (
        _dpo(model="a_file"),
        {"HF_HUB_OFFLINE": "1"},
        "`--model_name_or_path a_file` is a file; a model is a folder",
    ),
    "missing model, HF_HUB_OFFLINE": (
        _dpo(model="no_such_model"),
        {"HF_HUB_OFFLINE": "1"},
        "the Hub cannot be used (HF_HUB_OFFLINE is set)",
    ),
    # no network: a Hub endpoint nothing listens on answers at once, as a machine without network does
    "missing model, no network": (
        _dpo(model="no_such_model"),
        {"HF_ENDPOINT": "http://127.0.0.1:9"},
        "the Hub cannot be used (127.0.0.1 cannot be reached from here: ",
    ),
    "options without their flag": (
        [*_dpo(), "--trl-ext-plugins", _OPTIONS],
        {"HF_HUB_OFFLINE": "1"},
        "`plugins.padding_free` sets ['attention'], but `padding_free` is not set",
    ),
    # point 3: an explicit `false` against TRL's flag
    "padding_free false against --padding_free true": (
        [*_dpo(), "--trl-ext-padding-free", "false", "--padding_free", "true"],
        {"HF_HUB_OFFLINE": "1"},
        "`padding_free=false` (from the command line (--trl_ext_padding_free)) contradicts `padding_free=True` in the "
        "DPOConfig",
    ),
    # point 4: messages that pointed the wrong way
    "bare --trl-ext-plugins": (
        [*_dpo(), "--trl-ext-plugins", "--max_length", "64"],
        {"HF_HUB_OFFLINE": "1"},
        "`--trl-ext-plugins` needs a value: options by plugin name as JSON",
    ),
    "plugin typo in --trl-ext-plugins": (
        [*_dpo(), "--trl-ext-plugins", "paddng_free"],
        {"HF_HUB_OFFLINE": "1"},
        "`plugins` names `paddng_free` (from the command line (--trl_ext_plugins)), which is not installed. Did you "
        "mean `padding_free`?",
    ),
    "plugin typo in --trl-ext-block": (
        [*_dpo(), "--trl-ext-block", "paddng_free"],
        {"HF_HUB_OFFLINE": "1"},
        "`block` names unknown plugin(s) ['paddng_free']. Did you mean `padding_free`?",
    ),
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_a_mistake_is_one_line_before_any_model_loads(demo, case):
    argv, env, expected = MISTAKES[case]
    if "padding_free=True" in expected and "padding_free" not in _compat.trl_ignored_flags("DPOTrainer"):
        pytest.skip("this TRL packs DPO itself: `--padding_free true` is TRL's own")
    line = _one_line(_trl_ext(demo, *argv, "--report_to", "none", "--output_dir", "out", **env))
    assert expected in line, line


def test_a_plugin_typo_in_the_recipe_gets_a_did_you_mean(demo):
    recipe = demo / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"report_to": "none", "trl_ext": {"plugins": {"prompt_sharng": {}}}}))
    line = _one_line(_trl_ext(demo, *_dpo(), "--config", str(recipe), "--output_dir", "out", HF_HUB_OFFLINE="1"))
    assert f"`plugins` names `prompt_sharng` (from the `trl_ext:` section of the recipe {recipe}), which" in line
    assert "Did you mean `prompt_sharing`?" in line


def test_an_unknown_loss_type_with_token_budget_is_named_as_trl_names_it(demo):
    """Point 4: not token_budget's "not verified", but what stock TRL raises at the first step, with a hint."""
    argv = [*_dpo(model="model"), "--loss_type", "sigmod", "--trl-ext-token-budget", "256"]
    line = _one_line(_trl_ext(demo, *argv, "--report_to", "none", "--output_dir", "out", HF_HUB_OFFLINE="1"))
    assert "`loss_type='sigmod'` is no loss type of the installed TRL" in line
    assert "`ValueError: Unknown loss type: sigmod`" in line and "Did you mean `sigmoid`?" in line


# ---------------------------------------------------------------------------------------------------------------------
# Plugins that ran without doing anything say so in the end line (point 3)
# ---------------------------------------------------------------------------------------------------------------------


def _end_lines(proc: subprocess.CompletedProcess[str], plugin: str) -> tuple[str, str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    ran = next(line for line in lines if " ran with plugins: " in line)
    return ran, next(line for line in lines if line.startswith(f"[trl-ext]   {plugin}: "))


_TRAIN = ["--per_device_train_batch_size", "2", "--max_length", "64", "--report_to", "none"]


def test_precompute_without_precompute_ref_log_probs_says_it_did_nothing(demo):
    argv = [*_dpo(model="model"), *_TRAIN, "--output_dir", "out", "--trl-ext-precompute-ref-batch-size", "4"]
    _, line = _end_lines(_trl_ext(demo, *argv, HF_HUB_OFFLINE="1"), "precompute_ref_batch_size")
    assert line.endswith(
        "did nothing: this DPOTrainer has `precompute_ref_log_probs=False`, so there was no reference precompute to "
        "run (set `precompute_ref_log_probs=True` in the DPOConfig)"
    ), line


def test_an_unusable_cache_dir_is_not_named_as_the_cache_in_use(demo):
    blocker = demo / "blocker"
    blocker.write_text("")  # a file: no folder can be created under it
    options = f'{{"precompute_ref_batch_size": {{"cache_dir": "{blocker / "cache"}"}}}}'
    argv = [*_dpo(model="model"), *_TRAIN, "--output_dir", "out", "--precompute_ref_log_probs", "true"]
    argv += ["--trl-ext-precompute-ref-batch-size", "4", "--trl-ext-plugins", options]
    proc = _trl_ext(demo, *argv, HF_HUB_OFFLINE="1")
    _, line = _end_lines(proc, "precompute_ref_batch_size")
    assert line.endswith(
        f"train: 12 pairs computed; no cache: {blocker / 'cache'} cannot be created (Not a directory)"
    )
    gets = next(
        line for line in proc.stderr.splitlines() if "DPOTrainer gets plugins precompute_ref_batch_size" in line
    )
    assert f"cache {blocker / 'cache'}," not in gets and "no cache: " in gets, gets


def test_generation_without_zero3_says_it_did_nothing(demo):
    argv = ["online-dpo", "--model_name_or_path", "model", "--dataset_name", "prompts", "--reward_funcs"]
    argv += [
        "trl_ext.testing:length_reward",
        "--max_new_tokens",
        "4",
        "--max_steps",
        "1",
        *_TRAIN,
        "--output_dir",
        "out",
    ]
    proc = _trl_ext(demo, *argv, "--trl-ext-ds3-gather-for-generation", "true", HF_HUB_OFFLINE="1")
    ran, line = _end_lines(proc, "generation")
    assert "generation" in ran
    assert "did nothing: the model is not a DeepSpeed ZeRO-3 engine" in line and "generation(s) only got" in line
