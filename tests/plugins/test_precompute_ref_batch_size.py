"""`precompute_ref_batch_size`: reference log-probs equal TRL's native precompute, in dataset order, everywhere.

Single-process tests use float64 models: TRL's own values then move only in the last float32 bit when the batch
composition changes (the columns are stored as float32, ~8e-6 at |logp| ~ 100), so `atol=1e-4` is far below what a
wrong row order, truncation or `ld_alpha` (several nats) would give. (In float32, TRL 1.16 itself differs by up to
3e-3 between batch sizes 1 and 4.)
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import trl_ext
from trl_ext import UsageError, _compat
from trl_ext._logging import DEFAULT_LEVEL, LEVELS, NOTICE
from trl_ext.plugins.precompute_ref_batch_size import cache as cache_mod
from trl_ext.testing import make_model, make_preference_dataset

PLUGIN = "precompute_ref_batch_size"
SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-4


def _data(n=30, seed=5):
    return make_preference_dataset(n, seed=seed, max_prompt=48, max_completion=48)


@pytest.fixture
def logs():
    """Records of the trl_ext loggers (they do not propagate to the root logger, so caplog cannot see them)."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = _Keep(level=logging.DEBUG)
    root = logging.getLogger("trl_ext")
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield records
    root.removeHandler(handler)
    root.setLevel(old)


@pytest.fixture
def build(dpo_args, tokenizer):
    """Build a DPOTrainer with `precompute_ref_log_probs=True` on float64 models; count reference forwards."""

    def make(dataset, eval_dataset=None, ref=True, peft=False, fail=None, **overrides):
        from trl import DPOTrainer

        model = make_model(dtype=torch.float64)
        ref_model = make_model(seed=1, dtype=torch.float64) if ref else None
        peft_config = None
        if peft:
            from peft import LoraConfig

            # Random B (not the zero default), so a reference that forgot to disable the adapter would differ.
            peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        calls = {"n": 0}

        def count(module, args, kwargs):
            calls["n"] += 1
            if fail is not None:
                fail(calls["n"], kwargs)

        (ref_model or model).register_forward_pre_hook(count, with_kwargs=True)
        args = dpo_args(**{"precompute_ref_log_probs": True, "bf16": False, "max_length": 40, **overrides})
        trainer = DPOTrainer(
            model,
            args=args,
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            ref_model=ref_model,
            peft_config=peft_config,
        )
        return trainer, calls

    return make


def _cols(dataset):
    return np.asarray(dataset["ref_chosen_logps"]), np.asarray(dataset["ref_rejected_logps"])


_NATIVE: dict = {}


def _native(build, ref=True, peft=False, **overrides):
    """TRL's own precompute of the standard train (30 pairs) and eval (9 pairs) splits, built once per setting."""
    key = (ref, peft, tuple(sorted(overrides.items())))
    if key not in _NATIVE:
        trainer, _ = build(_data(30, seed=5), _data(9, seed=6), ref=ref, peft=peft, **overrides)
        columns = ("prompt_ids", "chosen_ids", "ref_chosen_logps", "ref_rejected_logps")
        _NATIVE[key] = tuple(
            {c: list(split[c]) for c in columns} for split in (trainer.train_dataset, trainer.eval_dataset)
        )
    return _NATIVE[key]


def assert_same_precompute(native, plugin):
    """Same rows in the same order, and the same reference log-probs."""
    assert list(native["prompt_ids"]) == list(plugin["prompt_ids"])
    assert list(native["chosen_ids"]) == list(plugin["chosen_ids"])
    for a, b in zip(_cols(native), _cols(plugin), strict=True):
        assert a.shape == b.shape and np.isfinite(b).all()
        np.testing.assert_allclose(b, a, rtol=0, atol=ATOL)


def _runs(trainer):
    return trainer._trl_ext.state[PLUGIN].runs


def _native_padded_tokens(dataset, batch_size, max_length=40):
    """Tokens TRL's dataset-order batches pad to (each batch pads chosen and rejected to its longest sequence)."""
    total = 0
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start : start + batch_size]
        longest = max(
            min(len(p) + max(len(c), len(r)), max_length)
            for p, c, r in zip(rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"], strict=True)
        )
        total += 2 * len(rows["prompt_ids"]) * longest
    return total


# -------------------------------------------------------------------------------------------------------------------
# options
# -------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, match",
    [
        ({"cache_dri": "/tmp"}, "Unknown option"),
        ({"sort": "random"}, "sort"),
        ({"ram_budget": "lots"}, "ram_budget"),
        ({"ram_budget": 0}, "ram_budget"),
        ({"ram_budget": 1.5}, "ram_budget"),
        ({"ram_budget": "150%"}, "ram_budget"),
        ({"ram_budget": True}, "ram_budget"),
        ({"shard_size": 0}, "shard_size"),
        ({"shard_size": "ten"}, "shard_size"),
        ({"shard_interval": -1}, "shard_interval"),
        ({"cache_dir": 3}, "cache_dir"),
        ({"cache_dir": ""}, "cache_dir"),
    ],
)
def test_bad_options_are_usage_errors(options, match):
    with pytest.raises(UsageError, match=match):
        trl_ext.install(precompute_ref_batch_size=4, plugins={PLUGIN: options})


@pytest.mark.parametrize("value", [0, -3, "many", 2.5])
def test_bad_batch_size_is_a_usage_error(value):
    with pytest.raises(UsageError, match="precompute_ref_batch_size"):
        trl_ext.install(precompute_ref_batch_size=value)


def test_ram_budget_parsing():
    from trl_ext.spec import Size

    def ram_budget(value):
        config = trl_ext.config.load_config(flags={"plugins": {PLUGIN: {"ram_budget": value}}}, environ={})
        return config.options(PLUGIN).ram_budget

    assert ram_budget("4GB") == Size("bytes", 4e9)
    assert ram_budget("512MiB") == Size("bytes", 512 * 2**20)
    assert ram_budget(1 << 30) == Size("bytes", float(1 << 30))
    assert ram_budget("25%") == Size("fraction", 0.25)
    assert ram_budget(0.5) == Size("fraction", 0.5)
    assert ram_budget("0.5") == Size("fraction", 0.5)


def test_warns_when_trainer_does_not_precompute(dpo_args, tokenizer, logs, tmp_path):
    from trl import DPOTrainer

    with trl_ext.install(precompute_ref_batch_size=4, plugins={PLUGIN: {"cache_dir": str(tmp_path)}}):
        trainer = DPOTrainer(
            make_model(),
            args=dpo_args(bf16=False),
            train_dataset=_data(4),
            processing_class=tokenizer,
            ref_model=make_model(),
        )
    assert "ref_chosen_logps" not in trainer.train_dataset.column_names
    assert any("precompute_ref_log_probs=False" in r.getMessage() for r in logs)


# -------------------------------------------------------------------------------------------------------------------
# equivalence with TRL, one process
# -------------------------------------------------------------------------------------------------------------------


CASES = {
    # explicit ref model, a train and an eval split, length-sorted fixed-size batches
    "fixed": dict(batch=3, options={}, trainer={}, ref=True, peft=False),
    # no ref model (the policy is the reference), ld_alpha, keep_end truncation to a short max_length
    "ld_alpha_keep_end": dict(
        batch=5,
        options={},
        trainer=dict(ld_alpha=0.5, truncation_mode="keep_end", max_length=24),
        ref=False,
        peft=False,
    ),
    # PEFT without a ref model: TRL disables the (randomly initialised) adapter for the reference
    "peft": dict(batch=4, options={}, trainer={}, ref=False, peft=True),
    # TRL's dataset-order batching, through the plugin's sharding and cache
    "sort_none": dict(batch=3, options={"sort": "none"}, trainer={}, ref=True, peft=False),
    # "auto" with a RAM budget small enough that the probe stops and the rest is planned by token budget
    "auto": dict(batch="auto", options={"ram_budget": "1MB"}, trainer={}, ref=True, peft=False),
}


@pytest.mark.slow  # seconds each: kept out of the fast loop's 90 s
@pytest.mark.parametrize("case", list(CASES))
def test_matches_trl_native(case, build, tmp_path):
    spec = CASES[case]
    native_train, native_eval = _native(build, ref=spec["ref"], peft=spec["peft"], **spec["trainer"])
    options = {"cache_dir": str(tmp_path / "cache"), **spec["options"]}
    with trl_ext.install(precompute_ref_batch_size=spec["batch"], plugins={PLUGIN: options}):
        plugin, calls = build(
            _data(30, seed=5), _data(9, seed=6), ref=spec["ref"], peft=spec["peft"], **spec["trainer"]
        )
        runs = _runs(plugin)
    assert_same_precompute(native_train, plugin.train_dataset)
    assert_same_precompute(native_eval, plugin.eval_dataset)
    assert [r["name"] for r in runs] == ["train", "eval"]
    assert all(r["source"] == "computed" for r in runs)
    assert calls["n"] == sum(r["forward_batches"] for r in runs) > 0
    if case == "fixed":
        # Length planning pads far less than TRL's dataset-order batches of the same size.
        assert runs[0]["batch_pairs_max"] == 3
        assert runs[0]["padded_tokens"] < 0.9 * _native_padded_tokens(plugin.train_dataset, 3)
    if case == "auto":
        assert runs[0]["probe_pairs_per_rank"] >= 1 and runs[0]["auto_stop"]


# a fixed batch size with padding_free: in the fast loop through test_padding_free.py's
# test_with_precompute_ref_batch_size_plugin (batches of 3, packed, the same reference columns)
@pytest.mark.parametrize("requested", [pytest.param(6, marks=pytest.mark.slow), "auto"])
def test_with_padding_free(build, tmp_path, requested):
    """With the `padding_free` plugin on, batches are planned by real tokens and packed by its forward wrapper."""
    native_train, _ = _native(build)
    options = {PLUGIN: {"cache_dir": str(tmp_path / str(requested)), "ram_budget": "1MB"}}
    with trl_ext.install(precompute_ref_batch_size=requested, padding_free=True, plugins=options):
        plugin, calls = build(_data(30, seed=5))
        run = _runs(plugin)[0]
    assert run["packed"] and run["source"] == "computed" and calls["n"] == run["forward_batches"] > 0
    assert_same_precompute(native_train, plugin.train_dataset)


@pytest.mark.slow  # seconds each: kept out of the fast loop's 90 s
def test_evaluate_with_a_new_dataset(build, tmp_path):
    """`DPOTrainer.evaluate(new_dataset)` precomputes through the plugin too, and gives TRL's metrics."""
    train, held_out = _data(12, seed=5), _data(10, seed=8)
    native, _ = build(train)
    expected = native.evaluate(held_out)
    with trl_ext.install(precompute_ref_batch_size=4, plugins={PLUGIN: {"cache_dir": str(tmp_path)}}):
        plugin, _ = build(train)
        got = plugin.evaluate(held_out)
        runs = _runs(plugin)
    assert [r["name"] for r in runs] == ["train", "eval"]
    for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_logps/chosen"):
        assert got[key] == pytest.approx(expected[key], abs=1e-6), key


# -------------------------------------------------------------------------------------------------------------------
# "auto": out-of-memory back-off
# -------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # seconds each: kept out of the fast loop's 90 s
def test_auto_backs_off_on_out_of_memory(build, logs, tmp_path):
    """A forward over 400 padded tokens raises OutOfMemoryError: "auto" stays under it and still gets every pair."""
    limit = 400

    def oom_over_limit(n, kwargs):
        if kwargs["input_ids"].numel() > limit:
            raise torch.OutOfMemoryError("test: over the simulated device memory")

    train = _data(40, seed=7)
    native, _ = build(train)
    options = {"cache_dir": str(tmp_path), "ram_budget": "8GB"}
    with trl_ext.install(precompute_ref_batch_size="auto", plugins={PLUGIN: options}):
        plugin, _ = build(train, fail=oom_over_limit)
        run = _runs(plugin)[0]
    assert_same_precompute(native.train_dataset, plugin.train_dataset)
    assert run["batch_pairs_max"] >= 2 and run["batch_tokens"] <= limit
    assert "oom_splits" not in run  # the planned batches all fit
    messages = [r.getMessage() for r in logs]
    assert any("out of memory" in m for m in messages)
    # What "auto" chose: one line per split at `notice`, shown by default; the probes at `info`.
    chose = [r for r in logs if '"auto" chose a budget of' in r.getMessage()]
    assert len(chose) == 1 and chose[0].levelno == NOTICE >= LEVELS[DEFAULT_LEVEL]
    assert "train split" in chose[0].getMessage() and "\n" not in chose[0].getMessage()
    assert all(r.levelno == logging.INFO for r in logs if "auto probe" in r.getMessage())


@pytest.mark.slow  # seconds each: kept out of the fast loop's 90 s
def test_fixed_batch_splits_on_out_of_memory(build, logs, tmp_path):
    """With a fixed batch size that does not fit, a batch that runs out of memory is halved, not fatal."""

    def oom_over_limit(n, kwargs):
        if kwargs["input_ids"].numel() > 400:
            raise torch.OutOfMemoryError("test: over the simulated device memory")

    train = _data(40, seed=7)
    native, _ = build(train)
    with trl_ext.install(precompute_ref_batch_size=16, plugins={PLUGIN: {"cache_dir": str(tmp_path)}}):
        plugin, _ = build(train, fail=oom_over_limit)
        run = _runs(plugin)[0]
    assert_same_precompute(native.train_dataset, plugin.train_dataset)
    assert run["oom_splits"] >= 1
    assert any("splitting it in two" in r.getMessage() for r in logs)


# -------------------------------------------------------------------------------------------------------------------
# out of memory where the ranks run in lockstep (multi-process DeepSpeed / FSDP)
# -------------------------------------------------------------------------------------------------------------------


def test_lockstep_and_the_budget_projection():
    """The two decisions the "auto" probe takes under lockstep: whether an out-of-memory error may be caught, and
    whether the next probe is expected over the budget."""
    from types import SimpleNamespace

    from trl_ext._shared import Ranks
    from trl_ext.plugins.precompute_ref_batch_size.sizer import lockstep, over_budget

    deepspeed = SimpleNamespace(is_deepspeed_enabled=True, is_fsdp_enabled=False)
    fsdp = SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=True)
    ddp = SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=False)
    assert lockstep(deepspeed, Ranks(2, 0)) and lockstep(fsdp, Ranks(4, 3))
    assert not lockstep(ddp, Ranks(2, 0))  # a DDP forward has no collective: backing off alone is safe
    assert not lockstep(deepspeed, Ranks(1, 0))  # one process: nobody to hang
    assert not over_budget(cost=2000, ref_cost=1000, ref_used=400, budget=1000)  # 800 bytes expected
    assert over_budget(cost=3000, ref_cost=1000, ref_used=400, budget=1000)  # 1200 bytes expected
    assert not over_budget(cost=1e9, ref_cost=1000, ref_used=0, budget=1)  # nothing measured: nothing projected


@pytest.fixture
def lockstep_ranks(monkeypatch):
    """Take the lockstep path (several DeepSpeed/FSDP ranks) in this single process, to exercise the real probe's
    decisions; `test_zero3_out_of_memory_in_the_auto_probe_fails_fast` runs the real thing."""
    from trl_ext.plugins.precompute_ref_batch_size import runner, sizer

    monkeypatch.setattr(sizer, "lockstep", lambda trainer, ranks: True)
    monkeypatch.setattr(runner, "lockstep", lambda trainer, ranks: True)


def test_lockstep_out_of_memory_is_raised_not_caught(build, lockstep_ranks, tmp_path):
    """Under lockstep an out-of-memory error in an "auto" probe, or in a planned batch, propagates with advice."""

    def oom_over_limit(n, kwargs):
        if kwargs["input_ids"].numel() > 400:
            raise torch.OutOfMemoryError("test: over the simulated device memory")

    options = {"cache_dir": str(tmp_path), "ram_budget": "8GB"}
    for size in ("auto", 16):
        with trl_ext.install(precompute_ref_batch_size=size, plugins={PLUGIN: options}):
            with pytest.raises(torch.OutOfMemoryError) as info:
                build(_data(40, seed=7), fail=oom_over_limit)
        assert any("cannot back off alone" in note for note in getattr(info.value, "__notes__", [])), size


def _touch_fresh_pages(size: int) -> None:
    """Make `size` bytes resident in pages no earlier allocation left behind (an anonymous map, written page by
    page, then unmapped): the peak RSS grows by `size` whatever the allocator keeps from earlier tests."""
    pages = mmap.mmap(-1, size)
    try:
        for offset in range(0, size, mmap.PAGESIZE):
            pages[offset] = 1
    finally:
        pages.close()


@pytest.mark.slow  # seconds each: kept out of the fast loop's 90 s
def test_lockstep_auto_stops_at_the_budget_check(build, lockstep_ranks, logs, tmp_path):
    """Under lockstep no probe runs whose memory, extrapolated from the largest probe that fit, exceeds the budget.

    Each forward really allocates 256 KiB per token (measured by the peak-RSS counter like any forward), so a probe
    of k pairs of 80 padded tokens needs about k * 20 MiB: with a 50 MiB budget, 1 and 2 pairs run, 4 does not.
    """
    per_token = 2**18
    seen = []

    def allocate(n, kwargs):
        tokens = kwargs["input_ids"].numel()
        seen.append(tokens)
        _touch_fresh_pages(tokens * per_token)

    native_train, _ = _native(build)
    options = {"cache_dir": str(tmp_path), "ram_budget": "50MiB"}
    with trl_ext.install(precompute_ref_batch_size="auto", plugins={PLUGIN: options}):
        plugin, _ = build(_data(30, seed=5), fail=allocate)
        run = _runs(plugin)[0]
    assert run["auto_stop"] == "memory (projected from the largest probe)" and run["auto_projected_stops"] >= 1
    assert max(seen) * per_token <= 50 * 2**20  # no forward went over the budget
    assert any("not run" in r.getMessage() and "projected" in r.getMessage() for r in logs)
    assert_same_precompute(native_train, plugin.train_dataset)


# -------------------------------------------------------------------------------------------------------------------
# cache
# -------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # seconds each: kept out of the fast loop's 90 s
def test_cache_reuse_invalidation_and_corruption(build, logs, tmp_path):
    cache = tmp_path / "cache"
    native, _ = build(_data(20, seed=9))
    with trl_ext.install(precompute_ref_batch_size=4, plugins={PLUGIN: {"cache_dir": str(cache)}}):
        first, calls = build(_data(20, seed=9))
        run = _runs(first)[0]
        assert run["source"] == "computed" and calls["n"] == run["forward_batches"] > 0
        entry = Path(run["cache_dir"])
        assert (entry / "meta.json").is_file() and not (entry / "parts").exists()

        # A second run, on a freshly built in-memory dataset with the same content: no model forward at all.
        second, calls = build(_data(20, seed=9))
        assert _runs(second)[0]["source"] == "cache" and calls["n"] == 0
        assert_same_precompute(native.train_dataset, second.train_dataset)

        # Settings that change the values change the key (TRL's own key ignores them, bug B8).
        for change in (dict(max_length=30), dict(ld_alpha=0.5), dict(truncation_mode="keep_end")):
            other, calls = build(_data(20, seed=9), **change)
            other_run = _runs(other)[0]
            assert other_run["source"] == "computed" and calls["n"] > 0, change
            assert other_run["cache_dir"] != run["cache_dir"]

        # A truncated data file is detected, reported, recomputed, and never used.
        data = entry / "ref_logps.npz"
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        third, calls = build(_data(20, seed=9))
        assert _runs(third)[0]["source"] == "computed" and calls["n"] > 0
        assert any("unusable" in r.getMessage() and r.levelno == logging.WARNING for r in logs)
        assert_same_precompute(native.train_dataset, third.train_dataset)

        # A well-formed entry whose values are not finite (a NaN sealed under a matching checksum): same.
        values = np.load(data)
        chosen = values["chosen"].copy()
        chosen[3] = np.nan
        np.savez(data, chosen=chosen, rejected=values["rejected"])
        meta = json.loads((entry / "meta.json").read_text())
        (entry / "meta.json").write_text(json.dumps({**meta, "sha256": cache_mod.sha256_file(data)}))
        nan, calls = build(_data(20, seed=9))
        assert _runs(nan)[0]["source"] == "computed" and calls["n"] > 0
        assert any("1 reference log-probs are not finite" in r.getMessage() for r in logs)
        assert_same_precompute(native.train_dataset, nan.train_dataset)

        # Garbage metadata: same.
        (entry / "meta.json").write_text("{not json")
        fourth, calls = build(_data(20, seed=9))
        assert _runs(fourth)[0]["source"] == "computed" and calls["n"] > 0
        assert_same_precompute(native.train_dataset, fourth.train_dataset)


def test_unusable_cache_dir_warns_and_computes(build, logs, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    native_train, _ = _native(build)
    with trl_ext.install(precompute_ref_batch_size=8, plugins={PLUGIN: {"cache_dir": str(blocker / "cache")}}):
        plugin, _ = build(_data(30, seed=5))
        run = _runs(plugin)[0]
    assert run["source"] == "computed" and "cache_dir" not in run
    assert any("cannot create the cache directory" in r.getMessage() for r in logs)
    assert_same_precompute(native_train, plugin.train_dataset)


def test_read_only_cache_dir_warns_once_before_the_forwards(build, logs):
    """A cache directory that exists but cannot be written (`/proc/self`, read-only even for root) is reported once,
    before the first forward, and the run computes without writing."""
    warned_before = []

    def first_forward(n, kwargs):
        if n == 1:
            warned_before.append(any("not writable" in r.getMessage() for r in logs))

    native_train, _ = _native(build)
    with trl_ext.install(precompute_ref_batch_size=8, plugins={PLUGIN: {"cache_dir": "/proc/self", "shard_size": 4}}):
        plugin, _ = build(_data(30, seed=5), fail=first_forward)
    warnings = [r.getMessage() for r in logs if r.levelno >= logging.WARNING]
    assert warned_before == [True]
    assert len([m for m in warnings if "not writable" in m]) == 1
    assert not [m for m in warnings if "could not write" in m]
    assert_same_precompute(native_train, plugin.train_dataset)


@pytest.mark.slow  # seconds each: kept out of the fast loop's 90 s
def test_interrupted_precompute_resumes(build, logs, tmp_path):
    cache = tmp_path / "cache"
    native, _ = build(_data(24, seed=11))

    def interrupt(n, kwargs):
        if n == 9:
            raise KeyboardInterrupt("test: interrupted")

    options = {"cache_dir": str(cache), "shard_size": 4}
    with trl_ext.install(precompute_ref_batch_size=2, plugins={PLUGIN: options}):
        with pytest.raises(KeyboardInterrupt):
            build(_data(24, seed=11), fail=interrupt)
        # Shards are saved every 4 pairs (2 batches): 8 finished batches -> 16 pairs on disk, each with its checksum.
        parts = sorted(cache.glob("*/parts/part-*.npz"))
        assert len(parts) == 4 and all(p.with_suffix(".sha256").is_file() for p in parts)
        # A damaged shard, a well-formed one rewritten with other values, one with a NaN under a recomputed file
        # checksum (not bound to the entry's key: foreign) are each dropped with a warning (their pairs are computed
        # again); the fourth is used.
        parts[0].write_bytes(b"garbage")
        shard = dict(np.load(parts[1]))
        np.savez(parts[1], **{**shard, "chosen": shard["chosen"] + 1.0})
        shard = dict(np.load(parts[2]))
        np.savez(parts[2], **{**shard, "chosen": np.full_like(shard["chosen"], np.nan)})
        parts[2].with_suffix(".sha256").write_text(cache_mod.sha256_file(parts[2]))
        resumed, calls = build(_data(24, seed=11))
        run = _runs(resumed)[0]
    assert run["resumed_pairs"] == 4
    n_pairs = len(resumed.train_dataset)
    assert calls["n"] == run["forward_batches"] == math.ceil((n_pairs - 4) / 2)
    assert len([r for r in logs if "discarding damaged resume shard" in r.getMessage()]) == 3
    assert_same_precompute(native.train_dataset, resumed.train_dataset)
    assert not list(cache.glob("*/parts/*.npz"))


@pytest.mark.slow  # seconds each: kept out of the fast loop's 90 s
def test_interrupted_auto_precompute_resumes_with_its_plan(build, tmp_path):
    """An "auto" precompute interrupted after its probes resumes with the saved budget and batch plan (no new probe),
    and its values are bit-identical to an uninterrupted run's (the out-of-memory limit is simulated, so "auto"
    decides the same in both)."""
    limit = 400

    def oom_over_limit(n, kwargs):
        if kwargs["input_ids"].numel() > limit:
            raise torch.OutOfMemoryError("test: over the simulated device memory")

    train = _data(40, seed=7)
    options = {"ram_budget": "8GB", "shard_size": 1}
    with trl_ext.install(precompute_ref_batch_size="auto", plugins={PLUGIN: {**options, "cache_dir": str(tmp_path)}}):
        full, full_calls = build(train, fail=oom_over_limit)
        full_run = _runs(full)[0]
    assert full_run["batches"] >= 3 and full_run["probe_pairs_per_rank"] > 0
    # Interrupt during the second planned batch: the probes and the first planned batch are saved.
    interrupt_at = full_calls["n"] - full_run["batches"] + 2

    def oom_then_interrupt(n, kwargs):
        oom_over_limit(n, kwargs)
        if n == interrupt_at:
            raise KeyboardInterrupt("test: interrupted")

    cache = tmp_path / "resume"
    with trl_ext.install(precompute_ref_batch_size="auto", plugins={PLUGIN: {**options, "cache_dir": str(cache)}}):
        with pytest.raises(KeyboardInterrupt):
            build(train, fail=oom_then_interrupt)
        assert len(list(cache.glob("*/parts/plan.json"))) == 1
        resumed, calls = build(train, fail=oom_over_limit)
        run = _runs(resumed)[0]
    assert run["batch_tokens"] == full_run["batch_tokens"]
    assert "probe_pairs_per_rank" not in run  # no new probe
    assert calls["n"] == run["forward_batches"] == run["batches"] == full_run["batches"] - 1
    for got, want in zip(_cols(resumed.train_dataset), _cols(full.train_dataset), strict=True):
        assert np.array_equal(got, want)


def test_iterable_dataset_is_refused_in_trls_words(build, tmp_path):
    """TRL's own check speaks: the same exception type and message as stock TRL (issue 15, point 7)."""

    def refusal():
        trainer, _ = build(_data(6))
        with pytest.raises(Exception) as info:
            trainer.evaluate(_data(6).to_iterable_dataset())
        return type(info.value), str(info.value)

    stock = refusal()
    with trl_ext.install(precompute_ref_batch_size=2, plugins={PLUGIN: {"cache_dir": str(tmp_path)}}):
        with_plugin = refusal()
    assert with_plugin == stock
    assert stock == (ValueError, _compat.DPO_PRECOMPUTE_ITERABLE_MESSAGE)


@pytest.mark.slow
def test_sigint_during_precompute_then_resume_is_bit_identical(tmp_path):
    """A real Ctrl-C (SIGINT) part way through a 300-pair precompute with the default `shard_size` (4096) saves
    time-based shards; a second run resumes from them, computes only the missing batches, and its cache is
    bit-identical to an uninterrupted run's (issue 15, point 6)."""
    import signal

    script = SCRIPTS / "precompute_interrupt.py"
    env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])

    def launch(cache, out, sleep):
        command = [sys.executable, str(script), str(cache), str(out), "0.5", str(sleep)]
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(proc):
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-3000:]

    reference = launch(tmp_path / "reference", tmp_path / "reference.json", 0.0)
    finish(reference)
    total = json.loads((tmp_path / "reference.json").read_text())
    assert "resumed_pairs" not in total and total["forwards"] == math.ceil(total["n_pairs"] / 2)

    cache = tmp_path / "cache"
    first = launch(cache, tmp_path / "first.json", 0.05)  # ~0.05 s per batch: several seconds in all
    deadline = time.monotonic() + 300
    while len(list(cache.glob("*/parts/part-*.npz"))) < 2:
        assert first.poll() is None, "the precompute ended before two shards were saved"
        assert time.monotonic() < deadline, "no time-based shard was saved"
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)
    output, _ = first.communicate(timeout=120)
    assert first.returncode != 0 and "KeyboardInterrupt" in output, output[-3000:]
    assert not (tmp_path / "first.json").exists()
    assert not list(cache.glob("*/ref_logps.npz"))  # interrupted before the end: no complete entry
    saved = 0
    for part in cache.glob("*/parts/part-*.npz"):
        if not part.with_suffix(".sha256").exists():
            continue  # interrupted between a shard and its checksum: the resume discards it (and recomputes it)
        with np.load(part) as npz:
            saved += len(npz["indices"])
    assert 0 < saved < total["n_pairs"]

    resumed = launch(cache, tmp_path / "resumed.json", 0.0)
    finish(resumed)
    record = json.loads((tmp_path / "resumed.json").read_text())
    assert record["resumed_pairs"] == saved
    # Only the missing batches ran: shards hold whole batches of 2.
    assert record["forwards"] == record["forward_batches"] == math.ceil((total["n_pairs"] - saved) / 2)
    assert not list(cache.glob("*/parts/*"))
    (entry,) = cache.glob("*/ref_logps.npz")
    (expected,) = (tmp_path / "reference").glob("*/ref_logps.npz")
    assert entry.parent.name == expected.parent.name  # the same cache key
    with np.load(entry) as got, np.load(expected) as want:
        for column in ("chosen", "rejected"):
            assert got[column].dtype == want[column].dtype
            assert np.array_equal(got[column], want[column])  # bit-identical, not merely close


# -------------------------------------------------------------------------------------------------------------------
# two processes: DDP (gloo) and DeepSpeed ZeRO-3 on CPU
# -------------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_two_processes(mode, tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPTS / "precompute_dist.py"),
        mode,
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    for r in ranks:
        native = r["native"]
        for name in ("plugin", "cached", "auto"):
            got = r[name]
            assert got["prompt_ids"] == native["prompt_ids"], name
            for col in ("chosen", "rejected", "eval_chosen", "eval_rejected"):
                np.testing.assert_allclose(got[col], native[col], rtol=0, atol=ATOL, err_msg=f"{name} {col}")
        # The work was split: each rank ran half of the batches (TRL runs every batch's forward on every rank too,
        # but on a different shard of the data).
        runs = r["plugin"]["runs"]
        assert [x["name"] for x in runs] == ["train", "eval"]
        assert r["plugin"]["forwards"] == sum(x["forward_batches"] for x in runs)
        # Equal batch counts per rank (ZeRO-3 lockstep): an odd count gets a filler batch on one rank.
        assert all(x["forward_batches"] == math.ceil(x["batches"] / 2) for x in runs)
        assert r["cached"]["forwards"] == 0 and [x["source"] for x in r["cached"]["runs"]] == ["cache", "cache"]
        assert r["auto"]["runs"][0]["probe_pairs_per_rank"] >= 1
        if mode == "zero3":
            assert r["native"]["precompute_engine"] == r["plugin"]["precompute_engine"] == "DeepSpeedEngine"
    for name in ("plugin", "cached", "auto"):
        for col in ("chosen", "rejected", "eval_chosen", "eval_rejected"):
            assert ranks[0][name][col] == ranks[1][name][col], (name, col)  # identical on every rank


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_zero3_out_of_memory_in_the_auto_probe_fails_fast(tmp_path):
    """Two ZeRO-3 processes; rank 1 runs out of memory inside an "auto" probe's forward while rank 0's forward goes on
    through its parameter gathers. Catching it there and entering the probe's next collective leaves the ranks in
    mismatched collectives (gloo aborts with `gloo::EnforceNotMet` and no word of memory; NCCL can hang until the
    timeout). The error is re-raised with advice, so torchrun stops the job with it."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(SCRIPTS / "precompute_dist.py"), "zero3-oom"]
    start = time.monotonic()
    try:
        proc = subprocess.run([*cmd, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the run hung after the out-of-memory error: {str(exc.stderr)[-4000:]}")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert "rank 1 ran out of memory in the middle of a forward" in output
    assert "cannot back off alone" in output  # the advice travels with the re-raised error
    assert "did not stop the run" not in output
    assert time.monotonic() - start < 300
