"""Self-check on first use: the shared forward equals the unshared packed forward on the first batch of each model.

Run once per model role (`policy`, `ref`; under PEFT the adapter-disabled reference runs through the policy model and
is checked with it), on the first call whose layout shares at least one prompt: the same call is run again, without
gradients, on the unshared packed layout (every row its own causal segment, as padding_free packs it), and the
per-token outputs TRL reads are compared. A difference beyond the dtype's round-off raises `UsageError` naming the
model, the output, the row and the column; nothing is silently turned off. Costs one extra no-grad forward per role.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._logging import get_logger
from ...errors import UsageError
from .dropout import forward_is_random
from .forward import FUSED_FIELDS
from .layout import SharedLayout, build_layout

logger = get_logger(__name__)

__all__ = ["TOLERANCES", "self_check"]

#: Per-token tolerance, relative to max(1, |value|), by the dtype of the compared output. Two packings of the same
#: tokens differ only by the order of floating-point sums; a token attending to the wrong keys, or at the wrong
#: position, moves its log-prob by far more than these.
TOLERANCES = {torch.float64: 1e-8, torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}


def _fields(outputs: Any, fused: bool, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    if fused:
        return {name: getattr(outputs, name) for name in FUSED_FIELDS if getattr(outputs, name, None) is not None}
    logits = outputs.logits
    real = kwargs["attention_mask"].bool()
    return {"logits": torch.where(real[..., None], logits, torch.zeros((), dtype=logits.dtype))}


def _random_forward(
    run: Callable[[dict[str, Any], SharedLayout], Any],
    kwargs: dict[str, Any],
    layout: SharedLayout,
    fused: bool,
    name: str,
    tolerance: float,
) -> float | None:
    """How much two runs of the same forward differ (None: not beyond `tolerance`)."""

    def once() -> torch.Tensor:
        with torch.no_grad():
            return _fields(run(kwargs, layout), fused, kwargs)[name].detach()

    return forward_is_random(once, tolerance, kwargs["input_ids"].device)


def self_check(
    run: Callable[[dict[str, Any], SharedLayout], Any],
    kwargs: dict[str, Any],
    layout: SharedLayout,
    outputs: Any,
    role: str,
    model_name: str,
) -> bool:
    """Compare `outputs` (the shared forward of `kwargs`) with the unshared packed forward. Returns False (nothing
    checked) when the layout shares no prompt; raises `UsageError` on a mismatch."""
    if layout.shared_rows == 0:
        return False
    fused = bool(kwargs.get("fused_lm_head"))
    unshared = build_layout(kwargs["input_ids"], kwargs["attention_mask"], None)
    with torch.no_grad():
        expected = _fields(run(kwargs, unshared), fused, kwargs)
    got = _fields(outputs, fused, kwargs)
    for name, want in expected.items():
        have = got[name].detach()
        if have.dtype == torch.bool:
            diff = (have != want).to(torch.float32)
            tol = 0.0
        else:
            tol = TOLERANCES.get(want.dtype, 1e-3)
            diff = (have.double() - want.double()).abs() / want.double().abs().clamp(min=1.0)
        worst = diff.max().item() if diff.numel() else 0.0
        if worst > tol or diff.isnan().any():
            flat = int(diff.nan_to_num(float("inf")).argmax())
            row, col = divmod(flat // (diff[0, 0].numel() if diff.dim() > 2 else 1), diff.shape[1])
            random = _random_forward(run, kwargs, unshared, fused, name, tol)
            if random is not None:
                raise UsageError(
                    f"prompt_sharing self-check on the {role} model ({model_name}): two unshared forwards of the same "
                    f"batch differ by {random:.3g} (relative), so the shared forward cannot be compared: the model "
                    "draws random numbers in training mode, i.e. dropout that neither TRL's `disable_dropout` nor "
                    "prompt_sharing could turn off (read from the config inside `forward`). Load the model with its "
                    "dropout set to 0 (e.g. `from_pretrained(..., dropout=0.0, attention_dropout=0.0)`), or disable "
                    "prompt_sharing for it."
                )
            raise UsageError(
                f"prompt_sharing self-check failed on the {role} model ({model_name}): the shared forward's `{name}` "
                f"differs from the unshared packed forward by {worst:.3g} (relative; tolerance {tol:g}) at row {row}, "
                f"column {col} of the padded batch. This model does not compute a shared prompt correctly; disable "
                "prompt_sharing for it (padding_free alone packs without sharing)."
            )
    logger.info("prompt_sharing: self-check passed on the %s model (%s)", role, ", ".join(expected))
    return True
