"""Fused varlen attention kernels for packed rows: which kernel runs a model's packed attention, and the call.

One fused varlen kernel call per layer does the work of the per-segment loop (one SDPA call per sequence) in one
launch. Two are known (`KERNELS`): PyTorch's `varlen_attn` (CUDA; `scale`, `window_size` and `enable_gqa` used where
the installed signature has them) and flash-attn >= 2.3's `flash_attn_varlen_func`, preferred for a model loaded with
`attn_implementation="flash_attention_2"`. Both align a causal mask to the bottom right when a segment has more keys
than queries: the shared-prompt pattern. The choice is made once per trainer and model (`choose`, `set_choice`, read
back through `choice_for(module)`), with the reasons it falls back to the exact per-segment loop
(`unsupported_features`; docs/plugins/padding_free.md lists them per torch release); each call pattern is measured on
the device before it trains (`probe.py`).

Every kernel call goes through `Kernel.call(q, k, v, cu_q, cu_k, max_q, max_k, causal=, window=, scale=)` (`q`
`[T_q, H_q, D]`, `k`/`v` `[T_k, H_kv, D]`, `window` the number of earlier keys a query sees or None): unit tests
substitute a CPU reference there (`KERNELS`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import _compat
from ...errors import UsageError

__all__ = [
    "FUSED_DTYPES",
    "KERNELS",
    "Choice",
    "Kernel",
    "choice_for",
    "choose",
    "choose_for_model",
    "describe_choice",
    "installed_kernels",
    "run_packed",
    "log_choices",
    "own_scales",
    "set_choice",
    "unsupported_features",
]

#: The dtypes the flash-attention kernels run in.
FUSED_DTYPES = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A fused varlen attention kernel: its `name` as logged, the device types and dtypes it runs on, whether it
    applies causal sliding `windows` itself and takes a scale other than `head_dim ** -0.5` (`scales`), its `call`."""

    name: str
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    windows: bool
    call: Callable[..., torch.Tensor]
    scales: bool = True


@functools.lru_cache(maxsize=1)
def _varlen_parameters() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal: bool, window: int | None, scale: float | None):
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_parameters()
    kwargs: dict[str, Any] = {}
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None and not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
        # torch 2.10: no `scale`; `choose` leaves such models to the loop, the probe refuses such calls
        raise ValueError(f"varlen_attn of torch {torch.__version__} has no `scale` (torch >= 2.11 has); scale {scale}")
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "window_size" in params:
        # a tuple: varlen_attn tests `window_size == (-1, 0)` for its causal flag
        kwargs["window_size"] = (window, 0) if window is not None else (-1, 0) if causal else (-1, -1)
    elif window is not None:  # torch 2.10: `windows=False`, never asked for one
        raise ValueError(f"varlen_attn of torch {torch.__version__} has no `window_size`")
    else:
        kwargs["is_causal"] = causal
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def _flash_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, causal: bool, window: int | None, scale: float | None):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal,
        window_size=(window, 0) if window is not None else (-1, -1),
    )  # fmt: skip


def installed_kernels() -> dict[str, Kernel]:
    """The fused kernels this environment has, by name (importable; their signature read once)."""
    found = {}
    try:
        params = _varlen_parameters()
    except ImportError:
        params = None
    if params is not None:
        windows, scales = "window_size" in params, "scale" in params
        found["varlen_attn"] = Kernel("varlen_attn", ("cuda",), FUSED_DTYPES, windows, _torch_varlen, scales)
    try:
        import flash_attn
    except ImportError:
        pass
    else:
        if _version_tuple(getattr(flash_attn, "__version__", "0")) >= (2, 3):  # `window_size` since 2.3
            found["flash_attn"] = Kernel("flash_attn", ("cuda",), FUSED_DTYPES, True, _flash_attn)
    return found


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int("".join(itertools.takewhile(str.isdigit, part)) or 0) for part in version.split(".")[:2])


#: The kernels the choice considers, by name: `installed_kernels()` at import. Unit tests substitute entries here.
KERNELS: dict[str, Kernel] = installed_kernels()


# ---------------------------------------------------------------------------------------------------------------------
# The choice, once per trainer and model
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which attention runs a model's packed calls.

    Args:
        kernel (`Kernel` or `None`): the fused kernel; None for the per-segment loop.
        device (`str`), dtype (`torch.dtype`): what the choice was made for.
        fallbacks (`tuple[str, ...]`): why the loop runs (or, with a kernel, which calls still run per segment).
    """

    kernel: Kernel | None
    device: str
    dtype: torch.dtype
    fallbacks: tuple[str, ...] = ()
    plugin: str = "packing"
    requested: str = "auto"
    #: the kernel probe's verdict per call pattern (`probe.checked_kernel`), filled on first use
    verdicts: dict[Any, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)


def unsupported_features(model: torch.nn.Module, base: str) -> list[str]:
    """What in `model` (loaded with attention `base`) the fused kernels do not compute: its calls run per segment."""
    config = model.config
    found = []
    if base != "sdpa":
        found.append(f"{base} attention (the model's own attention function)")
    if any(getattr(config, name, None) for name in ("attn_logit_softcapping", "softcap")):
        found.append("softcapping")
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        found.append("attention sinks")
    if getattr(config, "alibi", False) or getattr(config, "model_type", None) in _compat.OWN_ATTENTION_MODEL_TYPES:
        found.append("ALiBi / the model's own attention masks")
    if getattr(config, "attention_chunk_size", None):
        found.append("custom attention masks (chunked attention)")
    if any(isinstance(p := getattr(m, "attention_dropout", None), float) and p > 0 for m in model.modules()):
        found.append("dropout in attention")
    head_dim = getattr(config, "head_dim", None) or _head_dim(config)
    if isinstance(head_dim, int) and (head_dim % 8 or head_dim > 256):
        found.append(f"head_dim {head_dim} (the flash kernels need a multiple of 8, at most 256)")
    qk_dim = getattr(config, "qk_head_dim", None) or _sum(config, "qk_nope_head_dim", "qk_rope_head_dim")
    value_dim = getattr(config, "v_head_dim", None)
    if isinstance(qk_dim, int) and isinstance(value_dim, int) and qk_dim != value_dim:
        found.append(f"query/key head dim {qk_dim} and value head dim {value_dim} (the kernels take one head dim)")
    return found


def _sum(config: Any, *names: str) -> int | None:
    values = [getattr(config, name, None) for name in names]
    ints = [v for v in values if isinstance(v, int)]
    return sum(ints) if len(ints) == len(values) else None


def own_scales(model: torch.nn.Module) -> set[float]:
    """The attention scales of `model`'s layers (their `scaling`) that differ from `head_dim ** -0.5`."""
    found = set()
    for module in model.modules():
        scaling, head_dim = getattr(module, "scaling", None), getattr(module, "head_dim", None)
        if isinstance(scaling, float) and isinstance(head_dim, int) and head_dim > 0:
            if not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6):
                found.add(scaling)
    return found


def _head_dim(config: Any) -> int | None:
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _device_problem(device: torch.device) -> str | None:
    """Why the flash kernels are not used on this CUDA device: ROCm, or a GPU older than Ampere."""
    if device.type != "cuda":
        return None
    if getattr(torch.version, "hip", None):
        return "ROCm (HIP): trl-ext has not measured the fused kernels' causal alignment there"
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):
        return "a GPU older than compute capability 8.0 (the flash kernels need Ampere or newer)"
    return None


def choose(
    requested: str,
    device: torch.device | str,
    dtype: torch.dtype,
    features: Sequence[str],
    prefer: str | None = None,
    windows: bool = False,
    plugin: str = "packing",
    scales: set[float] | None = None,
) -> Choice:
    """The attention of a model's packed calls: a fused kernel of `KERNELS` where one runs on `device` in `dtype`,
    else the per-segment loop, with the reasons (`Choice.fallbacks`). `requested` is the plugin's `attention` option
    (`"segments"` forces the loop, `"fused"` the kernel or a `UsageError` naming the reasons); `prefer` the kernel to
    try first (`"flash_attn"` under `flash_attention_2`); `windows` / `scales`: the model's sliding windows and its
    layers' own attention scales, which a kernel without `window_size` / `scale` leaves to the loop."""
    device = torch.device(device)
    device_type = device.type
    if requested == "segments":
        return Choice(None, device_type, dtype, ("attention: segments",), plugin, requested)
    order = [prefer] if prefer in KERNELS else []
    order += [name for name in KERNELS if name not in order]
    candidates = (KERNELS[name] for name in order)
    kernel = next((k for k in candidates if device_type in k.devices and dtype in k.dtypes), None)
    reasons: list[str] = []
    problem = _device_problem(device) if kernel is not None else None
    if problem is not None:
        kernel = None
        reasons.append(problem)
    elif not KERNELS:
        reasons.append("no fused kernel installed (torch.nn.attention.varlen or flash-attn)")
    elif kernel is None:
        reasons += [
            f"{k.name} runs on {'/'.join(k.devices)} in {'/'.join(map(_short, k.dtypes))}" for k in KERNELS.values()
        ]
    reasons += features
    if kernel is not None and windows and not kernel.windows:
        reasons.append(f"sliding windows ({kernel.name} of this torch has no window_size)")
    unscaled = kernel is not None and bool(scales) and not kernel.scales
    if kernel is not None and unscaled:
        reasons.append(
            f"attention scale {min(scales or ())} ({kernel.name} of this torch has no scale: torch >= 2.11)"
        )
    blocking = kernel is None or bool(features) or (windows and not kernel.windows) or unscaled
    if requested == "fused" and blocking:
        raise UsageError(
            f"{plugin}: `attention: fused` asks for one fused varlen kernel per layer, which cannot run here "
            f"({device_type}, {_short(dtype)}): "
            f"{'; '.join(reasons)}. The fused kernels ({', '.join(KERNELS) or 'none installed'}) run on CUDA in "
            "bfloat16/float16 for plain sdpa attention. Set `attention: auto` (the per-segment attention where the "
            "kernel cannot run) or train on a GPU in bf16/fp16."
        )
    # features the kernel lacks make every call of the model run per segment (exact), so the kernel is not used
    return Choice(None if blocking else kernel, device_type, dtype, tuple(reasons), plugin, requested)


def training_dtype(model: torch.nn.Module, trainer: Any) -> torch.dtype:
    """The dtype `model` computes in during training, the one rule the packing plugins use: its parameters' dtype
    (float32 without parameters), or bf16/fp16 for a float32/float64 model under the trainer's `bf16=True` /
    `fp16=True` autocast."""
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    args = getattr(trainer, "args", None)
    bf16, fp16 = getattr(args, "bf16", False), getattr(args, "fp16", False)
    if dtype in (torch.float32, torch.float64) and (bf16 or fp16):
        return torch.bfloat16 if bf16 else torch.float16
    return dtype


def has_windows(config: Any) -> bool:
    """Whether `config` declares sliding-window layers."""
    layer_types = getattr(config, "layer_types", None) or ()
    return bool(getattr(config, "sliding_window", None)) or any("sliding" in str(t) for t in layer_types)


def choose_for_model(
    model: torch.nn.Module, base: str, requested: str, trainer: Any, plugin: str, prefer: str | None = None, *, patcher
) -> Choice:
    """`choose` for `model` (loaded with attention `base`) in `trainer`, made its packed attention (`set_choice`);
    forgotten when `patcher` (the trainer's undo stack) is undone."""
    # the trainer's device: the model may be moved there only when accelerate prepares it
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    trainer_device = getattr(getattr(trainer, "args", None), "device", None)
    if device.type == "cpu" and isinstance(trainer_device, torch.device):
        device = trainer_device
    dtype = training_dtype(model, trainer)
    features = unsupported_features(model, base)
    choice = choose(requested, device, dtype, features, prefer, has_windows(model.config), plugin, own_scales(model))
    set_choice(model.config, choice)
    if patcher is not None:  # None: a caller without a trainer (a test, the GPU bench)
        config = model.config
        patcher.defer(lambda: _CHOICES.pop(id(config), None))
    return choice


def log_choices(log: Any, plugin: str, choices: dict[str, Choice]) -> None:
    """One log line per trainer: `<plugin>: packed attention: varlen_attn (CUDA, bf16)` (by role if they differ)."""
    if not choices:
        return
    texts = {role: describe_choice(choice) for role, choice in choices.items()}
    if len(set(texts.values())) == 1:
        log.info("%s: packed attention: %s", plugin, next(iter(texts.values())))
    else:
        log.info("%s: packed attention: %s", plugin, "; ".join(f"{role}: {text}" for role, text in texts.items()))


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype).replace("torch.", ""))


def describe_choice(choice: Choice) -> str:
    """The log text of a choice: `varlen_attn (CUDA, bf16)` or `per-segment loop (cpu, float32)`."""
    where = f"{'CUDA' if choice.device == 'cuda' else choice.device}, {_short(choice.dtype)}"
    if choice.kernel is not None:
        return f"{choice.kernel.name} ({where})"
    return f"per-segment loop ({where}; not fused: {'; '.join(choice.fallbacks)})"


# The choice of each model config switched to a trl-ext attention, weakly (a config is unhashable), read through the
# layer's `config`. A stale entry is harmless: a detached trainer's config names its own attention again.
_CHOICES: dict[int, tuple[weakref.ref, Choice]] = {}


def set_choice(config: Any, choice: Choice) -> None:
    """Make `choice` the packed attention of the model whose config is `config`."""
    for key, (ref, _) in list(_CHOICES.items()):
        if ref() is None:
            _CHOICES.pop(key, None)
    _CHOICES[id(config)] = (weakref.ref(config), choice)


def choice_for(module: torch.nn.Module) -> Choice | None:
    """The choice made for the model an attention layer belongs to (via its `config`), or None."""
    config = getattr(module, "config", None)
    entry = _CHOICES.get(id(config)) if config is not None else None
    if entry is None or entry[0]() is not config:
        return None
    return entry[1]


def call_dtype(kernel: Kernel, query: torch.Tensor) -> torch.dtype | None:
    """The dtype `kernel` runs this call in: the query's, or under autocast the autocast dtype (float32 queries of a
    float32 model trained with `bf16=True`: rotary embeddings promote them; SDPA casts them down the same way);
    None when it runs neither."""
    if query.dtype in kernel.dtypes:
        return query.dtype
    device_type = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return dtype if dtype in kernel.dtypes else None
    return None


def runs_fused(choice: Choice | None, query: torch.Tensor) -> Kernel | None:
    """The kernel of `choice` when this call's tensors are what it was chosen for (device type and dtype)."""
    if choice is None or choice.kernel is None:
        return None
    kernel = choice.kernel
    return kernel if query.device.type in kernel.devices and call_dtype(kernel, query) is not None else None


def kernel_inputs(kernel: Kernel, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Transformers' `[1, H, T, D]` query/key/value as the kernels take them: `[T, H, D]`, contiguous, in the call's
    dtype (`call_dtype`)."""
    dtype = call_dtype(kernel, tensors[0])
    return [t[0].transpose(0, 1).to(dtype).contiguous() for t in tensors]


def run_packed(
    kernel: Kernel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    max_length: int,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """Causal attention of one packed row in one kernel call: `query [1, H, T, D]` (transformers' layout) ->
    `[1, T, H, D]` (an attention function's output layout)."""
    q, k, v = kernel_inputs(kernel, query, key, value)
    out = kernel.call(q, k, v, cu, cu, max_length, max_length, causal=True, window=window, scale=scaling)
    return out.unsqueeze(0)
