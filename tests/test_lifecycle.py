"""No silent surprises (issue 15): a trainer keeps its plugins for its whole life, TRL's errors stay TRL's, a
multi-process launch that runs single-process is refused, and what trl-ext does is visible at the default log level.

Real TRL trainers throughout; the only stand-in is the `recorder` test plugin (tests/helpers.py).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import trl_ext
from trl_ext import UsageError, _compat
from trl_ext.testing import length_reward, make_model, make_preference_dataset, make_prompt_dataset

REPO = Path(__file__).resolve().parents[1]


def _snapshot_trl():
    """Every TRL class and module trl-ext may patch, with a copy of its own attributes."""
    targets = [getattr(importlib.import_module(m), c) for m, c in _compat.TRAINERS.values()]
    targets += [importlib.import_module(m) for m, _ in _compat.TRAINERS.values()]
    return {id(t): (t, dict(vars(t))) for t in targets}


def _assert_trl_stock(before):
    for obj, attrs in before.values():
        now = dict(vars(obj))
        now.pop("__warningregistry__", None)  # Python's own record of warnings already shown
        attrs = {k: v for k, v in attrs.items() if k != "__warningregistry__"}
        assert now.keys() == attrs.keys(), obj
        assert not [k for k in attrs if now[k] is not attrs[k]], obj


def _dpo(tokenizer, dpo_args, n=8, **overrides):
    from trl import DPOTrainer

    return DPOTrainer(
        make_model(seed=0),
        ref_model=make_model(seed=0),
        args=dpo_args(**overrides),
        train_dataset=make_preference_dataset(n),
        eval_dataset=make_preference_dataset(4, seed=1),
        processing_class=tokenizer,
    )


def _losses(trainer):
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


# -------------------------------------------------------------------------------------------------------------------
# 1. a trainer keeps its plugins for its whole life
# -------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a few seconds: kept out of the fast loop's 90 s
def test_trainer_built_inside_the_block_trains_packed_after_it(tokenizer, dpo_args, tmp_path):
    from trl_ext.plugins.padding_free import PaddingFreeCollator

    before = _snapshot_trl()
    with trl_ext.install(padding_free=True):
        reference = _dpo(tokenizer, dpo_args)
        reference.train()
        trainer = _dpo(tokenizer, dpo_args, save_strategy="steps", save_steps=1, output_dir=str(tmp_path / "run"))
    _assert_trl_stock(before)  # TRL is stock again...
    state = trainer._trl_ext.state["padding_free"]  # ...but the trainer built inside keeps its plugins
    assert isinstance(trainer.data_collator, PaddingFreeCollator)

    calls = state.packed_calls
    trainer.train()
    assert state.packed_calls > calls and state.unpacked_calls == 0
    assert _losses(trainer) == _losses(reference)  # same packed path, same numbers

    calls = state.packed_calls
    metrics = trainer.evaluate()
    assert state.packed_calls > calls and "eval_loss" in metrics

    calls = state.packed_calls
    trainer.predict(trainer.eval_dataset)  # tokenized by TRL at construction
    assert state.packed_calls > calls

    calls = state.packed_calls
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
    assert state.packed_calls > calls and state.unpacked_calls == 0
    _assert_trl_stock(before)


@pytest.mark.slow  # a few seconds: kept out of the fast loop's 90 s
def test_a_second_install_does_not_disturb_trainers_of_the_first(tokenizer, dpo_args, recorder):
    first = trl_ext.install(padding_free=True)
    old = _dpo(tokenizer, dpo_args)
    first.uninstall()
    with trl_ext.install(plugins={"recorder": {}}) as second:
        new = _dpo(tokenizer, dpo_args)
        assert new._trl_ext.enabled == ("recorder",) and old._trl_ext.enabled == ("padding_free",)
        # An instance reports what it runs, whichever installation asks; a class what a trainer built now gets.
        assert second.enabled_plugins(old) == ["padding_free"] and first.enabled_plugins(old) == ["padding_free"]
        assert second.enabled_plugins(type(old)) == ["recorder"]
        state = old._trl_ext.state["padding_free"]
        old.train()  # under the second installation
        after_first = state.packed_calls
        assert after_first > 0 and "reduce_metrics" not in recorder.names()
        new.train()
        assert state.packed_calls == after_first  # the new trainer is not packed...
        assert recorder.names().count("reduce_metrics") == 3  # ...and has the second installation's plugin
    old.train()  # and after both are uninstalled
    assert state.packed_calls > after_first
    assert recorder.names().count("reduce_metrics") == 3


def test_hooks_outside_init_keep_running_after_uninstall(tokenizer, dpo_args, recorder, plain_online_dpo):
    """`log`, the DPO precompute of `evaluate()` and OnlineDPO's generation were class/module patches: now they are
    the trainer's own, and TRL's modules are stock between its calls."""
    from trl.experimental.online_dpo import online_dpo_trainer as odt

    stock_unwrap = odt.unwrap_model_for_generation
    with trl_ext.install(plugins={"recorder": {}}):
        dpo = _dpo(tokenizer, dpo_args, precompute_ref_log_probs=True)
        online = plain_online_dpo()
    assert odt.unwrap_model_for_generation is stock_unwrap
    start = len(recorder.events)
    dpo.train()
    dpo.evaluate(make_preference_dataset(4, seed=3))  # precomputed lazily, through the plugin hook
    online.train()
    names = recorder.names()[start:]
    assert names.count("reduce_metrics") >= 3 + 2
    assert [e[:2] for e in recorder.events[start:] if e[0] == "make_ref_precompute"] == [
        ("make_ref_precompute", "eval")
    ]
    assert names.count("make_generation_context") == 2  # one generation per OnlineDPO training step
    assert odt.unwrap_model_for_generation is stock_unwrap


def test_one_undo_mechanism_by_scope(tokenizer, dpo_args):
    """`TrainerContext.patch(scope, apply)`: a run-scope change holds only while the trainer runs, a trainer-scope one
    until it is detached, and a process-scope one is applied once for every trainer holding its key and undone when
    the last of them is detached; an unknown scope, or a process scope without a key, is a `UsageError`."""
    import types

    with trl_ext.install(padding_free=True) as installation:
        first, second = _dpo(tokenizer, dpo_args), _dpo(tokenizer, dpo_args)
    target = types.ModuleType("trl_ext_test_target")
    target.run = target.held = "stock"
    applied = []

    def hold(patcher):
        applied.append("applied")
        patcher.setattr(target, "held", "held")
        patcher.defer(lambda: applied.append("undone"))

    for trainer in (first, second):
        trainer._trl_ext.patch("process", hold, key="test-held")
    assert applied == ["applied"] and target.held == "held"
    ctx = first._trl_ext
    ctx.patch("run", lambda patcher: patcher.setattr(target, "run", "running"))
    assert target.run == "stock"
    with ctx.running():
        assert target.run == "running"
    assert target.run == "stock"
    ctx.patch("trainer", lambda patcher: patcher.setattr(first, "trl_ext_test_probe", 1, raising=False))
    with pytest.raises(UsageError, match="needs a `key`"):
        ctx.patch("process", hold)
    with pytest.raises(UsageError, match="unknown scope 'module'; the scopes are run, trainer, process"):
        ctx.patch("module", hold)
    installation.detach(first)
    assert target.held == "held" and not hasattr(first, "trl_ext_test_probe") and applied == ["applied"]
    installation.detach(second)
    assert target.held == "stock" and applied == ["applied", "undone"]


def test_uninstall_undoes_what_a_garbage_collected_trainer_held(tokenizer, dpo_args):
    """A process-wide change (the varlen attention registration) held by a trainer garbage-collected undetached is
    undone by the next `uninstall()`; while a live trainer holds it, it stays."""
    from transformers import AttentionInterface

    registry = _compat.attention_registry(AttentionInterface)
    with trl_ext.install(padding_free=True):
        trainer, kept = _dpo(tokenizer, dpo_args), _dpo(tokenizer, dpo_args)
    del trainer
    gc.collect()
    trl_ext.install(padding_free=True).uninstall()  # `kept` still holds it
    assert "trl_ext_varlen_sdpa" in registry and kept.model.config._attn_implementation == "trl_ext_varlen_sdpa"
    del kept
    gc.collect()
    assert "trl_ext_varlen_sdpa" in registry  # left until the next release point
    trl_ext.install(padding_free=True).uninstall()
    assert "trl_ext_varlen_sdpa" not in registry


def test_detach_makes_the_trainer_stock(tokenizer, dpo_args):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    with trl_ext.install(padding_free=True) as installation:
        trainer = _dpo(tokenizer, dpo_args)
    model = trainer.model
    assert model.config._attn_implementation == "trl_ext_varlen_sdpa"
    packed_forward = vars(model)["forward"]
    gc.collect()  # trainers of earlier tests, never detached, may still hold the attention registration
    installation.detach(trainer)
    installation.detach(trainer)  # a second call does nothing
    assert "_trl_ext" not in vars(trainer)
    assert "forward" not in vars(model.model)
    assert vars(model).get("forward") is not packed_forward
    assert type(trainer.data_collator) is DataCollatorForPreference
    assert model.config._attn_implementation == "sdpa"
    from transformers.modeling_utils import AttentionInterface

    assert "trl_ext_varlen_sdpa" not in AttentionInterface._global_mapping  # the last holder released it
    trainer.train()  # stock TRL


def test_uninstall_with_detach_and_the_uninstall_line(tokenizer, dpo_args, trl_ext_log):
    installation = trl_ext.install(padding_free=True)
    trainer = _dpo(tokenizer, dpo_args)
    installation.uninstall()
    assert "trl-ext uninstalled: TRL is stock again for new trainers; 1 trainer(s) built under it keep" in (
        trl_ext_log.text
    )
    assert trainer._trl_ext.enabled == ("padding_free",)
    installation.uninstall(detach=True)
    assert "_trl_ext" not in vars(trainer)


# -------------------------------------------------------------------------------------------------------------------
# 2. TRL's own flags: visible when left to TRL (the ZeRO-3 warning is in tests/plugins/test_generation.py)
# -------------------------------------------------------------------------------------------------------------------


def test_trl_flag_left_to_trl_is_named_in_the_trainer_line(tokenizer, dpo_args, monkeypatch, trl_ext_log):
    monkeypatch.setattr(_compat, "dpo_honours_padding_free", lambda: True)  # as on a TRL with patches/0001
    with trl_ext.install(sync_metrics=True):
        _dpo(tokenizer, dpo_args, padding_free=True)
    lines = [r.getMessage() for r in trl_ext_log.records if "DPOTrainer gets" in r.getMessage()]
    assert lines == [
        "trl-ext: DPOTrainer gets plugins sync_metrics; DPOConfig.padding_free=True is left to TRL (this TRL "
        "implements it); trl-ext's `padding_free` would serve it instead"
    ]


# -------------------------------------------------------------------------------------------------------------------
# 3. TRL's errors stay TRL's
# -------------------------------------------------------------------------------------------------------------------


def _old_online_dpo_call(tokenizer, online_dpo_args):
    from trl.experimental.online_dpo import OnlineDPOTrainer

    reward = dict(reward_model=make_model(seed=1), reward_processing_class=tokenizer)
    data = dict(train_dataset=make_prompt_dataset(4), processing_class=tokenizer)
    return OnlineDPOTrainer(model=make_model(seed=0), **reward, args=online_dpo_args(), **data)


def test_trl_signature_error_reads_as_without_trl_ext(tokenizer, online_dpo_args):
    with pytest.raises(TypeError) as stock:
        _old_online_dpo_call(tokenizer, online_dpo_args)
    assert "OnlineDPOTrainer.__init__() got an unexpected keyword argument 'reward_model'" in str(stock.value)
    with trl_ext.install(sync_metrics=True):
        with pytest.raises(TypeError) as ours:
            _old_online_dpo_call(tokenizer, online_dpo_args)
    assert type(ours.value) is type(stock.value) and str(ours.value) == str(stock.value)
    if sys.version_info >= (3, 11):
        notes = "\n".join(ours.value.__notes__)
        assert "pass `reward_funcs=`" in notes and "pass `reward_processing_classes=`" in notes
        assert ours.value.__cause__ is None and ours.value.__context__ is None


def test_trl_errors_from_inside_init_are_untouched(tokenizer, dpo_args):
    from trl import DPOTrainer

    def build():
        return DPOTrainer(make_model(seed=0), args=dpo_args(), processing_class=tokenizer)  # no train_dataset

    with pytest.raises(Exception) as stock:
        build()
    from trl_ext.context import live_contexts

    live = len(live_contexts())
    with trl_ext.install(padding_free=True):
        with pytest.raises(Exception) as ours:
            build()
    assert type(ours.value) is type(stock.value) and str(ours.value) == str(stock.value)
    assert len(live_contexts()) == live  # the trainer TRL refused to build holds no plugins


# -------------------------------------------------------------------------------------------------------------------
# 4. a distributed launch that runs single-process
# -------------------------------------------------------------------------------------------------------------------


def test_world_size_without_a_distributed_trainer_is_refused(dpo_args, monkeypatch, plain_dpo):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = dpo_args(use_cpu=False, bf16=False)  # what torchrun on CPU gives without `use_cpu=True`: a world of 1
    assert args.world_size == 1

    with trl_ext.install(padding_free=True):
        with pytest.raises(UsageError, match=r"WORLD_SIZE=2 says .* runs a world of 1 .*set `use_cpu=True`"):
            plain_dpo(args=args)


_WORLD_SCRIPT = """
import json, os, sys
import trl_ext
from trl import DPOConfig, DPOTrainer
from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer

def build(**kw):
    args = DPOConfig(output_dir=sys.argv[1], report_to=[], bf16=False, max_steps=1, **kw)
    return DPOTrainer(make_model(seed=0), ref_model=make_model(seed=0), args=args,
                      train_dataset=make_preference_dataset(4), processing_class=make_tokenizer())

# Each rank reports to its own file: two ranks printing to one pipe can interleave mid-line (seen in CI).
result = {}
with trl_ext.install(sync_metrics=True):
    try:
        build()
        result["refused"] = None
    except trl_ext.UsageError as exc:
        result["refused"] = str(exc)
    trainer = build(use_cpu=True)
    result["world"] = trainer.accelerator.num_processes
    result["enabled"] = list(trainer._trl_ext.enabled)
with open(os.path.join(sys.argv[2], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(result, f)

# gloo's threads can outlive the interpreter's teardown and abort a rank that succeeded (research/deepspeed_cpu.md)
import torch.distributed as dist
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.distributed
def test_torchrun_on_cpu_without_use_cpu_is_refused(tmp_path):
    script = tmp_path / "world.py"
    script.write_text(textwrap.dedent(_WORLD_SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRL_EXT_")}
    env.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    reports = tmp_path / "reports"
    reports.mkdir()
    proc = subprocess.run(
        cmd + [str(tmp_path / "out"), str(reports)], env=env, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    results = [json.loads((reports / f"rank{rank}.json").read_text()) for rank in range(2)]
    for result in results:
        refused = result["refused"]
        assert refused is not None, "rank was not refused"
        assert "WORLD_SIZE=2 says" in refused and "set `use_cpu=True`" in refused, refused
        assert result["world"] == 2 and result["enabled"] == ["sync_metrics"], result
    assert proc.stderr.count("trl-ext: DPOTrainer gets plugins sync_metrics") == 1  # the main process only


# -------------------------------------------------------------------------------------------------------------------
# 8. visible at the default log level, on the main process
# -------------------------------------------------------------------------------------------------------------------


def test_one_line_per_trainer_with_plugins_and_auto_choices(tokenizer, dpo_args, trl_ext_log, plain_online_dpo):
    with trl_ext.install(padding_free=True):
        _dpo(tokenizer, dpo_args)
        plain_online_dpo(ref=False)
    messages = [(r.levelname, r.getMessage()) for r in trl_ext_log.records]
    assert (
        "NOTICE",
        "trl-ext: DPOTrainer gets plugins padding_free (policy: trl_ext_varlen_sdpa, ref: trl_ext_varlen_sdpa)",
    ) in messages
    assert (
        "NOTICE",
        "trl-ext: `padding_free` is set, but the plugin `padding_free` applies only to DPOTrainer; this "
        "OnlineDPOTrainer runs without it",
    ) in messages
    assert not any("OnlineDPOTrainer gets" in m for _, m in messages)  # it got no plugins: no plugin line


_LOG_SCRIPT = """
import trl_ext
from trl import DPOConfig, DPOTrainer
from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer

with trl_ext.install(padding_free=True):
    DPOTrainer(make_model(seed=0), ref_model=make_model(seed=0),
               args=DPOConfig(output_dir="{out}", report_to=[], use_cpu=True, bf16=False),
               train_dataset=make_preference_dataset(4), processing_class=make_tokenizer())
print("DONE")
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("level", "shown", "warned"),
    [(None, True, False), ("warning", False, False), ("INFO", True, False), ("loud", True, True)],
)
def test_log_level_env(tmp_path, level, shown, warned):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRL_EXT_")}
    env.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if level is not None:
        env["TRL_EXT_LOG_LEVEL"] = level
    code = textwrap.dedent(_LOG_SCRIPT).format(out=tmp_path / "out")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("DONE"), proc.stderr[-3000:]
    assert ("[trl_ext.build|NOTICE] trl-ext: DPOTrainer gets plugins padding_free" in proc.stderr) == shown
    bad = f"TRL_EXT_LOG_LEVEL={level!r} is not a log level; using 'notice'"
    assert (bad in proc.stderr) == warned, proc.stderr[-3000:]


# -------------------------------------------------------------------------------------------------------------------
# 9. enabled_plugins takes a name, a class or an instance; nothing else
# -------------------------------------------------------------------------------------------------------------------


def test_enabled_plugins_accepts_classes_and_instances(dpo_args, plain_dpo):
    from trl import DPOTrainer
    from trl.experimental.online_dpo import OnlineDPOTrainer

    class MyDPOTrainer(DPOTrainer):
        pass

    with trl_ext.install(padding_free=True) as installation:
        assert installation.enabled_plugins("DPOTrainer") == ["padding_free"]
        assert installation.enabled_plugins(DPOTrainer) == ["padding_free"]
        assert installation.enabled_plugins(MyDPOTrainer) == ["padding_free"]
        assert installation.enabled_plugins(OnlineDPOTrainer) == []
        trainer = plain_dpo(MyDPOTrainer)
        assert installation.enabled_plugins(trainer) == ["padding_free"]
        for bad in (42, None, dpo_args()):
            with pytest.raises(TypeError, match="expected a trainer class name, a trainer class or a trainer"):
                installation.enabled_plugins(bad)
        for bad in ("SFTTrainer", "DPOTrainr", dict):
            with pytest.raises(UsageError, match="not a trainer trl-ext attaches to"):
                installation.enabled_plugins(bad)


def test_train_ends_with_one_line_giving_the_peak_memory(tokenizer, dpo_args, trl_ext_log):
    """When `train()` returns, one line per trainer names its plugins and the peak memory of the work in `train()`
    (the resident set on CPU; what `trl_ext._shared.PeakMemory` reads), from the main process."""
    with trl_ext.install(padding_free=True):
        trainer = _dpo(tokenizer, dpo_args)
    trl_ext_log.clear()
    trainer.train()
    lines = [r.getMessage() for r in trl_ext_log.records if "during train()" in r.getMessage()]
    assert len(lines) == 1
    match = re.fullmatch(
        r"trl-ext: DPOTrainer trained with plugins padding_free; peak memory ([\d.]+) (MiB|GiB) resident \(CPU\) "
        r"during train\(\)",
        lines[0],
    )
    assert match and float(match.group(1)) > 0, lines[0]  # GiB past 1024 MiB (a long test session's process)
    trainer.evaluate()  # evaluation alone logs no such line
    assert len([r for r in trl_ext_log.records if "during train()" in r.getMessage()]) == 1


@pytest.mark.slow  # about a minute: five trainers, two of them in threads
def test_overlapping_runs_and_uninstall_during_a_run_leave_trl_stock(tokenizer, dpo_args, online_dpo_args):
    """Two sync_metrics trainers whose `train()` calls overlap in threads, the first one finishing while the second
    still trains, and `uninstall()` called while an Online DPO trainer trains: each run-time wrapper is undone in
    whatever order the runs end, and TRL's and transformers' modules are stock again afterwards (each object
    itself)."""
    import threading

    from transformers import TrainerCallback
    from trl.experimental.online_dpo import OnlineDPOTrainer
    from trl.experimental.online_dpo import online_dpo_trainer as odt

    modules = [importlib.import_module(m) for m in _compat.LOSS_GATHER_MODULES] + [odt]
    before = {id(m): (m, dict(vars(m))) for m in modules}
    first_running, second_running, first_done = threading.Event(), threading.Event(), threading.Event()

    class Hold(TrainerCallback):
        def __init__(self, signal, wait):
            self.signal, self.wait = signal, wait

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                self.signal.set()
                assert self.wait.wait(60)

    with trl_ext.install(sync_metrics=True):
        first = _dpo(tokenizer, dpo_args, max_steps=2, logging_steps=1)
        second = _dpo(tokenizer, dpo_args, max_steps=2, logging_steps=1)
    first.add_callback(Hold(first_running, second_running))
    second.add_callback(Hold(second_running, first_done))
    errors = []

    def run(trainer, done=None):
        try:
            trainer.train()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            if done is not None:
                done.set()

    threads = [threading.Thread(target=run, args=(first, first_done))]
    threads[0].start()
    assert first_running.wait(60)
    threads.append(threading.Thread(target=run, args=(second,)))
    threads[1].start()
    for thread in threads:
        thread.join(120)
    assert not errors and all(not t.is_alive() for t in threads), errors
    _assert_trl_stock(before)

    installation = trl_ext.install(sync_metrics=True)
    online = OnlineDPOTrainer(
        make_model(seed=0),
        ref_model=make_model(seed=0),
        reward_funcs=length_reward,
        args=online_dpo_args(max_steps=2),
        train_dataset=make_prompt_dataset(4),
        processing_class=tokenizer,
    )

    class Uninstall(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if installation._installed:
                installation.uninstall()

    online.add_callback(Uninstall())
    online.train()
    assert not installation._installed
    _assert_trl_stock(before)


def test_deepcopy_of_a_trainer_with_plugins_is_a_clear_refusal_and_of_a_detached_one_works(tokenizer, dpo_args):
    """`copy.deepcopy(trainer)`: the plugins' wrappers belong to the trainer they were attached to, so a copy would
    train the original's models; it is refused with a `UsageError` saying what to do (it was a `TypeError` from deep
    inside the copy). Detached, the trainer is stock and copies as stock does."""
    import copy

    with trl_ext.install(sync_metrics=True, padding_free=True):
        trainer = _dpo(tokenizer, dpo_args, n=4)
    with pytest.raises(UsageError, match=r"copy.deepcopy of a DPOTrainer with trl-ext plugins \(.*padding_free"):
        copy.deepcopy(trainer)
    trainer._trl_ext.installation.detach(trainer)
    twin = copy.deepcopy(trainer)
    assert twin.model is not trainer.model and getattr(twin, "_trl_ext", None) is None
