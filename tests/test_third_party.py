"""The example plugin package of docs/writing-plugins.md, written out as printed, installed with pip into a temporary
directory and used as users would.

It has its own flag (`fused_loss`) and its own options dataclass, is found through the `trl_ext` entry-point group,
and is enabled from Python, the environment, YAML and the `trl-ext dpo` command line. It keeps the parsed `chunk` in
the trainer's `context.state` and says it in the trainer's log line, so each test checks that its hooks really ran
with the parsed options.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import trl_ext
from tests import helpers
from trl_ext import UsageError
from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer, preference_rows


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """`pip install` the package into its own directory (not into the test environment) and return that directory."""
    src = tmp_path_factory.mktemp("my_package")
    for name, text in helpers.example_plugin_files().items():
        (src / name).write_text(text)
    site = tmp_path_factory.mktemp("site")
    # As printed, but offline: no build isolation (setuptools is here), no dependency resolution (trl-ext is here),
    # and into its own directory so this environment is left as it is.
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
    proc = subprocess.run([*cmd, str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert list(site.glob("trl_ext_fused-0.1.0.dist-info/entry_points.txt"))
    return site


@pytest.fixture
def with_plugin(plugin_site, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_site))
    yield plugin_site
    sys.modules.pop("trl_ext_fused", None)


def _env(site: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def _dpo_trainer(tokenizer, dpo_args):
    from trl import DPOTrainer

    return DPOTrainer(
        make_model(seed=0),
        ref_model=make_model(seed=0),
        args=dpo_args(),
        train_dataset=make_preference_dataset(4),
        processing_class=tokenizer,
    )


@pytest.mark.slow  # `plugin_site` runs pip, a launched process (the fast loop finds the `recorder` plugin)
def test_enabled_from_python(with_plugin, tokenizer, dpo_args):
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("trl_ext").addHandler(handler)
    try:
        with trl_ext.install(fused_loss=True, plugins={"fused_loss": {"chunk": 7}}) as installation:
            assert "fused_loss" in installation.plugin_manager.catalog.specs
            assert "fused_loss" not in installation.plugin_manager.catalog.builtin
            trainer = _dpo_trainer(tokenizer, dpo_args)
            assert trainer._trl_ext.enabled == ("fused_loss",)
            assert trainer._trl_ext.state["fused_loss"] == 7
            trainer.train()
            assert trainer._trl_ext.state["fused_loss_steps"] == trainer.state.global_step > 0  # `trl_ext_call`
    finally:
        logging.getLogger("trl_ext").removeHandler(handler)
    assert "trl-ext: DPOTrainer gets plugins fused_loss (chunk=7)" in [r.getMessage() for r in records]
    with pytest.raises(UsageError, match=r"`plugins.fused_loss.chunk` must be a positive integer, got 0"):
        trl_ext.install(fused_loss=True, plugins={"fused_loss": {"chunk": 0}})
    with pytest.raises(UsageError, match=r"Unknown trl-ext flag `fused_los`.*Did you mean `fused_loss`"):
        trl_ext.install(fused_los=True)


@pytest.mark.slow  # `plugin_site` runs pip, a launched process (the fast loop finds the `recorder` plugin)
def test_enabled_from_the_environment_and_yaml(with_plugin, tokenizer, dpo_args, monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_EXT_FUSED_LOSS", "1")
    monkeypatch.setenv("TRL_EXT_PLUGINS", json.dumps({"fused_loss": {"chunk": "3"}}))
    with trl_ext.install():
        assert _dpo_trainer(tokenizer, dpo_args)._trl_ext.state["fused_loss"] == 3
    monkeypatch.delenv("TRL_EXT_FUSED_LOSS")
    monkeypatch.delenv("TRL_EXT_PLUGINS")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"trl_ext": {"fused_loss": True, "plugins": {"fused_loss": {"chunk": 5}}}}))
    monkeypatch.setenv("TRL_EXT_CONFIG", str(recipe))
    with trl_ext.install():
        assert _dpo_trainer(tokenizer, dpo_args)._trl_ext.state["fused_loss"] == 5


@pytest.mark.slow
def test_listed_by_trl_ext_plugins(plugin_site):
    exe = Path(sys.executable).with_name("trl-ext")
    out = subprocess.run([exe, "plugins"], capture_output=True, text=True, env=_env(plugin_site), timeout=300)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("fused_loss"))
    assert "third-party" in row and "chunk" in row and "DPOTrainer" in row
    assert "  option plugins.fused_loss.chunk: a positive integer; default 1024. Tokens per chunk." in out.stdout


@pytest.mark.slow
def test_enabled_from_the_trl_ext_dpo_command_line(plugin_site, tmp_path):
    model_dir = tmp_path / "model"
    make_model(seed=0).save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in preference_rows(4, seed=1)))
    exe = Path(sys.executable).with_name("trl-ext")
    args = [
        exe, "dpo",
        "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(tmp_path / "out"),
        "--per_device_train_batch_size", "2", "--max_steps", "1", "--report_to", "none", "--use_cpu", "true",
        "--save_strategy", "no", "--max_length", "64",
        "--trl-ext-fused-loss", "--trl_ext_plugins", json.dumps({"fused_loss": {"chunk": 11}}),
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, env=_env(plugin_site), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "gets plugins fused_loss (chunk=11)" in proc.stderr, proc.stderr[-4000:]
    help_text = subprocess.run([exe, "dpo", "--help"], capture_output=True, text=True, env=_env(plugin_site))
    assert help_text.returncode == 0, help_text.stderr[-2000:]
    assert "--trl-ext-fused-loss" in help_text.stdout and "(plugin `fused_loss`)" in help_text.stdout


def _broken_distribution(root: Path) -> None:
    """An installed (dist-info on the path) third-party plugin whose module fails to import."""
    (root / "trl_ext_broken_plugin.py").write_text("raise ImportError('needs a library that is not installed')\n")
    info = root / "trl_ext_broken_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trl-ext-broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[trl_ext]\nbroken_one = trl_ext_broken_plugin\n")


def test_broken_installed_plugin_is_skipped_with_the_block_line(tmp_path, monkeypatch, tokenizer, dpo_args):
    import logging

    import trl_ext.manager

    _broken_distribution(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(trl_ext.manager, "_WARNED", set())
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("trl_ext").addHandler(handler)
    try:
        with trl_ext.install(sync_metrics=True) as installation:  # nobody enables it: the rest works
            assert installation.enabled_plugins("DPOTrainer") == ["sync_metrics"]
    finally:
        logging.getLogger("trl_ext").removeHandler(handler)
    warnings = [r.getMessage() for r in records if "broken_one" in r.getMessage()]
    assert len(warnings) == 1 and "ImportError: needs a library that is not installed" in warnings[0], warnings
    assert "`TRL_EXT_BLOCK=broken_one`" in warnings[0] and "`block: [broken_one]`" in warnings[0]
    with pytest.raises(
        UsageError, match=r"(?s)`broken_one`.*package `trl-ext-broken-plugin`.*TRL_EXT_BLOCK=broken_one"
    ):
        trl_ext.install(plugins={"broken_one": {}})
    monkeypatch.setenv("TRL_EXT_BLOCK", "broken_one")  # the advice works
    with trl_ext.install(sync_metrics=True):
        pass


@pytest.mark.slow
def test_broken_installed_plugin_does_not_break_trl_ext_plugins(tmp_path):
    _broken_distribution(tmp_path)
    env = _env(tmp_path)
    exe = Path(sys.executable).with_name("trl-ext")
    proc = subprocess.run([exe, "plugins"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "sync_metrics" in proc.stdout and "broken_one: NOT LOADED" in proc.stdout
    assert proc.stderr.count("`TRL_EXT_BLOCK=broken_one`") == 1, proc.stderr
    blocked = subprocess.run(
        [exe, "plugins"], capture_output=True, text=True, env=dict(env, TRL_EXT_BLOCK="broken_one")
    )
    assert blocked.returncode == 0 and "broken_one" not in blocked.stderr, blocked.stderr
