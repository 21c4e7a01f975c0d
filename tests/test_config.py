"""Configuration: the sources, their precedence, and a UsageError for every bad input."""

from __future__ import annotations

import re

import pytest

from trl_ext import TrlExtConfig, UsageError
from trl_ext.config import load_config


def test_defaults_leave_every_plugin_off():
    config = load_config(environ={})
    assert config == TrlExtConfig()
    assert config.padding_free is False
    assert config.precompute_ref_batch_size is None
    assert config.ds3_gather_for_generation is None
    assert config.sync_metrics is False


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path):
    path = tmp_path / "trl_ext.yaml"
    path.write_text("padding_free: true\nprecompute_ref_batch_size: 8\nsync_metrics: true\n")
    # file only
    assert load_config(path, environ={}) == TrlExtConfig(
        padding_free=True, precompute_ref_batch_size=8, sync_metrics=True
    )
    # the environment overrides the file, key by key
    env = {"TRL_EXT_PRECOMPUTE_REF_BATCH_SIZE": "auto", "TRL_EXT_SYNC_METRICS": "false"}
    assert load_config(path, environ=env) == TrlExtConfig(
        padding_free=True, precompute_ref_batch_size="auto", sync_metrics=False
    )
    # keyword flags override both
    config = load_config(path, flags={"precompute_ref_batch_size": 32, "padding_free": False}, environ=env)
    assert config == TrlExtConfig(padding_free=False, precompute_ref_batch_size=32, sync_metrics=False)


def test_config_file_from_environment_and_nested_section(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("learning_rate: 1.0e-6\ntrl_ext:\n  padding_free: true\n  ds3_gather_for_generation: auto\n")
    config = load_config(environ={"TRL_EXT_CONFIG": str(path)})
    assert config.padding_free is True and config.ds3_gather_for_generation == "auto"


def test_config_object_and_mapping_are_bases_that_env_and_flags_override():
    base = TrlExtConfig(padding_free=True, precompute_ref_batch_size=4)
    config = load_config(base, flags={"precompute_ref_batch_size": 16}, environ={"TRL_EXT_SYNC_METRICS": "1"})
    assert config == TrlExtConfig(padding_free=True, precompute_ref_batch_size=16, sync_metrics=True)
    assert load_config({"padding_free": "yes"}, environ={}).padding_free is True


def test_plugins_and_block_from_env():
    env = {"TRL_EXT_PLUGINS": '{"precompute_ref_batch_size": {"sort": "none"}}', "TRL_EXT_BLOCK": "sync_metrics"}
    config = load_config(environ=env)
    assert config.plugins == {"precompute_ref_batch_size": {"sort": "none"}}
    assert config.options("precompute_ref_batch_size").sort == "none"
    assert config.block == ["sync_metrics"]
    assert "sync_metrics" not in config.flags  # a blocked plugin's flags do not exist
    config = load_config(environ={"TRL_EXT_PLUGINS": "padding_free,generation"})
    assert config.plugins == {"padding_free": {}, "generation": {}}


def test_one_size_grammar_for_every_plugin():
    from trl_ext.spec import Size

    for value, expected in [
        ("25%", Size("fraction", 0.25)),
        (0.5, Size("fraction", 0.5)),
        ("0.5", Size("fraction", 0.5)),
        ("4GB", Size("bytes", 4e9)),
        ("512MiB", Size("bytes", 512 * 2**20)),
        (1024, Size("bytes", 1024.0)),
    ]:
        generation = load_config(
            flags={"ds3_gather_for_generation": False, "plugins": {"generation": {"budget": value}}}, environ={}
        )
        precompute = load_config(
            flags={"precompute_ref_batch_size": 4, "plugins": {"precompute_ref_batch_size": {"ram_budget": value}}},
            environ={},
        )
        assert generation.options("generation").budget == expected
        assert precompute.options("precompute_ref_batch_size").ram_budget == expected
    for bad in ("0%", "lots", True, -1, 1.5, "3 parsecs"):
        for plugin, option in (("generation", "budget"), ("precompute_ref_batch_size", "ram_budget")):
            with pytest.raises(UsageError, match=rf"`plugins.{plugin}.{option}` must be a size"):
                load_config(flags={"plugins": {plugin: {option: bad}}}, environ={})


def test_blocked_flag_names_its_plugin():
    with pytest.raises(
        UsageError, match=r"`sync_metrics` is set .* the plugin `sync_metrics` that implements it is blocked"
    ):
        load_config(flags={"sync_metrics": True, "block": ["sync_metrics"]}, environ={})


@pytest.mark.parametrize(
    ("source", "match"),
    [
        (dict(flags={"padding_fre": True}), r"Unknown trl-ext flag `padding_fre`.*Did you mean `padding_free`"),
        (dict(environ={"TRL_EXT_PADING_FREE": "1"}), r"Unknown trl-ext flag `pading_free`.*\$TRL_EXT_PADING_FREE"),
        (dict(flags={"padding_free": "maybe"}), r"`padding_free` must be true or false"),
        (dict(flags={"sync_metrics": 2}), r"`sync_metrics` must be true or false"),
        (dict(flags={"precompute_ref_batch_size": 0}), r"`precompute_ref_batch_size` must be a positive integer"),
        (dict(flags={"precompute_ref_batch_size": "big"}), r"`precompute_ref_batch_size` must be"),
        (dict(flags={"precompute_ref_batch_size": True}), r"`precompute_ref_batch_size` must be"),
        (dict(flags={"ds3_gather_for_generation": "sometimes"}), r"`ds3_gather_for_generation` must be"),
        (dict(flags={"plugins": {"x": 3}}), r"`plugins.x` must be a mapping"),
        (dict(flags={"plugins": {"nope": {}}}), r"`plugins` names `nope`.*is not installed"),
        (dict(flags={"plugins": {"sync_metrics": {"a": 1}}}), r"plugin `sync_metrics` has no options"),
        (dict(flags={"plugins": 5}), r"`plugins` must map plugin names"),
        (dict(flags={"block": "generation"}), None),  # a comma list string is fine
        (dict(flags={"block": [1]}), r"`block` must be a list"),
        (dict(environ={"TRL_EXT_PLUGINS": "{not json"}), r"not valid JSON"),
        (dict(config=3), r"`config` must be a TrlExtConfig"),
    ],
)
def test_bad_input_is_a_usage_error(source, match):
    kwargs = {"environ": {}, **source}
    if match is None:
        load_config(**kwargs)
        return
    with pytest.raises(UsageError, match=match):
        load_config(**kwargs)


def test_bad_yaml_files(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("padding_free: [unclosed\n")
    with pytest.raises(UsageError, match="not valid YAML"):
        load_config(bad, environ={})
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("trl_ext:\n  sync_metric: true\n")
    with pytest.raises(UsageError, match=r"Unknown trl-ext flag `sync_metric`.*config file"):
        load_config(unknown, environ={})


def test_usage_error_is_a_value_error():
    assert issubclass(UsageError, ValueError)


def test_options_of_a_plugin_whose_flag_is_off_are_refused_built_in_and_third_party(monkeypatch):
    """Naming a plugin with flags under `plugins:` gives its options; its flag enables it. Without the flag the
    options would do nothing: a UsageError, for built-in and third-party plugins alike, with or without options."""
    import types

    import trl_ext
    from trl_ext.spec import Flag, PluginSpec, boolean

    from ._fakes import install_fake_plugin

    module = types.ModuleType("_trl_ext_fake_turbo")
    module.TRL_EXT_PLUGIN = PluginSpec(name="turbo", flags=(Flag("turbo", default=False, parse=boolean, help="x"),))
    install_fake_plugin(monkeypatch, "turbo", module)
    for plugins, flag in [
        ({"generation": {"budget": "8GB"}}, "ds3_gather_for_generation"),
        ({"precompute_ref_batch_size": {"sort": "none"}}, "precompute_ref_batch_size"),
        ({"sync_metrics": {}}, "sync_metrics"),
        ({"turbo": {}}, "turbo"),
    ]:
        name = next(iter(plugins))
        with pytest.raises(UsageError, match=rf"`plugins.{name}` .*but `{flag}` is not set.*its flag enables it"):
            trl_ext.install(plugins=plugins)
    with trl_ext.install(turbo=True, plugins={"turbo": {}}) as installation:
        assert installation.enabled_plugins("DPOTrainer")[-1:] == ["turbo"]


_PY_SOURCES = ("keyword", "env", "config")
_PY_PAIRS = [(high, low) for i, high in enumerate(_PY_SOURCES) for low in (*_PY_SOURCES[i + 1 :], "default")]


@pytest.mark.parametrize("third_party", [False, True])
@pytest.mark.parametrize(("high", "low"), _PY_PAIRS)
def test_install_precedence_per_source_pair(high, low, third_party, monkeypatch, tmp_path):
    """`install(**flags)` > `TRL_EXT_*` > `install(config=...)` > defaults, both ways round, for a built-in and a
    third-party flag."""
    import types

    from trl_ext.spec import Flag, PluginSpec, boolean

    from ._fakes import install_fake_plugin

    flag = "sync_metrics"
    if third_party:
        flag = "turbo"
        module = types.ModuleType("_trl_ext_fake_turbo")
        module.TRL_EXT_PLUGIN = PluginSpec(
            name="turbo", flags=(Flag("turbo", default=False, parse=boolean, help="x"),)
        )
        install_fake_plugin(monkeypatch, "turbo", module)
    for value in (True, False):
        values = {high: value} if low == "default" else {high: value, low: not value}
        path = tmp_path / "config.yaml"
        path.write_text(f"{flag}: {str(values.get('config')).lower()}\n" if "config" in values else "{}\n")
        environ = {f"TRL_EXT_{flag.upper()}": str(values["env"])} if "env" in values else {}
        flags = {flag: values["keyword"]} if "keyword" in values else {}
        config = load_config(path, flags=flags, environ=environ)
        assert getattr(config, flag) is value, (flag, values)


# -------------------------------------------------------------------------------------------------------------------
# One grammar for every source (issue 35, item 9)
# -------------------------------------------------------------------------------------------------------------------


def _from_source(source, flag, value, tmp_path, monkeypatch):
    """`flag: value` given the way a user gives it in `source`, resolved as trl-ext resolves that source."""
    import yaml

    from trl_ext.app.job_args import resolve_config

    for key in [k for k in __import__("os").environ if k.startswith("TRL_EXT_")]:
        monkeypatch.delenv(key)
    if source == "python":
        return load_config(flags={flag: value}, environ={})
    if source == "env":
        return load_config(environ={f"TRL_EXT_{flag.upper()}": str(value)})
    if source == "yaml":
        path = tmp_path / "trl_ext.yaml"
        path.write_text(yaml.safe_dump({flag: value}))
        return load_config(path, environ={})
    argv = [f"--trl-ext-{flag.replace('_', '-')}", str(value)]
    if source == "recipe":
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump({"learning_rate": 0.1, "trl_ext": {flag: value}}))
        argv = ["--config", str(path)]
    config, _, stripped = resolve_config(argv)
    if stripped:
        __import__("os").unlink(stripped)
    return config


SOURCES = ("python", "env", "yaml", "cli", "recipe")


@pytest.mark.parametrize("source", SOURCES)
def test_one_value_grammar_for_every_source(source, tmp_path, monkeypatch):
    """`fused_logprobs=1` and `precompute_ref_batch_size=256.0` mean the same from Python, the environment, a YAML
    file, the command line and a recipe, as `"yes"` and `"256"` do."""
    for value, expected in [
        (True, True), (False, False), (1, True), (0, False), ("yes", True), ("no", False),
        ("true", True), ("false", False), ("1", True), ("0", False), ("True", True), ("FALSE", False),
    ]:  # fmt: skip
        assert _from_source(source, "sync_metrics", value, tmp_path, monkeypatch).sync_metrics is expected, value
    for value in (256, 256.0, "256", "256.0"):
        config = _from_source(source, "precompute_ref_batch_size", value, tmp_path, monkeypatch)
        assert config.precompute_ref_batch_size == 256 and type(config.precompute_ref_batch_size) is int, value
    with pytest.raises(UsageError, match=r"must be a positive integer.* got '?256\.5'? \(not a whole number\)"):
        _from_source(source, "precompute_ref_batch_size", 256.5, tmp_path, monkeypatch)
    with pytest.raises(UsageError, match=r"`sync_metrics` must be true or false, got '?2'?"):
        _from_source(source, "sync_metrics", 2, tmp_path, monkeypatch)


def test_options_and_sizes_take_the_same_grammar():
    options = {"precompute_ref_batch_size": {"shard_size": 512.0}}
    config = load_config(flags={"precompute_ref_batch_size": 8, "plugins": options}, environ={})
    assert config.options("precompute_ref_batch_size").shard_size == 512
    with pytest.raises(UsageError, match=r"shard_size` must be a positive integer, got 512\.5 \(not a whole number\)"):
        load_config(flags={"plugins": {"precompute_ref_batch_size": {"shard_size": 512.5}}}, environ={})
    from trl_ext.spec import Size, parse_size

    assert parse_size(4e9) == parse_size(4_000_000_000) == Size("bytes", 4e9)  # a whole float is bytes, as the int
    assert parse_size(0.25) == parse_size("0.25") == Size("fraction", 0.25)


def test_recipe_errors_name_the_file_and_the_misspelled_section(tmp_path, monkeypatch):
    from trl_ext.app.job_args import resolve_config

    monkeypatch.delenv("TRL_EXT_SYNC_METRICS", raising=False)
    recipe = tmp_path / "my_recipe.yaml"
    recipe.write_text("learning_rate: 0.1\ntrl_ext:\n  sync_metrics: maybe\n")
    with pytest.raises(UsageError, match=rf"got 'maybe' \(from the `trl_ext:` section of the recipe {recipe}\)"):
        resolve_config(["--config", str(recipe)])
    for key in ("trl-ext", "TRL_EXT", "trlext"):
        recipe.write_text(f"learning_rate: 0.1\n{key}:\n  sync_metrics: true\n")
        with pytest.raises(UsageError, match=rf"The recipe {recipe} has a key `{key}:`. Did you mean `trl_ext:`\?"):
            resolve_config(["--config", str(recipe)])
        with pytest.raises(UsageError, match=rf"{recipe.name}' has a key `{key}:`. Did you mean `trl_ext:`\?"):
            load_config(recipe, environ={})  # the same file as a trl-ext config file


@pytest.mark.parametrize("where", ["plugins", "block"])
def test_a_plugin_typo_gets_a_did_you_mean(where, tmp_path):
    """Issue 41: a misspelled plugin under `plugins:` or `block` is answered as a misspelled flag is."""
    path = tmp_path / "trl_ext.yaml"
    path.write_text(f"{where}: [prompt_sharng]\n")
    with pytest.raises(UsageError, match="Did you mean `prompt_sharing`?"):
        load_config(path, environ={})


@pytest.mark.parametrize(
    ("flags", "environ", "source"),
    [
        ({"padding_free": False}, {}, "keyword flags of install()"),
        ({}, {"TRL_EXT_PADDING_FREE": "0"}, "environment variable $TRL_EXT_PADDING_FREE"),
    ],
)
def test_an_explicit_false_against_the_trl_flag_it_serves_is_refused(flags, environ, source, tmp_path):
    """Issue 41: `padding_free=False` given explicitly, with `DPOConfig(padding_free=True)` (which TRL ignores and
    trl-ext serves): one would silently override the other, so the pair is refused, naming both; left unset, the TRL
    flag turns the plugin on."""
    from trl import DPOConfig

    from trl_ext import _compat
    from trl_ext.build import check_trainer_settings

    if "padding_free" not in _compat.trl_ignored_flags("DPOTrainer"):
        pytest.skip("this TRL packs DPO itself")
    args = DPOConfig(output_dir=str(tmp_path), padding_free=True, use_cpu=True, report_to="none")
    message = f"`padding_free=false` (from {source}) contradicts `padding_free=True` in the DPOConfig"
    with pytest.raises(UsageError, match=re.escape(message)):
        check_trainer_settings(load_config(flags=flags, environ=environ), "DPOTrainer", args)
    assert "padding_free" in check_trainer_settings(load_config(environ={}), "DPOTrainer", args)
    args.padding_free = False
    assert "padding_free" not in check_trainer_settings(load_config(flags=flags, environ=environ), "DPOTrainer", args)
