"""Fast, trustworthy reference log-prob precompute for `DPOTrainer(precompute_ref_log_probs=True)`.

TRL precomputes the reference log-probs of every pair once, before training, in `DPOTrainer._precompute_ref_logps`
(trl 1.10-1.16). It batches in dataset order, so every batch is padded to its longest pair; its cache key is only
`(dataset fingerprint, weight hash)`, so changing `max_length`, `truncation_mode` or `ld_alpha` silently reuses stale
values; with an in-memory dataset the non-main ranks of a multi-process run crash with `FileNotFoundError` (the cache
path is a per-process temp file); and the cache location cannot be chosen (TRL issue #3985). This plugin replaces that
method (the values still come from TRL's own `DPOTrainer.compute_ref_log_probs`, so the model choice, PEFT adapter
disabling, `ld_alpha` and the DeepSpeed precompute engine are TRL's):

- **Length-planned batches.** Pairs are sorted by length, so each batch pads to pairs of similar length and the work is
  proportional to real tokens; results are written back in dataset order. When the `padding_free` plugin is enabled
  for the trainer, its backbone wrapper packs every batch, and batches are planned by real tokens instead.
- **`"auto"` batch size.** Probes the largest batch that fits, heaviest pairs first, doubling: on a GPU within 90%
  of the free device memory (an out-of-memory error backs off), on CPU within `ram_budget` of resident memory
  (measured with the kernel's peak-RSS counter); two bisection steps refine the limit. Doubling also stops once it no
  longer pays (past 4096 tokens per batch, less than 10% more real tokens per second), since a bigger batch then only
  holds more memory. The chosen token budget and the reason are logged; the remaining pairs are packed into
  length-sorted batches of at most that many (padded, or with `padding_free` real) tokens. The probes' values are kept.
- **Out of memory** on a planned batch (fixed size too) halves the batch and retries, with a warning (not under
  multi-process DeepSpeed, where ranks must run the same forwards).
- **A cache you can trust.** One directory per key, where the key covers the token columns of the dataset (hashed, so
  in-memory datasets are keyed by content), the reference weights (TRL's `hash_module`), the tokenizer, `max_length`,
  `truncation_mode`, `ld_alpha`, padding-free on/off, dtype/mixed precision, attention implementation and the TRL
  version. The data file is written to a temp file and renamed, and a `meta.json` with its SHA-256 and row count is
  written last; a file that does not match is reported with a warning and recomputed, never used. Results are also
  saved in shards while computing, so an interrupted precompute resumes where it stopped.
- **Multi-process.** The work is split across ranks (equal batch counts, so ZeRO-3 ranks run their forwards in
  lockstep), results are all-gathered, rank 0 alone reads and writes the cache and broadcasts what it read: no rank
  ever opens a file another rank wrote, so in-memory datasets work under DDP and DeepSpeed.
- A progress bar in pairs/s on the main process (disabled by `TQDM_DISABLE` or `disable_tqdm`).

Values equal TRL's own precompute up to float rounding: only the batch composition (and so the padding) changes, and
TRL's own values move as much between two batch sizes (in float32 with trl 1.16, up to ~3e-3 on log-probs of ~100;
in float64, only the float32 storage rounding).
Batches are collated in the main process (TRL's `dataloader_num_workers` is not used for the precompute).

Enable it with the flag (the value keeps TRL's meaning: pairs per precompute batch, or `"auto"`; it takes the place
of `DPOConfig.precompute_ref_batch_size`, which is then not used):

```python
with trl_ext.install(precompute_ref_batch_size=64):  # or "auto"
    trainer = DPOTrainer(model, args=DPOConfig(..., precompute_ref_log_probs=True), ...)
```

Options, under `plugins: {precompute_ref_batch_size: {...}}`:

- `cache_dir` (`str`, defaults to `<HF datasets cache>/trl_ext_ref_logps`): where cache entries live. Only the main
  process reads or writes it.
- `ram_budget` (`str`, `int` or `float`, defaults to `0.25`): memory the `"auto"` probe may use per process on CPU:
  bytes (`"4GB"`, `"512MiB"`, an int), or a fraction of the memory available when the precompute starts (`0.25`,
  `"25%"`), shared among the processes of the node.
- `sort` (`"length"` or `"none"`, defaults to `"length"`): `"none"` keeps TRL's dataset-order batches (for comparison).
- `shard_size` (`int`, defaults to `4096`): pairs per resume shard.

Refuses (`trl_ext.UsageError`): unknown options or bad values, and an `IterableDataset` (TRL cannot precompute one
either). It only applies to `DPOTrainer` with `precompute_ref_log_probs=True`; with that off it logs a warning that it
has nothing to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._logging import get_logger
from ..errors import UsageError
from ..hookspecs import hookimpl
from ..spec import Flag, PluginSpec, Size, either, one_of, optional, positive_int, size, text

NAME = "precompute_ref_batch_size"


@dataclass(frozen=True)
class PrecomputeOptions:
    """Options of the `precompute_ref_batch_size` plugin (`plugins: {precompute_ref_batch_size: {...}}`).

    Args:
        cache_dir (`str`, *optional*):
            Directory of a cache of reference log-probs keyed by everything that determines them; also makes an
            interrupted precompute resumable. `None`: no cache.
        ram_budget (`str`, `int` or `float`, *optional*, defaults to `0.25`):
            Memory the `"auto"` probe may use per process on CPU: bytes (`"4GB"`, `"512MiB"`, an int), or a fraction
            of the memory available when the precompute starts (`0.25`, `"25%"`), shared among the node's processes.
        sort (`str`, *optional*, defaults to `"length"`):
            `"length"` plans batches by length; `"none"` keeps TRL's dataset-order batches (for comparison).
        shard_size (`int`, *optional*, defaults to `4096`):
            Pairs per resume shard.
    """

    cache_dir: str | None = field(default=None, metadata={"parse": optional(text)})
    ram_budget: Size = field(default=Size("fraction", 0.25), metadata={"parse": size})
    sort: str = field(default="length", metadata={"parse": one_of("length", "none")})
    shard_size: int = field(default=4096, metadata={"parse": positive_int})


TRL_EXT_PLUGIN = PluginSpec(
    name=NAME,
    summary="Length-planned, cached, resumable reference log-prob precompute for DPO.",
    flags=(
        Flag(
            NAME,
            default=None,
            parse=optional(either(positive_int, one_of("auto"))),
            help='Pairs per batch for the reference precompute, or "auto" to probe the largest batch that fits.',
            cli_const="auto",
        ),
    ),
    options=PrecomputeOptions,
    trainers=("DPOTrainer",),
)
#: Bumped whenever the layout or meaning of a cache entry changes, so old entries are never read.
CACHE_FORMAT = 1
_TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
_REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
#: `"auto"` stops doubling when real tokens/s grew by < 10%, but only past this many tokens per batch: below it, fixed
#: per-batch costs dominate and timings are noise.
_PLATEAU_MIN_TOKENS = 4096
#: Share of the free GPU memory the `"auto"` probe may fill.
_GPU_MEMORY_FRACTION = 0.9

logger = get_logger(__name__)


# -------------------------------------------------------------------------------------------------------------------
# Hooks
# -------------------------------------------------------------------------------------------------------------------


@hookimpl
def trl_ext_trainer_init_start(trainer, context, init_kwargs):
    context.state[NAME] = PrecomputeState(options=context.options(NAME))
    args = init_kwargs.get("args")
    if not getattr(args, "precompute_ref_log_probs", False):
        logger.warning(
            "trl-ext: `precompute_ref_batch_size` is set, but this DPOTrainer has `precompute_ref_log_probs=False`, "
            "so there is no reference precompute to run. Set `precompute_ref_log_probs=True` in the DPOConfig."
        )


@hookimpl
def trl_ext_make_ref_precompute(trainer, context, dataset, name, batch_size):
    from datasets import IterableDataset

    if isinstance(dataset, IterableDataset):
        raise UsageError(
            f"`precompute_ref_batch_size` (trl-ext plugin `{NAME}`) needs a map-style dataset for the {name} split, "
            "got an IterableDataset (TRL cannot precompute one either). Use a `datasets.Dataset`, or set "
            "`precompute_ref_log_probs=False`."
        )
    state = context.state.get(NAME)
    if state is None:  # trainer built before this hook module saw it (cannot happen through install())
        state = context.state[NAME] = PrecomputeState(options=context.options(NAME))
    return _Precompute(trainer, context, state, dataset, name).run()


@dataclass
class PrecomputeState:
    """Per-trainer state, `context.state["precompute_ref_batch_size"]`.

    Attributes:
        options: the validated options.
        runs: one record per precompute call (split name, where the values came from, batch plan, timings), for logs,
            tests and benchmarks.
        token_budget: the per-batch token budget `"auto"` chose (kept for later `evaluate()` precomputes).
        model_hash: the hash of the reference weights, taken at the first precompute.
    """

    options: PrecomputeOptions
    runs: list[dict[str, Any]] = field(default_factory=list)
    token_budget: float | None = None
    model_hash: str | None = None


# -------------------------------------------------------------------------------------------------------------------
# Distributed helpers (every rank calls them in the same order)
# -------------------------------------------------------------------------------------------------------------------


class _Dist:
    def __init__(self, accelerator) -> None:
        self.world = int(getattr(accelerator, "num_processes", 1) or 1)
        self.rank = int(getattr(accelerator, "process_index", 0) or 0)
        self.is_main = self.rank == 0
        local = os.environ.get("LOCAL_WORLD_SIZE")
        self.local_world = int(local) if local and local.isdigit() else self.world

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


# -------------------------------------------------------------------------------------------------------------------
# Dataset lengths and content hash
# -------------------------------------------------------------------------------------------------------------------


def _scan_dataset(dataset, want_hash: bool):
    """Per-row token counts of the three token columns, and (optionally) a SHA-256 of their content."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    missing = [c for c in _TOKEN_COLUMNS if c not in dataset.column_names]
    if missing:
        raise UsageError(
            f"`{NAME}`: the dataset has no {missing} column(s); the precompute runs on TRL's tokenized dataset "
            "(prompt_ids/chosen_ids/rejected_ids). Vision datasets are not supported (TRL refuses them too)."
        )
    lengths = {c: [] for c in _TOKEN_COLUMNS}
    digest = hashlib.sha256() if want_hash else None
    view = dataset.select_columns(list(_TOKEN_COLUMNS)).with_format("arrow")
    for table in view.iter(batch_size=65536):
        for column in _TOKEN_COLUMNS:
            chunked = table.column(column)
            lengths[column].append(pc.list_value_length(chunked).to_numpy(zero_copy_only=False))
            if digest is not None:
                for chunk in chunked.chunks:
                    # `value_lengths`/`flatten` respect slicing, so views of the same rows hash the same.
                    digest.update(chunk.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype("<i8"))
                    flat = chunk.flatten().cast(pa.int64()).to_numpy(zero_copy_only=False)
                    digest.update(np.ascontiguousarray(flat, dtype="<i8"))
    out = {c: (np.concatenate(v) if v else np.zeros(0, dtype=np.int64)).astype(np.int64) for c, v in lengths.items()}
    return out, (digest.hexdigest() if digest is not None else None)


# -------------------------------------------------------------------------------------------------------------------
# Cache entries: <cache_dir>/<key>/{ref_logps.npz, meta.json, parts/part-*.npz}
# -------------------------------------------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_write_npz(path: Path, **arrays) -> None:
    import numpy as np

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class _CacheEntry:
    """One cache entry. Only the main process creates one."""

    def __init__(self, root: Path, key: str, n_rows: int, details: dict[str, Any]) -> None:
        self.dir = root / key
        self.key = key
        self.n_rows = n_rows
        self.details = details
        self.data = self.dir / "ref_logps.npz"
        self.meta = self.dir / "meta.json"
        self.parts = self.dir / "parts"

    def load(self):
        """The complete `(chosen, rejected)` arrays, or None. A damaged entry is reported and removed, never used."""
        import numpy as np

        if not self.meta.exists() and not self.data.exists():
            return None
        try:
            meta = json.loads(self.meta.read_text())
            if meta.get("format") != CACHE_FORMAT or meta.get("key") != self.key:
                raise ValueError("metadata does not match this key")
            if meta.get("n_rows") != self.n_rows:
                raise ValueError(f"{meta.get('n_rows')} rows recorded, the dataset has {self.n_rows}")
            if _sha256_file(self.data) != meta.get("sha256"):
                raise ValueError("checksum mismatch (partial or corrupted file)")
            with np.load(self.data) as npz:
                chosen, rejected = npz["chosen"], npz["rejected"]
            if chosen.shape != (self.n_rows,) or rejected.shape != (self.n_rows,):
                raise ValueError("array shapes do not match the row count")
            return chosen, rejected
        except Exception as exc:  # noqa: BLE001 - any damage means: recompute, never crash
            logger.warning(
                "trl-ext `%s`: the cached reference log-probs in %s are unusable (%s: %s); recomputing them.",
                NAME,
                self.dir,
                type(exc).__name__,
                exc,
            )
            for path in (self.meta, self.data):
                with contextlib.suppress(OSError):
                    path.unlink()
            return None

    def load_parts(self):
        """Rows finished by an interrupted earlier run: `(indices, chosen, rejected)` or None."""
        import numpy as np

        if not self.parts.is_dir():
            return None
        idx, chosen, rejected = [], [], []
        for path in sorted(self.parts.glob("part-*.npz")):
            try:
                with np.load(path) as npz:
                    i, c, r = npz["indices"], npz["chosen"], npz["rejected"]
                if not (i.shape == c.shape == r.shape and i.ndim == 1) or (
                    i.size and (i.min() < 0 or i.max() >= self.n_rows)
                ):
                    raise ValueError("inconsistent arrays")
            except Exception as exc:  # noqa: BLE001
                logger.warning("trl-ext `%s`: discarding damaged resume shard %s (%s).", NAME, path, exc)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            idx.append(i)
            chosen.append(c)
            rejected.append(r)
        if not idx:
            return None
        return np.concatenate(idx), np.concatenate(chosen), np.concatenate(rejected)

    def write_part(self, number: int, indices, chosen, rejected) -> None:
        self.parts.mkdir(parents=True, exist_ok=True)
        _atomic_write_npz(
            self.parts / f"part-{number:06d}-{os.getpid()}.npz", indices=indices, chosen=chosen, rejected=rejected
        )

    def write(self, chosen, rejected) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        _atomic_write_npz(self.data, chosen=chosen, rejected=rejected)
        meta = {
            "format": CACHE_FORMAT,
            "key": self.key,
            "n_rows": self.n_rows,
            "sha256": _sha256_file(self.data),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "details": self.details,
        }
        # Written last: an entry without a matching meta.json is never used.
        _atomic_write_text(self.meta, json.dumps(meta, indent=1, sort_keys=True))
        shutil.rmtree(self.parts, ignore_errors=True)


# -------------------------------------------------------------------------------------------------------------------
# The precompute
# -------------------------------------------------------------------------------------------------------------------


def _tokenizer_digest(tokenizer) -> str:
    if tokenizer is None:
        return "none"
    tok = getattr(tokenizer, "tokenizer", tokenizer)  # processors wrap a tokenizer
    h = hashlib.sha256(type(tok).__name__.encode())
    try:
        h.update(json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode())
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: its name and special tokens only
        h.update(str(getattr(tok, "name_or_path", "")).encode())
    special = {k: str(v) for k, v in sorted((getattr(tok, "special_tokens_map", None) or {}).items())}
    h.update(json.dumps([special, getattr(tok, "pad_token_id", None)], sort_keys=True).encode())
    return h.hexdigest()


def _cpu_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _PeakMemory:
    """Extra memory one forward needs beyond what the process holds before it (GPU: allocator; CPU: peak RSS)."""

    def __init__(self, device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.cpu_ok = Path("/proc/self/clear_refs").exists()

    def __enter__(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = _cpu_rss()
            try:
                # "5" resets the peak-RSS counter (VmHWM) of this process (Linux >= 4.0, proc(5)).
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self.cpu_ok = False
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.used = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            hwm = 0
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        hwm = int(line.split()[1]) * 1024
            self.used = max(0, (hwm if self.cpu_ok else _cpu_rss()) - self.base)


class _Precompute:
    def __init__(self, trainer, context, state: PrecomputeState, dataset, name: str) -> None:
        self.trainer = trainer
        self.context = context
        self.state = state
        self.opts = state.options
        self.dataset = dataset
        self.name = name
        self.dist = _Dist(trainer.accelerator)
        self.packed = context.is_enabled("padding_free")
        self.requested = context.config.precompute_ref_batch_size
        self.record: dict[str, Any] = {"name": name, "n_pairs": len(dataset), "packed": self.packed}

    def _info(self, *args) -> None:
        if self.dist.is_main:  # every rank plans the same, so one copy of each message is enough
            logger.info(*args)

    # ---------------------------------------------------------------------------------------------------------------

    def run(self):
        start = time.perf_counter()
        dataset = self.dataset
        present = [c for c in _REF_COLUMNS if c in dataset.column_names]
        if present:
            logger.warning(
                "trl-ext `%s`: replacing the existing %s columns of the %s dataset.", NAME, present, self.name
            )
            dataset = dataset.remove_columns(present)
        self.dataset = dataset
        n = len(dataset)
        lengths, content = _scan_dataset(dataset, want_hash=self.dist.is_main)
        self._set_costs(lengths)

        # TRL hashes the weights on every rank (rank-dependent under ZeRO-3, so only rank 0's value counts); doing the
        # same keeps any collective inside `state_dict()` matched.
        model_hash = self._model_hash()
        key, details = self._cache_key(content, model_hash) if self.dist.is_main else (None, None)
        entry = self._open_entry(key, n, details) if self.dist.is_main else None
        # Rank 0 alone touches the disk; the others get what it found (fixes TRL's multi-process in-memory crash, B7).
        found = entry.load() if entry is not None else None
        found = self.dist.broadcast(found)
        if found is not None:
            chosen, rejected = found
            self.record.update(source="cache", seconds=time.perf_counter() - start, forward_batches=0)
            self._info("trl-ext `%s`: reused cached reference log-probs for %s (%d pairs).", NAME, self.name, n)
        else:
            resumed = entry.load_parts() if entry is not None else None
            resumed = self.dist.broadcast(resumed)
            chosen, rejected = self._compute(n, entry, resumed)
            if entry is not None:
                _guarded(entry.write, chosen, rejected)
            self.record.update(seconds=time.perf_counter() - start)
        if entry is not None:
            self.record["cache_dir"] = str(entry.dir)
        self.state.runs.append(self.record)
        return self._attach(dataset, chosen, rejected, key if key is not None else "")

    def _attach(self, dataset, chosen, rejected, key):
        import numpy as np
        from datasets.fingerprint import Hasher

        fingerprint = self.dist.broadcast(Hasher.hash((dataset._fingerprint, key)))
        dataset = dataset.add_column(
            "ref_chosen_logps", np.asarray(chosen, dtype=np.float32), new_fingerprint=fingerprint
        )
        return dataset.add_column(
            "ref_rejected_logps",
            np.asarray(rejected, dtype=np.float32),
            new_fingerprint=Hasher.hash((fingerprint, "rejected")),
        )

    # ---------------------------------------------------------------------------------------------------------------

    def _open_entry(self, key: str, n: int, details: dict[str, Any]) -> _CacheEntry | None:
        """The main process's cache entry, or None (with a warning) when the cache directory cannot be created.

        Only the main process touches the disk, so a failure here must not raise: the other ranks would be left
        waiting in the next collective.
        """
        root = self.opts.cache_dir
        if root is None:
            import datasets.config

            root = Path(datasets.config.HF_DATASETS_CACHE) / "trl_ext_ref_logps"
        root = Path(root).expanduser()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning(
                "trl-ext `%s`: cannot create the cache directory %s (%s); computing without a cache. Set "
                "`plugins.%s.cache_dir` to a writable directory.",
                NAME,
                root,
                exc,
                NAME,
            )
            return None
        return _CacheEntry(root, key, n, details)

    def _ref_model(self):
        """What TRL's `_precompute_ref_logps` runs: the DeepSpeed precompute engine, else `ref_model or model`."""
        trainer = self.trainer
        if trainer.ref_model is None and getattr(trainer, "is_deepspeed_enabled", False):
            # trl 1.10-1.16 build one inference engine over the policy, reused across splits and `evaluate()` calls
            # (trl-1.16.0 trl/trainer/dpo_trainer.py:1196-1201; trl-1.12.0 :1161-1166).
            if getattr(trainer, "_precompute_engine", None) is None:
                import importlib

                dpo_module = importlib.import_module("trl.trainer.dpo_trainer")
                trainer._precompute_engine = dpo_module.prepare_deepspeed(trainer.model, trainer.accelerator)
            return trainer._precompute_engine
        return trainer.ref_model or trainer.model

    def _model_hash(self) -> str:
        """TRL's hash of the reference weights, taken once per trainer, before any precompute forward.

        trl 1.16 hashes in `__init__` before sharding (`_precompute_model_hash`, dpo_trainer.py:980). trl 1.12 hashes
        at every precompute call (dpo_trainer.py:1139), so under ZeRO-3 its eval-split hash is taken after the train
        split's inference engine partitioned the weights and changes from run to run; the first hash is the stable one
        (the reference does not change afterwards: TRL refuses a precompute after training unless the reference is a
        separate model or the PEFT base).
        """
        if self.state.model_hash is None:
            model_hash = getattr(self.trainer, "_precompute_model_hash", None)
            if model_hash is None:
                model_hash = _hash_module_full(self.trainer.ref_model or self.trainer.model)
            self.state.model_hash = model_hash
        return self.state.model_hash

    def _cache_key(self, content: str, model_hash: str) -> tuple[str, dict[str, Any]]:
        """Everything that changes the values. (TRL keys only on the dataset fingerprint and weights, B8.)"""
        import trl

        trainer = self.trainer
        args = trainer.args
        collator = trainer.data_collator
        from ..context import unwrap_causal_lm

        ref = unwrap_causal_lm(trainer.ref_model or trainer.model)
        config = getattr(ref, "config", None)
        try:
            dtype = str(next(ref.parameters()).dtype)
        except (StopIteration, AttributeError):
            dtype = "unknown"
        details = {
            "dataset_tokens_sha256": content,
            "n_rows": len(self.dataset),
            "ref_weights": model_hash,
            "tokenizer": _tokenizer_digest(getattr(trainer, "processing_class", None)),
            "max_length": getattr(collator, "max_length", getattr(args, "max_length", None)),
            "truncation_mode": getattr(collator, "truncation_mode", getattr(args, "truncation_mode", None)),
            "args_max_length": getattr(args, "max_length", None),
            "args_truncation_mode": getattr(args, "truncation_mode", None),
            "ld_alpha": getattr(trainer, "ld_alpha", getattr(args, "ld_alpha", None)),
            "padding_free": self.packed,
            "collator": type(collator).__qualname__,
            "dtype": dtype,
            "mixed_precision": str(getattr(trainer.accelerator, "mixed_precision", "no")),
            "attn_implementation": getattr(config, "_attn_implementation", None),
            "trl": trl.__version__,
        }
        key = hashlib.sha256(json.dumps([CACHE_FORMAT, details], sort_keys=True, default=str).encode()).hexdigest()
        return key, details

    # ---------------------------------------------------------------------------------------------------------------
    # planning

    def _set_costs(self, lengths) -> None:
        import numpy as np

        collator = self.trainer.data_collator
        max_length = getattr(collator, "max_length", getattr(self.trainer.args, "max_length", None))
        chosen = lengths["prompt_ids"] + lengths["chosen_ids"]
        rejected = lengths["prompt_ids"] + lengths["rejected_ids"]
        if max_length is not None:
            chosen = np.minimum(chosen, max_length)
            rejected = np.minimum(rejected, max_length)
        self.pair_len = np.maximum(chosen, rejected)  # a padded batch pads both sequences of every pair to this
        self.real_tokens = chosen + rejected
        # The key pairs are sorted by: what a pair costs in a batch of its own.
        self.unit_cost = self.real_tokens if self.packed else 2 * self.pair_len

    def _batch_cost(self, indices) -> float:
        if len(indices) == 0:
            return 0.0
        if self.packed:
            return float(self.real_tokens[indices].sum())
        return float(2 * len(indices) * self.pair_len[indices].max())

    def _order(self, indices):
        """Planning order of `indices`: longest first (so "auto" and out-of-memory meet the worst batch first)."""
        import numpy as np

        if self.opts.sort == "none":
            return np.sort(indices)
        return indices[np.argsort(-self.unit_cost[indices], kind="stable")]

    def _fixed_batches(self, indices, batch_size: int):
        ordered = self._order(indices)
        return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]

    def _budget_batches(self, indices, budget: float):
        ordered = self._order(indices)
        batches, current, cur_max, cur_sum = [], [], 0, 0
        for i in ordered.tolist():
            new_max = max(cur_max, int(self.pair_len[i]))
            new_sum = cur_sum + int(self.real_tokens[i])
            cost = new_sum if self.packed else 2 * (len(current) + 1) * new_max
            if current and cost > budget:
                batches.append(current)
                current, new_max, new_sum = [], int(self.pair_len[i]), int(self.real_tokens[i])
            current.append(i)
            cur_max, cur_sum = new_max, new_sum
        if current:
            batches.append(current)
        import numpy as np

        return [np.asarray(b, dtype=np.int64) for b in batches]

    def _deal(self, batches):
        """Split batches across ranks, heaviest first in snake order, with equal batch counts on every rank.

        ZeRO-3 forwards all-gather parameters, so every rank must run the same number of forwards; a rank with fewer
        batches runs a one-pair filler batch whose result is dropped. Returns, per rank, `(indices, is_filler)` items.
        """
        import numpy as np

        world = self.dist.world
        ranked = sorted(range(len(batches)), key=lambda b: -self._batch_cost(batches[b]))
        per_rank: list[list] = [[] for _ in range(world)]
        for pos, b in enumerate(ranked):
            turn, slot = divmod(pos, world)
            per_rank[slot if turn % 2 == 0 else world - 1 - slot].append((batches[b], False))
        count = max((len(r) for r in per_rank), default=0)
        filler = np.asarray([int(np.argmin(self.unit_cost))], dtype=np.int64)
        for lst in per_rank:
            lst.sort(key=lambda item: -self._batch_cost(item[0]))  # heaviest first: memory peaks early
            lst.extend([(filler, True)] * (count - len(lst)))
        return per_rank

    # ---------------------------------------------------------------------------------------------------------------
    # running

    def _forward(self, model, batch_indices):
        """TRL's own per-batch math (`compute_ref_log_probs`) on one collated batch; returns float32 numpy arrays."""
        import numpy as np
        import torch

        examples = self.dataset.__getitems__([int(i) for i in batch_indices])
        batch = self.trainer.data_collator(examples)
        device = self.trainer.accelerator.device
        batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        with torch.no_grad():
            chosen, rejected = self.trainer.compute_ref_log_probs(model, batch)
        self.record["forward_batches"] = self.record.get("forward_batches", 0) + 1
        self.record["padded_tokens"] = self.record.get("padded_tokens", 0) + int(batch["input_ids"].numel())
        return (
            chosen.detach().float().cpu().numpy().astype(np.float32),
            rejected.detach().float().cpu().numpy().astype(np.float32),
        )

    def _forward_or_split(self, model, batch):
        """Forward one batch; on out-of-memory, halve it and retry (one pair that does not fit is an error).

        Not under multi-process DeepSpeed: there every rank must run the same forwards (ZeRO-3 gathers parameters in
        each), and a rank cannot add forwards on its own.
        """
        import torch

        try:
            return [(batch, *self._forward(model, batch))]
        except torch.OutOfMemoryError:
            lockstep = self.dist.world > 1 and getattr(self.trainer, "is_deepspeed_enabled", False)
            if len(batch) == 1 or lockstep:
                raise
            if self.trainer.accelerator.device.type == "cuda":
                torch.cuda.empty_cache()
            self.record["oom_splits"] = self.record.get("oom_splits", 0) + 1
            logger.warning(
                "trl-ext `%s`: out of memory on a batch of %d pairs (%d tokens); splitting it in two. Use a smaller "
                '`precompute_ref_batch_size` or "auto".',
                NAME,
                len(batch),
                int(self._batch_cost(batch)),
            )
            half = len(batch) // 2
            return self._forward_or_split(model, batch[:half]) + self._forward_or_split(model, batch[half:])

    def _compute(self, n: int, entry: _CacheEntry | None, resumed):
        import numpy as np

        chosen = np.full(n, np.nan, dtype=np.float32)
        rejected = np.full(n, np.nan, dtype=np.float32)
        done = np.zeros(n, dtype=bool)
        if resumed is not None:
            idx, c, r = resumed
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
            gathered = self.dist.all_gather(results)
            idx = np.concatenate([g[0] for g in gathered]) if gathered else np.zeros(0, dtype=np.int64)
            if len(idx) == 0:
                return
            c = np.concatenate([g[1] for g in gathered])
            r = np.concatenate([g[2] for g in gathered])
            chosen[idx], rejected[idx], done[idx] = c, r, True
            if entry is not None:
                part_number[0] += 1
                _guarded(entry.write_part, part_number[0], idx, c, r)

        progress = self._progress(n, int(done.sum()))
        try:
            if len(todo) and self.requested == "auto":
                todo = self._probe(model, todo, store, progress)
            if len(todo):
                if self.requested == "auto":
                    batches = self._budget_batches(todo, self.state.token_budget)
                else:
                    batches = self._fixed_batches(todo, int(self.requested))
                self._run_batches(model, batches, store, progress)
        finally:
            if progress is not None:
                progress.close()
        if not done.all():  # pragma: no cover - a planning bug; never hand out NaNs
            raise RuntimeError(f"trl-ext `{NAME}`: {int((~done).sum())} pairs were not computed")
        return chosen, rejected

    def _progress(self, total: int, initial: int):
        disable = (
            not self.dist.is_main
            or bool(os.environ.get("TQDM_DISABLE", ""))
            or bool(getattr(self.trainer.args, "disable_tqdm", False))
        )
        if disable:
            return None
        from tqdm.auto import tqdm

        return tqdm(
            total=total, initial=initial, unit="pair", desc=f"Reference log-probs ({self.name})", dynamic_ncols=True
        )

    def _run_batches(self, model, batches, store, progress) -> None:

        per_rank = self._deal(batches)
        mine = per_rank[self.dist.rank]
        count = len(mine)
        self.record["batches"] = len(batches)
        self.record["batch_pairs_max"] = max((len(b) for b in batches), default=0)
        self._info(
            "trl-ext `%s`: %s split, %d pairs in %d batches (%s), %d per rank",
            NAME,
            self.name,
            sum(len(b) for b in batches),
            len(batches),
            "packed" if self.packed else "padded",
            count,
        )
        shard = self.opts.shard_size
        pending: list[tuple] = []
        pending_pairs = 0
        for j in range(count):
            batch, filler = mine[j]
            results = self._forward_or_split(model, batch)
            if not filler:  # a filler only keeps ZeRO-3 ranks in lockstep; its result is dropped
                pending.extend(results)
            # Every rank knows every rank's plan, so all reach the same shard boundaries (collectives stay matched).
            step_pairs = sum(len(lst[j][0]) for lst in per_rank if not lst[j][1])
            pending_pairs += step_pairs
            if progress is not None:
                progress.update(step_pairs)
            if pending_pairs >= shard or j == count - 1:
                store(_concat(pending))
                pending, pending_pairs = [], 0

    # ---------------------------------------------------------------------------------------------------------------
    # "auto"

    def _budget_bytes(self, device) -> float:
        import torch

        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return _GPU_MEMORY_FRACTION * free
        kind, value = self.opts.ram_budget.kind, self.opts.ram_budget.value
        if kind == "bytes":
            return value
        import psutil

        return value * psutil.virtual_memory().available / max(1, self.dist.local_world)

    def _probe(self, model, todo, store, progress):
        """Find the largest useful batch that fits; keep what the probes computed; set the token budget.

        Probes run the heaviest pairs first (each probe the next heaviest ones, and their values are kept, so no
        pair is computed twice), doubling the pairs per rank until a batch no longer fits (over the memory
        budget, or out of memory; then two bisection steps between the last size that fit and the first that did
        not), or until doubling stops paying: past 4096 tokens per batch, real tokens per second grew by less than
        10%, so a bigger batch would only hold more memory (and, padded, mix more lengths). Every rank probes its own
        share of the heaviest pairs and all ranks take each decision from everyone's outcome, so they run the same
        forwards (ZeRO-3 lockstep).
        """
        import numpy as np

        state = self.state
        if state.token_budget is not None:  # chosen by an earlier split of this trainer
            self.record["token_budget"] = state.token_budget
            return todo
        device = self.trainer.accelerator.device
        budget = self._budget_bytes(device)
        world, rank = self.dist.world, self.dist.rank
        heavy = todo[np.argsort(-self.unit_cost[todo], kind="stable")]
        share = heavy[rank::world]
        limit = len(todo) // world  # every rank can run a probe of this many pairs
        largest = {"k": 0, "cost": 0.0, "used": 0.0}  # the largest probe that fit
        fastest = {"k": 0, "cost": 0.0, "speed": 0.0}  # the fitting probe with the most real tokens per second
        fail = {"k": math.inf, "cost": math.inf, "oom": False}
        taken = 0  # pairs per rank the probes computed: each probe takes the next `k` heaviest, so none is redone

        def probe(k: int) -> float | None:
            """Probe `k` pairs per rank; return the real tokens/s over all ranks if it fit everywhere, else None."""
            nonlocal taken
            batch = share[taken : taken + k]
            cost = self._batch_cost(batch)
            # CPU: process CPU time, which other jobs on a shared machine barely disturb; GPU: wall time.
            clock = time.process_time if device.type == "cpu" else time.perf_counter
            start = clock()
            result, used = self._measured_forward(model, batch, device)
            seconds = clock() - start
            fits = result is not None and used <= budget
            real = float(self.real_tokens[batch].sum())
            outcomes = self.dist.all_gather((fits, result is None, cost, used, real, seconds))
            if not any(o[1] for o in outcomes):
                # Nobody ran out of memory: keep the values (also from a probe that was merely over budget).
                store(_concat([(batch, *result)]))
                if progress is not None:
                    progress.update(k * world)
                taken += k
            else:
                store(_concat([]))
            speed = sum(o[4] for o in outcomes) / max(max(o[5] for o in outcomes), 1e-9)
            self._info(
                "trl-ext `%s`: auto probe %d pairs/rank, %s tokens: %s, %.0f real tokens/s",
                NAME,
                k,
                [int(o[2]) for o in outcomes],
                ["out of memory" if o[1] else f"{o[3] / 2**20:.1f} MiB" for o in outcomes],
                speed,
            )
            if all(o[0] for o in outcomes):
                largest.update(k=k, cost=min(o[2] for o in outcomes), used=max(o[3] for o in outcomes))
                if speed > fastest["speed"]:
                    fastest.update(k=k, cost=largest["cost"], speed=speed)
                return speed
            fail.update(k=k, cost=min(o[2] for o in outcomes if not o[0]), oom=any(o[1] for o in outcomes))
            return None

        k, reason = 1, "the whole split fit"
        while limit and k <= limit - taken:
            before = fastest["speed"]
            speed = probe(k)
            if speed is None:
                reason = "memory"
                break
            if largest["cost"] >= _PLATEAU_MIN_TOKENS and speed < 1.1 * before:
                reason = "throughput stopped growing"
                break
            if taken == limit:
                break
            k = min(2 * k, limit - taken)
        if reason == "memory":
            for _ in range(2):  # bisect between the last fit and the first failure
                mid = min((largest["k"] + fail["k"]) // 2, limit - taken)
                if mid <= largest["k"] or mid >= fail["k"]:
                    break
                probe(mid)

        if limit == 0:
            token_budget = math.inf  # fewer pairs than processes: one batch each, nothing to measure
        elif largest["k"] == 0:
            # Even one pair per batch does not fit: run one pair at a time and say so.
            logger.warning(
                "trl-ext `%s`: a single pair needs more than the memory budget (%.0f MiB); using one pair per batch. "
                "On CPU, raise `plugins.%s.ram_budget`.",
                NAME,
                budget / 2**20,
                NAME,
            )
            token_budget = 0.0
        elif reason != "memory":
            token_budget = fastest["cost"] if reason != "the whole split fit" else largest["cost"]
        elif fail["oom"]:
            token_budget = largest["cost"]  # out of memory is not measured: never go beyond what ran
        else:
            # Memory grows about linearly with tokens: extrapolate from the largest probe that fit, with 10% headroom,
            # but never up to the size that did not fit.
            projected = largest["cost"] * 0.9 * budget / largest["used"] if largest["used"] > 0 else math.inf
            token_budget = max(largest["cost"], min(projected, fail["cost"] - 1))
        token_budget = self.dist.broadcast(token_budget)
        state.token_budget = token_budget
        self.record.update(token_budget=token_budget, probe_pairs_per_rank=taken, auto_stop=reason)
        self._info(
            'trl-ext `%s`: "auto" chose a budget of %s %s tokens per batch (stopped by: %s; memory budget %.0f MiB '
            "per process on %s)",
            NAME,
            "unlimited" if math.isinf(token_budget) else f"{token_budget:.0f}",
            "real" if self.packed else "padded",
            reason,
            budget / 2**20,
            device.type,
        )
        covered = np.concatenate([heavy[r::world][:taken] for r in range(world)]) if taken else np.zeros(0, np.int64)
        return np.setdiff1d(todo, covered, assume_unique=True)

    def _measured_forward(self, model, batch, device):
        """`((chosen, rejected), extra bytes)` of one forward, or `(None, 0)` when it ran out of memory."""
        import torch

        try:
            with _PeakMemory(device) as peak:
                result = self._forward(model, batch)
        except torch.OutOfMemoryError:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return None, 0.0
        return result, float(peak.used)


def _guarded(write, *args) -> None:
    """Run a cache write on the main process; a full disk or a read-only directory costs the cache, not the run."""
    try:
        write(*args)
    except OSError as exc:
        logger.warning(
            "trl-ext `%s`: could not write the reference log-prob cache (%s); continuing without it.", NAME, exc
        )


def _concat(results):
    """`[(indices, chosen, rejected), ...]` -> one `(indices, chosen, rejected)` triple (possibly empty)."""
    import numpy as np

    if not results:
        return np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32)
    return tuple(np.concatenate([np.asarray(r[i]) for r in results]) for i in range(3))


def _hash_module_full(module: Any) -> str:
    """TRL's `hash_module` (trl/trainer/utils.py), also for a reference that FSDP2 already sharded.

    trl 1.12 shards the reference with `prepare_fsdp` before the precompute (dpo_trainer.py:959 vs :986), and TRL's
    `hash_module` then fails on the sharded `DTensor`s (`.numpy() is not supported for tensor subclasses`; stock TRL
    1.12 fails the same way). Sharded entries are hashed at full size (`full_tensor()`, a collective: every rank
    hashes, see `run`), so the hash equals the unsharded model's and cache entries stay valid across engines.
    """
    import torch
    from trl.trainer.utils import hash_module

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
