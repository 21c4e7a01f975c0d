"""`verify`: the first training steps of a trainer whose plugins change the math (`TrainerContext.math_plugins`),
checked against stock TRL (docs/lifecycle.md says what and why).

In the first `verify` optimizer steps each call of the trainer's scoring method (`_compat.VERIFIED_SCORING_METHODS`)
runs as always, the per-sequence log-probs of its model calls captured (policy, then reference), then once more as
stock TRL on the same batch under `torch.no_grad()`: the method the trainer held before any plugin took part in its
calls (`TrainerContext.stock_methods`), with the `forward`s and attention implementations the plugins changed put back
(`Patcher.suspended`) and the call context's `stock` set (a plugin's wrapper that something else wrapped since, or
accelerate's autocast, then passes calls through). The random generators restart where the real call started and end
where it left them, and the trainer's attributes are put back (`_verify_state.snapshot`): training goes on bit for bit
as without verify. The tolerance per sequence comes from stock's own round-off (`MARGIN`, `FLOOR_ULPS`,
`FLOOR_ULPS_16`); a sequence outside it on any rank stops the run before the optimizer step with a `UsageError`."""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from . import _compat
from . import _verify_state as state
from ._logging import NOTICE, get_logger, is_main_process
from .call_context import call_entered
from .errors import UsageError
from .patching import Patcher

if TYPE_CHECKING:  # pragma: no cover
    from .context import TrainerContext

__all__ = ["FLOOR_ULPS", "MARGIN", "Verify", "attach"]

logger = get_logger(__name__)

#: The tolerance under 16-bit autocast: this many times stock's own largest 16-bit-vs-float32 difference on the batch
#: (the plugin's 16-bit rounding is another draw of the same size), plus the float32 floor.
MARGIN = 2.0
#: The floor: this many units of float32 round-off (float32 and float64 training: TRL's fused head and the Llama norms
#: compute in float32) per unit of a sequence's sum of |log-prob| and tokens.
FLOOR_ULPS = 64.0
#: 16-bit training without an autocast to leave (16-bit weights, DeepSpeed's bf16): one unit of the 16-bit dtype's
#: round-off per unit of that sum, a bound on round-off accumulated token by token rather than a measurement.
FLOOR_ULPS_16 = 1.0


def attach(ctx: TrainerContext) -> Verify | None:
    """Wrap the trainer's verified scoring method (outermost) and `training_step` when `verify` is on and an enabled
    plugin changes the math; both through the trainer's undo stack."""
    steps = ctx.config.verify
    name = _compat.VERIFIED_SCORING_METHODS.get(ctx.trainer_class)
    if not steps or not ctx.math_plugins or name is None or name not in ctx.stock_methods:
        return None
    trainer = ctx.trainer
    check = ctx.verified = Verify(ctx, name, steps)
    ctx.patcher.setattr(trainer, name, check.wrap_scoring(getattr(trainer, name)))
    ctx.patcher.setattr(trainer, "training_step", check.wrap_training_step(trainer.training_step))
    return check


class Verify:
    """One trainer's check; `results` holds `(step, role, worst error, its tolerance, reference)` per checked call."""

    def __init__(self, ctx: TrainerContext, name: str, steps: int) -> None:
        self.ctx = ctx
        self.name = name
        self.steps = steps
        self.results: list[tuple[int, str, float, float, str]] = []
        self.seconds = 0.0
        self.forwards = 0
        self.peak_rise = 0.0
        self._worst: tuple[float, str] | None = None  # this rank's worst error / tolerance and its text, pending
        self._logged_step = -1
        self.no_room = 0  # scoring calls whose stock call ran out of memory (not checked)
        self._in_training_step = 0  # scoring calls are checked inside the trainer's `training_step` only

    # -- when --------------------------------------------------------------------------------------------------------

    def _step(self) -> int | None:
        """The optimizer step in progress when it is one to check (inside a `training_step`, training mode, within
        the first `steps`): a scoring call of the user's own (`trainer._forward(...)` before training) is not."""
        trainer = self.ctx.trainer
        if not self._in_training_step or trainer.state.global_step >= self.steps or not trainer.model.training:
            return None
        return trainer.state.global_step

    # -- wrappers ----------------------------------------------------------------------------------------------------

    def wrap_scoring(self, current: Callable) -> Callable:
        @functools.wraps(current)
        def scoring(*args: Any, **kwargs: Any) -> Any:
            step = self._step()
            if step is None:
                return current(*args, **kwargs)
            return self._checked_call(step, current, args, kwargs)

        return scoring

    def wrap_training_step(self, current: Callable) -> Callable:
        @functools.wraps(current)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            self._in_training_step += 1
            try:
                step = self._step()
                loss = current(*args, **kwargs)
            finally:
                self._in_training_step -= 1
            if step is not None:
                self._settle(step)  # every rank, once per `training_step` of a checked step: before any optimizer step
            return loss

        return training_step

    # -- one checked call --------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _fits(self) -> Iterator[None]:
        """The stock call of a plugin that saves memory may not fit where the plugin's does (fused_logprobs' full
        logits): out of memory there, this call is not checked, and one warning says so."""
        import torch

        try:
            yield
        except torch.OutOfMemoryError as exc:
            self.no_room += 1
            if self.no_room == 1:
                logger.warning(
                    "trl-ext verify: %s: stock TRL's own scoring call does not fit in memory beside the plugins' "
                    "(%s), so the first steps are not checked against it; the plugins' self-checks and the kernel "
                    "probe still ran. `verify: false` skips the attempt.",
                    self.ctx.trainer_class,
                    str(exc).splitlines()[0][:200],
                )
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _checked_call(self, step: int, current: Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
        import torch

        trainer = self.ctx.trainer
        start = state.rng_states()
        grad = torch.is_grad_enabled()
        with self._capture() as plugin:
            result = current(*args, **kwargs)
        after = state.rng_states()
        plugin_seqs = self._sequences(plugin, result, args, kwargs, grad)
        began, peak0 = time.perf_counter(), state.peak_bytes(trainer)
        saved = state.snapshot(trainer)
        # the plugins' own counts too (what their end lines say): the plugin path runs again below when it drew
        kept = [(s, state.snapshot(s)) for s in self.ctx.state.values() if hasattr(s, "__dict__")]
        hooks = state.hooks(self._modules())
        # A forward that drew random numbers (dropout, a sampling router) is compared in eval mode, both paths again:
        # a plugin need not draw stock's samples (padding_free says so when it attaches).
        drew = not state.same_rng(start, after)
        no_room = self.no_room
        try:
            with self._eval_mode() if drew else contextlib.nullcontext(), self._fits():
                if drew:
                    plugin_seqs = self._extra_call(current, args, kwargs, start, grad, stock=False)
                stock = self._extra_call(self.ctx.stock_methods[self.name], args, kwargs, start, grad)
                reference = "float32 floor"
                wide = None
                if self._autocast_modules():
                    wide = self._extra_call(self.ctx.stock_methods[self.name], args, kwargs, start, grad, float32=True)
                    reference = f"stock {state.mixed_precision(trainer)} vs float32"
            if self.no_room > no_room:
                return result
            if drew:
                reference += ", eval mode: the forward draws random numbers in training"
        finally:
            state.restore(trainer, saved)
            for plugin_state, contents in kept:
                state.restore(plugin_state, contents)
            state.drop_new_hooks(hooks)
            state.set_rng_states(after)
        self.seconds += time.perf_counter() - began
        self.peak_rise = max(self.peak_rise, state.peak_bytes(trainer) - peak0)
        self._compare(step, plugin_seqs, stock, wide, reference)
        return result

    def _extra_call(
        self,
        method: Callable,
        args: tuple,
        kwargs: dict[str, Any],
        start: Any,
        grad: bool,
        stock: bool = True,
        float32: bool = False,
    ) -> list:
        """The captured per-sequence log-probs of `method` run once more on the same arguments, without gradients, from
        the random state `start`, its gathers answered by this rank: as stock (`stock`: the plugins' forwards and
        attention put back, the call context's `stock` set), in float32 (`float32`: outside accelerate's autocast)."""
        import torch

        state.set_rng_states(start)
        ctx = self.ctx
        accelerator = getattr(ctx.trainer, "accelerator", None)
        with call_entered(stock=stock), Patcher("trl-ext verify: an extra call's gathers") as local:
            for name in _compat.VERIFY_LOCAL_GATHERS if accelerator is not None else ():
                local.setattr(accelerator, name, state.local)
            with (
                torch.no_grad(),
                ctx.patcher.suspended(state.stock_attribute) if stock else contextlib.nullcontext(),
                self._without_autocast() if float32 else contextlib.nullcontext(),
                self._capture() as captured,
            ):
                result = method(*args, **kwargs)
        self.forwards += max(len(captured), 1)
        return self._sequences(captured, result, args, kwargs, grad)

    def _modules(self) -> list:
        """Every module of the trainer's models (wrapped and unwrapped), each once."""
        trainer = self.ctx.trainer
        models = (getattr(trainer, "model_wrapped", None), trainer.model, getattr(trainer, "ref_model", None))
        return list(dict.fromkeys(m for model in models if model is not None for m in model.modules()))

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """Every module of the trainer's models in eval mode for the block, each put back as it was."""
        modules = {module: module.training for module in self._modules()}
        try:
            for module in modules:
                module.training = False
            yield
        finally:
            for module, training in modules.items():
                module.training = training

    # -- capture -----------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _capture(self) -> Iterator[list]:
        """Collect the per-token log-probs `[rows, positions]` of each DPO model call made in the block."""
        captured: list = []
        if self.ctx.trainer_class != "DPOTrainer":
            yield captured
            return
        with Patcher("trl-ext verify: capture") as patcher:
            if _compat.dpo_has_fused_head():
                for model in self.ctx.models().values():
                    patcher.setattr(model, "forward", state.capture(model.forward, captured, fused=True))
            else:
                module = importlib.import_module(_compat.DPO_LOGITS_MODULE)
                for helper in _compat.dpo_logits_helpers():
                    if helper != _compat.DPO_ENTROPY_HELPERS[0]:
                        patcher.wrap(module, helper, functools.partial(state.capture, captured=captured, fused=False))
            yield captured

    def _sequences(self, captured: list, result: Any, args: tuple, kwargs: dict[str, Any], grad: bool) -> list:
        """`[(role, per-sequence log-probs, per-sequence scale)]` of one call: DPO's captured model calls (policy
        first), or Online DPO's `_forward` result (its role from the grad mode of the real call)."""
        if self.ctx.trainer_class == "DPOTrainer":
            inputs: Any = kwargs.get("inputs", args[1] if len(args) > 1 else None)
            mask = inputs["completion_mask"][..., 1:]
            roles = ["policy", *(["reference"] * len(captured))][: len(captured)]
            return [(role, *state.per_sequence(values, mask)) for role, values in zip(roles, captured, strict=True)]
        mask = kwargs.get("completion_mask", args[4] if len(args) > 4 else None)
        return [("policy" if grad else "reference", *state.per_sequence(result, mask))]

    # -- float32 reference under autocast ----------------------------------------------------------------------------

    def _autocast_modules(self) -> list:
        """The trainer's modules whose `forward` accelerate wrapped in 16-bit autocast (kept: `_original_forward`)."""
        if state.mixed_precision(self.ctx.trainer) not in ("bf16", "fp16"):
            return []
        return [module for module in self._modules() if _compat.ACCELERATE_ORIGINAL_FORWARD in module.__dict__]

    @contextlib.contextmanager
    def _without_autocast(self) -> Iterator[None]:
        with Patcher("trl-ext verify: float32 reference") as patcher:
            for module in self._autocast_modules():
                patcher.setattr(module, "forward", module.__dict__[_compat.ACCELERATE_ORIGINAL_FORWARD])
            yield

    # -- the verdict -------------------------------------------------------------------------------------------------

    def _compare(self, step: int, plugin: list, stock: list, wide: list | None, reference: str) -> None:
        import torch

        if [r for r, *_ in plugin] != [r for r, *_ in stock]:
            text = f"model calls ({[r for r, *_ in plugin]}) are not stock's ({[r for r, *_ in stock]})"
            self._worst = (float("inf"), text)  # settled like an error: every rank stops together
            plugin = stock = []
        f32 = torch.finfo(torch.float32).eps
        dtype = state.compute_dtype(self.ctx.trainer, bool(self._autocast_modules()))
        for index, ((role, values, _), (_, expected, scale)) in enumerate(zip(plugin, stock, strict=True)):
            if wide is not None:
                tolerance = MARGIN * (expected - wide[index][1]).abs().max() + FLOOR_ULPS * f32 * scale
                label = reference
            elif dtype.itemsize >= 4:
                tolerance, label = FLOOR_ULPS * f32 * scale, reference
            else:
                tolerance, label = FLOOR_ULPS_16 * torch.finfo(dtype).eps * scale, f"{dtype} round-off floor"
            error = (values.to(expected.dtype) - expected).abs()
            error = torch.where(torch.isnan(error), torch.full_like(error, float("inf")), error)
            ratio = error / tolerance.clamp(min=torch.finfo(tolerance.dtype).tiny)
            worst = int(ratio.argmax())
            err, tol = float(error[worst]), float(tolerance[worst])
            self.results.append((step + 1, role, err, tol, label))
            text = (
                f"{role} log-prob of sequence {worst} of the batch differs from stock by {err:.3g} (tolerance "
                f"{tol:.3g}, from {label})"
            )
            if self._worst is None or float(ratio[worst]) > self._worst[0]:
                self._worst = (float(ratio[worst]), text)
        if not state.distributed() and self._worst is not None and self._worst[0] > 1.0:
            self._refuse(step, self._worst[1])  # at once: the backward has not run

    def _refuse(self, step: int, text: str) -> None:
        self._worst = None
        plugins = ", ".join(self.ctx.math_plugins)
        raise UsageError(
            f"trl-ext verify: {self.ctx.trainer_class} with {plugins} does not compute stock TRL's log-probs on "
            f"training step {step + 1}: the {text}. Stopped before the optimizer step, so nothing was trained with "
            f"it. Train without {plugins} (or without the option that chose this path), and report the model and "
            "settings to trl-ext."
        )

    def _settle(self, step: int) -> None:
        """At the end of each `training_step` of a checked step, on every rank: raise if a checked call of any rank
        was out of tolerance (one collective when distributed), else log this step's line once."""
        import torch

        ratio, text = self._worst if self._worst is not None else (0.0, "")
        self._worst = None
        if state.distributed():
            value = torch.tensor([ratio], dtype=torch.float64, device=self.ctx.trainer.args.device)
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
            if float(value.item()) > 1.0 and ratio <= 1.0:
                text = "batch of another rank was out of tolerance (that rank's error names the sequence); the"
                text += " check on this rank passed"
            ratio = max(ratio, float(value.item()))
        if ratio > 1.0:
            self._refuse(step, text)
        accelerator = self.ctx.trainer.accelerator
        if not getattr(accelerator, "sync_gradients", True) or step == self._logged_step or not self.results:
            return  # the line comes with the step's last `training_step` (gradient accumulation)
        self._logged_step = step
        seconds, forwards, rise = self.seconds, self.forwards, self.peak_rise
        self.seconds, self.forwards, self.peak_rise = 0.0, 0, 0.0
        checked = [r for r in self.results if r[0] == step + 1]
        if not checked or not is_main_process(accelerator):
            return
        worst = max(checked, key=lambda r: r[2] / r[3] if r[3] else 0.0)
        logger.log(
            NOTICE,
            "trl-ext verify: %s step %d: %s equal stock TRL's per-sequence log-probs on the same batch (%d model "
            "calls: %s; worst error %.3g <= tolerance %.3g, from %s); cost %.2f s, %d extra stock forward(s), "
            "peak memory +%.0f MiB",
            self.ctx.trainer_class,
            step + 1,
            ", ".join(self.ctx.math_plugins),
            len(checked),
            "/".join(dict.fromkeys(r[1] for r in checked)),
            worst[2],
            worst[3],
            worst[4],
            seconds,
            forwards,
            rise / 2**20,
        )
