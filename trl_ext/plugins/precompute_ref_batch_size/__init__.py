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
  The choice is logged in one line at the default level (`notice`); each probe at `info`.
- **Out of memory** on a planned batch (fixed size too) halves the batch and retries, with a warning. Not under
  multi-process DeepSpeed or FSDP, where every rank must run the same forwards (they gather parameters with
  collectives), so a rank that caught the error could hang the others: there an out-of-memory error is re-raised
  with advice, and the `"auto"` probe stops at the budget check instead (a probe whose memory, extrapolated from the
  largest probe that fit, would exceed the budget is not run).
- **A cache you can trust.** One directory per key, where the key covers the token columns of the dataset (hashed, so
  in-memory datasets are keyed by content), the reference weights (TRL's `hash_module`), the tokenizer, `max_length`,
  `truncation_mode`, `ld_alpha`, padding-free on/off, dtype/mixed precision, attention implementation and the TRL
  version. The data file is written to a temp file and renamed, and a `meta.json` with its SHA-256 and row count is
  written last; a file that does not match is reported with a warning and recomputed, never used. A read-only
  cache directory is reported once, before the forwards; its entries are still read, and nothing is written.
  Results are also saved in shards while computing (every `shard_size` pairs, and at least every `shard_interval`
  seconds), so an interrupted precompute resumes where it stopped, with the same final values.
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
- `shard_interval` (`float`, defaults to `60`): a resume shard is also saved once this many seconds of precompute have
  passed since the last one, so an interruption (Ctrl-C, a killed job) loses at most about that much work whatever
  the dataset size. A resumed run computes the remaining batches exactly as the uninterrupted run would have, so the
  final cache is bit-identical to an uninterrupted run's (with `"auto"`, unless the interruption came during its
  probes). With several processes, deciding the time-based shards costs one tiny all-reduce per batch.

Refuses (`trl_ext.UsageError`): unknown options or bad values. An `IterableDataset` is left to TRL, which refuses it
with its own `ValueError` (the same message as without trl-ext, so code that matches TRL's message keeps working).
It only applies to `DPOTrainer` with `precompute_ref_log_probs=True`; with that off it logs a warning that it has
nothing to do, and the end-of-run line of `trl-ext dpo` says it did nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..._lazy import lazy_getattr
from ...spec import Flag, PluginSpec, Size, either, non_negative_float, one_of, optional, positive_int, size, text

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
        shard_interval (`float`, *optional*, defaults to `60.0`):
            Seconds of precompute after which a resume shard is saved even if it holds fewer than `shard_size` pairs,
            so an interruption loses at most about this much work.
    """

    cache_dir: str | None = field(default=None, metadata={"parse": optional(text)})
    ram_budget: Size = field(default=Size("fraction", 0.25), metadata={"parse": size})
    sort: str = field(default="length", metadata={"parse": one_of("length", "none")})
    shard_size: int = field(default=4096, metadata={"parse": positive_int})
    shard_interval: float = field(default=60.0, metadata={"parse": non_negative_float})


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
    hooks=".hooks",
    calls=("DPOTrainer._precompute_ref_logps",),
)


__getattr__ = lazy_getattr(__name__, rest="hooks")  # the implementation's names, imported on first use only
