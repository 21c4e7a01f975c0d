"""The on-disk cache of reference log-probs: the key (dataset content, weights, tokenizer, every setting that changes
the values), one directory per entry, atomic writes, checksummed metadata and the resume shards."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from trl_ext import _compat
from trl_ext.api import UsageError, get_logger

from . import NAME

logger = get_logger(f"trl_ext.plugins.{NAME}")

#: Bumped whenever the layout or meaning of a cache entry changes, so old entries are never read.
CACHE_FORMAT = 1
TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def scan_dataset(dataset, want_hash: bool):
    """Per-row token counts of the three token columns, and (optionally) a SHA-256 of their content."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    missing = [c for c in TOKEN_COLUMNS if c not in dataset.column_names]
    if missing:
        raise UsageError(
            f"`{NAME}`: the dataset has no {missing} column(s); the precompute runs on TRL's tokenized dataset "
            "(prompt_ids/chosen_ids/rejected_ids). Vision datasets are not supported (TRL refuses them too)."
        )
    lengths: dict[str, list[Any]] = {c: [] for c in TOKEN_COLUMNS}
    digest = hashlib.sha256() if want_hash else None
    view = dataset.select_columns(list(TOKEN_COLUMNS)).with_format("arrow")
    for table in view.iter(batch_size=65536):
        for column in TOKEN_COLUMNS:
            chunked = table.column(column)
            lengths[column].append(pc.list_value_length(chunked).to_numpy(zero_copy_only=False))
            if digest is not None:
                for chunk in chunked.chunks:
                    # `value_lengths`/`flatten` respect slicing, so views of the same rows hash the same.
                    digest.update(chunk.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype("<i8"))
                    flat = chunk.flatten().cast(pa.int64()).to_numpy(zero_copy_only=False)
                    digest.update(np.ascontiguousarray(flat, dtype="<i8").tobytes())
    out = {c: (np.concatenate(v) if v else np.zeros(0, dtype=np.int64)).astype(np.int64) for c, v in lengths.items()}
    return out, (digest.hexdigest() if digest is not None else None)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: Path, content: str | dict[str, Any]) -> None:
    """Write `content` (text, or arrays for an `.npz`) to a temporary file beside `path`, sync it, rename it over."""
    import numpy as np

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        if isinstance(content, str):
            f.write(content.encode())
        else:
            np.savez(f, **content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CacheEntry:
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
            if sha256_file(self.data) != meta.get("sha256"):
                raise ValueError("checksum mismatch (partial or corrupted file)")
            with np.load(self.data) as npz:
                chosen, rejected = npz["chosen"], npz["rejected"]
            if chosen.shape != (self.n_rows,) or rejected.shape != (self.n_rows,):
                raise ValueError("array shapes do not match the row count")
            _check_finite(chosen, rejected)
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
        """Rows finished by an interrupted earlier run: `(indices, chosen, rejected, plan)` or None (`plan`: what
        `write_plan` saved, or None)."""
        import numpy as np

        if not self.parts.is_dir():
            return None
        idx, chosen, rejected = [], [], []
        for path in sorted(self.parts.glob("part-*.npz")):
            seal = path.with_suffix(".sha256")
            try:
                if not seal.exists() or seal.read_text().strip() != self._seal(path):
                    raise ValueError("no matching checksum (a partial, rewritten or foreign file)")
                with np.load(path) as npz:
                    i, c, r = npz["indices"], npz["chosen"], npz["rejected"]
                if not (i.shape == c.shape == r.shape and i.ndim == 1) or (
                    i.size and (i.min() < 0 or i.max() >= self.n_rows)
                ):
                    raise ValueError("inconsistent arrays")
                _check_finite(c, r)
            except Exception as exc:  # noqa: BLE001
                logger.warning("trl-ext `%s`: discarding damaged resume shard %s (%s).", NAME, path, exc)
                for stale in (path, seal):
                    with contextlib.suppress(OSError):
                        stale.unlink()
                continue
            idx.append(i)
            chosen.append(c)
            rejected.append(r)
        if not idx:
            return None
        return np.concatenate(idx), np.concatenate(chosen), np.concatenate(rejected), self._load_plan()

    def write_plan(self, plan: dict[str, Any]) -> None:
        """The `"auto"` decision of this split (token budget, pairs left after the probes), for an exact resume."""
        self.parts.mkdir(parents=True, exist_ok=True)
        atomic_write(self.parts / "plan.json", json.dumps(plan))

    def _load_plan(self) -> dict[str, Any] | None:
        path = self.parts / "plan.json"
        if not path.exists():
            return None
        try:
            plan = json.loads(path.read_text())
            rest = plan["rest"]
            if not all(isinstance(i, int) and 0 <= i < self.n_rows for i in rest):
                raise ValueError("indices out of range")
            return {"batch_tokens": float(plan["batch_tokens"]), "rest": rest}
        except Exception as exc:  # noqa: BLE001 - a damaged plan: probe again
            logger.warning("trl-ext `%s`: discarding damaged resume plan %s (%s).", NAME, path, exc)
            return None

    def _seal(self, path: Path) -> str:
        """A shard's checksum, bound to this entry's key (a shard of another entry does not match)."""
        return hashlib.sha256(f"{self.key}:{sha256_file(path)}".encode()).hexdigest()

    def write_part(self, number: int, indices, chosen, rejected) -> None:
        """One resume shard, then its checksum (`part-*.sha256`, written last: a shard without one is not used)."""
        self.parts.mkdir(parents=True, exist_ok=True)
        path = self.parts / f"part-{number:06d}-{os.getpid()}.npz"
        atomic_write(path, {"indices": indices, "chosen": chosen, "rejected": rejected})
        atomic_write(path.with_suffix(".sha256"), self._seal(path))

    def write(self, chosen, rejected) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.data, {"chosen": chosen, "rejected": rejected})
        meta = {
            "format": CACHE_FORMAT,
            "key": self.key,
            "n_rows": self.n_rows,
            "sha256": sha256_file(self.data),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "details": self.details,
        }
        # Written last: an entry without a matching meta.json is never used.
        atomic_write(self.meta, json.dumps(meta, indent=1, sort_keys=True))
        shutil.rmtree(self.parts, ignore_errors=True)


def _check_finite(*arrays) -> None:
    import numpy as np

    for array in arrays:
        if not np.isfinite(array).all():
            raise ValueError(f"{int((~np.isfinite(array)).sum())} reference log-probs are not finite")


def tokenizer_digest(tokenizer) -> str:
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


def cache_key(trainer, dataset, content: str, model_hash: str, packed: bool) -> tuple[str, dict[str, Any]]:
    """The entry key and what it covers: everything that changes the values. (TRL keys only on the dataset fingerprint
    and the weights, B8.)"""
    import trl

    from trl_ext.api import unwrap_causal_lm

    args = trainer.args
    collator = trainer.data_collator
    ref = unwrap_causal_lm(trainer.ref_model or trainer.model)
    config = getattr(ref, "config", None)
    try:
        dtype = str(next(ref.parameters()).dtype)
    except (StopIteration, AttributeError):
        dtype = "unknown"
    max_length, truncation_mode = _compat.DPO_TRUNCATION_FIELDS
    ld_alpha = _compat.DPO_LD_ALPHA_ATTR
    details = {
        "dataset_tokens_sha256": content,
        "n_rows": len(dataset),
        "ref_weights": model_hash,
        "tokenizer": tokenizer_digest(getattr(trainer, "processing_class", None)),
        "max_length": getattr(collator, max_length, getattr(args, max_length, None)),
        "truncation_mode": getattr(collator, truncation_mode, getattr(args, truncation_mode, None)),
        "args_max_length": getattr(args, max_length, None),
        "args_truncation_mode": getattr(args, truncation_mode, None),
        "ld_alpha": getattr(trainer, ld_alpha, getattr(args, ld_alpha, None)),
        "packed": packed,
        "collator": type(collator).__qualname__,
        "dtype": dtype,
        "mixed_precision": str(getattr(trainer.accelerator, "mixed_precision", "no")),
        "attn_implementation": getattr(config, _compat.ATTN_IMPLEMENTATION_ATTR, None),
        "trl": trl.__version__,
    }
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, details], sort_keys=True, default=str).encode()).hexdigest()
    return key, details
