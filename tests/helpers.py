"""Helpers that several test modules share, in one place (no test module imports another): the `recorder` test
plugin, a third-party plugin's source, the code-names reader, a reference varlen kernel, tiny float64 models.

Comparison helpers and builders of the equivalence tests are in `tests/equivalence.py`; fake package metadata in
`tests/_fakes.py`; the architecture sweep's table in `tests/plugins/sweep.py`.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import trl_ext
from trl_ext.spec import PluginSpec
from trl_ext.testing import make_model

# ---------------------------------------------------------------------------------------------------------------------
# The `recorder` test plugin: records every hook, answers the exclusive ones with pass-through wrappers
# ---------------------------------------------------------------------------------------------------------------------


class CountingCollator:
    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def __call__(self, examples):
        self.calls += 1
        return self.inner(examples)


@dataclasses.dataclass(frozen=True)
class RecorderOptions:
    """Options of the `recorder` test plugin.

    Args:
        note (`str`, *optional*, defaults to `""`):
            Any text.
    """

    note: str = ""


class Recorder:
    """A third-party test plugin: records every hook, and answers the exclusive ones with pass-through wrappers."""

    TRL_EXT_PLUGIN = PluginSpec(
        name="recorder",
        summary="Records every hook.",
        options=RecorderOptions,
        calls=("DPOTrainer._precompute_ref_logps",),
    )

    def __init__(self):
        self.events = []
        self.forward_calls = {}
        self.collators = []
        self.generation_calls = 0

    @trl_ext.hookimpl
    def trl_ext_validate_config(self, config, trl_version):
        self.events.append(("validate", dataclasses.asdict(config.options("recorder"))))

    @trl_ext.hookimpl
    def trl_ext_trainer_init_start(self, trainer, context, init_kwargs):
        # TRL's __init__ has not run yet: the trainer has no model, and the constructor arguments are visible.
        self.events.append(("init_start", type(trainer).__name__, hasattr(trainer, "model"), "args" in init_kwargs))
        context.state["recorder"] = {"trainer_class": context.trainer_class}

    @trl_ext.hookimpl
    def trl_ext_make_collator(self, trainer, context, collator):
        self.events.append(("make_collator", type(collator).__name__))
        wrapped = CountingCollator(collator)
        self.collators.append(wrapped)
        return wrapped

    @trl_ext.hookimpl
    def trl_ext_make_packed_forward(self, trainer, context, role, backbone):
        self.events.append(("make_packed_forward", role))
        original = backbone.forward

        def forward(*args, **kwargs):
            self.forward_calls[role] = self.forward_calls.get(role, 0) + 1
            return original(*args, **kwargs)

        return forward

    @trl_ext.hookimpl
    def trl_ext_trainer_models_ready(self, trainer, context):
        self.events.append(("models_ready", hasattr(trainer, "ref_model")))

    @trl_ext.hookimpl
    def trl_ext_call(self, trainer, context, call):
        # DPO's reference precompute: the models are ready, and no forward has run yet.
        _, name, batch_size = call.args
        self.events.append(("make_ref_precompute", name, batch_size, sum(self.forward_calls.values())))
        return call.proceed()

    @trl_ext.hookimpl
    def trl_ext_trainer_init_end(self, trainer, context):
        self.events.append(("init_end", context.state["recorder"]["trainer_class"]))

    @trl_ext.hookimpl
    def trl_ext_reduce_metrics(self, trainer, context, logs):
        self.events.append(("reduce_metrics", "loss" in logs or "train_loss" in logs))

    @trl_ext.hookimpl
    def trl_ext_make_generation_context(self, trainer, context, model, call_kwargs):
        from trl.models.utils import unwrap_model_for_generation  # TRL's own, unpatched definition

        self.generation_calls += 1
        self.events.append(("make_generation_context", sorted(call_kwargs)))
        return unwrap_model_for_generation(model, **call_kwargs)

    @trl_ext.hookimpl
    def trl_ext_uninstall(self, installation):
        self.events.append(("uninstall",))

    def names(self):
        return [e[0] for e in self.events]


# ---------------------------------------------------------------------------------------------------------------------
# The example plugin of docs/writing-plugins.md, as printed (tests/test_third_party.py installs it)
# ---------------------------------------------------------------------------------------------------------------------


def example_plugin_files() -> dict[str, str]:
    """`{file name: text}` of the example package of docs/writing-plugins.md: its code blocks that start with
    `# my_package/<file>`, as printed."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "writing-plugins.md").read_text()
    files = {
        match[1]: block
        for block in re.findall(r"```(?:python|toml)\n(.*?)```", page, flags=re.S)
        if (match := re.match(r"# my_package/(\S+)\n", block))
    }
    assert set(files) == {"trl_ext_fused.py", "pyproject.toml"}, sorted(files)
    return files


# ---------------------------------------------------------------------------------------------------------------------
# The names a module's code uses (docstrings left out): the core-names and plugin-relations rules
# ---------------------------------------------------------------------------------------------------------------------


def imported_from(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a `from ... import` statement of a module of `package` imports from."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


#: `parse`'s trees, by source text.
_PARSED: dict[str, ast.Module] = {}


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse(source)`, parsed once per test run: the house tests walk every module of trl_ext/ and tests/
    several times (~5 ms a parse). Callers only read the tree."""
    tree = _PARSED.get(source)
    if tree is None:
        tree = _PARSED[source] = ast.parse(source, filename)
    return tree


def code_tokens(path: Path) -> set[str]:
    tree = parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    tokens: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            tokens.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
        elif isinstance(node, ast.Name):
            tokens.add(node.id)
        elif isinstance(node, ast.Attribute):
            tokens.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            tokens.add(node.name)
    return tokens


# ---------------------------------------------------------------------------------------------------------------------
# A reference varlen attention kernel for CPU (the dispatch, shared-prompt and GPU tests)
# ---------------------------------------------------------------------------------------------------------------------


class ReferenceVarlen:
    """Varlen attention on CPU, as the flash kernels define it: per segment, query `i` of `n` over `m` keys is
    aligned at `i + m - n`; causal: keys `j <= i + m - n`; a window `w`: also `j >= i + m - n - w`. Records each
    call's metadata (the metadata tests count them; the kernel probe's calls apart, in `probe_calls`)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.probe_calls: list[dict] = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, causal, window, scale):
        assert q.dim() == 3 and k.dim() == 3 and cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        bq, bk = cu_q.tolist(), cu_k.tolist()
        assert bq[-1] == q.shape[0] and bk[-1] == k.shape[0] and len(bq) == len(bk)
        lengths_q = [b - a for a, b in zip(bq[:-1], bq[1:], strict=True)]
        lengths_k = [b - a for a, b in zip(bk[:-1], bk[1:], strict=True)]
        assert max_q == max(lengths_q) and max_k == max(lengths_k)
        from trl_ext.api import current_call

        call = {"cu_q": cu_q, "causal": causal, "window": window, "segments": len(lengths_q)}
        (self.probe_calls if current_call().probing else self.calls).append(call)
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        outs = []
        spans_q = zip(bq[:-1], bq[1:], strict=True)
        for (qs, qe), (ks, ke) in zip(spans_q, zip(bk[:-1], bk[1:], strict=True), strict=True):
            n, m = qe - qs, ke - ks
            scores = torch.einsum("qhd,khd->hqk", q[qs:qe], k[ks:ke]) * scale
            aligned = torch.arange(n)[:, None] + (m - n)
            j = torch.arange(m)[None, :]
            visible = torch.ones(n, m, dtype=torch.bool)
            if causal or window is not None:
                visible = j <= aligned
            if window is not None:
                visible = visible & (j >= aligned - window)
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hqk,khd->qhd", weights, v[ks:ke]))
        return torch.cat(outs)


#: Gradient checkpointing kwargs that differ from transformers' defaults: the generation tests check they survive.
USER_GC_KWARGS = {"use_reentrant": False, "preserve_rng_state": False}


def gc_online_trainer(online_dpo_args, tokenizer, **overrides):
    """An `OnlineDPOTrainer` (tiny Llama, no reference model, bf16 off) with gradient checkpointing on with
    `USER_GC_KWARGS`; `overrides` go to the config."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    from trl_ext.testing import length_reward, make_prompt_dataset

    args = online_dpo_args(
        gradient_checkpointing=True, gradient_checkpointing_kwargs=dict(USER_GC_KWARGS), bf16=False, **overrides
    )
    return OnlineDPOTrainer(
        model=make_model(), reward_funcs=length_reward, args=args, train_dataset=make_prompt_dataset(4),
        processing_class=tokenizer,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Tiny float64 models of the padding_free coverage and prompt_sharing architecture tests
# ---------------------------------------------------------------------------------------------------------------------


#: The sizes of the tiny models built from a config: 2 layers, hidden 32, 4 heads (2 key/value heads).
TINY_SIZES = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
#: The special token ids of the tiny models built from a config.
TINY_TOKENS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)


def tiny(kind: str = "llama", seed: int = 0):
    """Tiny float64 models: a dense Llama, a sliding-window Mistral (window 4), a Mixtral (4 experts, top-2, aux loss
    coefficient 0.5 so that the auxiliary loss weighs in the comparison), a StableLM (partial rotary)."""
    from transformers import (
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        StableLmConfig,
        StableLmForCausalLM,
    )

    common = dict(
        vocab_size=256,
        **TINY_SIZES,
        max_position_embeddings=512,
        **TINY_TOKENS,
    )
    torch.manual_seed(seed)
    if kind == "llama":
        model = make_model(dtype=torch.float64, seed=seed)
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=4, **common)).to(torch.float64)
    elif kind == "mixtral":
        config = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5, **common)
        config._experts_implementation = "eager"  # grouped-mm experts have no fp64 CPU kernel
        model = MixtralForCausalLM(config).to(torch.float64)
    elif kind == "stablelm":
        # its decoder layer drops `cu_seq_lens_q` on the way to the attention: under gradient checkpointing the
        # recomputed layer finds the sequence bounds in the packed position_ids only
        model = StableLmForCausalLM(StableLmConfig(**common)).to(torch.float64)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)  # far from uniform, so misplaced tokens move log-probs a lot
    model.config._attn_implementation_internal = "sdpa"
    return model


#: The dense architectures whose packed / shared forward test_padding_free.py and test_prompt_sharing.py check alone
#: (`windowed_model`): sliding windows shorter than the sequences where the architecture has them.
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "phi3", "olmo2")
WINDOWED_KWARGS = dict(
    vocab_size=128,
    **TINY_SIZES,
    head_dim=8,
    max_position_embeddings=256,
    **TINY_TOKENS,
)
WINDOWED_EXTRA = {
    "mistral": {"sliding_window": 6},
    "qwen2": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    "gemma3_text": {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {"sliding_window": 6},
}


def windowed_model(model_type: str, attn: str):
    """A tiny float64 model of `model_type` (vocabulary 128, window 6 where it has one) with attention `attn`, in eval
    mode, seeded 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **WINDOWED_KWARGS, **WINDOWED_EXTRA.get(model_type, {}))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float64).eval()


# ---------------------------------------------------------------------------------------------------------------------
# Online DPO over a stored generation (the `online_build` fixture is in tests/plugins/conftest.py)
# ---------------------------------------------------------------------------------------------------------------------

#: Tolerances of the float64 Online DPO comparisons (Llama's RMSNorm runs in float32; see
#: tests/plugins/test_prompt_sharing.py)
ONLINE_GRAD_RTOL = 1e-6
ONLINE_LOGPS_RTOL = 1e-9


def generate_arity() -> int:
    """`OnlineDPOTrainer._generate` returns 4 tensors on TRL 1.12 and those plus `vision_inputs` on 1.16."""
    import inspect

    from trl.experimental.online_dpo import OnlineDPOTrainer

    return 5 if "vision_inputs = self._generate(" in inspect.getsource(OnlineDPOTrainer.training_step) else 4


def online_step(trainer):
    """One Online DPO training step from zero gradients: the loss and every gradient."""
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.training_step(trainer.model, {"prompt": ["w1 w2"] * 3})
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss, grads


# ---------------------------------------------------------------------------------------------------------------------
# Launching a script under torchrun (several CPU processes, gloo); the scripts share tests/plugins/scripts/_launched.py
# ---------------------------------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
PLUGIN_SCRIPTS = REPO / "tests" / "plugins" / "scripts"


def deepspeed_config(stage: int, **extra: Any) -> dict:
    """A DeepSpeed config: ZeRO `stage`, TRL's "auto" batch sizes and clipping, any optimizer, no progress prints;
    `extra` on top."""
    keys = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping")
    zero = {"zero_optimization": {"stage": stage, "overlap_comm": False}, "zero_allow_untested_optimizer": True}
    return {**dict.fromkeys(keys, "auto"), **zero, "steps_per_print": 10**9, **extra}


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of a launched test process: this one's, with this checkout first on `PYTHONPATH`, one intra-op
    thread per process, no progress bars, offline, warnings off, DeepSpeed on the CPU, TRL's experimental-API warning
    silenced, no `TRL_EXT_*` setting but the log level; then `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRL_EXT_") or k == "TRL_EXT_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    env.update(DS_ACCELERATOR="cpu", TRL_EXPERIMENTAL_SILENCE="1", **extra)
    return env


def launch(script: Path | str, *args: str, nproc: int = 2, timeout: float = 900) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node NPROC SCRIPT ARGS...` in `launch_env()`; the finished process (output
    captured)."""
    env = launch_env()
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", f"--nproc_per_node={nproc}", str(script), *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def trl_ext_records():
    """Records of the trl_ext loggers at INFO and above (they do not propagate to the root logger, so caplog cannot
    see them)."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    root = logging.getLogger("trl_ext")
    handler, level = _Keep(level=logging.DEBUG), root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def plant_attention(request, name: str, forward) -> Any:
    """Put `forward` in transformers' attention registry under `name` for the test, and return the function it
    replaces. At teardown the replaced one comes back only if `forward` is still registered: trl-ext may have removed
    the registration since (its trainer detached), and `monkeypatch.setitem` would bring back a registration no
    trainer holds, for every later test."""
    from transformers import AttentionInterface

    from trl_ext import _compat

    registry = _compat.attention_registry(AttentionInterface)
    replaced = registry[name]
    registry[name] = forward

    def restore() -> None:
        if registry.get(name) is forward:
            registry[name] = replaced

    request.addfinalizer(restore)
    return replaced
