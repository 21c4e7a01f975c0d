"""Every hook that trl-ext calls, in the order a run meets them.

A plugin is any object (usually a module) with functions named like these specs and marked with
`trl_ext.hookimpl`. Built-in plugins live in `trl_ext.plugins`; third-party plugins are found through the
`trl_ext` entry-point group. Both are registered with the same `PluginManager.register` call.

Rules that hold for every hook here:

- Parameters never have defaults (pluggy would not pass them).
- Trainer-scoped hooks (everything but the configuration hooks) are called only on the plugins that are *enabled
  for that trainer*; a disabled plugin is never called and therefore changes nothing.
- Trainer-scoped hooks run on **every rank** of a distributed run, in the same order, so an implementation may issue
  collectives as long as it does so unconditionally.
- `trl_ext_make_*` hooks (and `trl_ext_reduce_metrics`) are exclusive: at most one enabled plugin may return a value.
  They are ordinary hooks called through pluggy (wrappers and hook-call monitoring see them); trl-ext checks the
  list of results and raises `trl_ext.UsageError` when two enabled plugins answer the same call, instead of silently
  picking one. A `wrapper=True` implementation does not count as an answer.
- A plugin declares its flags, options and trainers with `TRL_EXT_PLUGIN = trl_ext.PluginSpec(...)`
  (`trl_ext.spec`); the core validates every value against those declarations before any hook runs.

This module imports nothing heavy: the types below are for type checkers only. `TrainerContext`, `Call`,
`TrlExtConfig` and `Installation` are the protocols of `trl_ext.interfaces`, which the classes of `trl_ext.api`
satisfy, so that the plugin manager, which imports this module, does not depend on the modules that use it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import Trainer

    from .interfaces import Call, Installation, TrainerContext, TrlExtConfig

PROJECT_NAME = "trl_ext"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

# -------------------------------------------------------------------------------------------------------------------
# Configuration (once per `trl_ext.install()`, every process, no trainer yet)
# -------------------------------------------------------------------------------------------------------------------


@hookspec
def trl_ext_validate_config(config: TrlExtConfig, trl_version: str) -> None:
    """Check combinations of flags and options before anything in TRL is patched.

    Called once per `install()`, on every registered (not blocked) plugin, enabled or not. Each flag and option was
    already parsed by its declared parser (`trl_ext.PluginSpec`), so an implementation only checks what the
    declarations cannot express (two settings that exclude each other, a TRL version a setting needs).

    Args:
        config: the merged configuration (defaults < config file < `TRL_EXT_*` environment < keyword flags). A
            plugin reads its flags as attributes (`config.padding_free`) and its options with
            `config.options("<plugin name>")`.
        trl_version: the installed TRL version string.

    Raise `trl_ext.UsageError` naming the flag or option and what to do instead. The return value is ignored.
    """


# -------------------------------------------------------------------------------------------------------------------
# Trainer lifecycle (every stock trainer constructed while installed; every rank)
# -------------------------------------------------------------------------------------------------------------------


@hookspec
def trl_ext_trainer_init_start(trainer: Trainer, context: TrainerContext, init_kwargs: dict[str, Any]) -> None:
    """A stock TRL trainer is being constructed; TRL's own `__init__` has not run yet.

    Called before any of TRL's `__init__` work, which matters because DPO precomputes reference log-probs inside
    `__init__` (TRL >= 0.29). `trainer` is the bare instance (no attributes yet).

    Args:
        trainer: the trainer instance under construction.
        context: trl-ext's per-trainer state; plugins keep their per-trainer objects in `context.state`.
        init_kwargs: the constructor's arguments by name (`args`, `data_collator`, `train_dataset`, ...). A plugin may
            replace entries; TRL's `__init__` is then called with the result.

    The return value is ignored.
    """


@hookspec
def trl_ext_trainer_models_ready(trainer: Trainer, context: TrainerContext) -> None:
    """The trainer's policy, reference model and data collator exist, and no forward pass has run yet.

    For `DPOTrainer` this is right before the reference precompute (when `precompute_ref_log_probs=True`) or at the
    end of `__init__`; for `OnlineDPOTrainer` at the end of `__init__`. Called once per trainer, on every rank,
    after `trl_ext_make_collator`, `trl_ext_make_packed_forward`, `trl_ext_make_head_forward` and
    `trl_ext_make_model_forward` were applied.
    """


@hookspec
def trl_ext_trainer_init_end(trainer: Trainer, context: TrainerContext) -> None:
    """TRL's `__init__` has returned; the trainer is fully constructed. Called once per trainer, on every rank."""


@hookspec
def trl_ext_describe(trainer: Trainer, context: TrainerContext) -> str | None:
    """A few words on what the plugin chose for this trainer (what `"auto"` resolved to), or None.

    Called once per trainer after `trl_ext_trainer_init_end`, on the main process only, on each enabled plugin; the
    text goes in parentheses after the plugin's name in the trainer's log line
    (`trl-ext: DPOTrainer gets plugins padding_free (attention=trl_ext_varlen_sdpa)`).
    """


@hookspec
def trl_ext_advise_unused(trainer: Trainer, trainer_class: str, trl_args: Any) -> str | None:
    """A warning for a trainer this plugin applies to but is *not* enabled for, or None.

    The one trainer-scoped hook called on disabled plugins: once per trainer, after construction, on the main process
    only, on every registered plugin that applies to `trainer_class` and is not enabled for it. Use it when the
    trainer's TRL config (`trl_args`) sets a TRL flag that TRL honours but the plugin would serve better; the text
    should say what TRL will do and name the trl-ext flag. The core logs it as a warning.
    """


# -------------------------------------------------------------------------------------------------------------------
# Extension points, one per optimization (every rank)
# -------------------------------------------------------------------------------------------------------------------


@hookspec
def trl_ext_call(trainer: Trainer, context: TrainerContext, call: Call) -> Any:
    """Take part in one call of a trainer method that the plugin lists in `PluginSpec.calls`; return its result.

    Called on every rank, for every call of the method, on the enabled plugins that list it, as a chain (outermost
    first, in pluggy's call order; `trl-ext plugins --order` prints it): `call.proceed()` runs the rest of the chain,
    TRL's own method last, with `call.args` / `call.kwargs` or the arguments given to it. An implementation may run it
    several times, or not at all (it then replaces TRL's method: list it under `PluginSpec.replaces`). `trl_ext.calls`
    says which methods may be listed and when they are wrapped; DPO's reference precompute
    (`_precompute_ref_logps(dataset, name, batch_size)`, called from `__init__` and `evaluate()`) is one, wrapped
    before TRL's `__init__` runs, after the models are ready.
    """


@hookspec
def trl_ext_make_collator(trainer: Trainer, context: TrainerContext, collator: Callable) -> Callable | None:
    """Return the data collator this trainer should use instead of `collator`, or None to keep it.

    Called once, at the `trl_ext_trainer_models_ready` point (before the DPO reference precompute), with the
    collator the trainer holds (TRL's default one, or the user's). The result becomes `trainer.data_collator` and is
    used for the precompute, training and evaluation loaders. Exclusive: two enabled plugins returning one is a
    `UsageError`.
    """


@hookspec
def trl_ext_make_packed_forward(
    trainer: Trainer, context: TrainerContext, role: str, backbone: torch.nn.Module
) -> Callable | None:
    """Return a replacement `forward` for a model's backbone (`model.base_model`), or None to keep it.

    Called once per model the trainer runs (`role` is `"policy"` or `"ref"`; under PEFT, `"policy"` is the base
    model that also serves as the adapter-disabled reference), at the `trl_ext_trainer_models_ready` point. The
    result is installed as an instance attribute `backbone.forward` through the trainer's undo stack: it stays for the
    trainer's life and is removed by `Installation.detach(trainer)`. It must accept and return what the original
    forward does.
    Exclusive: two enabled plugins answering is a `UsageError`.
    """


@hookspec
def trl_ext_reduce_metrics(
    trainer: Trainer, context: TrainerContext, logs: dict[str, float]
) -> dict[str, float] | None:
    """Return the metrics to log instead of TRL's own reduction, or None to keep TRL's.

    Called inside `trainer.log(logs)` on every rank, before TRL merges its buffered metrics
    (`DPOTrainer._metrics`) into `logs`. `logs` holds what the caller passed (loss, learning rate, and for
    `OnlineDPOTrainer` its already-averaged `stats`; eval keys carry the `eval_` prefix). A returned dict replaces
    `logs` entirely and TRL's buffered metrics for the window are discarded.
    Exclusive: two enabled plugins answering is a `UsageError`.
    """


@hookspec
def trl_ext_stock_batches(trainer: Trainer, context: TrainerContext, mode: str, calls: int, sizes: list[int]) -> None:
    """The last `calls` `compute_loss` calls ran, re-cut into micro-batches of a plugin's own, what stock runs as
    batches of `sizes` pairs.

    Announced by the plugin that re-cuts them (token_budget, through `context.hook`), on every rank, after a
    `training_step` or `prediction_step` call: at the end of each optimizer step (`mode` `"train"`) and of each
    evaluation batch it cut (`"eval"`). A plugin that counts the pairs of each `compute_loss`
    call (a metrics reducer weighting stock's per-batch means) replaces its last `calls` counts with `sizes`. The
    return value is ignored.
    """


@hookspec
def trl_ext_make_generation_context(
    trainer: Trainer, context: TrainerContext, model: torch.nn.Module, call_kwargs: dict[str, Any]
) -> AbstractContextManager | None:
    """Return the context manager that yields the model to call `generate` on, or None to use TRL's.

    Called wherever the trainer's module calls `unwrap_model_for_generation(model, accelerator, ...)` (the name is
    patched where the trainer module looks it up), on every rank. `call_kwargs` holds the other arguments TRL passed
    (`accelerator`, `gather_deepspeed3_params`, and on newer TRL `generation_kwargs`,
    `gradient_checkpointing_kwargs`). The context manager must yield exactly once and restore the model on every
    path. Exclusive: two enabled plugins answering is a `UsageError`.
    """


# --- Scoring log-probs from hidden states (the output head, and the trainer methods that read it) ------------------


@hookspec
def trl_ext_make_head_forward(
    trainer: Trainer, context: TrainerContext, role: str, head: torch.nn.Module
) -> Callable | None:
    """Return a replacement `forward` for a model's output head (`get_output_embeddings()`), or None to keep it.

    The output head is the module that turns the hidden states into logits; a replacement may score there what the
    trainer's scoring method asks for (e.g. the completion tokens' log-probs, chunk by chunk, without the
    full-vocabulary logits), and must run as the original does otherwise. Called once per model the trainer runs
    (`role` is `"policy"` or `"ref"`, as for `trl_ext_make_packed_forward`, and after it), at the
    `trl_ext_trainer_models_ready` point, for a model whose `get_output_embeddings()` returns a module. The result is
    installed as an instance attribute `head.forward` through the trainer's undo stack: it stays for the trainer's
    life and is removed by `Installation.detach(trainer)`.
    Exclusive: two enabled plugins answering is a `UsageError`.
    """


@hookspec
def trl_ext_make_model_forward(
    trainer: Trainer, context: TrainerContext, role: str, model: torch.nn.Module
) -> Callable | None:
    """Return a replacement `forward` for a causal LM the trainer runs (the whole model), or None to keep it.

    Called once per model the trainer runs (`role` is `"policy"` or `"ref"`; `model` is the `*ForCausalLM` module,
    unwrapped from DeepSpeed/DDP and PEFT), after `trl_ext_make_head_forward` and before
    `trl_ext_trainer_models_ready`: the replacement wraps `model.forward` as it is then (over the installed
    backbone and head forwards), so it is the outermost, and a plugin may prepare the model (its attention, its
    dropout) before building it and measure it once installed, in `trl_ext_trainer_models_ready`. A call the
    replacement does not change must run as the original does. Installed as an instance attribute `model.forward`
    through the trainer's undo stack (removed by `Installation.detach(trainer)`).
    Exclusive: two enabled plugins answering is a `UsageError`.
    """


# --- end: scoring log-probs from hidden states -----------------------------------------------------------------------


# -------------------------------------------------------------------------------------------------------------------
# Teardown
# -------------------------------------------------------------------------------------------------------------------


@hookspec
def trl_ext_uninstall(installation: Installation) -> None:
    """`Installation.uninstall()` is running, before trl-ext's undo stack is unwound.

    Called once per installation, on every registered plugin. Undo anything not done through the undo stack.
    Trainers built under the installation keep their plugins after it (see `Installation.uninstall`): a process-wide
    resource that such a trainer still needs is held per trainer with `context.patch("process", apply, key=...)`
    instead, and released when the last trainer holding it is detached.
    """
