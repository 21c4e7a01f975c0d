"""What the DPO equivalence tests share: a trainer builder, sharpened tiny models, and the stock-vs-optimized
comparison of per-sequence log-probs, loss and gradients on the same examples.

Used by tests/plugins/test_padding_free*.py, tests/plugins/test_prompt_sharing.py and the patched-TRL tests in
tests/patches/ (which run against a patched TRL, see patches/check.sh). Each test module keeps its own tolerances,
with the reason next to them; the helpers take them as arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import trl_ext
from trl_ext.testing import make_model


def _trl_loss_types() -> list[str]:
    # read from the installed TRL (its `loss_type` help and `_compute_loss` branches), not kept by hand: a loss type a
    # TRL adds is parametrized, and must pass, in every equivalence test that covers "every loss type"
    from trl_ext.plugins.token_budget.hooks import trl_loss_types

    return sorted(trl_loss_types())


#: Every DPO loss type of the installed TRL.
TRL_LOSS_TYPES = _trl_loss_types()

#: The loss options, each on the loss types it applies to (the cases after the one-per-type ones).
LOSS_OPTION_CASES: list[dict] = [
    {"loss_types": ["robust"], "label_smoothing": 0.1},
    {"loss_types": ["aot", "aot_unpaired"], "label_smoothing": 0.1},
    {"loss_types": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
    {"loss_types": ["sigmoid"], "ld_alpha": 0.5},
    {"loss_types": ["sigmoid_norm", "ipo"], "ld_alpha": 0.3, "loss_weights": [1.0, 0.5]},
    # not with "sft": TRL's `per_sequence_loss *= weights` fails on its expanded sft loss (stock TRL 1.12 and 1.16)
    {"loss_types": ["sigmoid", "ipo", "apo_down"], "use_weighting": True},
]
#: Every DPO loss type the installed TRL has, and the loss options, as cases for the packing and fused-scoring tests.
#: Each case sets the attributes `DPOTrainer.__init__` stores from `DPOConfig` (`loss_types`, `loss_weights`,
#: `label_smoothing`, `ld_alpha`, `use_weighting`; the same in TRL 1.12 and 1.16) on a trainer built once with
#: `use_weighting=True` (so TRL 1.16's fused head also returns `log_sum_sq_probs`), which runs TRL's real
#: `_compute_loss` for every case at a fraction of the cost of a trainer per case. exo_pair takes log(label_smoothing).
LOSS_CASES: list[dict] = [
    *({"loss_types": [t], **({"label_smoothing": 1e-3} if t == "exo_pair" else {})} for t in TRL_LOSS_TYPES),
    *LOSS_OPTION_CASES,
]


def set_loss(trainer, case: dict) -> None:
    """Give `trainer` the loss of `case` (one of `LOSS_CASES`)."""
    trainer.loss_types = case["loss_types"]
    trainer.loss_weights = case.get("loss_weights", [1.0] * len(case["loss_types"]))
    trainer.label_smoothing = case.get("label_smoothing", 0.0)
    trainer.ld_alpha = case.get("ld_alpha")
    trainer.use_weighting = case.get("use_weighting", False)


def assert_every_loss_case(
    trainers: tuple[Any, ...],
    compare: Callable[[], object],
    cases: list[dict] = LOSS_CASES,
    set_loss: Callable[[Any, dict], None] = set_loss,
    every_type: bool = True,
) -> None:
    """`compare()` with each of `cases` set on every one of `trainers`; the cases that fail are reported together.
    `every_type`: the cases also cover every loss type of the installed TRL."""
    failures = []
    for case in cases:
        for trainer in trainers:
            set_loss(trainer, case)
        try:
            compare()
        except AssertionError as exc:
            failures.append(f"{case}: {exc}")
    assert not failures, "\n".join(failures)
    if every_type:
        assert {t for case in cases for t in case["loss_types"]} == set(TRL_LOSS_TYPES)


def train_logs(trainer: Any) -> list[dict]:
    """Train `trainer`; its logs of the training steps."""
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


def assert_same_logs(expected: list[dict], actual: list[dict], *, rel: float, abs: float, skip=()) -> None:
    """As many logs (at least one), the same keys, every value (timings and `skip` aside) within `rel` / `abs`."""
    assert len(expected) == len(actual) > 0
    for e, a in zip(expected, actual, strict=True):
        assert e.keys() == a.keys()
        for key in e:
            if key.endswith(("runtime", "per_second")) or key in skip:
                continue
            assert a[key] == pytest.approx(e[key], rel=rel, abs=abs), key


def keep_end_data() -> Any:
    """Three pairs whose prompts `truncation_mode="keep_end"` at `max_length=10` cuts whole: a sequence then starts
    with a completion token."""
    from datasets import Dataset

    words = lambda a, n: " ".join(f"w{a + i}" for i in range(n))  # noqa: E731
    rows = [(words(1, 2), words(10, 15), words(30, 2)), (words(40, 3), words(50, 4), words(60, 14))]
    rows += [(words(80, 6), words(90, 1), words(100, 3))]
    return Dataset.from_list([{"prompt": p, "chosen": " " + c, "rejected": " " + r} for p, c, r in rows])


def stock_and_plugin(build: Callable[..., Any], install: dict, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """`build(*args, **kwargs)` twice: a stock trainer, then one built with trl-ext installed with `install` (a trainer
    keeps its plugins after the installation ends)."""
    stock = build(*args, **kwargs)
    with trl_ext.install(**install):
        return stock, build(*args, **kwargs)


def ref_columns(stock: Any, other: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`(stock's, other's)` precomputed reference log-prob columns of the two trainers' training datasets."""
    columns = ("ref_chosen_logps", "ref_rejected_logps")
    return [(torch.tensor(stock.train_dataset[c]), torch.tensor(other.train_dataset[c])) for c in columns]


def lora(targets=("q_proj", "v_proj"), experts: bool = False) -> Any:
    """The equivalence tests' LoRA adapter (r 4, no dropout) on `targets`; `experts`: also on a MoE model's expert
    parameters (peft's `target_parameters`). A new config per trainer."""
    from peft import LoraConfig

    extra = {"target_parameters": ["experts.gate_up_proj", "experts.down_proj"]} if experts else {}
    return LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0, **extra)


def online_generation(
    prompt_lens: tuple[int, ...] = (5, 9, 2),
    completion_lens: tuple[int, ...] = (6, 3, 1, 4, 6, 2),
    width: int = 6,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stored Online DPO generation, to stand in for `_generate` so that every trainer scores the same tokens:
    left-padded prompts repeated twice (as TRL does), completions of different lengths padded after their end.
    Returns `prompt_ids, prompt_mask, completion_ids, completion_mask`."""
    g = torch.Generator().manual_seed(seed)
    p = max(prompt_lens)
    prompt_ids = torch.zeros(len(prompt_lens), p, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, n in enumerate(prompt_lens):
        prompt_ids[i, p - n :] = torch.randint(4, 250, (n,), generator=g)
        prompt_mask[i, p - n :] = 1
    prompt_ids, prompt_mask = prompt_ids.repeat(2, 1), prompt_mask.repeat(2, 1)
    completion_ids = torch.randint(4, 250, (len(completion_lens), width), generator=g)
    completion_mask = (torch.arange(width)[None] < torch.tensor(completion_lens)[:, None]).long()
    return prompt_ids, prompt_mask, completion_ids.masked_fill(completion_mask == 0, 0), completion_mask


def one_thread() -> Iterator[None]:
    """Body of a module fixture: tiny models run as fast on one intra-op thread, and much faster on a shared 2-core
    machine (no spin-waiting). Use as `_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sharpen(model: Any) -> Any:
    """Scale the LM head of a freshly initialised tiny model: its next-token distribution is then far from uniform
    (logit std ~2.5 instead of ~0.16), so scoring a token from the wrong position, sequence or segment moves the
    log-probs a lot, not by a hair."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(16)
    return model


def dpo_builder(
    dpo_args: Callable,
    tokenizer: Any,
    dataset: Any,
    *,
    dtype: torch.dtype | None = None,
    sharpened: bool = True,
    factory: Callable[..., Any] = make_model,
) -> Callable[..., Any]:
    """A `make(**kwargs)` that builds a `DPOTrainer`: policy seed 0, reference seed 1 (`ref=False`: none, for PEFT or
    precompute), both from `factory(**model_kwargs, seed=...)` (`make_model` by default; in `dtype` if given, sharpened
    unless `sharpened=False`); the other keyword arguments go to the `DPOConfig` (bf16 off unless asked: equivalence
    is checked in full precision)."""

    def make(
        *,
        ref: bool = True,
        peft_config: Any = None,
        model_kwargs: dict | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        **args: Any,
    ) -> Any:
        from trl import DPOTrainer

        model_kwargs = dict(model_kwargs or {})
        if dtype is not None:
            model_kwargs.setdefault("dtype", dtype)
        # TRL 1.x defaults to bf16 autocast where supported (CPU included)
        args.setdefault("bf16", False)
        shape = sharpen if sharpened else (lambda m: m)
        model = shape(factory(**model_kwargs))
        ref_model = shape(factory(**{**model_kwargs, "seed": 1})) if ref else None
        if peft_config is not None:
            torch.manual_seed(123)  # the same LoRA init in every trainer
        return DPOTrainer(
            model,
            ref_model=ref_model,
            args=dpo_args(**args),
            train_dataset=dataset if train_dataset is None else train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
        )

    return make


def examples(trainer: Any, n: int = 6) -> list[dict]:
    return [trainer.train_dataset[i] for i in range(n)]


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest `|a - b| / max(1, |b|)`, in float64."""
    return ((a.double() - b.double()).abs() / b.double().abs().clamp(min=1.0)).max().item()


def loss_and_grads(trainer: Any, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's DPO loss of `batch` and the policy's gradients of it."""
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same_grads(expected: dict, actual: dict, rtol: float) -> None:
    """Every gradient equal within `rtol` times the largest |gradient| (and there are gradients to compare)."""
    assert expected.keys() == actual.keys() and expected
    scale = max(g.abs().max().item() for g in expected.values())
    worst = max((expected[n] - actual[n]).abs().max().item() for n in expected)
    assert scale > 0
    assert worst <= rtol * scale, f"grad diff {worst:.3g} vs max |grad| {scale:.3g}"


def compare(
    stock: Any,
    other: Any,
    batch_examples: list[dict],
    *,
    batch_key: str,
    calls: Callable[[], int],
    misses: Callable[[], int],
    logps_rtol: float,
    loss_rtol: float,
    grad_rtol: float,
    logps: bool = True,
) -> tuple[dict, dict]:
    """Per-sequence log-probs (TRL's own `compute_ref_log_probs`, the precompute's scoring), loss and gradients of a
    stock trainer and a trainer with a plugin on the same examples.

    `batch_key` is the key the plugin's collator adds; `calls()` counts the plugin's optimized forwards (it must
    grow) and `misses()` its scoring forwards that ran unoptimized (it must stay 0).
    """
    stock_batch = stock.data_collator(batch_examples)
    other_batch = other.data_collator(batch_examples)
    assert batch_key in other_batch and batch_key not in stock_batch
    before = calls()
    if logps:
        stock_logps = stock.compute_ref_log_probs(stock.model, stock_batch)
        other_logps = other.compute_ref_log_probs(other.model, other_batch)
        for a, b in zip(stock_logps, other_logps, strict=True):
            assert max_rel(b, a) <= logps_rtol
    stock_loss, stock_grads = loss_and_grads(stock, stock_batch)
    other_loss, other_grads = loss_and_grads(other, other_batch)
    assert calls() > before  # the optimized path really ran
    assert misses() == 0
    assert abs(other_loss.item() - stock_loss.item()) <= loss_rtol * max(1.0, abs(stock_loss.item()))
    assert_same_grads(stock_grads, other_grads, grad_rtol)
    return stock_batch, other_batch


#: Each packing plugin: the key its collator adds, and its state's counts of optimized and unoptimized scoring calls.
PACKING = {
    "padding_free": ("trl_ext_packing", "packed_calls", "unpacked_calls"),
    "prompt_sharing": ("trl_ext_prompt_sharing", "shared_calls", "unshared_calls"),
}


def compare_plugin(stock: Any, other: Any, batch_examples: list[dict], plugin: str, **tolerances: Any) -> tuple:
    """`compare` for a trainer with the packing `plugin` (its batch key and counters, `PACKING`); `tolerances`:
    `logps_rtol`, `loss_rtol`, `grad_rtol` (and `logps`)."""
    key, calls, misses = PACKING[plugin]
    state = other._trl_ext.state[plugin]
    return compare(
        stock,
        other,
        batch_examples,
        batch_key=key,
        calls=lambda: getattr(state, calls),
        misses=lambda: getattr(state, misses),
        **tolerances,
    )


#: What a packing plugin refuses in any model, each case with the words of its refusal.
PACKING_REFUSALS = ("flex_attention", "liger", "prompt_tuning")


def assert_refused(build: Callable[..., Any], case: str) -> None:
    """`build(...)` (a `dpo_builder`'s, with a packing plugin installed) refuses the setting `case` of
    `PACKING_REFUSALS` with a `UsageError` naming it: flex attention, Liger kernels, a prompt-learning PEFT adapter."""
    from trl_ext import UsageError

    if case == "flex_attention":
        kwargs, match = {"model_kwargs": {"attn_implementation": "flex_attention"}}, "flex_attention"
    elif case == "liger":
        kwargs, match = {"use_liger_kernel": True}, "use_liger_kernel"
    else:
        from peft import PromptTuningConfig

        prompt_tuning = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
        kwargs, match = {"ref": False, "peft_config": prompt_tuning}, "prompt-learning"
    with pytest.raises(UsageError, match=match):
        build(**kwargs)


def add_mask_window(model: Any, window: int) -> Any:
    """Make every attention layer of a Llama-style `model` apply a sliding window of `window` tokens only through the
    4D mask tensor it receives, as `trust_remote_code` code that derives its locality from the padded mask would:
    nothing in the config or the layer arguments says so, only a measurement sees it. Returns `model`."""

    def add_window(module: Any, args: tuple, kwargs: dict) -> tuple:
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            n, k = mask.shape[-2], mask.shape[-1]
            near = torch.arange(n)[:, None] - torch.arange(k)[None, :] < window
            kwargs["attention_mask"] = mask & near if mask.dtype == torch.bool else mask.masked_fill(~near, -1e30)
        return args, kwargs

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(add_window, with_kwargs=True)
    return model


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any operation creates while active (`.largest`): a test that
    a path never builds `[rows, length, vocab]` logits."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out
