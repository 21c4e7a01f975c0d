"""CPU stand-ins for the fused varlen kernels of each torch release and of flash-attn, for the tests of
`trl_ext/toolkit/packing/kernels.py` (`_torch_varlen`, `_flash_attn`) and of the kernel probe (`probe.py`).

Each `varlen_attn` has its release's public signature exactly (read from `torch/nn/attention/varlen.py` of the 2.10,
2.11, 2.12/2.13, 2.14 and 2.15 wheels; /work/shared/research/gpu_kernels.md, section 2) and its documented behaviour:
how the causal flag is derived from `window_size` (a tuple compare in 2.11-2.14, a list compare in 2.15), the
`ValueError` for unequal heads without `enable_gqa` (2.12+), 2.15's scale validation and backend selection (cuDNN where
eligible, causal cuDNN only when `cu_seq_q is cu_seq_k`, `RuntimeError` when flash SDP is disabled and cuDNN does not
qualify), 2.14's cuDNN rule (non-causal calls with more than 128 queries). Underneath, FlashAttention-2's argument
checks and normalizations (`flash_api.cpp`: int32 `cu_seqlens`, integer maxima, one head dim, a multiple of 8 up to
256, heads a multiple of key heads; `max_q == 1` is not causal; a left window reaching past the longest key segment is
none) and its mask (`mask.h`: bottom-right alignment), computed as the kernel rounds: scores and softmax in float32,
the attention weights rounded to the input dtype before they weigh the values, the output rounded once. The emulated
cuDNN path aligns causal masks to the top left, as torch 2.15's own comment says cuDNN does.

`fault` plants one error in the kernel, for the probe's tests: `"window+1"`, `"window-1"`, `"top-left"`,
`"default-scale"`, `"gqa-drop"` (key head `h % H_kv` instead of `h // group`)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch

RELEASES = ("2.10", "2.11", "2.13", "2.14", "2.15")
SIXTEEN_BITS = (torch.bfloat16, torch.float16)


class FlashError(RuntimeError):
    """What the emulated kernel raises where the real one's argument checks would."""


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    causal: bool,
    left: int,
    right: int,
    scale: float | None,
    dtypes: tuple[torch.dtype, ...],
    top_left: bool = False,
    fault: str | None = None,
) -> torch.Tensor:
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        raise FlashError(f"FlashAttention only supports fp16 and bf16 data type, got {q.dtype}")
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32:
        raise FlashError("cu_seqlens_q must have dtype int32")
    if not (isinstance(max_q, int) and isinstance(max_k, int)):
        raise FlashError(f"max_seqlen must be an int, got {type(max_q).__name__}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise FlashError("Input tensor must have contiguous last dimension")
    dim = q.shape[-1]
    if k.shape[-1] != dim or v.shape[-1] != dim:
        raise FlashError("query, key and value must have the same head dim")
    if dim % 8 or dim > 256:
        raise FlashError("FlashAttention forward only supports head dimension at most 256 and a multiple of 8")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise FlashError("Number of heads in key/value must divide number of heads in query")
    # flash_api.cpp's normalizations
    if max_q == 1:
        causal = False
    if causal:
        right = 0
    if left >= max_k:
        left = -1
    if fault == "window+1" and left >= 0:
        left += 1
    if fault == "window-1" and left > 0:
        left -= 1
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = dim**-0.5 if scale is None or fault == "default-scale" else scale
    group = heads // kv_heads
    if fault == "gqa-drop" and group > 1:
        index = torch.arange(heads) % kv_heads
    else:
        index = torch.arange(heads) // group
    k, v = k.index_select(1, index.to(k.device)), v.index_select(1, index.to(v.device))
    bq, bk = cu_q.tolist(), cu_k.tolist()
    outs = []
    for (qs, qe), (ks, ke) in zip(zip(bq[:-1], bq[1:], strict=True), zip(bk[:-1], bk[1:], strict=True), strict=True):
        n, m = qe - qs, ke - ks
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].to(work), k[ks:ke].to(work)) * scale
        shift = 0 if top_left or fault == "top-left" else m - n
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(m, device=q.device)[None, :]
        visible = torch.ones(n, m, dtype=torch.bool, device=q.device)
        if causal or right >= 0:
            visible &= j < torch.clamp(i + 1 + shift + max(right, 0), max=m)
        if left >= 0:
            visible &= j >= i + shift - left
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        weights = torch.nan_to_num(weights).to(q.dtype).to(work)  # a row with no key attends to nothing
        outs.append(torch.einsum("hqk,khd->qhd", weights, v[ks:ke].to(work)))
    return torch.cat(outs).to(q.dtype)


def varlen_attn_fake(
    release: str, *, dtypes: tuple[torch.dtype, ...] = SIXTEEN_BITS, cudnn: bool = True, fault: str | None = None
) -> Callable[..., torch.Tensor]:
    """A `varlen_attn` with the signature and behaviour of torch `release` (one of `RELEASES`); `dtypes` the kernel
    accepts (wider to run float64 models through it on CPU); `cudnn`: the device qualifies for cuDNN (2.14/2.15)."""
    opts = dict(dtypes=dtypes, fault=fault)

    if release == "2.10":

        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return _flash(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal, left=-1, right=-1,
                          scale=None, **opts)  # fmt: skip

        return varlen_attn

    if release == "2.11":

        def varlen_attn(  # type: ignore[misc]
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
        ):
            is_causal = window_size == (-1, 0)
            return _flash(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal, left=window_size[0],
                          right=window_size[1], scale=scale, **opts)  # fmt: skip

        return varlen_attn

    def common(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, list_compare):
        if not enable_gqa and query.size(1) != key.size(1):
            raise ValueError(
                f"Expect query and key/value to have the same number of heads but got Hq={query.size(1)} and "
                f"Hkv={key.size(1)}. Try setting enable_gqa=True for GQA."
            )
        is_causal = list(window_size) == [-1, 0] if list_compare else window_size == (-1, 0)
        return is_causal

    def run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa):
        if release in ("2.12", "2.13"):
            is_causal = common(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
                               False)  # fmt: skip
            top_left = False
        elif release == "2.14":
            is_causal = common(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
                               False)  # fmt: skip
            # cuDNN: full (non-windowed, non-causal) attention only, more than 128 queries, no GQA
            top_left = (
                cudnn and list(window_size) == [-1, -1] and max_q > 128 and query.size(1) == key.size(1)
            )  # fmt: skip
        elif release == "2.15":
            if scale is not None and not scale > 0:
                raise ValueError(f"scale must be positive, got {scale}")
            is_causal = common(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
                               True)  # fmt: skip
            windowed = list(window_size) not in ([-1, -1], [-1, 0])
            eligible = (
                cudnn and not windowed and query.size(1) == key.size(1) and (not is_causal or cu_seq_q is cu_seq_k)
            )  # fmt: skip
            if not eligible and not torch.backends.cuda.flash_sdp_enabled():
                raise RuntimeError("No viable backend for varlen_attn: flash is disabled and cuDNN is not eligible")
            top_left = eligible
        else:
            raise ValueError(f"no fake for torch {release}")
        return _flash(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal, left=window_size[0],
                      right=window_size[1], scale=scale, top_left=top_left, **opts)  # fmt: skip

    def varlen_attn(  # type: ignore[misc]
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
    ):  # fmt: skip
        return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa)

    return varlen_attn


def flash_attn_module(
    version: str, *, dtypes: tuple[torch.dtype, ...] = SIXTEEN_BITS, fault: str | None = None
) -> types.ModuleType:
    """A `flash_attn` module of `version` with `flash_attn_varlen_func` (flash-attn 2.x's signature; `window_size`
    from 2.3)."""
    module = types.ModuleType("flash_attn")
    module.__version__ = version  # type: ignore[attr-defined]

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
        causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
        return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        return _flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                      left=window_size[0], right=window_size[1], scale=softmax_scale, dtypes=dtypes,
                      fault=fault)  # fmt: skip

    module.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    return module


def install_release(monkeypatch, release: str, **options) -> None:
    """Make torch's `varlen_attn` the fake of `release` for one test (the kernel module reads its signature anew)."""
    import torch.nn.attention.varlen as varlen

    from trl_ext.toolkit.packing import kernels

    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn_fake(release, **options))
    kernels._varlen_parameters.cache_clear()  # the caller clears it again after the test (`fresh_signature`)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # no flash-attn: `import flash_attn` raises ImportError
