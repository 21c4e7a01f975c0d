"""Shared fixtures: tiny models, a local tokenizer, synthetic data, and a clean trl-ext state around every test."""

from __future__ import annotations

import gc
import os

import pytest

# No automatic garbage collection while the tests are collected: importing torch, transformers, TRL, peft and datasets
# creates ~450k long-lived objects, and the collector's full passes over them as they grow (each 0.1-0.6 s, ~2 s in
# all) find almost nothing. Collection ends with one full collection, the survivors frozen, and the collector back on
# (`pytest_collection_finish`).
gc.disable()

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("ACCELERATE_DISABLE_RICH", "1")


def pytest_configure(config):
    # registered here, not in pyproject.toml: the GPU tests (tests/plugins/test_varlen_gpu.py) skip themselves without
    # CUDA, so the CPU suite runs them as skips
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one); `-m gpu` runs only these")


def pytest_collection_modifyitems(config, items):
    """Every process-launching test (`distributed`, `deepspeed`) is also `slow`: `-m "not slow"` is the fast loop."""
    for item in items:
        if item.get_closest_marker("distributed") or item.get_closest_marker("deepspeed"):
            item.add_marker(pytest.mark.slow)


def _freeze_what_lives() -> None:
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    """Move what collection imported (torch, transformers, TRL, peft, datasets: ~450k objects) out of the garbage
    collector's reach before any test runs. `Trainer.train` calls `gc.collect()` (accelerate's `free_memory`), which
    otherwise walks all of it, 0.3-0.5 s a call. Only objects that exist now are frozen, so every test's own objects
    (trainers, models) are still collected as before."""
    _freeze_what_lives()
    gc.enable()


#: Objects the garbage collector tracks, between two test modules, above which they are frozen as well (below).
_FREEZE_ABOVE = 20_000


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Between two test modules, what tests imported or cached for good (DeepSpeed, matplotlib and its fonts, more
    architectures: up to ~100k objects, 0.1 s a `gc.collect()`) is frozen too once it has grown large. By then the
    module's fixtures are torn down and pytest has let go of the last test's: what is garbage is collected first, and
    only what lives on is frozen."""
    result = yield
    if nextitem is not None and getattr(nextitem, "module", None) is not getattr(item, "module", None):
        if len(gc.get_objects()) > _FREEZE_ABOVE:
            _freeze_what_lives()
    return result


@pytest.fixture(scope="session", autouse=True)
def _one_intra_op_thread():
    """Every test runs torch on one intra-op thread: the tests' tiny models run as fast on one, and a second thread
    only spin-waits (on a 2-core machine, about twice the CPU time of the whole fast loop). Launched processes are
    not affected (they set `OMP_NUM_THREADS` themselves)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _accelerate_package_checks_cached():
    """accelerate's `is_peft_available()` / `is_deepspeed_available()` read and parse the package's metadata on every
    call, and `Accelerator.unwrap_model` asks both on every forward (~3 ms each, a tenth of a tiny training step).
    What is installed does not change during a test run, so the answer is kept after the first call."""
    import functools

    from accelerate.utils import imports

    check = getattr(imports, "_is_package_available", None)
    if check is None:  # an accelerate without it: nothing to keep
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(imports, "_is_package_available", functools.cache(check))
        yield


@pytest.fixture(scope="session", autouse=True)
def _dill_global_names_kept():
    """Every TRL trainer `map`s its dataset, and `datasets` fingerprints each map's function with dill, which finds the
    globals a function names by disassembling its code to text (`dill.detect.nestedglobals`; with the seed stacks
    below, ~8 % of the fast loop's CPU in interleaved runs).
    The answer depends on the code object alone, and code objects are immutable: it is kept per code object, so
    every fingerprint stays what dill computes."""
    from dill import detect

    compute = detect.nestedglobals
    kept: dict[tuple[object, bool], list[str]] = {}

    def nestedglobals(func, recurse=True):
        code = detect.code(func)
        if code is None:
            return compute(func, recurse)
        names = kept.get((code, recurse))
        if names is None:
            names = kept[(code, recurse)] = compute(code, recurse)
        return list(names)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(detect, "nestedglobals", nestedglobals)
        yield


@pytest.fixture(scope="session", autouse=True)
def _no_call_stacks_kept_for_absent_devices():
    """`torch.manual_seed` (every model build, every `Trainer`) queues a seed for each accelerator backend that is not
    initialized yet, and torch records the whole Python call stack with it (`traceback.format_stack()`, ~1 ms under
    pytest's deep stacks, three backends a seed), to show should that backend's initialization later fail. A backend
    that is not available here never initializes, so the stack can never be shown: it is not recorded for those."""
    import types

    import torch

    with pytest.MonkeyPatch.context() as mp:
        for name in ("cuda", "xpu", "mtia"):
            backend = getattr(torch, name, None)
            if backend is not None and hasattr(backend, "traceback") and not backend.is_available():
                stack = [f"(the call stack is not recorded in the tests: torch.{name} is not available here)\n"]
                mp.setattr(backend, "traceback", types.SimpleNamespace(format_stack=lambda stack=stack: list(stack)))
        yield


#: Lines for the terminal summary of the run: figures a test computes that CI's log shows (`report` fixture).
_REPORT: list[tuple[str, str]] = []


@pytest.fixture(scope="session")
def report():
    """`report(section, line)`: print `line` under `section` in the run's terminal summary (shown with `-q` too)."""

    def add(section: str, line: str) -> None:
        _REPORT.append((section, line))

    return add


def pytest_terminal_summary(terminalreporter):
    sections: dict[str, list[str]] = {}
    for section, line in _REPORT:
        sections.setdefault(section, []).append(line)
    for section, lines in sections.items():
        terminalreporter.write_sep("-", section)
        for line in lines:
            terminalreporter.write_line(line)


def _installed_plugin_distributions() -> set[str]:
    import importlib.metadata

    return {
        str(getattr(dist, "_path", ""))
        for dist in importlib.metadata.distributions()
        if any(ep.group == "trl_ext" for ep in dist.entry_points)
    }


#: Third-party trl-ext plugins installed in this environment when the tests started (e.g. the README's example).
_INSTALLED_PLUGINS = _installed_plugin_distributions()


@pytest.fixture(autouse=True)
def _only_the_tests_own_plugins(monkeypatch):
    """Tests see the built-in plugins and the ones they install themselves, never a third-party plugin that happens to
    be installed in the environment: plugin discovery skips the distributions found at start-up."""
    if not _INSTALLED_PLUGINS:
        return
    import importlib.metadata

    real = importlib.metadata.distributions

    def distributions(**kwargs):
        return [d for d in real(**kwargs) if str(getattr(d, "_path", "")) not in _INSTALLED_PLUGINS]

    monkeypatch.setattr(importlib.metadata, "distributions", distributions)


@pytest.fixture(autouse=True)
def _no_leftover_installation(monkeypatch):
    """Every test starts without trl-ext installed and without TRL_EXT_* variables, and must leave it so."""
    for key in list(os.environ):
        if key.startswith("TRL_EXT_") and key != "TRL_EXT_LOG_LEVEL":
            monkeypatch.delenv(key)
    from trl_ext.installation import Installation

    assert Installation._active is None or not Installation._active.installed
    yield
    # Trainers keep their plugins after `uninstall()` (issue 15); detach them so that no test sees another's.
    from trl_ext.context import live_contexts

    for ctx in reversed(live_contexts()):
        ctx.detach()
    active = Installation._active
    if active is not None and active.installed:
        active.uninstall()
        pytest.fail("test left trl-ext installed")


@pytest.fixture
def recorder(monkeypatch):
    """The `recorder` test plugin (tests/helpers.py), discoverable as a third-party plugin for this test."""
    from tests._fakes import install_fake_plugin
    from tests.helpers import Recorder

    plugin = Recorder()
    install_fake_plugin(monkeypatch, "recorder", plugin)
    return plugin


@pytest.fixture
def trl_ext_log(caplog):
    """trl-ext's log records (its root logger does not propagate, so caplog's handler is attached to it)."""
    import logging

    root = logging.getLogger("trl_ext")
    root.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        root.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def tokenizer():
    from trl_ext.testing import make_tokenizer

    return make_tokenizer()


#: What every test trainer's config says: on the CPU, 2 steps, a log each, no logging integrations, no checkpoints,
#: float32. TRL defaults to bf16 autocast, which a CPU without bf16 instructions emulates (matmuls ~17x slower than
#: float32 on the 2-core test machine); the tests of 16-bit training ask for it (`bf16=True` / `fp16=True`).
_TEST_ARGS = dict(max_steps=2, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, bf16=False)


@pytest.fixture
def dpo_args(tmp_path):
    """Factory for a CPU `DPOConfig` with no logging integrations and no checkpoints."""

    def make(**overrides):
        from trl import DPOConfig

        defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=4)
        return DPOConfig(
            **{**_TEST_ARGS, **defaults, "learning_rate": 1e-3, "dataloader_drop_last": False, **overrides}
        )

    return make


@pytest.fixture
def online_dpo_args(tmp_path):
    def make(**overrides):
        from trl.experimental.online_dpo import OnlineDPOConfig

        defaults = dict(output_dir=str(tmp_path / "out-online"), per_device_train_batch_size=2, max_new_tokens=6)
        return OnlineDPOConfig(**{**_TEST_ARGS, **defaults, **overrides})

    return make


@pytest.fixture
def plain_dpo(dpo_args, tokenizer):
    """`plain_dpo(trainer_class=DPOTrainer, args=dpo_args(), pairs=4, **kwargs)`: a trainer of two tiny float32 Llamas
    (both seed 0) on `pairs` preference pairs, for tests of what is attached and called, not of values."""

    def make(trainer_class=None, args=None, pairs=4, **kwargs):
        from trl import DPOTrainer

        from trl_ext.testing import make_model, make_preference_dataset

        return (trainer_class or DPOTrainer)(
            make_model(seed=0),
            ref_model=make_model(seed=0),
            args=dpo_args() if args is None else args,
            train_dataset=make_preference_dataset(pairs),
            processing_class=tokenizer,
            **kwargs,
        )

    return make


@pytest.fixture
def plain_online_dpo(online_dpo_args, tokenizer):
    """`plain_online_dpo(ref=True)`: an `OnlineDPOTrainer` of two tiny float32 Llamas (both seed 0; no reference model
    with `ref=False`) on 4 prompts, rewarded by length, for tests of what is attached and called, not of values."""

    def make(ref=True):
        from trl.experimental.online_dpo import OnlineDPOTrainer

        from trl_ext.testing import length_reward, make_model, make_prompt_dataset

        return OnlineDPOTrainer(
            make_model(seed=0),
            ref_model=make_model(seed=0) if ref else None,
            reward_funcs=length_reward,
            args=online_dpo_args(),
            train_dataset=make_prompt_dataset(4),
            processing_class=tokenizer,
        )

    return make
