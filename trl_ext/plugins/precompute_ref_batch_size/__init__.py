"""Fast, trustworthy reference log-prob precompute for `DPOTrainer(precompute_ref_log_probs=True)`.

Replaces `DPOTrainer._precompute_ref_logps`: length-planned batches (or an `"auto"` batch size), a cache keyed by
everything that determines the values, resumable, and safe on several processes.

See docs/plugins/precompute_ref_batch_size.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_ext.api import (
    Flag,
    PluginSpec,
    Size,
    either,
    lazy_getattr,
    non_negative_float,
    one_of,
    optional,
    positive_int,
    size,
    text,
)

NAME = "precompute_ref_batch_size"


@dataclass(frozen=True)
class PrecomputeOptions:
    """Options of the `precompute_ref_batch_size` plugin (`plugins: {precompute_ref_batch_size: {...}}`).

    Args:
        cache_dir (`str`, *optional*):
            Directory of a cache of reference log-probs keyed by everything that determines them; also makes an
            interrupted precompute resumable. `None`: `<HF datasets cache>/trl_ext_ref_logps`.
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
    replaces=("DPOTrainer._precompute_ref_logps",),
)


__getattr__ = lazy_getattr(__name__, rest="hooks")  # the implementation's names, imported on first use only
