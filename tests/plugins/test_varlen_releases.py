"""The fused varlen kernels of every torch release with `varlen_attn` (2.10 - 2.15) and of flash-attn, through the
project's own translation (`kernels._torch_varlen`, `kernels._flash_attn`), on CPU; and the kernel probe
(`toolkit/packing/probe.py`) that measures a kernel on the training device before it computes anything that trains.

The stand-ins (`tests/varlen_releases.py`) have each release's exact signature and documented behaviour on top of
FlashAttention-2's argument checks, normalizations and mask, so what `_torch_varlen` passes to each release is what
is tested, one level above where `ReferenceVarlen` replaces the kernel in the other varlen tests.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import pytest
import torch

import trl_ext
from tests import equivalence as eq
from tests import varlen_releases as releases
from tests.helpers import ReferenceVarlen, tiny
from trl_ext import UsageError
from trl_ext.api import current_call
from trl_ext.testing import make_preference_dataset
from trl_ext.toolkit.packing import kernels, probe, segments

_one_thread = pytest.fixture(scope="module", autouse=True)(eq.one_thread)
F64 = (torch.float64,)


@pytest.fixture(autouse=True)
def fresh_signature(monkeypatch):
    """Each test reads the signature of the `varlen_attn` it installs, and leaves none cached behind."""
    monkeypatch.setattr(segments, "_CACHE", type(segments._CACHE)())
    kernels._varlen_parameters.cache_clear()
    yield
    kernels._varlen_parameters.cache_clear()


def _kernel(monkeypatch, release: str, dtypes=releases.SIXTEEN_BITS, **options) -> kernels.Kernel:
    """The `varlen_attn` kernel as `installed_kernels()` builds it for the fake of `release`, run on CPU."""
    releases.install_release(monkeypatch, release, dtypes=dtypes, **options)
    kernel = kernels.installed_kernels()["varlen_attn"]
    return dataclasses.replace(kernel, devices=("cpu",), dtypes=dtypes)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# name: (query lengths, key lengths or None for the same tensor, causal, window, heads, kv heads, scale)
CASES = {
    "packed": ([1, 9, 40, 150], None, True, None, 4, 4, None),
    "packed, GQA, own scale": ([3, 30, 140], None, True, None, 8, 2, 0.0625),
    "packed, window": ([1, 9, 40, 150], None, True, 5, 4, 2, None),
    "shared": ([12, 7, 1, 40], [12, 19, 13, 52], True, None, 4, 4, None),
    "shared, window, GQA": ([12, 7, 1, 40], [12, 19, 13, 52], True, 3, 4, 2, 0.2),
    "tail (not causal)": ([5, 2, 140], [19, 13, 162], False, None, 4, 4, None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("release", releases.RELEASES)
def test_each_release_through_the_translation_equals_the_reference(monkeypatch, release, case):
    """`_torch_varlen` against each release's signature: the output equals a float64 reference of the flash
    semantics (bottom-right causal, `(w, 0)` windows, the layer's scale, GQA) to round-off; on torch 2.10, which has
    no `scale` and no `window_size`, such calls raise a ValueError naming the missing argument (the choice and the
    probe keep them on the per-segment loop: the tests below)."""
    lengths_q, lengths_k, causal, window, heads, kv_heads, scale = CASES[case]
    kernel = _kernel(monkeypatch, release, dtypes=F64)
    gen = torch.Generator().manual_seed(0)
    cu_q = _cu(lengths_q)
    cu_k = cu_q if lengths_k is None else _cu(lengths_k)
    lengths_k = lengths_k or lengths_q
    q = torch.randn(sum(lengths_q), heads, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths_k), kv_heads, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    args = (q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k))
    if release == "2.10" and (window is not None or scale is not None):
        assert not kernel.windows and not kernel.scales
        with pytest.raises(ValueError, match="has no `(window_size|scale)`"):
            kernel.call(*args, causal=causal, window=window, scale=scale)
        return
    got = kernel.call(*args, causal=causal, window=window, scale=scale)
    want = ReferenceVarlen()(*args, causal=causal, window=window, scale=scale)
    assert (got - want).abs().max().item() <= 1e-12 * want.abs().max().item()


def test_the_choice_follows_each_release_signature(monkeypatch):
    """torch 2.10's `varlen_attn` has neither `scale` nor `window_size`: a model with its own attention scale or with
    sliding windows keeps the per-segment loop, each reason named; `attention: fused` there is a `UsageError`. From
    2.11 both run fused."""
    bf16 = torch.bfloat16
    old = _kernel(monkeypatch, "2.10")
    monkeypatch.setattr(kernels, "KERNELS", {"varlen_attn": old})
    assert (old.windows, old.scales) == (False, False)
    assert kernels.choose("auto", "cpu", bf16, []).kernel is old  # the default scale, no window: fused
    choice = kernels.choose("auto", "cpu", bf16, [], scales={0.0625})
    assert choice.kernel is None
    assert choice.fallbacks == ("attention scale 0.0625 (varlen_attn of this torch has no scale: torch >= 2.11)",)
    assert "sliding windows" in kernels.choose("auto", "cpu", bf16, [], windows=True).fallbacks[0]
    with pytest.raises(UsageError, match="attention scale 0.0625"):
        kernels.choose("fused", "cpu", bf16, [], scales={0.0625}, plugin="padding_free")
    for release in releases.RELEASES[1:]:
        kernels._varlen_parameters.cache_clear()
        new = _kernel(monkeypatch, release)
        monkeypatch.setattr(kernels, "KERNELS", {"varlen_attn": new})
        assert (new.windows, new.scales) == (True, True)
        assert kernels.choose("auto", "cpu", bf16, [], windows=True, scales={0.0625}).kernel is new


def test_own_scales_reads_the_layers():
    """The scales the choice reads are the layers' own `scaling` where it differs from `head_dim ** -0.5`."""
    model = tiny("mistral")
    assert kernels.own_scales(model) == set()
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.25
    assert kernels.own_scales(model) == {0.25}


@pytest.mark.parametrize("version, chosen", [("2.1.0", False), ("2.2.5", False), ("2.3.0", True), ("2.7.4", True)])
def test_flash_attn_is_chosen_from_2_3(monkeypatch, version, chosen):
    """flash-attn has `window_size` from 2.3: an older one is not used; a newer one computes the shared-prompt
    call (bottom-right, window, GQA, scale) as the reference does."""
    monkeypatch.setitem(sys.modules, "flash_attn", releases.flash_attn_module(version, dtypes=F64))
    found = kernels.installed_kernels()
    assert ("flash_attn" in found) == chosen
    if not chosen:
        return
    lengths_q, lengths_k = [12, 7, 1, 40], [12, 19, 13, 52]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lengths_q), 4, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths_k), 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    args = (q, k, v, _cu(lengths_q), _cu(lengths_k), 40, 52)
    got = found["flash_attn"].call(*args, causal=True, window=3, scale=0.2)
    want = ReferenceVarlen()(*args, causal=True, window=3, scale=0.2)
    assert (got - want).abs().max().item() <= 1e-12 * want.abs().max().item()


def test_rocm_keeps_the_loop(monkeypatch):
    """On ROCm (`torch.version.hip`) the fused kernels are not used (their causal alignment there is not measured):
    the loop, named in the log line; `attention: fused` is refused."""
    kernel = dataclasses.replace(_kernel(monkeypatch, "2.13"), devices=("cuda",))
    monkeypatch.setattr(kernels, "KERNELS", {"varlen_attn": kernel})
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    choice = kernels.choose("auto", "cuda", torch.bfloat16, [])
    assert choice.kernel is None and choice.fallbacks[0].startswith("ROCm (HIP)")
    assert "ROCm (HIP)" in kernels.describe_choice(choice)
    with pytest.raises(UsageError, match="ROCm"):
        kernels.choose("fused", "cuda", torch.bfloat16, [], plugin="prompt_sharing")


def test_unequal_head_dims_keep_the_loop():
    """MLA attention (DeepSeek-V2/V3: query/key head dim 192, value 128) is named at the choice, from the config, and
    the probe (which reads the head dims from each call's query/key/value) refuses such calls without running them."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1,
    )  # fmt: skip
    features = kernels.unsupported_features(DeepseekV3ForCausalLM(config), "sdpa")
    assert "query/key head dim 24 and value head dim 16 (the kernels take one head dim)" in features
    calls = []
    kernel = kernels.Kernel("varlen_attn", ("cpu",), F64, True, lambda *a, **k: calls.append(a))
    pattern = probe.Pattern("cpu", torch.float64, 2, 2, 24, 24, 16, None, None, False)
    result = probe.probe(kernel, pattern)
    assert not result.passed and "head dims 24/24/16 differ" in result.reason and not calls


# ---------------------------------------------------------------------------------------------------------------------
# The probe: round-off passes, every planted fault is refused, in bf16 and fp16
# ---------------------------------------------------------------------------------------------------------------------


def _pattern(dtype, shared, *, heads=8, kv_heads=2, window=4, scale=0.0625, dim=64):
    return probe.Pattern("cpu", dtype, heads, kv_heads, dim, dim, dim, window, scale, shared)


#: The fast loop probes a right kernel of 2.13 (the release of the planted faults and the trainer tests below); 2.11
#: and 2.15 are `slow`. Each release's own translation is checked in the fast loop, for every release, by
#: `test_each_release_through_the_translation_equals_the_reference`.
PROBED_RELEASES = [pytest.param("2.11", marks=pytest.mark.slow), "2.13", pytest.param("2.15", marks=pytest.mark.slow)]


@pytest.mark.parametrize("shared", [False, True], ids=["packed", "shared"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("release", PROBED_RELEASES)
def test_the_probe_passes_a_right_kernel(monkeypatch, release, dtype, shared):
    """A right kernel in 16 bits is within the tolerance (4 epsilons of the dtype) with a margin of 3 or more, with
    GQA, a window and a scale of its own; and with a window wider than the probe's segments."""
    kernel = _kernel(monkeypatch, release)
    for window in (4, None, 4095):
        result = probe.probe(kernel, _pattern(dtype, shared, window=window))
        assert result.passed, result
        assert result.error is not None and result.error <= result.tolerance / 3, result


FAULTS = ["window+1", "window-1", "top-left", "default-scale", "gqa-drop"]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_probe_refuses_each_planted_fault(monkeypatch, fault, dtype):
    """Each fault moves the output or a gradient by 3 tolerances or more on the probe's shapes: a window off by one
    either way, top-left causal alignment (shared prompts: the only calls whose query and key segments differ),
    the default scale instead of the layer's, a key head that serves the wrong group of query heads."""
    kernel = _kernel(monkeypatch, "2.13", fault=fault)
    result = probe.probe(kernel, _pattern(dtype, shared=fault == "top-left"))
    assert not result.passed and result.error is not None, result
    assert result.error >= 3 * result.tolerance, result


def test_a_kernel_that_raises_falls_back_or_is_refused_when_asked_for(monkeypatch, caplog):
    """torch 2.15 with flash SDP disabled raises for calls cuDNN does not take (a windowed call): the probe turns the
    exception into the per-segment loop for that pattern, with one warning naming it; with `attention: fused` it is a
    `UsageError`. Calls cuDNN takes (packed causal, one `cu_seqlens` tensor, no GQA) still pass."""
    kernel = _kernel(monkeypatch, "2.15")
    q = torch.randn(1, 8, 20, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 20, 64, dtype=torch.bfloat16)
    was = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        auto = kernels.Choice(kernel, "cpu", torch.bfloat16, plugin="padding_free")
        with caplog.at_level(logging.WARNING, logger="trl_ext"):
            assert probe.checked_kernel(auto, kernel, q, k, k, 4, None, False) is None
            assert probe.checked_kernel(auto, kernel, q, k, k, 4, None, False) is None  # judged once
        warnings = [r.getMessage() for r in caplog.records if "failed its probe" in r.getMessage()]
        assert len(warnings) == 1 and "raised RuntimeError: No viable backend" in warnings[0]
        assert "these calls run per segment" in warnings[0]
        mha = torch.randn(1, 8, 20, 64, dtype=torch.bfloat16)  # cuDNN takes no GQA
        assert probe.checked_kernel(auto, kernel, q, mha, mha, None, None, False) is kernel
        fused = kernels.Choice(kernel, "cpu", torch.bfloat16, plugin="padding_free", requested="fused")
        with pytest.raises(UsageError, match="attention: fused.*failed its probe"):
            probe.checked_kernel(fused, kernel, q, k, k, 4, None, False)
    finally:
        torch.backends.cuda.enable_flash_sdp(was)


def test_the_probe_leaves_training_state_alone(monkeypatch):
    """Run inside a forward under no_grad, autocast and an activation checkpoint's saved-tensor hooks, the probe
    measures as if alone, draws nothing from the global generators, and leaves the caller's modes as they were."""
    kernel = _kernel(monkeypatch, "2.13")
    pattern = _pattern(torch.bfloat16, shared=True)
    state = torch.get_rng_state()
    packed = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), hooks:
        result = probe.probe(kernel, pattern)
        assert not torch.is_grad_enabled() and torch.is_autocast_enabled("cpu")
    assert result.passed, result
    assert not packed and torch.equal(torch.get_rng_state(), state)


@pytest.mark.slow  # seconds: twelve probes of 32 heads x 128 dims on the CPU
def test_probe_installed_kernels_reports_each_pattern(monkeypatch):
    """The report `trl-ext bench --device cuda` records: one entry per kernel, dtype and pattern."""
    releases.install_release(monkeypatch, "2.13")
    assert probe.probe_installed_kernels("cpu") == []  # varlen_attn runs on CUDA only
    cpu = dataclasses.replace(kernels.installed_kernels()["varlen_attn"], devices=("cpu",))
    monkeypatch.setattr(probe, "installed_kernels", lambda: {"varlen_attn": cpu})
    rows = probe.probe_installed_kernels("cpu")
    assert len(rows) == 2 * 2 * 3 and {r["kernel"] for r in rows} == {"varlen_attn"}
    assert all(r["passed"] and r["error"] <= r["tolerance"] / 3 for r in rows), rows


# ---------------------------------------------------------------------------------------------------------------------
# A real DPOTrainer at default options with a wrong kernel never trains differently
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset():
    return make_preference_dataset(12, seed=0, prompt_median=10, completion_median=6)


def _scaled_mistral(seed: int = 0, **_):
    """A tiny float64 Mistral (window 4, 4 heads over 2 key heads) whose layers scale attention by 0.25."""
    model = tiny("mistral", seed=seed)
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.25
    return model


def _counting(kernel: kernels.Kernel) -> tuple[kernels.Kernel, list]:
    calls: list = []

    def call(*args, **options):
        if not current_call().probing:
            calls.append(options)
        return kernel.call(*args, **options)

    return dataclasses.replace(kernel, call=call), calls


_SLOW = pytest.mark.slow  # the fast loop keeps one right and one wrong kernel per plugin
CASES_TRAINER = [
    ("padding_free", None),
    ("padding_free", "window+1"),
    pytest.param("padding_free", "default-scale", marks=_SLOW),
    pytest.param("padding_free", "gqa-drop", marks=_SLOW),
    pytest.param("prompt_sharing", None, marks=_SLOW),
    ("prompt_sharing", "top-left"),
    pytest.param("prompt_sharing", "window-1", marks=_SLOW),
]


@pytest.mark.parametrize("plugin, fault", CASES_TRAINER)
def test_a_wrong_kernel_never_trains(monkeypatch, plugin, fault, dpo_args, tokenizer, dataset, caplog):
    """A real DPOTrainer (float64, default options) with the torch 2.13 kernel "installed" for CPU: the right kernel
    runs every layer and equals stock (log-probs, loss, gradients within the sweep's 1e-6); a kernel with a planted
    fault is measured by the probe at its first call, refused with a warning naming the error, and the per-segment
    loop computes instead: equal to stock, nothing trained wrong."""
    kernel, calls = _counting(_kernel(monkeypatch, "2.13", dtypes=F64, fault=fault))
    monkeypatch.setattr(kernels, "KERNELS", {"varlen_attn": kernel})
    build = eq.dpo_builder(dpo_args, tokenizer, dataset, sharpened=False, factory=_scaled_mistral)
    stock = build()
    with caplog.at_level(logging.INFO, logger="trl_ext"):
        with trl_ext.install(**{plugin: True}):
            fused = build()
        state = fused._trl_ext.state[plugin]
        counter = (lambda: state.packed_calls) if plugin == "padding_free" else (lambda: state.shared_calls)
        misses = (lambda: state.unpacked_calls) if plugin == "padding_free" else (lambda: state.unshared_calls)
        key = "trl_ext_packing" if plugin == "padding_free" else "trl_ext_prompt_sharing"
        eq.compare(
            stock, fused, eq.examples(stock), batch_key=key, calls=counter, misses=misses,
            logps_rtol=1e-6, loss_rtol=1e-6, grad_rtol=1e-6,
        )  # fmt: skip
    messages = [r.getMessage() for r in caplog.records]
    assert f"{plugin}: packed attention: varlen_attn (cpu, float64)" in messages
    failed = [m for m in messages if "failed its probe" in m]
    if fault is None:
        assert not failed and calls and any(m.startswith(f"{plugin}: varlen_attn passed its probe") for m in messages)
        assert {c["window"] for c in calls if c["causal"]} == {3} and {c["scale"] for c in calls} == {0.25}
    else:
        assert failed and not calls, (failed, len(calls))
        assert all(m.startswith(f"{plugin}: varlen_attn failed its probe (cpu, float64") for m in failed)


def test_attention_fused_with_a_wrong_kernel_stops_before_any_step(monkeypatch, dpo_args, tokenizer, dataset):
    """With `attention: fused` a kernel that fails its probe is a `UsageError` at the first forward: no parameter
    changed."""
    kernel = _kernel(monkeypatch, "2.13", dtypes=F64, fault="window+1")
    monkeypatch.setattr(kernels, "KERNELS", {"varlen_attn": kernel})
    build = eq.dpo_builder(dpo_args, tokenizer, dataset, sharpened=False, factory=_scaled_mistral)
    with trl_ext.install(padding_free=True, plugins={"padding_free": {"attention": "fused"}}):
        trainer = build(max_steps=1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(
        UsageError, match="padding_free: `attention: fused` asks for varlen_attn, which failed its probe"
    ):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_doctor_names_each_kernel_and_what_it_lacks(monkeypatch):
    """`trl-ext doctor` says which fused kernel is installed and what its release lacks."""
    from trl_ext.app.cli import _fused_kernels

    releases.install_release(monkeypatch, "2.10")
    assert _fused_kernels().startswith("varlen_attn (no window_size, no scale: such models run per segment): CUDA")
    kernels._varlen_parameters.cache_clear()
    releases.install_release(monkeypatch, "2.13")
    monkeypatch.setitem(sys.modules, "flash_attn", releases.flash_attn_module("2.6.3"))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    line = _fused_kernels()
    assert line.startswith("varlen_attn, flash_attn: CUDA bf16/fp16 only; not used on ROCm"), line


def test_detach_forgets_the_models_kernel_choice(monkeypatch, dpo_args, tokenizer, dataset):
    """A trainer's kernel choices (and their probe verdicts) are kept per model config while it is attached, and
    forgotten when it is detached."""
    kernel = _kernel(monkeypatch, "2.13", dtypes=F64)
    monkeypatch.setattr(kernels, "KERNELS", {"varlen_attn": kernel})
    build = eq.dpo_builder(dpo_args, tokenizer, dataset, sharpened=False, factory=_scaled_mistral)
    installation = trl_ext.install(padding_free=True)
    with installation:
        trainer = build()
    layer = trainer.model.model.layers[0].self_attn
    assert kernels.choice_for(layer) is not None
    installation.detach(trainer)
    assert kernels.choice_for(layer) is None and id(trainer.model.config) not in kernels._CHOICES
