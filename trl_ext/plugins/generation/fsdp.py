"""The generation plugin under FSDP: which `ds3_gather_for_generation` settings mean something there."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trl_ext.api import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from .hooks import GenerationState


def check_fsdp_generation(state: GenerationState, accelerator: Any) -> None:
    """Under FSDP, accept only the flag value that means what FSDP does, and refuse the others (`UsageError`).

    Under FSDP2 each `fully_shard` unit is unsharded for its own forward only (TRL's `unwrap_model_for_generation` just
    unwraps), which is what `False` asks for under ZeRO-3 (tests/scale checks the peak; docs/plugins/generation.md,
    "Under FSDP2"): `False` is accepted unless `reshard_after_forward=False` keeps every unit unsharded; `True`,
    `"auto"` and the `budget` option would do nothing and are refused."""
    from accelerate.utils import DistributedType

    state_ = getattr(accelerator, "state", None)
    plugin = getattr(state_, "fsdp_plugin", None)
    if plugin is None or getattr(accelerator, "distributed_type", None) != DistributedType.FSDP:
        return
    version = getattr(plugin, "fsdp_version", 1)
    if state.flag is not False or state.budget is not None:
        setting = "the `budget` option" if state.flag is False else f"ds3_gather_for_generation={state.flag!r}"
        raise UsageError(
            f"trl-ext `generation`: {setting} has no effect under FSDP{version}: the plugin gathers or keeps "
            "parameters gathered only for DeepSpeed ZeRO-3. Under FSDP each fully_shard unit is unsharded in its "
            "own forward (with reshard_after_forward=True, freed after it), so generation already holds one unit "
            "at a time. Set ds3_gather_for_generation=False (and no `budget`), or unset it."
        )
    if plugin.reshard_after_forward is False:
        raise UsageError(
            "trl-ext `generation`: ds3_gather_for_generation=False asks to keep generation memory bounded, but the "
            f"FSDP{version} plugin has reshard_after_forward=False, so every unit stays unsharded after its first "
            "generation forward and each rank holds the whole model. Set fsdp_config "
            '{"reshard_after_forward": true}, or unset ds3_gather_for_generation.'
        )
    state.log_once(
        "fsdp",
        "generation: under FSDP%d with reshard_after_forward=True each unit is unsharded only for its own forward: "
        "ds3_gather_for_generation=False holds what FSDP holds (shards, the unsharded tail and one unit at a time)",
        version,
    )
