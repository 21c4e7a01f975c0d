"""Dropout under prompt sharing: every dropout a model applies is found, and turned off or refused (a shared prompt
would see one dropout mask where the padded forward draws two).

A site is an `nn.Dropout*` module with `p > 0`, or a positive float attribute of a module whose name says dropout or
layer drop (`toolkit.randomness.dropout_attribute`): TRL's `disable_dropout` zeroes `nn.Dropout` modules only, OPT
for one applies `nn.functional.dropout` with float attributes taken from `config.dropout`. Dropout read from the
config inside `forward` has no attribute to set: `setup.refuse_random_draws` finds it by the random numbers drawn.
"""

from __future__ import annotations

from typing import Any

import torch

from trl_ext.toolkit.randomness import dropout_attribute

__all__ = ["describe", "disable_dropout", "dropout_sites"]


def dropout_sites(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str]]:
    """Every active dropout site of `model`: `(module, attribute, label)`, the label naming the module class and the
    attribute (`"OPTDecoderLayer.dropout"`)."""
    sites = []
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) or (
            "dropout" in type(module).__name__.lower() and isinstance(getattr(module, "p", None), float)
        ):
            if float(getattr(module, "p", 0.0)) > 0:
                sites.append((module, "p", f"{type(module).__name__}.p"))
            continue
        for name, value in vars(module).items():
            if dropout_attribute(name, value):
                sites.append((module, name, f"{type(module).__name__}.{name}"))
    return sites


def describe(sites: list[tuple[torch.nn.Module, str, str]]) -> str:
    """`"OPTDecoderLayer.dropout (x2), OPTAttention.dropout (x2)"`: the sites by label, in model order."""
    counts: dict[str, int] = {}
    for _, _, label in sites:
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{label} (x{n})" if n > 1 else label for label, n in counts.items())


def disable_dropout(patcher: Any, model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str]]:
    """Set every dropout site of `model` to 0 through `patcher` (undone when the trainer is detached); the sites."""
    sites = dropout_sites(model)
    for module, name, _ in sites:
        value = getattr(module, name)
        patcher.setattr(module, name, 0 if isinstance(value, int) else 0.0)
    return sites
