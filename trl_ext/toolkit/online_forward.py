"""Online DPO's scoring forward, written once, for the plugins that score it another way (prompt_sharing from its
packed logits, fused_logprobs inside the output head).

TRL's `_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None)` (trl 1.10-1.16)
1. cuts the prompt on the left so that prompt + completion <= `trainer.max_length` (text only);
2. concatenates prompt and completion (ids and mask) and calls `model(ids, attention_mask=mask)`;
3. returns the `log_softmax` of the logit columns `[P - 1, P + C - 1)` (`[0, C)` without a prompt) gathered at the
   completion tokens, `[rows, C]`.

`ScoringCall.build` does 1 and the inputs of 2, `ScoringCall.log_probs` does 3. `verify_against_trl` runs TRL's own
`_forward` and these steps with a stand-in model whose logits are a fixed function of the tokens and columns it sees,
with and without the left cut and without a prompt (microseconds), and refuses a TRL whose `_forward` differs.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from ..errors import UsageError

__all__ = ["ScoringCall", "verify_against_trl"]


@dataclasses.dataclass(frozen=True)
class ScoringCall:
    """One Online DPO scoring call of a text batch, after TRL's left cut: the model's input `ids` (`[rows, P + C]`,
    prompt cut on the left then completion) and `mask`, the `completion_ids` scored (`[rows, C]`), the `prompt_columns`
    kept (`P`), and the logit columns `[start, end)` that score the completion."""

    ids: torch.Tensor
    mask: torch.Tensor
    completion_ids: torch.Tensor
    prompt_columns: int
    start: int
    end: int | None

    @classmethod
    def build(
        cls,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        max_length: int | None,
    ) -> ScoringCall:
        """TRL's steps 1 and 2 (the left cut to `max_length`, the concatenation)."""
        cut = prompt_ids.size(1) - prompt_columns(prompt_ids.size(1), completion_ids.size(1), max_length)
        prompt_ids, prompt_mask = prompt_ids[:, cut:], prompt_mask[:, cut:]
        columns = prompt_ids.size(1)
        start, end = (columns - 1, -1) if columns > 0 else (0, None)
        ids, mask = torch.cat((prompt_ids, completion_ids), dim=1), torch.cat((prompt_mask, completion_mask), dim=1)
        return cls(ids, mask, completion_ids, columns, start, end)

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """TRL's step 3 on the model's `[rows, P + C, vocab]` logits: the completion tokens' log-probs `[rows, C]`."""
        scored = logits[:, self.start : self.end]
        return torch.take_along_dim(scored.log_softmax(dim=-1), self.completion_ids.unsqueeze(-1), dim=2).squeeze(-1)


def prompt_columns(prompt: int, completion: int, max_length: int | None) -> int:
    """How many of `prompt` columns TRL's `_forward` keeps before `completion` columns: it cuts on the left so that
    prompt + completion <= `max_length` (`num_tokens_to_truncate`)."""
    if max_length is None:
        return prompt
    return prompt - max(prompt + completion - max_length, 0)


class _StandInModel:
    """Logits that are a fixed function of each token, its column and its row's mask: any change in which columns
    reach the model, in what order, or which logits are read, changes the result."""

    vocab = 7

    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if kwargs or attention_mask is None:
            raise TypeError(f"model called with {sorted(kwargs)} and attention_mask={attention_mask is not None}")
        columns = torch.arange(ids.size(1), dtype=torch.float64)
        base = (ids.double() * 0.37 + columns * 0.11 + attention_mask.double() * 0.53).unsqueeze(-1)
        logits = torch.sin(base * torch.arange(1, self.vocab + 1, dtype=torch.float64))
        return types.SimpleNamespace(logits=logits)


def _probe(prompt: int, completion: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = 3
    prompt_ids = torch.randint(1, _StandInModel.vocab, (rows, prompt), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    if prompt > 1:
        prompt_mask[0, :1] = 0  # left padding
    completion_ids = torch.randint(1, _StandInModel.vocab, (rows, completion), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, completion - 1 :] = 0  # padding after an end
    return prompt_ids, prompt_mask, completion_ids, completion_mask


class _TrainerView:
    """The trainer as TRL's `_forward` sees it in the probe: `max_length` set by the probe, every other attribute the
    trainer's own (a TRL whose `_forward` reads more settings reads the trainer's)."""

    def __init__(self, trainer: Any, max_length: int) -> None:
        self._trainer = trainer
        setattr(self, _compat.ONLINE_DPO_MAX_LENGTH_ATTR, max_length)

    def __getattr__(self, name: str) -> Any:
        if self._trainer is None:
            raise AttributeError(name)
        return getattr(self._trainer, name)


def verify_against_trl(forward: Callable, plugin: str, trainer: Any = None) -> None:
    """Raise `UsageError` unless `ScoringCall` reproduces `forward` (TRL's own `OnlineDPOTrainer._forward` function,
    as installed) exactly, on probes with the left cut, without it, and without a prompt. `trainer`: the trainer
    whose settings `forward` may read besides `max_length`."""
    model = _StandInModel()
    cases = ((5, 4, None), (5, 4, 6), (5, 4, 4), (0, 4, None))  # (prompt, completion, max_length)
    for seed, (prompt, completion, max_length) in enumerate(cases):
        batch = _probe(prompt, completion, seed)
        stand_in_trainer = _TrainerView(trainer, max_length or 10**6)
        try:
            expected = forward(stand_in_trainer, model, *batch)
        except Exception as exc:  # noqa: BLE001 - any failure means this TRL's _forward is not the one we reproduce
            detail = f"it raised {type(exc).__name__}: {exc}"
        else:
            call = ScoringCall.build(*batch, max_length or 10**6)
            got = call.log_probs(model(call.ids, attention_mask=call.mask).logits)
            if got.shape == expected.shape and torch.equal(got, expected):
                continue
            detail = f"its result differs from trl-ext's steps (shapes {tuple(expected.shape)} / {tuple(got.shape)})"
        raise UsageError(
            f"{plugin}: this TRL's `{getattr(forward, '__qualname__', forward)}` is not the scoring "
            f"forward {plugin} reproduces (prompt {prompt}, completion {completion}, max_length {max_length}: "
            f"{detail}). Train without {plugin} on this TRL version, and report it."
        )
