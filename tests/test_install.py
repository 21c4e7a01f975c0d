"""`trl_ext.install()` on real TRL trainers: hook order, pass-through equivalence, reversibility, bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

import trl_ext
from trl_ext import UsageError, _compat
from trl_ext.manager import builtin_plugin_modules
from trl_ext.spec import Flag, PluginSpec, boolean
from trl_ext.testing import make_model, make_preference_dataset

from ._fakes import install_fake_plugin


def _train_dpo(tokenizer, dpo_args, arch="llama", **arg_overrides):
    from trl import DPOTrainer

    trainer = DPOTrainer(
        make_model(arch, seed=0),
        ref_model=make_model(arch, seed=0),
        args=dpo_args(**arg_overrides),
        train_dataset=make_preference_dataset(8),
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer, [log["loss"] for log in trainer.state.log_history if "loss" in log]


# Qwen2 is `slow`: the hooks wrap any backbone alike; the packing plugins' Qwen2 forwards are checked in the fast loop
# (tests/plugins/test_padding_free.py and test_prompt_sharing.py `test_architectures`).
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_dpo_hooks_run_in_order_and_pass_through_changes_nothing(tokenizer, dpo_args, recorder, arch):
    _, stock_losses = _train_dpo(tokenizer, dpo_args, arch)
    with trl_ext.install(plugins={"recorder": {"note": "hi"}}) as installation:
        trainer, losses = _train_dpo(tokenizer, dpo_args, arch)
        assert trainer._trl_ext.enabled == ("recorder",)
        assert installation.enabled_plugins("DPOTrainer") == ["recorder"]
    assert recorder.names()[:6] == [
        "validate",
        "init_start",
        "make_collator",
        "make_packed_forward",
        "make_packed_forward",
        "models_ready",
    ]
    assert recorder.events[0] == ("validate", {"note": "hi"})
    assert recorder.events[1] == ("init_start", "DPOTrainer", False, True)
    assert recorder.events[2] == ("make_collator", "DataCollatorForPreference")
    assert [e[1] for e in recorder.events[3:5]] == ["policy", "ref"]
    assert recorder.events[5] == ("models_ready", True)
    assert recorder.events[6] == ("init_end", "DPOTrainer")
    assert recorder.names().count("reduce_metrics") == len(losses) + 1  # one per logging step, plus the final summary
    assert recorder.names()[-1] == "uninstall"
    # The plugin's collator and forwards really were the ones used...
    assert recorder.collators[0].calls == 2
    assert recorder.forward_calls == {"policy": 2, "ref": 2}
    # ...and since they pass through, the run is bit-identical to stock TRL.
    assert losses == stock_losses and len(losses) == 2


def test_disabled_plugin_changes_nothing(tokenizer, dpo_args, recorder):
    _, stock_losses = _train_dpo(tokenizer, dpo_args)
    with trl_ext.install() as installation:  # recorder is registered, but not enabled
        assert installation.plugin_manager.get_plugin("recorder") is recorder
        trainer, losses = _train_dpo(tokenizer, dpo_args)
        assert trainer._trl_ext.enabled == ()
    assert recorder.names() == ["validate", "uninstall"]
    assert losses == stock_losses


def test_precompute_hook_runs_after_models_ready_and_before_any_forward(tokenizer, dpo_args, recorder):
    from trl import DPOTrainer

    with trl_ext.install(plugins={"recorder": {}}):
        trainer = DPOTrainer(
            make_model(seed=0),
            args=dpo_args(precompute_ref_log_probs=True, precompute_ref_batch_size=3),
            train_dataset=make_preference_dataset(8),
            processing_class=tokenizer,
        )
        assert "ref_chosen_logps" in trainer.train_dataset.column_names  # TRL did it, since the hook returned None
    names = recorder.names()
    assert names.index("models_ready") < names.index("make_ref_precompute") < names.index("init_end")
    assert ("make_ref_precompute", "train", 3, 0) in recorder.events
    assert recorder.forward_calls["policy"] == 3  # ceil(8 / 3) precompute batches ran through the plugin's forward


def test_online_dpo_hooks_including_generation(recorder, plain_online_dpo):
    with trl_ext.install(plugins={"recorder": {}}):
        trainer = plain_online_dpo()
        trainer.train()
    names = recorder.names()
    assert names[1:3] == ["init_start", "make_collator"]
    assert names.index("models_ready") < names.index("init_end") < names.index("make_generation_context")
    assert recorder.generation_calls == 2  # one generation per training step
    assert "accelerator" in recorder.events[names.index("make_generation_context")][1]
    assert names.count("reduce_metrics") >= 2
    assert any(k.startswith("objective/") for log in trainer.state.log_history for k in log)


def _snapshot(objects):
    return {id(obj): (obj, dict(vars(obj))) for obj in objects}


def test_uninstall_restores_every_patched_object_identically(recorder, plain_dpo):
    import importlib

    from trl import DPOTrainer
    from trl.experimental.online_dpo import OnlineDPOTrainer

    # Every class and module trl-ext may patch, as listed in the compat module.
    targets = [getattr(importlib.import_module(m), c) for m, c in _compat.TRAINERS.values()]
    targets += [importlib.import_module(m) for m, _ in _compat.TRAINERS.values()]
    targets += [importlib.import_module(m) for m in _compat.GENERATION_HELPER_MODULES.values()]
    before = _snapshot(targets)
    installation = trl_ext.install(plugins={"recorder": {}})
    assert DPOTrainer.__dict__["__init__"] is not before[id(DPOTrainer)][1]["__init__"]
    assert "__init__" in vars(OnlineDPOTrainer) and "log" not in vars(OnlineDPOTrainer)  # per trainer, not per class
    trainer = plain_dpo()
    backbone = trainer.model.base_model
    assert "forward" in vars(backbone) and "_trl_ext" in vars(trainer)
    installation.uninstall()
    installation.uninstall()  # a second call is a no-op
    after = _snapshot(targets)
    for key, (obj, attrs) in before.items():
        now = after[key][1]
        assert now.keys() == attrs.keys(), obj
        changed = [name for name in attrs if now[name] is not attrs[name]]
        assert not changed, (obj, changed)
    # The trainer built while installed keeps its plugins (its own attributes, its models, its collator)...
    assert "forward" in vars(backbone) and trainer._trl_ext.enabled == ("recorder",)
    # ...until it is detached, which makes it and its models stock.
    installation.detach(trainer)
    assert "forward" not in vars(backbone)
    assert "_trl_ext" not in vars(trainer)
    assert not {"log", "train", "evaluate", "predict", "_precompute_ref_logps"} & set(vars(trainer))
    assert trainer.data_collator is recorder.collators[0].inner
    # A trainer built after uninstall is stock: no hooks run.
    events = len(recorder.events)
    plain_dpo()
    assert len(recorder.events) == events


class _OwnsPaddingFree:
    """A third-party plugin that claims TRL's `padding_free` flag; `seen`: the flag its trainer was built with."""

    TRL_EXT_PLUGIN = PluginSpec(
        name="fake_padding_free",
        flags=(Flag("padding_free", default=False, parse=boolean, help="Pack."),),
        trainers=("DPOTrainer",),
        trl_flag="padding_free",
    )

    @trl_ext.hookimpl
    def trl_ext_trainer_init_start(self, trainer, context, init_kwargs):
        self.seen = init_kwargs["args"].padding_free


def test_trl_flag_that_trl_ignores_enables_the_plugin_with_that_flag(dpo_args, monkeypatch, caplog, plain_dpo):
    """`DPOConfig(padding_free=True)` (ignored by TRL >= 0.29) enables the trl-ext plugin owning `padding_free`."""

    plugin = _OwnsPaddingFree()
    install_fake_plugin(monkeypatch, "fake_padding_free", plugin)
    block = ["padding_free"] if "padding_free" in builtin_plugin_modules() else []
    with trl_ext.install(block=block) as installation:
        args = dpo_args(padding_free=True)
        assert installation.enabled_plugins("DPOTrainer", args) == ["fake_padding_free"]
        assert installation.enabled_plugins("DPOTrainer", dpo_args()) == []
        assert installation.enabled_plugins("OnlineDPOTrainer", args) == []
        with caplog.at_level("WARNING"):
            trainer = plain_dpo(args=args)
        assert trainer._trl_ext.enabled == ("fake_padding_free",)
        assert plugin.seen is True
        assert args.padding_free is True  # the user's config object is left as it was
        assert "temporarily unavailable" not in caplog.text  # TRL did not fall back: the plugin handles the flag


def test_trl_that_honours_the_flag_keeps_it_and_refuses_a_double_claim(dpo_args, monkeypatch, plain_dpo):
    """On a TRL that implements `padding_free` itself (e.g. with patches/0001), the TRL flag stays TRL's."""

    install_fake_plugin(monkeypatch, "fake_padding_free", _OwnsPaddingFree())
    monkeypatch.setattr(_compat, "dpo_honours_padding_free", lambda: True)
    block = ["padding_free"] if "padding_free" in builtin_plugin_modules() else []
    with trl_ext.install(block=block) as installation:
        assert installation.enabled_plugins("DPOTrainer", dpo_args(padding_free=True)) == []
    with trl_ext.install(block=block, padding_free=True):
        with pytest.raises(UsageError, match=r"Both TRL's own `padding_free=True`.*`fake_padding_free`"):
            plain_dpo(args=dpo_args(padding_free=True))


def test_unsupported_trl_version_is_a_usage_error(monkeypatch):
    for version in ("1.9.2", "1.17.0", "0.29.1", "2.0.0.dev0"):
        monkeypatch.setattr(_compat, "installed_version", lambda dist, v=version: v if dist == "trl" else "1")
        with pytest.raises(UsageError, match=rf"trl-ext supports trl>=1.10,<1.17, but trl=={version} is installed"):
            trl_ext.install()
    monkeypatch.setattr(_compat, "installed_version", lambda dist: None)
    with pytest.raises(UsageError, match="TRL is not installed"):
        trl_ext.install()


def test_renamed_trl_attribute_fails_clearly_and_leaves_trl_untouched(monkeypatch):
    from trl import DPOTrainer

    monkeypatch.delattr(DPOTrainer, "_precompute_ref_logps")
    before = dict(vars(DPOTrainer))
    with pytest.raises(UsageError, match=r"cannot find `.*DPOTrainer._precompute_ref_logps`.*renamed or removed"):
        trl_ext.install()
    assert dict(vars(DPOTrainer)) == before


def test_install_again_with_the_same_flags_returns_the_active_installation():
    """A notebook cell run twice: the same flags give the active installation; other flags a clear error."""
    assert trl_ext.current() is None
    with trl_ext.install(sync_metrics=True) as installation:
        assert installation.installed and trl_ext.current() is installation
        assert trl_ext.install(sync_metrics=True) is installation
        assert trl_ext.install({"sync_metrics": "true"}) is installation  # the same merged configuration
        with pytest.raises(
            UsageError, match=r"already installed .*Uninstall it first: `trl_ext.current\(\).uninstall"
        ):
            trl_ext.install(padding_free=True)
        assert trl_ext.current() is installation
    assert not installation.installed and trl_ext.current() is None
    trl_ext.install(padding_free=True).uninstall()  # installable again
    assert trl_ext.current() is None


def test_trainer_built_before_install_is_reported_stock(dpo_args, plain_dpo):
    trainer = plain_dpo()
    with trl_ext.install(padding_free=True) as installation:
        assert installation.enabled_plugins(trainer) == []  # it runs stock: nothing was attached to it
        assert installation.enabled_plugins("DPOTrainer") == ["padding_free"]  # what a trainer built now gets
        assert installation.enabled_plugins(trainer, dpo_args()) == ["padding_free"]


def test_options_of_a_plugin_its_trl_flag_could_enable_must_be_used(dpo_args, plain_dpo):
    """`plugins: {padding_free: {...}}` without `padding_free: true`: the options apply to trainers whose DPOConfig
    sets `padding_free=True`, and a trainer without it is refused instead of silently ignoring them."""

    def build(args):
        return plain_dpo(args=args)

    with trl_ext.install(plugins={"padding_free": {"attention": "dense"}}):
        with pytest.raises(
            UsageError,
            match=r"`plugins.padding_free` sets \['attention'\], but `padding_free` is not set, so the plugin "
            r"`padding_free` is off for this DPOTrainer.*`padding_free=True` in the DPOConfig",
        ):
            build(dpo_args())
        trainer = build(dpo_args(padding_free=True))
        assert trainer._trl_ext.enabled == ("padding_free",)
        assert trainer._trl_ext.state["padding_free"].attention == "dense"


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (dict(padding_frees=True), "Unknown trl-ext flag `padding_frees`"),
        (dict(plugins={"not_installed": {}}), r"`plugins` names `not_installed`.*which is not installed"),
        (dict(plugins={"recorder": {"colour": 1}}), r"Unknown option\(s\) `colour` for the trl-ext plugin `recorder`"),
        (dict(block=["nope"]), "`block` names unknown plugin"),
    ],
)
def test_bad_install_input_is_a_usage_error(flags, match, recorder):
    with pytest.raises(UsageError, match=match):
        trl_ext.install(**flags)


def test_flag_whose_plugin_is_blocked_is_a_usage_error():
    for flag, owner, value in [
        ("padding_free", "padding_free", True),
        ("sync_metrics", "sync_metrics", True),
        ("precompute_ref_batch_size", "precompute_ref_batch_size", 8),
        ("ds3_gather_for_generation", "generation", False),
    ]:
        if owner in builtin_plugin_modules():
            with pytest.raises(
                UsageError, match=rf"`{flag}` is set .*the plugin `{owner}` that implements it is blocked"
            ):
                trl_ext.install(block=[owner], **{flag: value})
        else:
            with pytest.raises(UsageError, match=rf"`{flag}` is set, but the plugin `{owner}` .* not available"):
                trl_ext.install(**{flag: value})


@pytest.mark.slow
def test_importing_trl_ext_imports_neither_torch_nor_trl():
    code = (
        "import sys, trl_ext, trl_ext.config, trl_ext.hookspecs; "
        "print(sorted(m for m in ('torch', 'trl', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(("eval_pairs", "said"), [(5, True), (8, False)])
def test_sync_metrics_says_when_uneven_eval_batches_make_its_means_differ_from_stock(
    eval_pairs, said, dpo_args, plain_dpo, trl_ext_log
):
    """A partial last eval batch (5 pairs in batches of 4 and 1): sync_metrics' eval means are over pairs, stock's
    over per-batch means, and one line says so; full batches: no line."""
    with trl_ext.install(sync_metrics=True):
        args = dpo_args(per_device_eval_batch_size=4)
        trainer = plain_dpo(args=args, eval_dataset=make_preference_dataset(eval_pairs, seed=3))
        trainer.evaluate()
        trainer.evaluate()
    lines = [r.getMessage() for r in trl_ext_log.records if "sync_metrics: the eval batches" in r.getMessage()]
    assert len(lines) == (1 if said else 0), lines  # once per trainer
    if said:
        assert "held 4 / 1 pairs (5 in all)" in lines[0] and "stock TRL averages the per-batch means" in lines[0]


def test_trl_precompute_left_to_trl_names_the_trl_ext_flag(tokenizer, dpo_args, trl_ext_log):
    """No plugin enabled, `DPOConfig(precompute_ref_log_probs=True, precompute_ref_batch_size=8)`: TRL precomputes, and
    one warning names trl-ext's `precompute_ref_batch_size`."""
    from trl import DPOTrainer

    with trl_ext.install():
        trainer = DPOTrainer(
            make_model(seed=0),
            args=dpo_args(precompute_ref_log_probs=True, precompute_ref_batch_size=8),
            train_dataset=make_preference_dataset(4),
            processing_class=tokenizer,
        )
    assert trainer._trl_ext.enabled == () and "ref_chosen_logps" in trainer.train_dataset.column_names
    lines = [r.getMessage() for r in trl_ext_log.records if r.levelname == "WARNING"]
    assert len(lines) == 1, lines
    assert "DPOConfig(precompute_ref_log_probs=True, precompute_ref_batch_size=8) is left to TRL" in lines[0]
    assert '`precompute_ref_batch_size=8` (or "auto")' in lines[0]
