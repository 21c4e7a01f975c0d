"""Everything trl-ext knows about TRL versions, in one place.

Each entry says which TRL versions it was checked on. When a new TRL minor is released, read its
`trl/trainer/dpo_trainer.py`, `trl/experimental/online_dpo/online_dpo_trainer.py` and `trl/models/utils.py`, check
every entry below, and only then raise `TRL_MAX_EXCLUSIVE`.
"""

from __future__ import annotations

import importlib.metadata
import re

from .errors import UsageError

#: Supported TRL range: >= 1.10, < 1.17. Checked on 1.12.0 and 1.16.0 (CI), read on 1.10.0 and 1.14.0.
TRL_MIN = (1, 10)
TRL_MAX_EXCLUSIVE = (1, 17)
SUPPORTED_TRL_SPEC = ">=1.10,<1.17"

#: DPO replaced `model(...).logits` with a fused LM head (`model(..., fused_lm_head=True)` returning `log_probs`,
#: `entropy`, `mean_logits`, `is_top1`) in 1.15.0. Checked: 1.12.0 (logits path), 1.16.0 (fused path).
DPO_FUSED_LM_HEAD_SINCE = (1, 15)

#: TRL config flags that TRL accepts but ignores, by trainer class name. While trl-ext is installed, setting one of
#: them enables the trl-ext plugin of the same name for that trainer instead.
#: - `DPOConfig.padding_free`: warned about and forced off since 0.29.0 ("temporarily unavailable after a
#:   refactor"); checked 1.12.0 (dpo_trainer.py:717-724) and 1.16.0 (dpo_trainer.py:732-739).
TRL_IGNORED_FLAGS: dict[str, tuple[str, ...]] = {"DPOTrainer": ("padding_free",)}


def dpo_honours_padding_free() -> bool:
    """Whether the installed DPO implements `padding_free` itself.

    False on TRL 0.29-1.16 (`DPOTrainer.__init__` forces it off; its `DataCollatorForPreference` has no
    `padding_free` field: checked 1.12.0 and 1.16.0). True with `patches/0001-dpo-padding-free.patch` applied, or a
    release that restores the feature with the collator field.
    """
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    return "padding_free" in getattr(DataCollatorForPreference, "__dataclass_fields__", {})


def trl_ignored_flags(trainer_class: str) -> tuple[str, ...]:
    """`TRL_IGNORED_FLAGS` for the installed TRL (a patched TRL may honour some of them)."""
    flags = TRL_IGNORED_FLAGS.get(trainer_class, ())
    if trainer_class == "DPOTrainer" and "padding_free" in flags and dpo_honours_padding_free():
        flags = tuple(f for f in flags if f != "padding_free")
    return flags


#: Trainers trl-ext attaches to, as (module, class name). Checked on 1.12.0 and 1.16.0; OnlineDPO moved to
#: `trl.experimental.online_dpo` in 0.26.0 and has been there only since 0.29.0.
TRAINERS: dict[str, tuple[str, str]] = {
    "DPOTrainer": ("trl.trainer.dpo_trainer", "DPOTrainer"),
    "OnlineDPOTrainer": ("trl.experimental.online_dpo.online_dpo_trainer", "OnlineDPOTrainer"),
    # For the `generation` plugin only (the other built-ins list the trainers they apply to). Both generate through
    # `unwrap_model_for_generation(self.model_wrapped, ...)`; checked on 1.12.0 and 1.16.0.
    "GRPOTrainer": ("trl.trainer.grpo_trainer", "GRPOTrainer"),
    "RLOOTrainer": ("trl.trainer.rloo_trainer", "RLOOTrainer"),
}

#: Trainer modules that import `unwrap_model_for_generation` by name (`from ...models.utils import ...`), so the
#: name must be patched in each of these modules, not in `trl.models.utils`. Checked on 1.12.0 and 1.16.0.
GENERATION_HELPER_MODULES: dict[str, str] = {
    "OnlineDPOTrainer": "trl.experimental.online_dpo.online_dpo_trainer",
    "GRPOTrainer": "trl.trainer.grpo_trainer",  # `from ..models import unwrap_model_for_generation`
    "RLOOTrainer": "trl.trainer.rloo_trainer",  # idem
}

#: `DPOTrainer._precompute_ref_logps(self, dataset, name, batch_size)` runs inside `__init__`; present with this
#: signature on 1.10.0-1.16.0 (checked 1.12.0, 1.16.0).
DPO_PRECOMPUTE_METHOD = "_precompute_ref_logps"


def parse_version(version: str) -> tuple[int, ...]:
    """`"1.16.0"` -> `(1, 16, 0)`; pre-release and local suffixes are dropped (`"1.17.0.dev0"` -> `(1, 17, 0)`)."""
    match = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_supported_trl(version: str | None) -> bool:
    if version is None:
        return False
    v = parse_version(version)[:2]
    return TRL_MIN <= v < TRL_MAX_EXCLUSIVE


def check_trl_version(version: str | None = None) -> str:
    """Return the installed TRL version, or raise `UsageError` if it is outside the supported range."""
    version = installed_version("trl") if version is None else version
    if version is None:
        raise UsageError(
            f"trl-ext needs TRL ({SUPPORTED_TRL_SPEC}), but TRL is not installed. "
            f"Run `pip install 'trl{SUPPORTED_TRL_SPEC}'`."
        )
    if not is_supported_trl(version):
        raise UsageError(
            f"trl-ext supports trl{SUPPORTED_TRL_SPEC}, but trl=={version} is installed. Install a supported "
            f"release (`pip install 'trl{SUPPORTED_TRL_SPEC}'`) or a trl-ext release that supports trl {version}."
        )
    return version


def dpo_uses_fused_lm_head(version: str | None = None) -> bool:
    version = installed_version("trl") if version is None else version
    return parse_version(version or "0")[:2] >= DPO_FUSED_LM_HEAD_SINCE


# -------------------------------------------------------------------------------------------------------------------
# Keywords TRL renamed (for a note on TRL's own "unexpected keyword argument" error; the error itself is TRL's)
# -------------------------------------------------------------------------------------------------------------------

#: `{trainer class: {old keyword: new spelling}}`. Extend when TRL renames a constructor keyword.
#: - `OnlineDPOTrainer(reward_model=..., reward_processing_class=...)`: removed in favour of `reward_funcs` /
#:   `reward_processing_classes` (both absent from `OnlineDPOTrainer.__init__` on 1.12.0 and 1.16.0).
TRL_RENAMED_KEYWORDS: dict[str, dict[str, str]] = {
    "OnlineDPOTrainer": {"reward_model": "reward_funcs", "reward_processing_class": "reward_processing_classes"},
}


def renamed_keyword_notes(trainer_class: str, error: BaseException, keywords: object) -> list[str]:
    """Notes naming the new spelling of each renamed keyword among `keywords` that TRL's `error` rejects."""
    if not isinstance(error, TypeError) or "unexpected keyword argument" not in str(error):
        return []
    renames = TRL_RENAMED_KEYWORDS.get(trainer_class, {})
    return [
        f"TRL renamed `{old}=`: pass `{new}=` to {trainer_class} instead (note added by trl-ext)."
        for old, new in renames.items()
        if old in keywords
    ]
