"""Random numbers a model draws in its forward in training mode, found by measurement and named by layer.

Besides dropout, layers may sample in training (PhiMoE's router: Gumbel sampling and a random Heun mask; DBRX's router
jitters its input), which changes the forward's values only now and then, so comparing two forwards may not see it.
The random number generator always does: `random_draws` runs one forward and reports each module that advanced the
generator of the model's device while it ran (outside its submodules' calls), in execution order. Packed or shared
rows draw on other tensor shapes than the padded batch, so they get other samples than stock TRL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RandomDraw", "describe_draws", "dropout_attribute", "random_draws", "training_draws"]

_LAYER_DROP = ("layerdrop", "layer_drop", "drop_path", "drop_path_rate")


@dataclasses.dataclass(frozen=True)
class RandomDraw:
    """A module that drew random numbers in a forward: `name` (its path in the model), `cls` (its class name), and
    `dropout` (whether it is a dropout site: an `nn.Dropout*` module or a module whose class says dropout)."""

    name: str
    cls: str
    dropout: bool

    def __str__(self) -> str:
        return f"`{self.name}` ({self.cls})" if self.name else f"({self.cls})"


def dropout_attribute(name: str, value: Any) -> bool:
    """Whether a module attribute holds a positive dropout / layer-drop probability (OPT's decoder layer applies
    `nn.functional.dropout` with `self.dropout`)."""
    lowered = name.lower()
    positive = isinstance(value, (float, int)) and not isinstance(value, bool) and value > 0
    return positive and ("dropout" in lowered or lowered in _LAYER_DROP)


def _drops_out(module: torch.nn.Module) -> bool:
    """A dropout module, or a module holding a positive dropout / layer-drop probability."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd) or "dropout" in type(module).__name__.lower():
        return True
    return any(dropout_attribute(name, value) for name, value in vars(module).items())


def _gather(module: torch.nn.Module) -> Any:
    """Enter DeepSpeed's `GatheredParameters` for `module`'s own ZeRO-3 partitioned parameters, or None."""
    own = [p for p in module.parameters(recurse=False) if hasattr(p, "ds_id")]
    if not own:
        return None
    import deepspeed

    gathered = deepspeed.zero.GatheredParameters(own, modifier_rank=None)
    gathered.__enter__()
    return gathered


def _release(frame: list[Any]) -> None:
    if frame[2] is not None:
        frame[2].__exit__(None, None, None)
        frame[2] = None


def random_draws(model: torch.nn.Module, run: Callable[[], Any], training: bool = True) -> list[RandomDraw]:
    """Run `run()` (a forward of `model`) once, with `model` in training mode (`training`), under `torch.no_grad`,
    and return every module that advanced the device's random number generator while it ran, outside the calls of
    its submodules (the innermost drawing layer), in execution order, each once. The caller's generator state and
    the modules' modes are restored."""
    device = next(model.parameters()).device
    state = (lambda: torch.cuda.get_rng_state(device)) if device.type == "cuda" else torch.get_rng_state
    names = {module: name for name, module in model.named_modules()}
    frames: list[list[Any]] = []  # per call: [module, generator state after its last child returned, gathered]
    found: dict[str, RandomDraw] = {}
    # DeepSpeed ZeRO-3 partitions the parameters when the model is built (`zero.Init`), before any engine runs its
    # gathering hooks: gather each module's own parameters while it runs, one module at a time (every rank runs the
    # same probe, so the collectives match).
    zero3 = any(hasattr(p, "ds_id") for p in model.parameters())

    def drew(frame: list[Any], now: torch.Tensor) -> None:
        if not torch.equal(frame[1], now):
            module = frame[0]
            name = names.get(module, "")
            found.setdefault(name, RandomDraw(name, type(module).__name__, _drops_out(module)))

    def pre(module: torch.nn.Module, args: Any) -> None:
        gathered = _gather(module) if zero3 else None
        now = state()
        if frames:
            drew(frames[-1], now)
        frames.append([module, now, gathered])

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        now = state()
        while frames and frames[-1][0] is not module:  # a call that raised inside: unwind to this module
            _release(frames.pop())
        if frames:
            frame = frames.pop()
            drew(frame, now)
            _release(frame)
        if frames:
            frames[-1][1] = now

    handles = []
    for module in list(model.modules())[1:]:  # the model itself is the root frame below (`run` may bypass __call__)
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    modes = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            frames.append([model, state(), _gather(model) if zero3 else None])
            run()
            if frames and frames[0][0] is model:
                drew(frames[0], state())
    finally:
        while frames:
            _release(frames.pop())
        for handle in handles:
            handle.remove()
        for module, mode in modes.items():
            module.training = mode
    return list(found.values())


def describe_draws(draws: list[RandomDraw], limit: int = 3) -> str:
    """`"`model.layers.0.mlp.router` (PhimoeTopKRouter), `model.layers.1.mlp.router` (PhimoeTopKRouter)"`: the first
    `limit` drawing layers, and how many more."""
    shown = ", ".join(str(d) for d in draws[:limit])
    more = len(draws) - limit
    return shown + (f" and {more} more" if more > 0 else "")


def training_draws(model: torch.nn.Module) -> list[RandomDraw]:
    """`random_draws` of `model`'s stock padded forward (`probe.stock_forward`: its original attention, no trl-ext
    wrapper) in training mode, on a probe of two right-padded rows (8 and 6 tokens): the layers that draw random
    numbers while `model` trains. The draws do not depend on the probe's length, only on the layers it runs through."""
    from .probe import stock_forward

    device = next(model.parameters()).device
    lm: Any = model  # a PreTrainedModel: `get_input_embeddings` / `get_output_embeddings`
    vocab = int(lm.get_input_embeddings().num_embeddings)
    weight = getattr(lm.get_output_embeddings(), "weight", None) if hasattr(lm, "get_output_embeddings") else None
    if isinstance(weight, torch.Tensor):
        # ids both embedded and scored (CPM-Ant embeds extra ids); a ZeRO-3 partitioned weight keeps its full shape in
        # `ds_shape` (its own shape is empty until gathered)
        vocab = min(vocab, int(getattr(weight, "ds_shape", weight.shape)[0]))
    low = min(3, vocab - 1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(low, vocab, (2, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    ids, mask = ids.to(device), mask.to(device)

    def run() -> Any:
        # `forward`, not `__call__`: a probe, not a forward of the model's own (hooks that count its calls stay quiet)
        with stock_forward(model):
            return model.forward(input_ids=ids, attention_mask=mask, use_cache=False)

    return random_draws(model, run, training=True)
