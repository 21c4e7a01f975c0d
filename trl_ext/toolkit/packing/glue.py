"""What every packing plugin needs around the model: the trainer refusals, the collator base that annotates batches,
the predicate of a scoring call, and re-padding of a packed causal-LM output (torch only: no TRL or transformers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import _compat
from ...call_context import current_call
from ...errors import UsageError

__all__ = [
    "VISION_KEYS",
    "AnnotatingCollator",
    "check_packable_trainer",
    "positional_input_ids",
    "refuse_liger",
    "repad_outputs",
    "scoring_call",
]

#: Batch keys of vision-language collators (DataCollatorForVisionPreference, VLM processors): image features are
#: matched to placeholder tokens per row, which neither packing nor sharing keeps.
VISION_KEYS = (
    "pixel_values",
    "pixel_attention_mask",
    "image_grid_thw",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
)


def check_packable_trainer(trainer: Any, plugin: str) -> None:
    """Refuse, with a `UsageError` naming `plugin`, the trainers whose rows cannot be packed: vision-language models
    or datasets, and prompt-learning PEFT (virtual tokens prepended to every row)."""
    if any(getattr(trainer, attr, False) for attr in _compat.TRL_VISION_ATTRS):
        raise UsageError(
            f"{plugin} does not support vision-language models or image datasets: image features are matched to "
            f"placeholder tokens per row. Disable {plugin} for this trainer."
        )
    peft_config = getattr(getattr(trainer, "model", None), "peft_config", None)
    if isinstance(peft_config, dict):
        from peft import PromptLearningConfig

        if any(isinstance(cfg, PromptLearningConfig) for cfg in peft_config.values()):
            raise UsageError(
                f"{plugin} does not support prompt-learning PEFT methods (prompt tuning, prefix tuning, P-tuning): "
                f"they prepend virtual tokens to every row. Use a weight adapter such as LoRA, or disable {plugin}."
            )


def refuse_liger(init_kwargs: dict[str, Any], plugin: str, why: str) -> None:
    """Refuse a trainer built with `use_liger_kernel=True` (TRL's Liger DPO loss bypasses the packed model forward)."""
    args = init_kwargs.get("args")
    if args is not None and getattr(args, "use_liger_kernel", False):
        raise UsageError(
            f"{plugin} does not support `use_liger_kernel=True` ({why}). Set `use_liger_kernel=False` or disable "
            f"{plugin}."
        )


class AnnotatingCollator:
    """Wraps a preference collator (TRL's `DataCollatorForPreference` or a user's) and adds a plugin's metadata to each
    batch, computed in the data-loader process; the padded batch is kept as it is, and the model wrappers pop the
    metadata before the model sees its kwargs. Attributes of the wrapped collator (`max_length`, `truncation_mode`,
    `pad_token_id`, read by other plugins) are read through. Subclasses set `plugin` and implement `annotate(batch)`.
    """

    plugin = "trl-ext"
    #: How a pair's tokens sit in the packed rows, for plugins that size batches by tokens: `"packed"` (both
    #: sequences, the prompt in each) or `"prompt-shared"` (the prompt once, then each completion).
    token_layout = "packed"

    def __init__(self, collator: Callable) -> None:
        self.collator = collator

    def annotate(self, batch: dict[str, Any]) -> None:
        raise NotImplementedError

    def __call__(self, examples: list[dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
        batch = self.collator(examples, *args, **kwargs)
        vision = [k for k in VISION_KEYS if k in batch]
        if vision:
            raise UsageError(f"{self.plugin} cannot pack vision-language batches (keys {vision}); disable it.")
        self.annotate(batch)
        return batch

    def __getattr__(self, name: str) -> Any:
        if name == "collator":  # not set yet (unpickling in a data-loader worker)
            raise AttributeError(name)
        return getattr(self.collator, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.collator!r})"


def positional_input_ids(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """Move a positional `input_ids` (`model(ids, ...)`) into `kwargs`; returns the positional arguments left."""
    if args and isinstance(args[0], torch.Tensor) and "input_ids" not in kwargs:
        kwargs["input_ids"] = args[0]
        return args[1:]
    return args


def scoring_call(kwargs: dict[str, Any], cache_unset_ok: bool = False) -> bool:
    """Whether a model call is a scoring forward on a padded batch that a packed layout reproduces exactly.

    TRL's DPO passes `use_cache=False`; generation and plain calls use a cache. With `cache_unset_ok` a call that
    leaves `use_cache` to the config also qualifies (Online DPO's scoring call: the cache it would build is never
    read).
    """
    if current_call().stock:  # a self-check's stock reference: every call runs as stock transformers runs it
        return False
    input_ids, attention_mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    use_cache = kwargs.get("use_cache")
    return (
        isinstance(input_ids, torch.Tensor)
        and input_ids.dim() == 2
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.shape == input_ids.shape
        and kwargs.get("inputs_embeds") is None
        and kwargs.get("past_key_values") is None
        and (use_cache is False or (cache_unset_ok and not use_cache))
        and not kwargs.get("output_hidden_states")
        and not kwargs.get("output_attentions")
        and kwargs.get("shift_labels") is None
        and not kwargs.get("logits_to_keep")
        and not any(k in kwargs for k in VISION_KEYS)
    )


def repad_outputs(
    outputs: Any,
    fused: bool,
    unpack: Callable[[torch.Tensor], torch.Tensor],
    unpack_shifted: Callable[[torch.Tensor], torch.Tensor | None],
) -> Any:
    """Put a packed causal-LM output back into the padded layout, in place: the fused LM head's per-token fields
    (`fused`, shifted `[1, N - 1]` -> `[R, L - 1]`) or the logits (`[1, N, V]` -> `[R, L, V]`)."""
    if fused:
        for name in _compat.FUSED_LM_HEAD_FIELDS:
            value = getattr(outputs, name, None)
            if value is not None:
                setattr(outputs, name, unpack_shifted(value))
    elif getattr(outputs, "logits", None) is not None:
        outputs.logits = unpack(outputs.logits)
    return outputs
