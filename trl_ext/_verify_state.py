"""What `trl_ext.verify` keeps of a trainer around its extra calls, and reads from them: the random generators, the
metric buffers the stock call appends to, the per-token log-probs a call's models return, the dtype it computes in."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _compat
from ._shared import peak_bytes as _peak_bytes

if TYPE_CHECKING:  # pragma: no cover
    import torch


def stock_attribute(target: Any, attr: str) -> bool:
    """What the stock call puts back: the `forward`s and attention implementations the plugins replaced."""
    return attr in ("forward", _compat.ATTN_IMPLEMENTATION_FIELD)


def local(value: Any, *args: Any, **kwargs: Any) -> Any:
    """`accelerator.gather` answered by this rank alone."""
    return value


def capture(original: Callable, captured: list, *, fused: bool) -> Callable:
    """`original`, appending to `captured` the per-token log-probs of each call: a model's fused-head `log_probs`
    (`fused`: calls with `fused_lm_head=True`), or what a logits helper returns (its first item)."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if not fused:
            captured.append((result[0] if isinstance(result, tuple) else result).detach())
        elif kwargs.get(_compat.FUSED_LM_HEAD_KWARG) and getattr(result, "log_probs", None) is not None:
            captured.append(result.log_probs.detach())
        return result

    return wrapper


def per_sequence(values: Any, mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of the masked per-token log-probs (float64), and the scale of their round-off: the sum of
    |log-prob| and the number of tokens."""
    import torch

    mask = mask.to(torch.float64)
    values = values[:, -mask.size(1) :].detach().to(torch.float64) * mask
    return values.sum(-1), values.abs().sum(-1) + mask.sum(-1)


#: A trainer attribute is plain data when it is built of numbers, strings, tensors that need no gradient, and lists,
#: tuples and dicts of those, with at most this many tensor elements and container items in all.
PLAIN_LIMIT = 1 << 20


class _NotPlain(Exception):
    pass


def _save(value: Any, budget: list[int]) -> Any:
    """A memento of plain `value` that `_put_back` turns into the same objects with the same contents."""
    import torch

    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        budget[0] -= 1
        return ("value", value)
    if isinstance(value, torch.Tensor):
        budget[0] -= value.numel()
        if value.requires_grad or budget[0] < 0:
            raise _NotPlain
        return ("tensor", value, value.detach().clone())
    if isinstance(value, (list, tuple, dict)):
        budget[0] -= len(value)
        if budget[0] < 0:
            raise _NotPlain
        if isinstance(value, dict):
            return ("dict", value, [(_save(k, budget), _save(v, budget)) for k, v in value.items()])
        return ("list" if isinstance(value, list) else "tuple", value, [_save(v, budget) for v in value])
    raise _NotPlain


def _put_back(memento: tuple) -> Any:
    import torch

    kind, value = memento[0], memento[1]
    if kind == "value":
        return value
    if kind == "tensor":
        saved = memento[2]
        if value.shape != saved.shape or value.dtype != saved.dtype:
            return saved
        with torch.no_grad():
            value.copy_(saved)
        return value
    if kind == "dict":
        items = [(_put_back(k), _put_back(v)) for k, v in memento[2]]
        value.clear()
        value.update(items)
        return value
    items = [_put_back(v) for v in memento[2]]
    if kind == "tuple":
        return type(value)(items) if type(value) is tuple else value
    value[:] = items
    return value


def _plain(value: Any) -> Any:
    try:
        return _save(value, [PLAIN_LIMIT])
    except _NotPlain:
        return None


def snapshot(trainer: Any) -> dict[str, Any]:
    """What an extra call may change on the trainer (or on a plugin's state object): every attribute, and for plain
    data (`PLAIN_LIMIT`: e.g. stock DPO's metric buffer `_metrics` and token count `_total_train_tokens`, a TRL's or a
    subclass's own on-device metric sums, a plugin's counts) each list, dict and tensor object with its contents, so
    that `restore` puts back the same objects as they were. Not a list of TRL's names: whatever a release or a user's
    subclass counts in its scoring method goes back. Any other attribute (a model, a dataset) is put back as the same
    object, but what the call changes inside it is not; an attribute the call adds is removed."""
    return {name: _plain(value) or ("value", value) for name, value in trainer.__dict__.items()}


def restore(trainer: Any, saved: dict[str, Any]) -> None:
    for name in [n for n in trainer.__dict__ if n not in saved]:
        del trainer.__dict__[name]  # what the stock call added
    for name, memento in saved.items():
        trainer.__dict__[name] = _put_back(memento)


#: The per-module hook registries of `torch.nn.Module` (each `{handle id: hook}`).
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def hooks(modules: Any) -> list[tuple[dict, set]]:
    """Each hook registry of `modules` with the handles it holds now (`drop_new_hooks` removes those added since:
    a stock call may register hooks, e.g. TRL re-enabling gradient checkpointing registers its input hook again)."""
    out = []
    for module in modules:
        for name in _HOOK_DICTS:
            registry = module.__dict__.get(name)
            if isinstance(registry, dict):
                out.append((registry, set(registry)))
    return out


def drop_new_hooks(saved: list[tuple[dict, set]]) -> None:
    for registry, keys in saved:
        for key in [k for k in registry if k not in keys]:
            del registry[key]


def rng_states() -> tuple[Any, Any]:
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def same_rng(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    import torch

    if not torch.equal(a[0], b[0]):
        return False
    return a[1] is None or b[1] is None or all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def set_rng_states(states: tuple[Any, Any]) -> None:
    import torch

    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def peak_bytes(trainer: Any) -> float:
    return _peak_bytes(getattr(getattr(trainer, "args", None), "device", None)) or 0.0


def mixed_precision(trainer: Any) -> str:
    return str(getattr(getattr(trainer, "accelerator", None), "mixed_precision", "no"))


def compute_dtype(trainer: Any, autocast: bool) -> torch.dtype:
    """The dtype the trainer's policy computes in: the 16-bit dtype of its autocast, else its parameters' (16-bit
    under DeepSpeed's bf16; float32 with `fp16=True` on CPU, where accelerate does not autocast)."""
    import torch

    if autocast:
        return torch.bfloat16 if mixed_precision(trainer) == "bf16" else torch.float16
    parameter = next(iter(trainer.model.parameters()), None)
    return parameter.dtype if parameter is not None and parameter.is_floating_point() else torch.float32


def distributed() -> bool:
    import torch

    return torch.distributed.is_available() and torch.distributed.is_initialized()
