"""Per-trainer state: which plugins are enabled for one trainer, their state objects, and the trainer's undo stack."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from .manager import call_exclusive
from .patching import Patcher

if TYPE_CHECKING:  # pragma: no cover
    import pluggy

    from .installation import Installation

__all__ = ["TrainerContext", "unwrap_causal_lm"]


class _SubsetHooks:
    """`context.hook.<name>(...)` calls only the plugins enabled for this trainer."""

    def __init__(self, pm: pluggy.PluginManager, disabled: set[Any]) -> None:
        self._pm = pm
        self._disabled = disabled

    def __getattr__(self, name: str) -> pluggy.HookCaller:
        return self._pm.subset_hook_caller(name, remove_plugins=self._disabled)


class TrainerContext:
    """trl-ext's view of one trainer, stored on it as `trainer._trl_ext`.

    Attributes:
        installation: the `Installation` that attached to the trainer.
        trainer_class: `"DPOTrainer"` or `"OnlineDPOTrainer"` (the stock class the trainer derives from).
        enabled: names of the plugins enabled for this trainer, in registration order.
        state: per-plugin objects, by plugin name. A plugin keeps its per-trainer state here, never in globals.
        patcher: undo stack for changes to this trainer and its models (undone by `Installation.uninstall()`).
    """

    def __init__(
        self, installation: Installation, trainer: Any, trainer_class: str, enabled: list[str], trl_args: Any
    ) -> None:
        self.installation = installation
        self._trainer = weakref.ref(trainer)
        self.trainer_class = trainer_class
        self.enabled: tuple[str, ...] = tuple(enabled)
        self.trl_args = trl_args
        self.state: dict[str, Any] = {}
        self.patcher = Patcher(f"trl-ext[{trainer_class}]")
        self.models_ready = False
        pm = installation.plugin_manager
        disabled = {plugin for name, plugin in pm.list_name_plugin() if name not in self.enabled}
        self.hook = _SubsetHooks(pm, disabled)

    @property
    def trainer(self) -> Any:
        return self._trainer()

    @property
    def config(self):
        return self.installation.config

    def options(self, plugin: str) -> Any:
        """The parsed options of `plugin` (an instance of its declared options dataclass, or None if it has none)."""
        return self.installation.config.options(plugin)

    def is_enabled(self, plugin: str) -> bool:
        return plugin in self.enabled

    def call_exclusive(self, hook_name: str, **kwargs: Any) -> Any:
        return call_exclusive(getattr(self.hook, hook_name), **kwargs)

    def prepare_models(self) -> None:
        """Apply the collator and packed-forward extension points, then announce `trl_ext_trainer_models_ready`.

        Idempotent: runs once, at the first point where TRL is about to run a model (the DPO precompute) or at the
        end of `__init__`.
        """
        if self.models_ready:
            return
        self.models_ready = True
        trainer = self.trainer
        collator = getattr(trainer, "data_collator", None)
        if collator is not None:
            new = self.call_exclusive("trl_ext_make_collator", trainer=trainer, context=self, collator=collator)
            if new is not None:
                self.patcher.setattr(trainer, "data_collator", new)
        for role, model in self.models().items():
            backbone = getattr(model, "base_model", None)
            if backbone is None or backbone is model:
                continue
            forward = self.call_exclusive(
                "trl_ext_make_packed_forward", trainer=trainer, context=self, role=role, backbone=backbone
            )
            if forward is not None:
                self.patcher.setattr(backbone, "forward", forward)
        self.hook.trl_ext_trainer_models_ready(trainer=trainer, context=self)

    def models(self) -> dict[str, Any]:
        """The causal LMs this trainer runs, by role (`"policy"`, `"ref"`), unwrapped from DeepSpeed/DDP and PEFT."""
        trainer = self.trainer
        out = {}
        policy = unwrap_causal_lm(getattr(trainer, "model", None))
        if policy is not None:
            out["policy"] = policy
        ref = unwrap_causal_lm(getattr(trainer, "ref_model", None))
        if ref is not None and ref is not policy:
            out["ref"] = ref
        return out


def unwrap_causal_lm(model: Any) -> Any:
    """Strip DeepSpeed engines, DDP and PEFT wrappers: return the `*ForCausalLM` module (or None)."""
    seen = 0
    while model is not None and seen < 8:
        seen += 1
        if hasattr(model, "get_base_model") and callable(model.get_base_model) and hasattr(model, "peft_config"):
            model = model.get_base_model()
            continue
        inner = getattr(model, "module", None)
        if inner is not None and type(model).__name__ in (
            "DeepSpeedEngine",
            "DistributedDataParallel",
            "DataParallel",
        ):
            model = inner
            continue
        break
    return model
