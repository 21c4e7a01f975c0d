"""Every hook that trl-ext calls, in the order a run meets them (docs/writing-plugins.md explains them in prose).

Rules for every hook here: parameters never have defaults (pluggy would not pass them); trainer-scoped hooks are
called only on the plugins enabled for that trainer, on every rank in the same order (so an implementation may issue
collectives unconditionally); `trl_ext_make_*` and `trl_ext_reduce_metrics` are exclusive: plain pluggy hooks whose
results trl-ext checks, two enabled plugins answering one call being a `trl_ext.UsageError` (a `wrapper=True`
implementation does not count as an answer). The parameters are typed with the protocols at the end of this
module (the core's classes satisfy them: mypy checks each in `trl_ext.api`), so that it imports nothing of trl-ext.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import Trainer

PROJECT_NAME = "trl_ext"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def trl_ext_validate_config(config: TrlExtConfig, trl_version: str) -> None:
    """Check combinations of flags and options before anything in TRL is patched.

    Called once per `install()` on every registered plugin, enabled or not, after every value was parsed: check what
    the declarations cannot express and raise `trl_ext.UsageError` naming the setting and what to do instead.
    """


@hookspec
def trl_ext_trainer_init_start(trainer: Trainer, context: TrainerContext, init_kwargs: dict[str, Any]) -> None:
    """A stock TRL trainer is being constructed; TRL's own `__init__` has not run yet.

    `trainer` is the bare instance. A plugin may replace entries of `init_kwargs` (the constructor's arguments by
    name): TRL's `__init__` is called with the result.
    """


@hookspec
def trl_ext_trainer_models_ready(trainer: Trainer, context: TrainerContext) -> None:
    """The trainer's policy, reference model and data collator exist, and no forward pass has run yet.

    Once per trainer, after the collator and forward extension points were applied: right before DPO's reference
    precompute in `__init__` (TRL >= 0.29, `precompute_ref_log_probs=True`), else at the end of `__init__`.
    """


@hookspec
def trl_ext_trainer_init_end(trainer: Trainer, context: TrainerContext) -> None:
    """TRL's `__init__` has returned; the trainer is fully constructed. Called once per trainer, on every rank."""


@hookspec
def trl_ext_describe(trainer: Trainer, context: TrainerContext) -> str | None:
    """A few words on what the plugin chose for this trainer (what `"auto"` resolved to), or None.

    Called after `trl_ext_trainer_init_end` on the main process; the text follows the plugin's name in the trainer's
    log line, in parentheses."""


@hookspec
def trl_ext_advise_unused(trainer: Trainer, trainer_class: str, trl_args: Any) -> str | None:
    """A warning for a trainer this plugin applies to but is *not* enabled for, or None.

    The one trainer-scoped hook called on disabled plugins (main process only): for a TRL flag in `trl_args` that TRL
    honours but the plugin would serve better, say what TRL will do and name the trl-ext flag."""


@hookspec
def trl_ext_call(trainer: Trainer, context: TrainerContext, call: Call) -> Any:
    """Take part in one call of a trainer method that the plugin lists in `PluginSpec.calls`; return its result.

    The enabled plugins that list the method run as a chain, outermost first (`trl-ext plugins --order`):
    `call.proceed()` runs the rest, TRL's own method last. `trl_ext.calls` says which methods may be listed and when
    they are wrapped.
    """


@hookspec
def trl_ext_make_collator(trainer: Trainer, context: TrainerContext, collator: Callable) -> Callable | None:
    """Return the data collator this trainer should use instead of `collator`, or None to keep it.

    Called once, before `trl_ext_trainer_models_ready`; the result becomes `trainer.data_collator`. Exclusive."""


@hookspec
def trl_ext_make_packed_forward(
    trainer: Trainer, context: TrainerContext, role: str, backbone: torch.nn.Module
) -> Callable | None:
    """Return a replacement `forward` for a model's backbone (`model.base_model`), or None to keep it.

    Called once per model the trainer runs (`role` `"policy"` or `"ref"`; under PEFT the `"policy"` base model is
    also the adapter-disabled reference). Installed as `backbone.forward` through the trainer's undo stack, until
    `Installation.detach(trainer)`; it must accept and return what the original does. Exclusive.
    """


@hookspec
def trl_ext_reduce_metrics(
    trainer: Trainer, context: TrainerContext, logs: dict[str, float]
) -> dict[str, float] | None:
    """Return the metrics to log instead of TRL's own reduction, or None to keep TRL's.

    Called inside `trainer.log(logs)`, before TRL merges its buffered metrics (`DPOTrainer._metrics`) into `logs`
    (eval keys carry the `eval_` prefix). A returned dict replaces `logs` and TRL's buffered metrics for the window
    are discarded. Exclusive.
    """


@hookspec
def trl_ext_stock_batches(trainer: Trainer, context: TrainerContext, mode: str, calls: int, sizes: list[int]) -> None:
    """The last `calls` `compute_loss` calls ran, re-cut into micro-batches of a plugin's own, what stock runs as
    batches of `sizes` pairs.

    Announced by the plugin that re-cuts them (token_budget, through `context.hook`) at the end of each optimizer step
    (`mode` `"train"`) and of each evaluation batch it cut (`"eval"`). A plugin counting the pairs of each
    `compute_loss` call replaces its last `calls` counts with `sizes`.
    """


@hookspec
def trl_ext_make_generation_context(
    trainer: Trainer, context: TrainerContext, model: torch.nn.Module, call_kwargs: dict[str, Any]
) -> AbstractContextManager | None:
    """Return the context manager that yields the model to call `generate` on, or None to use TRL's.

    Called wherever the trainer's module calls `unwrap_model_for_generation(model, accelerator, ...)`; `call_kwargs`
    holds TRL's other arguments (`accelerator`, `gather_deepspeed3_params`, on newer TRL `generation_kwargs`,
    `gradient_checkpointing_kwargs`). It must yield exactly once and restore the model on every path. Exclusive.
    """


@hookspec
def trl_ext_make_head_forward(
    trainer: Trainer, context: TrainerContext, role: str, head: torch.nn.Module
) -> Callable | None:
    """Return a replacement `forward` for a model's output head (`get_output_embeddings()`), or None to keep it.

    It may score what the trainer's scoring method asks for (without the full-vocabulary logits) and runs as the
    original otherwise. Called per model after `trl_ext_make_packed_forward`, installed like it. Exclusive.
    """


@hookspec
def trl_ext_make_model_forward(
    trainer: Trainer, context: TrainerContext, role: str, model: torch.nn.Module
) -> Callable | None:
    """Return a replacement `forward` for a causal LM the trainer runs (the whole model), or None to keep it.

    Called per model (unwrapped from DeepSpeed/DDP and PEFT) after `trl_ext_make_head_forward`: it wraps
    `model.forward` as it then is, so it is the outermost. A call it does not change must run as the original does.
    Installed as `model.forward` like the packed forward. Exclusive.
    """


@hookspec
def trl_ext_uninstall(installation: Installation) -> None:
    """`Installation.uninstall()` is running, before trl-ext's undo stack is unwound.

    Called on every registered plugin to undo anything not done through an undo stack (what trainers built under the
    installation still need is held with `context.patch("process", ...)` instead)."""


# -- the protocols of what the hooks receive -------------------------------------------------------------------------


class Patcher(Protocol):
    """An undo stack (`trl_ext.api.Patcher`): changes recorded, and undone newest first."""

    def setattr(self, target: Any, attr: str, value: Any, *, raising: bool = True) -> Any: ...
    def wrap(self, target: Any, attr: str, make_wrapper: Callable[[Any], Any]) -> Any: ...
    def defer(self, fn: Callable[[], None]) -> None: ...
    def undo(self) -> None: ...


class TrlExtConfig(Protocol):
    """The merged configuration (`trl_ext.api.TrlExtConfig`): flags read as attributes, options by plugin."""

    flags: dict[str, Any]
    plugins: dict[str, dict[str, Any]]
    block: list[str]
    verify: int

    def __getattr__(self, name: str) -> Any: ...
    def options(self, plugin: str) -> Any: ...
    def flag_is_set(self, plugin: str) -> bool: ...
    def to_dict(self) -> dict[str, Any]: ...
    def changed(self) -> dict[str, Any]: ...


class Call(Protocol):
    """One call of a wrapped trainer method, as a `trl_ext_call` implementation sees it (`trl_ext.api.Call`)."""

    name: str
    args: tuple
    kwargs: dict
    original: Callable
    last: bool

    def proceed(self, *args: Any, **kwargs: Any) -> Any: ...


class TrainerContext(Protocol):
    """trl-ext's view of one trainer (`trl_ext.api.TrainerContext`): its plugins, their state, its undo stack."""

    trainer_class: str
    enabled: tuple[str, ...]
    trl_args: Any
    state: dict[str, Any]
    attached: bool
    math_plugins: list[str]
    stock_methods: dict[str, Callable[..., Any]]
    calls: dict[str, tuple[str, ...]]

    @property
    def installation(self) -> Installation: ...
    @property
    def patcher(self) -> Patcher: ...
    @property
    def hook(self) -> Any: ...
    @property
    def trainer(self) -> Any: ...
    @property
    def config(self) -> TrlExtConfig: ...
    def options(self, plugin: str) -> Any: ...
    def is_enabled(self, plugin: str) -> bool: ...
    def plugins_serving(self, role: str) -> tuple[str, ...]: ...
    def call_exclusive(self, hook_name: str, **kwargs: Any) -> Any: ...
    def call_math(self, hook_name: str, **kwargs: Any) -> Any: ...
    def patch(self, scope: str, apply: Callable[[Patcher], None], *, key: str | None = None) -> None: ...
    def running(self) -> AbstractContextManager[None]: ...
    def models(self) -> dict[str, Any]: ...


class Installation(Protocol):
    """An active trl-ext installation (`trl_ext.api.Installation`)."""

    trl_version: str
    keep_records: bool

    @property
    def config(self) -> TrlExtConfig: ...
    @property
    def plugin_manager(self) -> pluggy.PluginManager: ...
    @property
    def installed(self) -> bool: ...
    @property
    def records(self) -> list[dict[str, Any]]: ...
    def enabled_plugins(self, trainer: str | type | Any, trl_args: Any = None) -> list[str]: ...
    def contexts(self) -> Sequence[TrainerContext]: ...
    def detach(self, trainer: Any = None) -> None: ...
    def uninstall(self, *, detach: bool = False) -> None: ...
