"""The measured parts of `trl-ext bench --device` (`PARTS`; docs/benchmarks.md says what each measures), each run in
a process of its own by `bench.device`, under its own timeout:
`python -m trl_ext.app.bench.device_parts PART --device D --preset P --rounds R --warmup W --out FILE`.

A step is what the Trainer's loop runs for one optimizer step: `get_batch_samples` (token_budget cuts its micro-batches
there), `training_step` per batch and an AdamW step, between `torch.cuda.synchronize()` calls, with
`torch.cuda.max_memory_allocated` reset before it. The JSON is written after each checkpointing setting, so a part cut
short by its timeout keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .device_workload import PRESETS, SETTINGS, make_model, online_trainer
from .device_workload import cuda as _cuda
from .stats import against, interleave, progress, ratios, summarize

PARTS = ("kernel_probe", "packing", "fused_logprobs", "token_budget")


def _sync(device: str) -> None:
    import torch

    if _cuda(device):
        torch.cuda.synchronize()


def set_checkpointing(trainer: Any, on: bool) -> None:
    model = trainer.model
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.train()


def attention_of(trainer: Any) -> str | None:
    """The packed attention a packing plugin chose for the trainer's policy (fused kernel or per-segment loop)."""
    from ...toolkit.packing.kernels import describe_choice

    context = getattr(trainer, "_trl_ext", None)
    for state in getattr(context, "state", {}).values():
        choice = getattr(state, "kernels", {}).get("policy")
        if choice is not None:
            return describe_choice(choice)
    return None


def _checks(trainer: Any) -> int:
    """How many scoring calls `verify` has checked against stock on this trainer (each with extra stock forwards)."""
    return len(getattr(getattr(getattr(trainer, "_trl_ext", None), "verified", None), "results", ()))


class Stepper:
    """One variant's trainer, its optimizer and its steps' batches; `step(i)` runs step `i mod len(steps)` and
    records its peak."""

    def __init__(self, trainer: Any, device: str) -> None:
        import torch
        from transformers.trainer_callback import PrinterCallback

        self.trainer, self.device = trainer, device
        trainer.remove_callback(PrinterCallback)
        self.steps = self._batches()
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-6, fused=_cuda(device))
        self.peaks: list[float] = []
        self.losses: list[float] = []
        self.checked: list[bool] = []  # per step: whether `verify` checked it (train() checks the first only)

    def _batches(self) -> list[list[Any]]:
        """Every optimizer step's micro-batches, through the plugins' loader collators."""
        trainer = self.trainer
        ga = trainer.args.gradient_accumulation_steps
        trainer.current_gradient_accumulation_steps = ga  # set by the Trainer's loop; read by training_step
        loader = iter(trainer.get_train_dataloader())
        steps: list[list[Any]] = []
        with contextlib.suppress(StopIteration):
            while True:
                steps.append([next(loader) for _ in range(ga)])
        return steps

    def tokens(self) -> tuple[int, int]:
        """(real, padded) tokens of every step's stock batches, as the collator padded them."""
        masks = [batch["attention_mask"] for step in self.steps for batch in step]
        return sum(int(mask.sum()) for mask in masks), sum(mask.numel() for mask in masks)

    def step(self, index: int, keep: bool = True) -> float:
        import torch

        trainer, cuda = self.trainer, _cuda(self.device)
        trainer.model.zero_grad(set_to_none=True)
        _sync(self.device)
        before = 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        checks, start = _checks(trainer), time.perf_counter()
        batches = self.steps[index % len(self.steps)]
        samples, items = trainer.get_batch_samples(iter(batches), len(batches), trainer.args.device)
        losses = [trainer.training_step(trainer.model, inputs, items).detach() for inputs in samples]
        self.optimizer.step()
        _sync(self.device)
        seconds = time.perf_counter() - start
        trainer.state.global_step += 1  # as the Trainer's loop does: `verify` checks the first step only
        self.checked.append(_checks(trainer) > checks)
        loss = float(sum(losses))  # read after the step: no host synchronisation inside it
        if keep:
            if cuda:
                self.peaks.append((torch.cuda.max_memory_allocated() - before) / 2**30)
            self.losses.append(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss}")
        return seconds


def measure(steppers: dict[str, Stepper], opts: argparse.Namespace, tokens: float) -> dict[str, Any]:
    """Each variant's first step (its loss), then warm-up and interleaved rounds; per variant the median step, real
    tokens per second, the step peak and the speed-up over the first variant (median of per-round ratios, IQR)."""
    base = next(iter(steppers))
    first = {}
    for name, s in steppers.items():
        s.step(0)
        first[name] = s.losses[-1]
        for index in range(1, len(s.steps)):  # every batch's shapes seen once before any timed step
            s.step(index, keep=False)
        s.peaks.clear()
        s.checked.clear()

    def arm(name: str):
        return lambda index: steppers[name].step(index, keep=index >= opts.warmup)

    times = interleave({n: arm(n) for n in steppers}, rounds=opts.rounds, what=opts.what, warmup=opts.warmup)
    out: dict[str, Any] = {}
    for name, s in steppers.items():
        median = statistics.median(times[name])
        entry: dict[str, Any] = {
            "step_s": times[name],
            "step_median_s": median,
            "tokens_per_s": tokens / median if median else None,
            "step_peak_gb": max(s.peaks) if s.peaks else None,
            "first_loss": first[name],
            "first_loss_rel_diff": abs(first[name] - first[base]) / max(1e-12, abs(first[base])),
            "attention": attention_of(s.trainer),
            "verified_timed_steps": sum(s.checked),  # verify's stock forwards in a timed step: not the plugin's time
        }
        if name != base:
            entry["speedup"] = against(summarize(ratios(times, base, name)), base)
            peak, base_peak = entry["step_peak_gb"], out[base]["step_peak_gb"]
            entry["peak_ratio"] = peak / base_peak if peak is not None and base_peak else None
        out[name] = entry
        progress(f"{opts.what}: {name}: {median:.3f} s per step, attention {entry['attention']}")
    if "padding_free" in out and "prompt_sharing" in out and base != "padding_free":
        out["prompt_sharing"]["speedup_vs_padding_free"] = against(
            summarize(ratios(times, "padding_free", "prompt_sharing")), "padding_free"
        )
    return out


def dpo_trainer(preset: dict[str, Any], models: tuple[Any, Any], data: Any, opts: Any, flags: dict, **config: Any):
    from trl import DPOConfig, DPOTrainer

    import trl_ext

    from .workload import make_tokenizer

    kwargs: dict[str, Any] = dict(
        output_dir=opts.tmp,
        per_device_train_batch_size=preset["pairs"],
        max_length=preset["max_length"],
        report_to=[],
        use_cpu=not _cuda(opts.device),
        bf16=False,  # bf16 weights on the GPU, float32 on the CPU: no autocast
        save_strategy="no",
        logging_steps=10**6,
        gradient_checkpointing=False,  # set per setting
        train_sampling_strategy="sequential",  # every variant the same pairs in the same steps
        dataloader_drop_last=True,
        seed=0,
    )
    args = DPOConfig(**{**kwargs, **config})
    policy, ref = (copy.deepcopy(m) for m in models)
    with trl_ext.install(flags) if flags else contextlib.nullcontext():
        return DPOTrainer(
            policy,
            ref_model=ref,
            args=args,
            train_dataset=data,
            processing_class=make_tokenizer(preset["model"]["vocab"]),
        )


def _dpo_setup(opts: argparse.Namespace) -> tuple[dict[str, Any], tuple[Any, Any], Any]:
    from datasets import Dataset

    from .workload import preference_rows

    preset = PRESETS[opts.preset]
    rows = preference_rows(
        preset["pairs"] * preset["batches"], vocab_size=preset["model"]["vocab"], **preset["lengths"]
    )
    data = Dataset.from_list(rows)
    models = (make_model(preset, opts.device, 0), make_model(preset, opts.device, 1))
    return preset, models, data


def _settings(opts: argparse.Namespace, steppers: dict[str, Any], tokens: float, record: dict[str, Any]) -> None:
    """Both checkpointing settings measured (`tokens`: real tokens per step), the JSON written after each."""
    for key, on in SETTINGS:
        for s in steppers.values():
            set_checkpointing(s.trainer, on)
        opts.what = f"{opts.part}, gradient checkpointing {'on' if on else 'off'}"
        record["settings"][key] = measure(steppers, opts, tokens)
        _write(record, opts)


def packing(opts: argparse.Namespace, record: dict[str, Any]) -> None:
    preset, models, data = _dpo_setup(opts)
    steppers = {"stock": Stepper(dpo_trainer(preset, models, data, opts, {}), opts.device)}
    for name in ("padding_free", "prompt_sharing"):
        steppers[name] = Stepper(dpo_trainer(preset, models, data, opts, {name: True}), opts.device)
    real, padded = steppers["stock"].tokens()
    steps = len(steppers["stock"].steps)
    record.update(token_bound=padded / real, real_tokens=real, padded_tokens=padded, steps=steps)
    _settings(opts, steppers, real / steps, record)


def token_budget(opts: argparse.Namespace, record: dict[str, Any]) -> None:
    from .plugin_sections import token_bound

    preset, models, data = _dpo_setup(opts)
    micro, ga = preset["micro_pairs"], preset["pairs"] // preset["micro_pairs"]
    shape = dict(per_device_train_batch_size=micro, gradient_accumulation_steps=ga)
    fixed = dpo_trainer(preset, models, data, opts, {"padding_free": True}, **shape)
    bound, sizes = token_bound(fixed, micro)
    budget = dpo_trainer(preset, models, data, opts, {"padding_free": True, "token_budget": bound}, **shape)
    steppers = {"padding_free": Stepper(fixed, opts.device), "token_budget": Stepper(budget, opts.device)}
    record.update(token_bound_tokens=bound, pairs_per_step=preset["pairs"], micro_pairs=micro)
    _settings(opts, steppers, sum(sizes) / len(steppers["padding_free"].steps), record)
    counts = budget._trl_ext.state["token_budget"].micro_batch_counts
    record["micro_batches_per_step"] = {"padding_free": ga, "token_budget": sorted(set(counts))}


def fused_logprobs(opts: argparse.Namespace, record: dict[str, Any]) -> None:
    steppers = {name: OnlineStepper(online_trainer(opts, name), opts.device) for name in ("stock", "fused_logprobs")}
    _settings(opts, steppers, steppers["stock"].real_tokens, record)


class OnlineStepper(Stepper):
    """A `Stepper` over an Online DPO trainer whose generation returns its stored batch: a step is
    `training_step` on the prompts (scoring, loss, backward) and the optimizer's step."""

    def _batches(self) -> list[list[Any]]:  # no loader: the batch is stored
        trainer = self.trainer
        self.real_tokens = trainer._bench_tokens
        trainer.get_batch_samples = lambda it, n, device: (list(it), None)
        return [[{"prompt": ["w1"] * trainer.args.per_device_train_batch_size}]]

    def step(self, index: int, keep: bool = True) -> float:
        for values in self.trainer.stats.values():
            values.clear()
        return super().step(index, keep)


def kernel_probe(opts: argparse.Namespace, record: dict[str, Any]) -> dict[str, Any]:
    """Every installed fused kernel and call pattern probed on the device (another module's API; absent from a build
    without it)."""
    try:
        from ...toolkit.packing.probe import probe_installed_kernels
    except ImportError:
        record["kernel_probe"] = "not available in this build"
        return record
    results = probe_installed_kernels(device=opts.device)
    record["kernels"] = results
    record["passed"] = bool(results) and all(r.get("passed") for r in results)
    return record


def _write(record: dict[str, Any], opts: argparse.Namespace) -> None:
    record["seconds"] = time.perf_counter() - opts.started
    Path(opts.out).write_text(json.dumps(record, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_ext.app.bench.device_parts")
    parser.add_argument("part", choices=PARTS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--out", required=True)
    opts = parser.parse_args(argv)
    opts.started = time.perf_counter()
    preset = PRESETS[opts.preset]
    opts.rounds = preset["rounds"] if opts.rounds is None else opts.rounds
    opts.warmup = preset["warmup"] if opts.warmup is None else opts.warmup
    record: dict[str, Any] = {"part": opts.part, "preset": opts.preset, "device": opts.device, "settings": {}}
    if opts.part != "kernel_probe":
        record.update(rounds=opts.rounds, warmup=opts.warmup)
    _quiet()
    with tempfile.TemporaryDirectory() as tmp:
        opts.tmp = tmp
        try:
            globals()[opts.part](opts, record)
        except Exception as exc:  # noqa: BLE001 - said in the part's JSON, and in its exit status
            record["error"] = f"{type(exc).__name__}: {exc}"[:1000]
            _write(record, opts)
            raise
    record["complete"] = True
    _write(record, opts)
    return 0


def _quiet() -> None:
    import os
    import warnings

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:  # pragma: no cover - the kernel probe needs no datasets
        pass


if __name__ == "__main__":
    sys.exit(main())
