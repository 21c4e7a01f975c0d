"""Micro-batches cut by tokens instead of pairs, with the same gradients and metrics as stock TRL
(`token_budget=<tokens>` or `"auto"`).

Each optimizer step consumes the pairs stock TRL gives it, run in micro-batches of at most `token_budget` tokens,
taking part in the trainer's loaders and steps through `trl_ext_call`.

See docs/plugins/token_budget.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_ext.api import Flag, PluginSpec, Size, either, lazy_getattr, one_of, optional, positive_int, size

NAME = "token_budget"


class _NoValue(str):
    """What a bare `--trl-ext-token-budget` (no value) gives the flag's parser, which refuses it: the flag takes a
    number of tokens or "auto", never a silent default."""

    def __repr__(self) -> str:
        return 'no value (a bare `--trl-ext-token-budget`: give a number of tokens or "auto")'


NO_VALUE = _NoValue("")


@dataclass(frozen=True)
class TokenBudgetOptions:
    """Options of the `token_budget` plugin (`plugins: {token_budget: {...}}`).

    Args:
        ram_budget (`str`, `int` or `float`, *optional*, defaults to `0.25`):
            Memory a training micro-batch may add on CPU when `token_budget="auto"` measures the budget: bytes
            (`"4GB"`, `"512MiB"`, an int), or a fraction of the memory available when the trainer is built (`0.25`,
            `"25%"`), shared among the node's processes. On GPU the budget is 90% of the free device memory.
    """

    ram_budget: Size = field(default=Size("fraction", 0.25), metadata={"parse": size})


TRL_EXT_PLUGIN = PluginSpec(
    name=NAME,
    summary="Micro-batches of at most N tokens, gradients and metrics equal to stock.",
    flags=(
        Flag(
            NAME,
            default=None,
            parse=optional(either(positive_int, one_of("auto"))),
            help='Most tokens per DPO micro-batch (pairs per optimizer step unchanged), or "auto" to measure it; '
            "a value is required.",
            cli_const=NO_VALUE,
        ),
    ),
    options=TokenBudgetOptions,
    trainers=("DPOTrainer",),
    hooks=".hooks",
    calls=(
        "get_train_dataloader",
        "get_eval_dataloader",
        "get_test_dataloader",
        "get_batch_samples",
        "training_step",
        "compute_loss",
        "prediction_step",
        "train",
        "accelerator.gather",
        "accelerator.gather_for_metrics",
    ),
)


__getattr__ = lazy_getattr(__name__, rest="hooks")  # the implementation's names, imported on first use only
