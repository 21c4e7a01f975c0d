"""The `trl-ext` command line, run as users run it: a subprocess of the installed console script (`slow`), or
`main([...])` in this process where the output is all that is checked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import trl_ext
from trl_ext.manager import builtin_plugin_modules


def _run(*args, check=True, env=None, cwd=None):
    exe = str(__import__("pathlib").Path(sys.executable).with_name("trl-ext"))
    exe = exe if os.path.exists(exe) else shutil.which("trl-ext")
    env = env or dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    return subprocess.run([exe, *args], capture_output=True, text=True, check=check, timeout=300, env=env, cwd=cwd)


@pytest.mark.slow
def test_doctor_prints_versions_support_and_attention_backends():
    out = _run("doctor").stdout
    import trl

    assert f"trl           {trl.__version__}" in out and "supported" in out
    for dist in ("transformers", "torch", "accelerate", "deepspeed"):
        assert dist in out
    assert "attention" in out and "sdpa" in out
    assert out.strip().endswith("OK")


@pytest.mark.slow
def test_plugins_lists_builtins_with_flags_and_applicability():
    out = _run("plugins").stdout
    builtins = builtin_plugin_modules()
    for name in builtins:
        assert name in out
    if builtins:
        assert "built-in" in out and "applies" in out
    # each flag and option with what it accepts, its default and one line of help, from the declarations
    assert "  flag   sync_metrics: true or false; default false. " in out
    assert "  option plugins.precompute_ref_batch_size.shard_size: a positive integer; default 4096. " in out


@pytest.mark.slow
def test_plugins_with_unknown_block_name_fails_with_usage_message():
    proc = _run("plugins", "--block", "nope", check=False)
    assert proc.returncode == 2
    assert "trl-ext: error: `block` names unknown plugin" in proc.stderr


@pytest.mark.slow
def test_version():
    assert _run("--version").stdout.strip() == f"trl-ext {trl_ext.__version__}"


def _third_party_plugin(root):
    """A real installed third-party plugin: a module and a `.dist-info` with a `trl_ext` entry point, on PYTHONPATH."""
    (root / "tp_plugin.py").write_text(
        "from trl_ext.spec import Flag, PluginSpec, boolean\n"
        "TRL_EXT_PLUGIN = PluginSpec(name='tp_plugin', summary='Third party.',\n"
        "    flags=(Flag('tp_turbo', default=False, parse=boolean, help='Third-party turbo mode.'),))\n"
    )
    info = root / "tp_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tp-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[trl_ext]\ntp_plugin = tp_plugin\n")
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("command", ["dpo", "online-dpo"])
def test_job_help_shows_trl_ext_flags_first_one_line_each(command, tmp_path):
    proc = _run(command, "--help", env=_third_party_plugin(tmp_path))
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"usage: trl-ext {command} ") and len(lines[0]) < 120  # a short usage line
    top = lines.index("trl-ext flags:")
    assert top < lines.index("options:") and top < 5  # our group comes first, above TRL's options
    from trl_ext.manager import load_catalog

    flags = [*load_catalog()[0].flags, "tp_turbo", "plugins", "block", "config"]
    for name in flags:
        line = next(line for line in lines if line.startswith(f"  --trl-ext-{name.replace('_', '-')} "))
        helps = {"tp_turbo": "Third-party turbo mode."}
        if name in helps:
            assert helps[name] in line  # the help sits on the flag's own line, built from its declaration
    assert "Warning" not in proc.stderr, proc.stderr  # no TRLExperimentalWarning (or other) noise
    assert "trl online-dpo" not in proc.stdout  # TRL has no such command


@pytest.mark.slow
def test_top_level_help_points_to_no_missing_trl_command():
    out = " ".join(_run("--help").stdout.split())  # argparse wraps lines
    assert "trl online-dpo" not in out and "trl-ext online-dpo --help" in out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["dpo", "--trl-ext-padding-fre"], "Did you mean `padding_free`"),
        (["dpo", "--trl_ext_sync_metric", "true"], "Did you mean `sync_metrics`"),
        (["dpo", "--lerning-rate", "1e-3"], "Did you mean `--learning-rate`"),
        (["online-dpo", "--max_new_tokns", "4"], "Did you mean `--max_new_tokens`"),
        (["dpo", "--learning_rate", "fast"], "invalid float value"),
    ],
)
def test_bad_flag_is_one_clean_error_line_with_exit_code_2(argv, expected):
    proc = _run(*argv, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no traceback, no warnings, no usage block
    assert lines[0].startswith("trl-ext: error: ") and "the command line" in lines[0] and expected in lines[0]


# -------------------------------------------------------------------------------------------------------------------
# In this process: what `--help` and `trl-ext plugins [NAME]` print (issue 35, item 7)
# -------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["dpo", "online-dpo"])
def test_job_help_gives_each_flag_what_it_accepts_and_its_default(command, capsys):
    from trl_ext.app.cli import main
    from trl_ext.manager import load_catalog
    from trl_ext.spec import SettingDoc

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    catalog = load_catalog()[0]
    assert catalog.flags
    for name, (flag, owner) in catalog.flags.items():
        line = next(line for line in lines if line.startswith(f"  --trl-ext-{name.replace('_', '-')} "))
        default = SettingDoc("flag", name, flag.parse.expects, flag.default, flag.help).default_text()
        assert f"Accepts {flag.parse.expects}; default {default} (plugin `{owner}`)." in line, line


def test_plugins_name_prints_one_plugin_page(capsys):
    import inspect

    from trl_ext.app.cli import main
    from trl_ext.manager import load_catalog

    catalog = load_catalog()[0]
    for name in catalog.specs:
        assert main(["plugins", name]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"{name} (built-in; applies to ")
        doc = inspect.getdoc(catalog.plugins[name])
        assert doc and doc.splitlines()[0] in out and doc.splitlines()[-1] in out  # the whole docstring
        for setting in catalog.specs[name].docs():
            key = setting.name if setting.kind == "flag" else f"plugins.{name}.{setting.name}"
            assert f"  {setting.kind:<6} {key}: {setting.accepts}; default {setting.default_text()}." in out
        others = [other for other in catalog.specs if other != name]
        assert not any(f"plugins.{other}." in out for other in others)  # only this plugin's settings


def test_plugins_name_that_does_not_exist_is_a_usage_error(capsys):
    from trl_ext.app.cli import main

    assert main(["plugins", "padding_fre"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trl-ext: error: No trl-ext plugin `padding_fre`.") and "Did you mean `padding_free`?" in err
    assert len(err.strip().splitlines()) == 1
