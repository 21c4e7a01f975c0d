"""The precompute of one split: cache lookup, batch planning, the forwards (split on out-of-memory), the resume
shards, and the exchange between ranks."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_ext import _compat
from trl_ext.api import InternalError, Ranks, get_logger
from trl_ext.toolkit.roles import PACKING

from . import NAME
from .cache import REF_COLUMNS, CacheEntry, cache_key, scan_dataset
from .sizer import OOM_ADVICE, BatchPlan, concat_results, lockstep, probe

if TYPE_CHECKING:
    from . import PrecomputeState

logger = get_logger(f"trl_ext.plugins.{NAME}")


class Precompute:
    """One call of `DPOTrainer._precompute_ref_logps`, on every rank."""

    def __init__(self, trainer, context, state: PrecomputeState, dataset, name: str) -> None:
        self.trainer = trainer
        self.context = context
        self.state = state
        self.opts = state.options
        self.dataset = dataset
        self.name = name
        self.ranks = Ranks.of(trainer.accelerator)
        # Reference log-probs computed by a packing plugin (declared by role) are cached apart from padded ones.
        self.packed = bool(set(context.plugins_serving(PACKING)) & set(context.enabled))
        self.requested = context.config.precompute_ref_batch_size
        self.record: dict[str, Any] = {"name": name, "n_pairs": len(dataset), "packed": self.packed}
        self.cache_writable = True  # False once a cache write failed (or the directory is read-only): warned once

    def info(self, *args) -> None:
        if self.ranks.is_main:  # every rank plans the same, so one copy of each message is enough
            logger.info(*args)

    def run(self):
        start = time.perf_counter()
        dataset = self.dataset
        present = [c for c in REF_COLUMNS if c in dataset.column_names]
        if present:
            logger.warning(
                "trl-ext `%s`: replacing the existing %s columns of the %s dataset.", NAME, present, self.name
            )
            dataset = dataset.remove_columns(present)
        self.dataset = dataset
        n = len(dataset)
        lengths, content = scan_dataset(dataset, want_hash=self.ranks.is_main)
        collator = self.trainer.data_collator
        length_field = _compat.DPO_TRUNCATION_FIELDS[0]  # the collator's truncation length, else the config's
        max_length = getattr(collator, length_field, getattr(self.trainer.args, length_field, None))
        self.plan = BatchPlan(lengths, max_length, self.packed, self.opts.sort)

        # TRL hashes the weights on every rank (rank-dependent under ZeRO-3, so only rank 0's value counts); doing the
        # same keeps any collective inside `state_dict()` matched.
        model_hash = self._model_hash()
        key, details = (
            cache_key(self.trainer, dataset, content, model_hash, self.packed) if self.ranks.is_main else (None, None)
        )
        entry = self._open_entry(key, n, details) if self.ranks.is_main else None
        # Rank 0 alone touches the disk; the others get what it found (fixes TRL's multi-process in-memory crash, B7).
        found = self.ranks.broadcast(entry.load() if entry is not None else None)
        if found is not None:
            chosen, rejected = found
            self.record.update(source="cache", seconds=time.perf_counter() - start, forward_batches=0)
            self.info("trl-ext `%s`: reused cached reference log-probs for %s (%d pairs).", NAME, self.name, n)
        else:
            resumed = self.ranks.broadcast(entry.load_parts() if entry is not None else None)
            chosen, rejected = self._compute(n, entry, resumed)
            if entry is not None:
                self._guarded(entry.write, chosen, rejected)
            self.record.update(seconds=time.perf_counter() - start)
        if entry is not None:
            self.record["cache_dir"] = str(entry.dir)
        self.state.runs.append(self.record)
        return self._attach(dataset, chosen, rejected, key if key is not None else "")

    def _attach(self, dataset, chosen, rejected, key):
        import numpy as np
        from datasets.fingerprint import Hasher

        fingerprint = self.ranks.broadcast(Hasher.hash((getattr(dataset, _compat.DATASET_FINGERPRINT_ATTR), key)))
        dataset = dataset.add_column(
            "ref_chosen_logps", np.asarray(chosen, dtype=np.float32), new_fingerprint=fingerprint
        )
        return dataset.add_column(
            "ref_rejected_logps",
            np.asarray(rejected, dtype=np.float32),
            new_fingerprint=Hasher.hash((fingerprint, "rejected")),
        )

    def _open_entry(self, key: str, n: int, details: dict[str, Any]) -> CacheEntry | None:
        """The main process's cache entry, or None (with a warning) when the cache directory cannot be created (never
        raises: the other ranks would be left waiting in the next collective)."""
        if self.opts.cache_dir is None:
            import datasets.config

            root = Path(datasets.config.HF_DATASETS_CACHE) / "trl_ext_ref_logps"
        else:
            root = Path(self.opts.cache_dir)
        root = root.expanduser()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.state.cache_problem = f"no cache: {root} cannot be created ({exc.strerror or exc})"
            logger.warning(
                "trl-ext `%s`: cannot create the cache directory %s (%s); computing without a cache. Set "
                "`plugins.%s.cache_dir` to a writable directory.",
                NAME,
                root,
                exc,
                NAME,
            )
            return None
        try:  # a read-only directory: say so now, once, rather than at every write after the forwards
            with tempfile.TemporaryFile(dir=root):
                pass
        except OSError as exc:
            self.cache_writable = False
            self.state.cache_problem = f"cache {root} read-only, nothing saved ({exc.strerror or exc})"
            logger.warning(
                "trl-ext `%s`: the cache directory %s is not writable (%s); an entry already there is used, but "
                "nothing is saved (no cache entry, no resume shards). Set `plugins.%s.cache_dir` to a writable "
                "directory.",
                NAME,
                root,
                exc,
                NAME,
            )
        return CacheEntry(root, key, n, details)

    def _guarded(self, write, *args) -> None:
        """Run a cache write on the main process; a full disk or a read-only directory costs the cache, not the run
        (the first failure is reported and ends the cache writes of this split)."""
        if not self.cache_writable:
            return
        try:
            write(*args)
        except OSError as exc:
            self.cache_writable = False
            self.state.cache_problem = f"cache not saved: a write failed ({exc.strerror or exc})"
            logger.warning(
                "trl-ext `%s`: could not write the reference log-prob cache (%s); continuing without saving it.",
                NAME,
                exc,
            )

    def _ref_model(self):
        """What TRL's `_precompute_ref_logps` runs: the DeepSpeed precompute engine, else `ref_model or model`."""
        trainer = self.trainer
        if trainer.ref_model is None and getattr(trainer, _compat.TRAINER_SHARDING_FLAGS[0], False):
            # trl 1.10-1.16 build one inference engine over the policy, reused across splits and `evaluate()` calls
            # (trl-1.16.0 trl/trainer/dpo_trainer.py:1196-1201; trl-1.12.0 :1161-1166).
            attr = _compat.DPO_PRECOMPUTE_ENGINE_ATTR
            if getattr(trainer, attr, None) is None:
                prepare_deepspeed = _compat.import_object(*_compat.DPO_PREPARE_DEEPSPEED)
                setattr(trainer, attr, prepare_deepspeed(trainer.model, trainer.accelerator))
            return getattr(trainer, attr)
        return trainer.ref_model or trainer.model

    def _model_hash(self) -> str:
        """TRL's hash of the reference weights, taken once per trainer, before any precompute forward.

        trl 1.16 hashes in `__init__` before sharding (`_precompute_model_hash`, dpo_trainer.py:980); trl 1.12 at every
        precompute call (dpo_trainer.py:1139), under ZeRO-3 after the train split's engine partitioned the weights,
        which changes from run to run. The first hash is the stable one (TRL refuses a later precompute unless the
        reference is a separate model or the PEFT base, which training leaves alone)."""
        if self.state.model_hash is None:
            model_hash = getattr(self.trainer, _compat.DPO_PRECOMPUTE_HASH_ATTR, None)
            if model_hash is None:
                model_hash = hash_module_full(self.trainer.ref_model or self.trainer.model)
            self.state.model_hash = model_hash
        return self.state.model_hash

    def forward(self, model, batch_indices):
        """TRL's own per-batch math (`compute_ref_log_probs`) on one collated batch; returns float32 numpy arrays."""
        import numpy as np
        import torch

        examples = self.dataset.__getitems__([int(i) for i in batch_indices])
        batch = self.trainer.data_collator(examples)
        device = self.trainer.accelerator.device
        batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        with torch.no_grad():
            chosen, rejected = getattr(self.trainer, _compat.DPO_COMPUTE_REF_METHOD)(model, batch)
        self.record["forward_batches"] = self.record.get("forward_batches", 0) + 1
        self.record["padded_tokens"] = self.record.get("padded_tokens", 0) + int(batch["input_ids"].numel())
        return (
            chosen.detach().float().cpu().numpy().astype(np.float32),
            rejected.detach().float().cpu().numpy().astype(np.float32),
        )

    def _forward_or_split(self, model, batch):
        """Forward one batch; on out-of-memory, halve it and retry (one pair that does not fit is an error). Not under
        `lockstep`, where every rank must run the same forwards and a rank cannot add forwards on its own."""
        import torch

        try:
            return [(batch, *self.forward(model, batch))]
        except torch.OutOfMemoryError as exc:
            if lockstep(self.trainer, self.ranks):
                exc.add_note(OOM_ADVICE)
                raise
            if len(batch) == 1:
                raise
            if self.trainer.accelerator.device.type == "cuda":
                torch.cuda.empty_cache()
            self.record["oom_splits"] = self.record.get("oom_splits", 0) + 1
            logger.warning(
                "trl-ext `%s`: out of memory on a batch of %d pairs (%d tokens); splitting it in two. Use a smaller "
                '`precompute_ref_batch_size` or "auto".',
                NAME,
                len(batch),
                int(self.plan.batch_cost(batch)),
            )
            half = len(batch) // 2
            return self._forward_or_split(model, batch[:half]) + self._forward_or_split(model, batch[half:])

    def _compute(self, n: int, entry: CacheEntry | None, resumed):
        import numpy as np

        chosen = np.full(n, np.nan, dtype=np.float32)
        rejected = np.full(n, np.nan, dtype=np.float32)
        done = np.zeros(n, dtype=bool)
        saved_plan = None
        if resumed is not None:
            idx, c, r, saved_plan = resumed
            chosen[idx], rejected[idx], done[idx] = c, r, True
            logger.warning(
                "trl-ext `%s`: resuming the %s precompute, %d of %d pairs were saved by an interrupted run.",
                NAME,
                self.name,
                int(done.sum()),
                n,
            )
            self.record["resumed_pairs"] = int(done.sum())
        self.record["source"] = "computed"
        todo = np.flatnonzero(~done)
        model = self._ref_model() if len(todo) else None
        part_number = [int(time.time() * 1000) % 10**9]

        def store(results) -> None:
            """Every rank gets every rank's results; rank 0 also saves them as a resume shard."""
            idx, c, r = concat_results(self.ranks.all_gather(results))
            if len(idx) == 0:
                return
            chosen[idx], rejected[idx], done[idx] = c, r, True
            if entry is not None:
                part_number[0] += 1
                self._guarded(entry.write_part, part_number[0], idx, c, r)

        from tqdm.auto import tqdm

        hide = not self.ranks.is_main or bool(os.environ.get("TQDM_DISABLE", ""))
        progress = tqdm(
            total=n,
            initial=int(done.sum()),
            unit="pair",
            desc=f"Reference log-probs ({self.name})",
            dynamic_ncols=True,
            disable=hide or bool(getattr(self.trainer.args, "disable_tqdm", False)),
        )
        try:
            # Batches are planned over every pair the uninterrupted run would plan (`rest`) and those already saved are
            # skipped, so a resumed run is bit-identical (docs/plugins/precompute_ref_batch_size.md, "Resume").
            rest = np.arange(n, dtype=np.int64)
            if len(todo) and self.requested == "auto":
                if self.state.batch_tokens is not None:  # chosen by an earlier split of this trainer: no probe
                    self.record["batch_tokens"] = self.state.batch_tokens
                elif saved_plan is not None:
                    self.state.batch_tokens = self.record["batch_tokens"] = saved_plan["batch_tokens"]
                    rest = np.asarray(saved_plan["rest"], dtype=np.int64)
                else:
                    rest = probe(self, model, todo, store, progress)
                    if entry is not None:
                        self._guarded(
                            entry.write_plan, {"batch_tokens": self.state.batch_tokens, "rest": rest.tolist()}
                        )
            if len(todo):
                if self.requested == "auto":
                    batches = self.plan.budget_batches(rest, self.state.batch_tokens)
                else:
                    batches = self.plan.fixed_batches(rest, int(self.requested))
                batches = [b for b in batches if not done[b].all()]
                self._run_batches(model, batches, store, progress)
        finally:
            progress.close()
        if not done.all():  # pragma: no cover - a planning bug; never hand out NaNs
            raise InternalError(f"trl-ext `{NAME}`: {int((~done).sum())} pairs were not computed")
        return chosen, rejected

    def _run_batches(self, model, batches, store, progress) -> None:

        per_rank = self.plan.deal(batches, self.ranks.world)
        mine = per_rank[self.ranks.rank]
        count = len(mine)
        self.record["batches"] = len(batches)
        self.record["batch_pairs_max"] = max((len(b) for b in batches), default=0)
        self.info(
            "trl-ext `%s`: %s split, %d pairs in %d batches (%s), %d per rank",
            NAME,
            self.name,
            sum(len(b) for b in batches),
            len(batches),
            "packed" if self.packed else "padded",
            count,
        )
        shard, interval = self.opts.shard_size, self.opts.shard_interval
        pending: list[tuple] = []
        pending_pairs = 0
        device = self.trainer.accelerator.device
        last_store = time.monotonic()
        for j in range(count):
            batch, filler = mine[j]
            results = self._forward_or_split(model, batch)
            if not filler:  # a filler only keeps ZeRO-3 ranks in lockstep; its result is dropped
                pending.extend(results)
            # Every rank knows every rank's plan, so all reach the same shard boundaries (collectives stay matched).
            step_pairs = sum(len(lst[j][0]) for lst in per_rank if not lst[j][1])
            pending_pairs += step_pairs
            progress.update(step_pairs)
            due = pending_pairs >= shard or j == count - 1
            if not due:
                # Also by elapsed time, so an interruption loses at most about `shard_interval` seconds of work
                # whatever the dataset size. Clocks differ between ranks: any rank that is due makes all store
                # (one all-reduce per batch with several processes, none with one).
                due = self.ranks.any_true(time.monotonic() - last_store >= interval, device)
            if due:
                store(concat_results(pending))
                pending, pending_pairs = [], 0
                last_store = time.monotonic()


def hash_module_full(module: Any) -> str:
    """TRL's `hash_module` (`_compat.DPO_HASH_MODULE`), also for a reference that FSDP2 already sharded: trl 1.12
    shards it before the precompute (dpo_trainer.py:959 vs :986), where TRL's `hash_module` fails on `DTensor`s (as in
    stock). Sharded entries are hashed at full size (`full_tensor()`, a collective: every rank hashes), so the hash is
    the unsharded model's and cache entries stay valid across engines."""
    import hashlib

    import torch

    hash_module = _compat.import_object(*_compat.DPO_HASH_MODULE)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor has no FSDP2
        return hash_module(module)
    state = module.state_dict()
    if not any(isinstance(t, DTensor) for t in state.values()):
        return hash_module(module)
    h = hashlib.sha256()
    for _, tensor in sorted(state.items()):
        tensor = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
        h.update(str(tensor.dtype).encode())
        if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            tensor = tensor.to(torch.float32)
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()
