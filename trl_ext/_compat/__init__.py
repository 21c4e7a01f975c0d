"""Everything trl-ext knows about TRL versions, in one place.

Each entry says which TRL versions it was checked on. When a new TRL minor is released, read its
`trl/trainer/dpo_trainer.py`, `trl/experimental/online_dpo/online_dpo_trainer.py` and `trl/models/utils.py`, check
every entry below, run tests/test_compat.py and tests/versions against it (docs/versions.md), and only then raise
`TRL_MAX_EXCLUSIVE`. Code layouts that differ within the range are found by probes (`_compat.layouts`), not versions.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Iterable

from ..errors import UsageError
from .layouts import *  # noqa: F403 - the TRL layouts found by probes are part of `_compat`
from .layouts import DPO_SCORING_METHODS, dpo_has_fused_head

#: The private config field behind transformers' `config._attn_implementation` property (transformers 5: the property
#: reads it, `_remove_keys_not_serialized` keeps it out of saved configs). Checked on transformers 5.24.0.
ATTN_IMPLEMENTATION_FIELD = "_attn_implementation_internal"
#: accelerate's `prepare_model` under native mixed precision keeps a model's `forward` as `_original_forward` and
#: installs its autocast wrapper over it (accelerator.py). Consumer: `verify` (its float32 reference). Checked 1.15.0.
ACCELERATE_ORIGINAL_FORWARD = "_original_forward"

#: The columns of a DPO dataset after `DPOTrainer` tokenized it (prompt, chosen, rejected token ids): what the
#: packing self-checks read to find the longest pair training will feed. Checked on 1.12.0 and 1.16.0.
DPO_TOKENIZED_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")

#: Supported TRL range: >= 1.10, < 1.17 (which releases CI and the version matrix run: docs/versions.md).
TRL_MIN = (1, 10)
TRL_MAX_EXCLUSIVE = (1, 17)
SUPPORTED_TRL_SPEC = ">=1.10,<1.17"

#: DPO replaced `model(...).logits` with a fused LM head (`model(..., fused_lm_head=True)` returning `log_probs`,
#: `entropy`, `mean_logits`, `is_top1`) in 1.15.0. Checked: 1.10.0-1.14.2 (logits path), 1.15.0, 1.16.0 (fused path).
#: The installed TRL is probed (`dpo_has_fused_head`); the version is read only for a TRL that is not installed.
DPO_FUSED_LM_HEAD_SINCE = (1, 15)

#: TRL config flags that TRL accepts but ignores, by trainer class name. While trl-ext is installed, setting one of
#: them enables the trl-ext plugin of the same name for that trainer instead.
#: - `DPOConfig.padding_free`: warned about and forced off since 0.29.0 ("temporarily unavailable after a
#:   refactor"); checked 1.12.0 (dpo_trainer.py:717-724) and 1.16.0 (dpo_trainer.py:732-739).
TRL_IGNORED_FLAGS: dict[str, tuple[str, ...]] = {"DPOTrainer": ("padding_free",)}


def dpo_honours_padding_free() -> bool:
    """Whether the installed DPO implements `padding_free` itself: False on TRL 0.29-1.16 (its
    `DataCollatorForPreference` has no `padding_free` field: checked 1.12.0 and 1.16.0), True with
    `patches/0001-dpo-padding-free.patch` applied or a release that restores the feature with the collator field."""
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


def import_object(module: str, name: str):
    """`getattr(importlib.import_module(module), name)`, for the `(module, name)` facts below."""
    return getattr(importlib.import_module(module), name)


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


def unexpected_trl(plugin: str) -> str:
    """The end of a refusal of what the installed TRL does otherwise than the releases trl-ext was checked on."""
    checked = f"the releases trl-ext was checked on ({SUPPORTED_TRL_SPEC})"
    return f"trl=={installed_version('trl')} differs from {checked}: install one of those or disable {plugin}"


def dpo_uses_fused_lm_head(version: str | None = None) -> bool:
    """Whether `DPOTrainer` scores with TRL's fused LM head: probed on the installed TRL, read from `version` if given
    (a release that is not installed)."""
    if version is None or version == installed_version("trl"):
        return dpo_has_fused_head()
    return parse_version(version or "0")[:2] >= DPO_FUSED_LM_HEAD_SINCE


#: Keywords TRL renamed, `{trainer class: {old keyword: new spelling}}`, for a note on TRL's own "unexpected keyword
#: argument" error (the error itself is TRL's). Extend when TRL renames a constructor keyword.
#: - `OnlineDPOTrainer(reward_model=..., reward_processing_class=...)`: removed in favour of `reward_funcs` /
#:   `reward_processing_classes` (both absent from `OnlineDPOTrainer.__init__` on 1.12.0 and 1.16.0).
TRL_RENAMED_KEYWORDS: dict[str, dict[str, str]] = {
    "OnlineDPOTrainer": {"reward_model": "reward_funcs", "reward_processing_class": "reward_processing_classes"},
}


def renamed_keyword_notes(trainer_class: str, error: BaseException, keywords: Iterable[str]) -> list[str]:
    """Notes naming the new spelling of each renamed keyword among `keywords` that TRL's `error` rejects."""
    if not isinstance(error, TypeError) or "unexpected keyword argument" not in str(error):
        return []
    renames = TRL_RENAMED_KEYWORDS.get(trainer_class, {})
    return [
        f"TRL renamed `{old}=`: pass `{new}=` to {trainer_class} instead (note added by trl-ext)."
        for old, new in renames.items()
        if old in keywords
    ]


# ===================================================================================================================
# The facts the plugins rely on, by consumer. Each is checked against the installed TRL/transformers/DeepSpeed by
# tests/test_compat.py; a new release that changes one fails there, with the entry's name, before any plugin test.
# ===================================================================================================================

# -- precompute_ref_batch_size ---------------------------------------------------------------------------------------

#: TRL's own refusal of an `IterableDataset` in `DPOTrainer._precompute_ref_logps` (its first statement; raised as a
#: `ValueError`). Consumer: precompute_ref_batch_size, which steps aside for an IterableDataset so that TRL's check
#: speaks. Identical on 1.12.0 (dpo_trainer.py:1134-1138) and 1.16.0 (:1169-1173).
DPO_PRECOMPUTE_ITERABLE_MESSAGE = (
    "`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a map-style "
    "Dataset or set `precompute_ref_log_probs=False`."
)
#: `DPOTrainer.compute_ref_log_probs(self, model, inputs) -> (chosen_logps, rejected_logps)`: TRL's per-batch
#: reference math. Consumer: precompute_ref_batch_size (runner). Checked 1.12.0, 1.16.0.
DPO_COMPUTE_REF_METHOD = "compute_ref_log_probs"
#: The DeepSpeed inference engine TRL builds once for the precompute when there is no separate reference model
#: (`self._precompute_engine = prepare_deepspeed(self.model, self.accelerator)`, with `prepare_deepspeed` imported by
#: name into `trl.trainer.dpo_trainer`). Consumer: precompute_ref_batch_size (runner). 1.16.0 dpo_trainer.py:1196-1201,
#: 1.12.0 :1161-1166.
DPO_PRECOMPUTE_ENGINE_ATTR = "_precompute_engine"
DPO_PREPARE_DEEPSPEED = ("trl.trainer.dpo_trainer", "prepare_deepspeed")
#: The weight hash TRL keys its precompute cache on: `trl.trainer.utils.hash_module(module) -> str`. 1.16.0 stores it
#: at `__init__` as `_precompute_model_hash` (dpo_trainer.py:980); 1.12.0 has no such attribute and calls
#: `hash_module` in `_precompute_ref_logps` (:1139). The release in between that added it was not checked: the
#: consumer uses the attribute when it exists and `hash_module` otherwise. Consumer: precompute_ref_batch_size.
DPO_HASH_MODULE = ("trl.trainer.utils", "hash_module")
DPO_PRECOMPUTE_HASH_ATTR = "_precompute_model_hash"

# -- sync_metrics: DPO -----------------------------------------------------------------------------------------------

#: The private per-mode metric buffer of `DPOTrainer` (`self._metrics[mode][name]`, a dict of lists); `log()` averages
#: and clears it. Consumers: sync_metrics (dpo), token_budget, the core's `log` wrapper. Checked 1.12.0, 1.16.0.
DPO_METRICS_BUFFER = "_metrics"
#: `DPOTrainer._compute_loss(self, model, inputs, return_outputs)`: where every metric is computed and gathered.
#: Consumer: sync_metrics (dpo). Checked 1.12.0, 1.16.0.
DPO_COMPUTE_LOSS = "_compute_loss"
#: The metrics `_compute_loss` writes, in the order it writes them, with the number of `accelerator.gather` /
#: `gather_for_metrics` calls made since the previous write (its gather order: sync_metrics identifies each gathered
#: tensor by its position). `aux_loss` only with `aux_loss_enabled`; `num_tokens` (the attention-mask tokens of the
#: batch) only in training. The token metrics gather (sum, count) scalar pairs, the pair metrics one `[B]` vector each.
#: Consumer: sync_metrics (dpo). Identical on 1.12.0 (dpo_trainer.py:1610-1683) and 1.16.0 (:1530-1601), the fused and
#: the logits paths alike.
DPO_METRIC_GATHERS: tuple[tuple[str, int], ...] = (
    ("aux_loss", 1),
    ("entropy", 2),
    ("num_tokens", 1),
    ("logits/chosen", 4),
    ("logits/rejected", 0),
    ("mean_token_accuracy", 2),
    ("rewards/chosen", 2),
    ("rewards/rejected", 0),
    ("rewards/accuracies", 1),
    ("rewards/margins", 1),
    ("logps/chosen", 1),
    ("logps/rejected", 1),
)
#: The token metrics: gathered as (sum, count) scalar pairs, entropy first (then `num_tokens` in training), in this
#: order. Consumers: sync_metrics (schema, dpo), token_budget (metrics). Checked 1.12.0, 1.16.0.
DPO_TOKEN_METRICS = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")
#: The per-pair metrics: one `[B]` vector each, gathered last by `accelerator.gather`, in this order. Consumers:
#: sync_metrics, token_budget (metrics). Checked 1.12.0 (dpo_trainer.py:1662-1683), 1.16.0 (:1582-1601).
DPO_PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
#: Gathers per `_compute_loss` call without `aux_loss` and outside training (the sum of `DPO_METRIC_GATHERS` minus the
#: optional two). Consumer: sync_metrics (dpo). Checked 1.12.0, 1.16.0.
DPO_GATHERS_PER_CALL = 14
#: `DPOTrainer` attributes sync_metrics and token_budget read or update (set in `__init__`, so read directly): whether
#: the MoE aux loss is added, and the running count of training tokens behind `num_tokens`. Checked 1.12.0, 1.16.0
#: (dpo_trainer.py:905, :966 on 1.16.0).
DPO_AUX_LOSS_FLAG = "aux_loss_enabled"
DPO_TOTAL_TRAIN_TOKENS = "_total_train_tokens"

# -- sync_metrics: OnlineDPO -----------------------------------------------------------------------------------------

#: `OnlineDPOTrainer.stats` keys (its metric buffer), by what each averages over: per pair, and per completion (two
#: completions per prompt). The `objective/rlhf_reward`, `objective/scores*` keys exist only with reward functions.
#: Consumer: sync_metrics (dpo). online_dpo_trainer.py 1.16.0:352-368, 1.12.0:343-359.
ONLINE_DPO_STATS = "stats"
ONLINE_DPO_PAIR_METRICS = (
    "beta",
    "logps/chosen",
    "logps/rejected",
    "objective/scores_margin",
    "rewards/accuracies",
    "rewards/chosen",
    "rewards/margins",
    "rewards/rejected",
)
ONLINE_DPO_COMPLETION_METRICS = (
    "objective/entropy",
    "objective/kl",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "val/contain_eos_token",
)
#: The `OnlineDPOTrainer` methods sync_metrics wraps for one training step. Checked 1.12.0, 1.16.0.
ONLINE_DPO_STEP_METHODS = ("training_step", "_forward", "_generate", "_calculate_rewards_from_functions")
#: `OnlineDPOTrainer._generate(...)` returns `(prompt_ids, prompt_mask, completion_ids, completion_mask[,
#: vision_inputs])`: the positions of the completion ids and mask. Consumer: sync_metrics (dpo). Checked
#: 1.12.0, 1.16.0 (online_dpo_trainer.py:1056 on 1.16.0).
ONLINE_DPO_GENERATE_RETURN = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
ONLINE_DPO_COMPLETION_IDS, ONLINE_DPO_COMPLETION_MASK = 2, 3
#: EOS ids checked for `val/contain_eos_token`: `self.eos_token_ids` (a list) on 1.16.0 (online_dpo_trainer.py:406,
#: :1177); 1.12.0 has no such attribute and checks only `self._tokenizer.eos_token_id` (:1152). The consumer uses the
#: attribute when it exists. Consumer: sync_metrics (dpo).
ONLINE_DPO_EOS_IDS_ATTR = "eos_token_ids"
ONLINE_DPO_TOKENIZER_ATTR = "_tokenizer"
#: OnlineDPO rounds its logged training loss to this many decimals in its own `_maybe_log_save_evaluate`
#: (`round(tr_loss_scalar / steps, 4)`). Consumer: sync_metrics (hooks). 1.16.0:1332, 1.12.0:1333.
ONLINE_DPO_LOSS_DECIMALS = 4

# -- sync_metrics: transformers Trainer ------------------------------------------------------------------------------

#: Modules whose `nested_gather` gathers the training loss in `_maybe_log_save_evaluate`: transformers >= 5.2 and
#: OnlineDPO's own override (imported by name there). Consumer: sync_metrics (loss deferral). Checked transformers
#: 5.23.0 with trl 1.12.0 and 1.16.0.
LOSS_GATHER_MODULES = ("transformers.trainer", "trl.experimental.online_dpo.online_dpo_trainer")
#: `transformers.Trainer` members sync_metrics wraps or reads (the logging step, FLO bookkeeping, checkpointing, the
#: batch prefetch of a gradient-accumulation window, the last logged step and the running loss). Checked 5.23.0.
TRAINER_METHODS = ("_maybe_log_save_evaluate", "store_flos", "_save_checkpoint", "get_batch_samples")
TRAINER_LAST_LOGGED_ATTR = "_globalstep_last_logged"  # the global step of the last log (int)
TRAINER_TOTAL_LOSS_ATTR = "_total_loss_scalar"  # the running training loss, summed over logged steps (float)
TRAINER_FLOS_ATTR = "current_flos"  # the FLOs since the last `store_flos` (float)
TRAINER_STATE_ATTRS = (TRAINER_LAST_LOGGED_ATTR, TRAINER_TOTAL_LOSS_ATTR, TRAINER_FLOS_ATTR)

# -- transformers' attention registries -------------------------------------------------------------------------------

#: `AttentionInterface` and `AttentionMaskInterface` keep their process-wide registrations in the class attribute
#: `_global_mapping` (a dict): read to ask whether a name is registered, popped to unregister (there is no public
#: `unregister`). Consumer: `toolkit.packing.attention` (`register_attention`, `unregister_attention`,
#: `packed_or_base_attention`). Checked on transformers 5.24.0.
ATTENTION_REGISTRY_FIELD = "_global_mapping"


def attention_registry(interface: type) -> dict:
    """The process-wide `{name: function}` registry of a transformers attention interface class."""
    return getattr(interface, ATTENTION_REGISTRY_FIELD)


# -- TRL facts read by the packing plugins ----------------------------------------------------------------------------

#: DPOTrainer attributes, set in `__init__`, that say it runs a vision-language model or an image dataset. Consumer:
#: `toolkit.packing.glue.check_packable_trainer` (packing refuses both). Checked on 1.12.0 and 1.16.0.
TRL_VISION_ATTRS = ("_is_vlm", "_is_vision_dataset")
#: `OnlineDPOTrainer._forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None)`,
#: and the attribute that holds its `max_length`. Consumers: `toolkit.online_forward` (reproduces it and verifies
#: that against it), prompt_sharing and fused_logprobs. Checked on 1.10.0-1.16.0.
ONLINE_DPO_FORWARD_METHOD = "_forward"
ONLINE_DPO_MAX_LENGTH_ATTR = "max_length"
#: The methods in which each stock trainer runs its models and turns their logits into the completion tokens'
#: log-probs: what `verify` runs as stock (`TrainerContext.stock_methods`). Consumers: fused_logprobs (DPO's only
#: on TRL < 1.15) and prompt_sharing, through `trl_ext_call`. Checked on 1.10.0-1.16.0 (all exist on every supported
#: TRL); none for GRPO and RLOO (no plugin scores them).
TRAINER_SCORING_METHODS = {"DPOTrainer": DPO_SCORING_METHODS, "OnlineDPOTrainer": (ONLINE_DPO_FORWARD_METHOD,)}
#: Wrapped by `trl_ext.calls` before TRL's `__init__` (it runs DPO's precompute, which scores: `compute_ref_log_probs`)
INIT_CALLS = (DPO_PRECOMPUTE_METHOD, *DPO_SCORING_METHODS, ONLINE_DPO_FORWARD_METHOD)
#: transformers' `Trainer`: the attribute saying that `compute_loss` already scaled the loss for gradient accumulation
#: (`training_step` then does not divide it), and the method that fetches one optimizer step's batches. Consumer:
#: `plugins.token_budget` (`hooks` sets the attribute, `calls` re-cuts the fetched batches). Checked on transformers
#: 5.24.0.
TRAINER_LOSS_SCALED_ATTR = "loss_is_scaled_for_ga"
TRAINER_BATCH_SAMPLES_METHOD = "get_batch_samples"


# -- generation: DeepSpeed ZeRO-3 ------------------------------------------------------------------------------------

#: `PartitionedParameterCoordinator` keeps its limits in name-mangled attributes (deepspeed 0.19.8,
#: runtime/zero/partitioned_param_coordinator.py:116-122): the reuse distance (nothing reappearing within it is
#: released), the prefetch bucket and the live-parameter limit. Consumer: generation (deepspeed). Checked 0.19.8.
DS_COORDINATOR_LIMITS = (
    "_PartitionedParameterCoordinator__max_reuse_dist_in_numel",
    "_PartitionedParameterCoordinator__prefetch_bucket_sz",
    "_PartitionedParameterCoordinator__max_n_available_params",
)
#: `__params_to_release` is `functools.lru_cache`d (wrapped by `instrument_w_nvtx` without `functools.wraps`), so it
#: must be cleared around generation. Consumer: generation (deepspeed). 0.19.8 :633-634.
DS_RELEASE_CACHE = "_PartitionedParameterCoordinator__params_to_release"
#: Coordinator methods generation calls. Checked 0.19.8.
DS_COORDINATOR_METHODS = ("is_invalid_trace", "_invalidate_trace", "_clean_inflight_param_registry")
#: `DeepSpeedZeRoOffload` members: the coordinator, the module hooks, re-registration. Consumer: generation
#: (deepspeed), like TRL's own `remove_hooks`/`add_hooks` (trl/models/utils.py). Checked 0.19.8.
DS_OFFLOAD_ATTRS = ("param_coordinator", "forward_hooks", "backward_hooks", "module")
DS_OFFLOAD_METHODS = ("_register_deepspeed_module",)
#: The ZeRO-3 optimizer holds the `DeepSpeedZeRoOffload` as this attribute. Consumer: generation. Checked 0.19.8.
DS_OPTIMIZER_OFFLOAD_ATTR = "parameter_offload"
#: DeepSpeed's global stack of modules inside a forward (`runtime/zero/parameter_offload.py:20`), pushed/popped by
#: its hooks; and the per-module dict of "external" parameters it keeps gathered for the module's forward (:380-398).
#: Consumer: generation (deepspeed, budget). Checked 0.19.8.
DS_FWD_MODULE_STACK = ("deepspeed.runtime.zero.parameter_offload", "FWD_MODULE_STACK")
DS_EXTERNAL_PARAMS_ATTR = "_external_params"
#: Per-parameter ZeRO-3 attributes read by generation: full size, status, active modules, persistence. 0.19.8.
DS_PARAM_ATTRS = ("ds_numel", "ds_status", "ds_active_sub_modules", "ds_persist")

# -- generation: what TRL's generation context does besides gathering ------------------------------------------------

#: The arguments of TRL's `unwrap_model_for_generation` that generation reads from the patched call (its
#: `call_kwargs`): the accelerator and TRL's own gather flag; and `generation_kwargs`, which comes with TRL's
#: generation-config override below. Consumer: generation (the hook). Checked 1.12.0, 1.16.0 (trl/models/utils.py).
GENERATION_HELPER_PARAMS = ("accelerator", "gather_deepspeed3_params")
GENERATION_HELPER_KWARGS_PARAM = "generation_kwargs"
#: TRL gives generation a private copy of `generation_config` with the trainer's `generation_kwargs` applied only on
#: transformers below this version (`_override_model_generation_config`: on 5.x it yields the model unchanged).
#: Consumer: generation (context), which keeps a private copy on every version and applies the kwargs where TRL does.
#: Checked 1.12.0 and 1.16.0 with transformers 5.24.0.
TRL_GENERATION_CONFIG_OVERRIDE = ("trl.models.utils", "_override_model_generation_config")
TRL_GENERATION_KWARGS_BELOW_TRANSFORMERS = (5, 0)


def trl_applies_generation_kwargs(transformers_version: str | None = None) -> bool:
    """Whether TRL applies `generation_kwargs` to generation's config copy with this transformers (default: the
    installed one); see `TRL_GENERATION_KWARGS_BELOW_TRANSFORMERS`."""
    version = transformers_version or installed_version("transformers") or "0"
    return parse_version(version)[:2] < TRL_GENERATION_KWARGS_BELOW_TRANSFORMERS


#: The per-module entries `PreTrainedModel.gradient_checkpointing_enable` sets on each module that supports
#: checkpointing: the flag and the checkpoint function (transformers 5.24.0 modeling_utils.py, `GradientCheckpointing
#: Layer`). Consumer: generation (context), which switches checkpointing off for generation and restores both exactly.
GRADIENT_CHECKPOINTING_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")

# -- precompute_ref_batch_size: what determines the reference log-probs -----------------------------------------------

#: The truncation settings of DPO: fields of `DPOConfig` and of `DataCollatorForPreference` (the collator's win when it
#: has them). Consumer: precompute_ref_batch_size (batch plan, cache key). Checked 1.12.0, 1.16.0.
DPO_TRUNCATION_FIELDS = ("max_length", "truncation_mode")
#: `DPOTrainer` copies `args.ld_alpha` (LD-DPO's weight of the tokens past the shorter completion, which changes the
#: reference log-probs) to this attribute in `__init__`. Consumer: precompute_ref_batch_size (cache key). Checked
#: 1.12.0 (dpo_trainer.py:775), 1.16.0 (:805).
DPO_LD_ALPHA_ATTR = "ld_alpha"
#: The config attribute that names the attention implementation in use (`PreTrainedConfig._attn_implementation`, from
#: `attn_implementation=` or the model's choice). Consumers: precompute_ref_batch_size (cache key), the packing
#: inspection (`toolkit/architecture.py`). Checked 5.24.0.
ATTN_IMPLEMENTATION_ATTR = "_attn_implementation"
#: `Trainer` flags set in `create_accelerator_and_postprocess` from the accelerator's plugins. Consumer:
#: precompute_ref_batch_size (the DeepSpeed precompute engine, sharded-model sizing). Checked transformers 5.24.0.
TRAINER_SHARDING_FLAGS = ("is_deepspeed_enabled", "is_fsdp_enabled")
#: `datasets.Dataset` keeps its content hash in this private attribute. Consumer: precompute_ref_batch_size (the
#: fingerprint of the dataset with the precomputed columns). Checked datasets 5.2.0.
DATASET_FINGERPRINT_ATTR = "_fingerprint"

# -- prompt_sharing: the MoE router auxiliary loss ---------------------------------------------------------------

#: transformers' load-balancing loss, `load_balancing_loss_func(gate_logits: tuple[[tokens, experts], ...],
#: num_experts, top_k, attention_mask)`, a mask-weighted mean over `[batch * length]` token rows. Each MoE modeling
#: module carries its own copy (the model's forward calls it as `(outputs.router_logits, self.num_experts,
#: self.num_experts_per_tok, attention_mask)`), and TRL >= 1.15's fused LM head calls Mixtral's on the backbone's
#: router logits (trl/trainer/utils.py `add_fused_lm_head`). Consumer: prompt_sharing (moe), which recomputes it in the
#: padded layout after a shared forward with the model module's copy, Mixtral's when the module has none. Checked on
#: transformers 5.24.0 (mixtral, qwen3_moe, olmoe, gpt_oss, granitemoe, jetmoe, ernie4_5_moe).
MOE_AUX_LOSS = ("transformers.models.mixtral.modeling_mixtral", "load_balancing_loss_func")

# -- padding_free: attention that bypasses transformers' attention interface -----------------------------------------

#: `model_type`s whose attention modules compute attention themselves (no `ALL_ATTENTION_FUNCTIONS`) from the 4D mask
#: that `masking_utils.create_causal_mask` returns, adding it as a float bias (MPT: `.to(torch.bool)` of it, True =
#: masked); Falcon takes its SDPA branch only for an implementation named exactly "sdpa". Their ALiBi biases (Bloom,
#: MPT, Falcon with `alibi=True`) grow linearly with the key's index in the row, so within one sequence they differ
#: from the padded biases by a per-query constant, which softmax ignores. Consumer: padding_free (a packed call gives
#: them the block-diagonal float mask of the packed sequences). Checked 5.24.0 (modeling_bloom/falcon/mpt/
#: gpt_neox_japanese).
OWN_ATTENTION_MODEL_TYPES = ("bloom", "falcon", "gpt_neox_japanese", "mpt")
#: MPT's ALiBi bias table covers `config.max_seq_len` keys (`MptModel.forward` builds it before the mask; a longer row
#: fails to broadcast in `MptAttention`). Consumer: padding_free (splits a packed batch into packed rows of at most
#: that many tokens, `hooks.row_limit`; the packed mask refuses a longer row).
#: Checked 5.24.0.
MPT_ALIBI_TABLE_ATTR = "max_seq_len"
#: Model types whose mask creation receives the packed `position_ids` (so transformers remaps chunk boundaries to each
#: sequence's own positions) and whose chunked attention lives only in the mask (`attention_chunk_size`). Consumer:
#: padding_free inspection. Checked 5.24.0 (modeling_llama4 `create_chunked_causal_mask(..., position_ids=...)`).
CHUNKED_MASK_MODEL_TYPES = ("llama4", "llama4_text")
