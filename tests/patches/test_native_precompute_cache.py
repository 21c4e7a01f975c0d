"""patches/0003-dpo-precompute-cache-key.patch: TRL's native reference precompute cache is keyed and placed correctly.

Runs only against the patched TRL (`TRL_EXT_PATCHED_TRL=1`, see conftest.py and patches/check.sh). The patch changes
only where the precomputed reference log-probs are stored and looked up (`DPOTrainer._precompute_ref_logps`), not how
they are computed, so "stock" here is TRL's precompute loop run by hand: the same tokenized dataset, in dataset order,
batched by TRL's collator and scored by TRL's `compute_ref_log_probs` (which the patch does not touch), on a trainer
built with `precompute_ref_log_probs=False`. Every value must match it, whether it came from memory, the cache file or
another process.

Float64 models: the same batches give the same values up to the last bits, so `ATOL=1e-8` is far below what a stale
cache entry (another `max_length` or `ld_alpha`, several nats) or a row in the wrong place would give.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trl_ext.testing import make_model, make_preference_dataset

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-8
BATCH = 4


def _data(n=14, seed=5):
    return make_preference_dataset(n, seed=seed, max_prompt=24, max_completion=24)


@pytest.fixture
def build(dpo_args, tokenizer):
    """A float64 DPOTrainer with an explicit reference model, whose forwards are counted."""

    def make(dataset, precompute=True, **overrides):
        from trl import DPOTrainer

        ref_model = make_model(seed=1, dtype=torch.float64)
        calls = {"n": 0}
        ref_model.register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
        settings = {"max_length": 32, "truncation_mode": "keep_end", "bf16": False, **overrides}
        args = dpo_args(precompute_ref_log_probs=precompute, precompute_ref_batch_size=BATCH, **settings)
        trainer = DPOTrainer(
            make_model(dtype=torch.float64),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            ref_model=ref_model,
        )
        return trainer, calls

    return make


def _stock(build, dataset, **overrides):
    """TRL's precompute loop by hand, on a trainer that does not precompute (no code path of the patch)."""
    from torch.utils.data import DataLoader

    trainer, _ = build(dataset, precompute=False, **overrides)
    chosen, rejected = [], []
    with torch.no_grad():
        for batch in DataLoader(trainer.train_dataset, batch_size=BATCH, collate_fn=trainer.data_collator):
            c, r = trainer.compute_ref_log_probs(trainer.ref_model, batch)
            chosen.append(c)
            rejected.append(r)
    return list(trainer.train_dataset["prompt_ids"]), torch.cat(chosen).numpy(), torch.cat(rejected).numpy()


def _columns(trainer):
    ds = trainer.train_dataset
    return list(ds["prompt_ids"]), np.asarray(ds["ref_chosen_logps"]), np.asarray(ds["ref_rejected_logps"])


def _assert_same(stock, native):
    assert native[0] == stock[0]  # same rows, same order
    for a, b in zip(stock[1:], native[1:], strict=True):
        assert b.shape == a.shape and np.isfinite(b).all()
        np.testing.assert_allclose(b, a, rtol=0, atol=ATOL)


def _ref_files(cache_dir):
    return sorted(p.name for p in Path(cache_dir).glob("ref_logps-*.arrow"))


@pytest.mark.parametrize("overrides", [{}, {"ld_alpha": 0.5}, {"max_length": 12, "truncation_mode": "keep_start"}])
def test_matches_stock_in_memory_and_file_backed(build, tmp_path, overrides):
    from datasets import load_from_disk

    stock = _stock(build, _data(), **overrides)
    # in memory, no cache directory: values kept in memory, no file anywhere
    native, calls = build(_data(), **overrides)
    assert native.train_dataset.cache_files == [] and calls["n"] > 0
    _assert_same(stock, _columns(native))
    # file-backed: TRL's cache file next to the dataset's files
    _data().save_to_disk(str(tmp_path / "data"))
    native, _ = build(load_from_disk(str(tmp_path / "data")), **overrides)
    assert native.train_dataset.cache_files  # read back from the cache file written next to the data
    _assert_same(stock, _columns(native))


def test_changed_settings_recompute(build, tmp_path):
    cache_dir = tmp_path / "cache"
    first, calls = build(_data(), precompute_ref_cache_dir=str(cache_dir))
    assert calls["n"] > 0 and len(_ref_files(cache_dir)) == 1
    for i, changed in enumerate([{"max_length": 12}, {"ld_alpha": 0.5}, {"truncation_mode": "keep_start"}]):
        native, calls = build(_data(), precompute_ref_cache_dir=str(cache_dir), **changed)
        assert calls["n"] > 0, changed  # recomputed, not read from the first entry
        assert len(_ref_files(cache_dir)) == i + 2
        _assert_same(_stock(build, _data(), **changed), _columns(native))
        assert not np.allclose(_columns(native)[1], _columns(first)[1]), changed


def test_cache_dir_is_reused_without_forwards(build, tmp_path):
    cache_dir = tmp_path / "cache"
    stock = _stock(build, _data())
    first, calls = build(_data(), precompute_ref_cache_dir=str(cache_dir))
    assert calls["n"] == -(-len(stock[0]) // BATCH)  # one reference forward per batch
    files = _ref_files(cache_dir)
    assert len(files) == 1
    # a fresh trainer on a freshly built in-memory dataset with the same content and the same reference weights
    second, calls = build(_data(), precompute_ref_cache_dir=str(cache_dir))
    assert calls["n"] == 0 and _ref_files(cache_dir) == files
    _assert_same(stock, _columns(second))
    # padding-free (patch 0001) lays batches out differently but gives the same values: same key, cache reused
    third, calls = build(_data(), precompute_ref_cache_dir=str(cache_dir), padding_free=True)
    assert third.padding_free and calls["n"] == 0 and _ref_files(cache_dir) == files
    _assert_same(stock, _columns(third))
    # and computed padding-free (no cache), it agrees with the padded values up to float64 rounding
    fourth, calls = build(_data(), padding_free=True)
    assert calls["n"] > 0
    _assert_same(stock, _columns(fourth))


def test_two_processes_in_memory_dataset(build, tmp_path):
    """Stock TRL 1.16 crashes the non-main rank here with FileNotFoundError (bug B7)."""
    stock = _stock(build, _data())
    env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(SCRIPTS / "native_precompute_dist.py")]
    proc = subprocess.run(cmd + [str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["world"] == 2
        for name in ("memory", "cache_dir", "cached"):
            got = result[name]
            _assert_same(stock, (got["prompt_ids"], np.asarray(got["chosen"]), np.asarray(got["rejected"])))
        assert result["memory"]["cache_files"] == [] and result["memory"]["forwards"] > 0
        assert result["cached"]["forwards"] == 0
    assert len(_ref_files(tmp_path / "cache")) == 1
