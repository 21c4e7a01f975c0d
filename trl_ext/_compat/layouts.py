"""TRL code layouts that trl-ext finds by probing the installed TRL, not by its version number: which names a trainer
module imports, which of its helpers are importable. A new release's layout is then recognised by a probe, or refused
by name before the first step, never met as a crash. Part of `_compat` (re-exported there); each fact says its
consumer and the releases it was checked on; docs/versions.md tables `DPOTrainer`'s layouts per TRL minor (1.10-1.13:
logits read through `selective_log_softmax` and `entropy_from_logits`; 1.14: `row_mask=` and
`selective_log_softmax_and_entropy`; 1.15-1.16: TRL's fused LM head).
"""

from __future__ import annotations

import dataclasses
import importlib

__all__ = [
    "DPO_ENTROPY_HELPERS",
    "DPO_FUSED_HEAD_WITHOUT_KERNEL",
    "DPO_LOGITS_HELPERS",
    "DPO_LOGITS_MODULE",
    "DPO_LOGPROBS_HELPER",
    "DPO_SCORING_METHODS",
    "DPO_UNKNOWN_LOGITS_HELPERS",
    "DPO_USE_WEIGHTING_ATTR",
    "FUSED_LM_HEAD_FIELDS",
    "FUSED_LM_HEAD_KWARG",
    "FUSED_LM_HEAD_OUTPUT",
    "TRL_FACTS",
    "TrlFact",
    "VERIFIED_SCORING_METHODS",
    "VERIFY_LOCAL_GATHERS",
    "dpo_has_fused_head",
    "dpo_logits_helpers",
    "dpo_training_refusal",
]

#: The DPO trainer module (which imports its helpers by name) and TRL's trainer utilities.
DPO_MODULE = "trl.trainer.dpo_trainer"
TRL_UTILS_MODULE = "trl.trainer.utils"

#: TRL < 1.15: the module whose imported helpers DPOTrainer applies to the logits, those helpers (token log-probs,
#: entropy; 1.14 reads the entropy otherwise, `DPO_ENTROPY_HELPERS`), and the DPOTrainer methods whose model calls
#: produce the logits they read (on every release). Consumers: `plugins.fused_logprobs.dpo` (replaces the helpers
#: there, held while a trainer needs them) and `plugins.token_budget.metrics`. Checked on 1.10.0-1.13.0.
DPO_LOGITS_MODULE = DPO_MODULE
DPO_LOGITS_HELPERS = ("selective_log_softmax", "entropy_from_logits")
DPO_SCORING_METHODS = ("_compute_loss", "compute_ref_log_probs")
#: `DPOTrainer.use_weighting`, set in `__init__` from `DPOConfig.use_weighting` (WPO's per-pair weights, read by
#: `_compute_loss`). Consumer: `plugins.fused_logprobs.dpo` (the statistics the head computes). Checked 1.16.0.
DPO_USE_WEIGHTING_ATTR = "use_weighting"

#: Per-token outputs of TRL's fused LM head (`trl.trainer.utils.FusedCausalLMOutput`), `[B, L - 1]` each; the
#: padding_free and prompt_sharing plugins re-pad them (`toolkit.packing.glue.repad_outputs`). Checked 1.15.0, 1.16.0;
#: absent on 1.10.0-1.14.2.
FUSED_LM_HEAD_OUTPUT = ("trl.trainer.utils", "FusedCausalLMOutput")
FUSED_LM_HEAD_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
#: The keyword DPO passes to the model forward to get the fused output. Consumer: padding_free. Checked 1.15.0, 1.16.0.
FUSED_LM_HEAD_KWARG = "fused_lm_head"

#: `add_fused_lm_head`, imported by name into the DPO module when `DPOTrainer` scores with TRL's fused LM head (then
#: `model(..., fused_lm_head=True)` returns `log_probs`, no logits). Present 1.15.0, 1.16.0; absent 1.10.0-1.14.2.
#: Consumers: fused_logprobs (leaves DPO to it), padding_free / prompt_sharing (re-pad its outputs), sync_metrics.
DPO_FUSED_HEAD_HELPER = "add_fused_lm_head"
#: The chunked log-prob autograd function the fused head applies (`trl.trainer.utils._ChunkedLogProbFunction`). 1.15.0
#: imports it from `trl.kernels` inside `try/except ImportError` (Triton ships with CUDA builds of torch on Linux
#: only) and sets it to None otherwise; 1.16.0 imports it unconditionally. Consumer: `dpo_training_refusal`.
DPO_FUSED_HEAD_FUNCTION = "_ChunkedLogProbFunction"

#: Without the fused head, the helper through which `_compute_loss` and `compute_ref_log_probs` read the per-token
#: log-probs from the logits: `selective_log_softmax(logits, index[, temperature][, row_mask])` (1.10.0-1.14.2;
#: `row_mask=`, which zeroes the positions it masks, from 1.14.0).
DPO_LOGPROBS_HELPER = "selective_log_softmax"
#: ... and those through which `_compute_loss` reads the per-token entropy: `entropy_from_logits(logits)` (1.10.0-
#: 1.13.0) or `selective_log_softmax_and_entropy(logits, index, entropy_requires_grad, temperature, row_mask)`
#: returning `(log-probs, entropy)` (1.14.0-1.14.2, where the DPO module no longer imports `entropy_from_logits`).
DPO_ENTROPY_HELPERS = ("entropy_from_logits", "selective_log_softmax_and_entropy")


#: The scoring method `trl_ext.verify` checks in each trainer's training steps: DPO's `_compute_loss(model, inputs,
#: return_outputs)` (its model calls give the per-token log-probs: the fused head's `log_probs` on 1.15-1.16, the
#: `DPO_LOGPROBS_HELPER` / `selective_log_softmax_and_entropy` results on 1.10-1.14, masked by
#: `inputs["completion_mask"][:, 1:]`), and Online DPO's `_forward(model, prompt_ids, prompt_mask, completion_ids,
#: completion_mask, ...)`, which returns the completion tokens' log-probs `[rows, C]`. Checked on 1.10.0-1.16.0.
VERIFIED_SCORING_METHODS = {"DPOTrainer": "_compute_loss", "OnlineDPOTrainer": "_forward"}
#: The accelerator methods through which those methods gather their metrics over the ranks (DPO `_compute_loss`,
#: Online DPO none): answered by the rank itself in verify's stock call, whose metrics are discarded, so that it
#: makes no collective of its own (and none that a plugin recording TRL's gathers would see). Checked 1.10.0-1.16.0.
VERIFY_LOCAL_GATHERS = ("gather", "gather_for_metrics")


def dpo_has_fused_head() -> bool:
    """Whether the installed `DPOTrainer` scores with TRL's own fused LM head (probe: `DPO_FUSED_HEAD_HELPER`)."""
    return hasattr(importlib.import_module(DPO_MODULE), DPO_FUSED_HEAD_HELPER)


def dpo_logits_helpers() -> tuple[str, ...]:
    """The helpers the installed `DPOTrainer` reads its logits through (log-probs first), found in its module; `()`
    when it scores with the fused head or reads them through helpers trl-ext does not know."""
    module = importlib.import_module(DPO_MODULE)
    if dpo_has_fused_head() or not hasattr(module, DPO_LOGPROBS_HELPER):
        return ()
    entropy = tuple(name for name in DPO_ENTROPY_HELPERS if hasattr(module, name))
    return (DPO_LOGPROBS_HELPER, *entropy) if entropy else ()


@dataclasses.dataclass(frozen=True)
class TrlFact:
    """A fact about some TRL releases that makes trl-ext refuse something; its `name` is in every refusal it causes
    (and in docs/versions.md), so the user can look it up."""

    name: str
    releases: str
    text: str

    def refusal(self, what: str) -> str:
        return f"{what}: {self.text} (TRL fact {self.name}: {self.releases}; see docs/versions.md)"


#: 1.15.0 without Triton (any CPU-only torch, macOS): stock `DPOTrainer` fails at its first step.
DPO_FUSED_HEAD_WITHOUT_KERNEL = TrlFact(
    "DPO_FUSED_HEAD_WITHOUT_KERNEL",
    "trl 1.15.0 where Triton does not import",
    "this TRL's DPOTrainer scores with its fused LM head through `trl.trainer.utils._ChunkedLogProbFunction`, which "
    "it imports from `trl.kernels` only where Triton imports; here it is None, so stock DPOTrainer itself fails at "
    "its first training step (`'NoneType' object has no attribute 'apply'`). Install trl 1.16 (`pip install "
    "'trl>=1.16,<1.17'`), trl 1.14, or a CUDA build of torch with Triton",
)
#: No fused head, and not the logits helpers of 1.10-1.14: fused_logprobs cannot tell how DPO reads its logits.
DPO_UNKNOWN_LOGITS_HELPERS = TrlFact(
    "DPO_UNKNOWN_LOGITS_HELPERS",
    "a DPO layout outside those of trl 1.10-1.16",
    f"this TRL's DPOTrainer neither scores with the fused LM head (`{DPO_FUSED_HEAD_HELPER}`) nor reads its logits "
    f"through `{DPO_LOGPROBS_HELPER}` and one of {list(DPO_ENTROPY_HELPERS)} (the layouts of TRL 1.10-1.14); train "
    "without the plugin named above, or use a TRL in trl-ext's range",
)
#: Every fact above, by name (the version matrix checks that each refusal names one of these).
TRL_FACTS = {fact.name: fact for fact in (DPO_FUSED_HEAD_WITHOUT_KERNEL, DPO_UNKNOWN_LOGITS_HELPERS)}


def dpo_training_refusal() -> TrlFact | None:
    """The fact that keeps stock `DPOTrainer` from training with the installed TRL here, or None."""
    if not dpo_has_fused_head():
        return None
    utils = importlib.import_module(TRL_UTILS_MODULE)
    if getattr(utils, DPO_FUSED_HEAD_FUNCTION, object()) is None:
        return DPO_FUSED_HEAD_WITHOUT_KERNEL
    return None
