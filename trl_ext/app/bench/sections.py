"""The bench's sections on the shared setup (a small Llama from a config, synthetic preference data with skewed
lengths, the DPO arguments): `padding_free`, `precompute`, `sync_metrics` and `generation`, each measuring stock TRL
against trl-ext on the same data and weights and returning its numbers with their computed verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import InternalError
from .stats import agreement, interleave, padding_bounds, progress, ratios, summarize

_WORKER = "trl_ext.app._bench_worker"
#: The sections, in the order they run and are reported, and the flag each measures.
SECTIONS = {
    "padding_free": "padding_free",
    "precompute": "precompute_ref_batch_size",
    "sync_metrics": "sync_metrics",
    "generation": "ds3_gather_for_generation",
    "token_budget": "token_budget",
    "fused_logprobs": "fused_logprobs",
}

#: Largest |loss difference| per batch, stock against `padding_free`, that still counts as the same losses: both run
#: in fp32 on the same batches and weights (DPO losses ~0.7; a reordered sum moves them by ~1e-7).
LOSS_ATOL = 1e-4
#: Largest |reference log-prob difference|, TRL's precompute against trl-ext's, relative to the largest |log-prob|,
#: that still counts as the same values: fp32, and only the batch composition (the padding) differs, which moves TRL's
#: own values by up to ~3e-5 of their size between two batch sizes.
REF_LOGP_RTOL = 1e-4
#: Rounds the precompute comparison runs first and does not keep (first calls, allocator growth).
WARMUP_ROUNDS = 1


#: The workload's sizes: `--quick`, and the default.
_SIZES: dict[bool, dict[str, Any]] = {
    True: dict(vocab=2048, hidden=128, layers=2, pairs=48, steps=3, prompt=40, completion=40, max_len=128),
    False: dict(vocab=32000, hidden=256, layers=4, pairs=128, steps=10, prompt=60, completion=60, max_len=400),
}


class Setup:
    def __init__(self, args: argparse.Namespace) -> None:
        from .workload import make_model, make_preference_dataset, make_tokenizer

        self.size = s = dict(batch=8, **_SIZES[args.quick])
        #: The built-in model's shape (the fused_logprobs section's models too).
        self.shape = dict(hidden_size=s["hidden"], num_layers=s["layers"], num_heads=4, num_kv_heads=2)
        if args.model:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(args.model)
            self.model_fn = lambda: AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
            vocab = len(self.tokenizer)
            self.model_desc = args.model
        else:
            self.tokenizer = make_tokenizer(s["vocab"])
            vocab = s["vocab"]
            self.model_fn = lambda: make_model(
                vocab_size=vocab, intermediate_size=4 * s["hidden"], seed=0, **self.shape
            )
            n_params = sum(p.numel() for p in self.model_fn().parameters())
            self.model_desc = f"llama hidden={s['hidden']} layers={s['layers']} vocab={vocab} ({n_params / 1e6:.1f}M)"
        lengths = dict(prompt_median=s["prompt"], completion_median=s["completion"], sigma=0.8, seed=0)
        cut = dict(max_prompt=s["max_len"], max_completion=s["max_len"])
        self.dataset = make_preference_dataset(s["pairs"], vocab_size=min(vocab, s["vocab"]), **lengths, **cut)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)

    def dpo_args(self, name: str, **overrides: Any):
        from trl import DPOConfig

        kwargs = dict(
            output_dir=str(self.out / "runs" / name),
            per_device_train_batch_size=self.size["batch"],
            max_steps=self.size["steps"],
            logging_steps=1,
            learning_rate=1e-4,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
            disable_tqdm=True,
            # fp32 on both sides: TRL 1.x defaults to bf16 autocast on CPU, whose noise would blur the comparison.
            bf16=False,
        )
        kwargs.update(overrides)
        return DPOConfig(**kwargs)


def reference(setup: Setup) -> Any:
    """The policy's architecture with other weights: with equal weights every DPO loss is log 2, and a comparison of
    losses would prove nothing."""
    import torch

    ref = setup.model_fn()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * p.std().nan_to_num() * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return ref


def padding_free(setup: Setup, rounds: int) -> dict[str, Any]:
    """Forward + backward of a DPO training step (TRL's real loss) on the same batches and weights, stock against
    `padding_free`, one pass over the batches per arm and round."""
    from trl import DPOTrainer

    import trl_ext

    n_batches = setup.size["steps"]

    def build(label: str) -> Any:
        trainer = DPOTrainer(
            setup.model_fn(),
            ref_model=reference(setup),
            args=setup.dpo_args(label),
            train_dataset=setup.dataset,
            processing_class=setup.tokenizer,
        )
        loader = trainer.get_train_dataloader()
        # Fixed batches, in dataset order, through each trainer's own collator (padded, or packed).
        rows: Any = trainer.train_dataset
        batches = [
            loader.collate_fn([rows[i] for i in range(k * setup.size["batch"], (k + 1) * setup.size["batch"])])
            for k in range(n_batches)
        ]
        return trainer, batches

    def step(trainer: Any, batch: dict[str, Any]) -> tuple[float, float]:
        trainer.model.train()
        start = time.perf_counter()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        elapsed = time.perf_counter() - start
        trainer.model.zero_grad(set_to_none=True)
        return elapsed, float(loss.detach())

    progress("padding_free: building stock and padding_free DPO trainers")
    stock, stock_batches = build("stock")
    with trl_ext.install(padding_free=True):  # the stock trainer, built before, keeps TRL's code
        packed, packed_batches = build("padding_free")
        losses: dict[str, list[float]] = {"stock": [], "trl_ext": []}
        sides = {"stock": (stock, stock_batches), "trl_ext": (packed, packed_batches)}

        def one_round(index: int) -> dict[str, float]:
            # Batch by batch, both sides back to back (order flipping every batch), so a load change on the machine
            # hits both sides of a round alike.
            total = {"stock": 0.0, "trl_ext": 0.0}
            for k in range(n_batches):
                for name in ("stock", "trl_ext") if (index + k) % 2 == 0 else ("trl_ext", "stock"):
                    trainer, batches = sides[name]
                    elapsed, loss = step(trainer, batches[k])
                    total[name] += elapsed
                    if index == 0:
                        losses[name].append(loss)
            return total

        times = interleave(dict.fromkeys(sides), rounds=rounds, what="padding_free", paired=one_round)
    bounds = padding_bounds([b["attention_mask"] for b in stock_batches])
    bound = bounds["bound"]
    speed = summarize(ratios(times, "stock", "trl_ext"), bound=bound)
    max_diff = max(abs(a - b) for a, b in zip(losses["stock"], losses["trl_ext"], strict=True))
    return {
        **bounds,
        "speedup": speed,
        "fraction_of_bound": speed["median"] / bound,
        "batches": n_batches,
        "stock": {"pass_seconds": times["stock"], "loss": losses["stock"]},
        "trl_ext": {"pass_seconds": times["trl_ext"], "loss": losses["trl_ext"]},
        "max_abs_loss_diff": max_diff,
        "losses": agreement(max_diff, LOSS_ATOL, "losses"),
    }


def precompute(setup: Setup, rounds: int) -> dict[str, Any]:
    """TRL's reference precompute against trl-ext's (same batch size, and `"auto"`), timed by `PrecomputeRig` of
    `benchmarks/precompute.py`, one trainer build per arm and round, in process CPU time (torch on one thread: the CPU
    time is the work, which a busy shared machine leaves alone; wall time, which counts the waits for a core, is kept
    as `wall_seconds`)."""
    import shutil
    from types import SimpleNamespace

    import numpy as np

    from .. import _bench_precompute as pre

    s = setup.size
    batch = 16
    options = SimpleNamespace(
        pairs=2 * s["pairs"], batch_size=batch, max_length=1024, dtype="float32", ram_budget=None
    )
    data_kwargs = dict(vocab_size=s["vocab"], prompt_median=s["prompt"], completion_median=s["completion"], seed=1)
    work = Path(tempfile.mkdtemp(prefix="trl-ext-bench-precompute-", dir=setup.out))
    model = setup.model_fn()
    rig = pre.PrecomputeRig(options, model, setup.model_fn(), setup.tokenizer, data_kwargs, False, work)
    columns: dict[str, Any] = {}
    wall: dict[str, list[float]] = {}
    chosen: list[Any] = []  # the batch size "auto" chose in each kept round (it probes the free memory)

    def arm(variant: str):
        def run(index: int) -> float:
            box, record, cols, _ = rig.run(variant, work / f"cache-{variant}-{index}")  # a fresh cache every round
            columns.setdefault(variant, cols)
            if index >= WARMUP_ROUNDS:
                wall.setdefault(variant, []).append(box["seconds"])
                if variant == "plugin-auto":
                    chosen.append(record.get("batch_tokens"))
            return box["cpu_seconds"]

        return run

    progress(f"precompute: {options.pairs} pairs, batch {batch}: TRL, trl-ext, trl-ext auto")
    try:
        times = interleave(
            {name: arm(name) for name in ("trl", "plugin", "plugin-auto")},
            rounds=rounds,
            what="precompute",
            warmup=WARMUP_ROUNDS,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(columns["trl"], columns["plugin"], strict=True))
    scale = max(float(np.abs(a).max()) for a in columns["trl"])
    return {
        "pairs": options.pairs,
        "batch_size": batch,
        "clock": "cpu",
        "warmup_rounds": WARMUP_ROUNDS,
        "stock": {"seconds": times["trl"], "wall_seconds": wall["trl"]},
        "trl_ext": {"seconds": times["plugin"], "wall_seconds": wall["plugin"]},
        "trl_ext_auto": {"seconds": times["plugin-auto"], "wall_seconds": wall["plugin-auto"], "batch_tokens": chosen},
        "speedup": summarize(ratios(times, "trl", "plugin")),
        "speedup_auto": summarize(ratios(times, "trl", "plugin-auto")),
        # Wall time on a shared machine counts the waits for a core: for reference only, not flagged.
        "wall_speedup": statistics.median(ratios(wall, "trl", "plugin")),
        "max_abs_ref_logp_diff": diff,
        "max_abs_ref_logp": scale,
        "values": agreement(diff, REF_LOGP_RTOL * scale, "values"),
    }


def generation(setup: Setup, quick: bool) -> dict[str, Any]:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return {
            "skipped": 'needs DeepSpeed, which is not installed (pip install "trl-ext[deepspeed]"; from a clone: '
            'pip install -c constraints.txt -e ".[deepspeed]")'
        }
    out = setup.out / "generation.json"
    cmd = ["trl_ext.app._bench_generation", "--json", str(out), "--output-dir", str(setup.out / "runs" / "generation")]
    cmd += (
        ["--repeats", "1", "--layers", "4", "--hidden", "256", "--new-tokens", "16"] if quick else ["--repeats", "2"]
    )
    progress("generation: 2-process ZeRO-3 OnlineDPO, every mode (stock gather/no-gather, trl-ext modes)")
    report = _torchrun(cmd, out, "ZeRO-3 generation run", 1200, ACCELERATE_USE_DEEPSPEED="true")
    base = report["modes"][0]
    for mode in report["modes"]:
        mode["peak_vs_gather"] = max(mode["peak_bytes_per_rank"]) / max(base["peak_bytes_per_rank"])
        mode["time_vs_gather"] = mode["seconds"] / base["seconds"]
    differ = [mode["mode"] for mode in report["modes"] if not mode["same_tokens"]]
    report["tokens"] = {
        "same": not differ,
        "text": "greedy tokens identical in every mode" if not differ else f"TOKENS DIFFER in {', '.join(differ)}",
        "flags": [f"TOKENS DIFFER in {', '.join(differ)}"] if differ else [],
    }
    return report


def _torchrun(args: list[str], out: Path, what: str, timeout: int, **env: str) -> dict[str, Any]:
    """`torchrun -m ARGS` with 2 processes; the JSON report it wrote to `out`."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", **env)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise InternalError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_collectives(out: Path, extra: Sequence[str] = ()) -> dict[str, Any]:
    """Run the 2-process `collectives` worker (stock and `sync_metrics`, interleaved) under torchrun; its report."""
    return _torchrun([_WORKER, "collectives", "--out", str(out), *extra], out, "2-process run", 1800)


def sync_metrics(setup: Setup, quick: bool, rounds: int) -> dict[str, Any]:
    progress("sync_metrics: 2-process DPO, stock and sync_metrics in interleaved rounds")
    extra = ["--rounds", str(rounds)] + (["--quick"] if quick else [])
    results = run_collectives(setup.out / "collectives.json", extra)
    progress(f"sync_metrics: {results['rounds']} interleaved rounds")
    results["step_time_ratio"] = summarize(
        [a / b for a, b in zip(results["stock"]["step_seconds"], results["trl_ext"]["step_seconds"], strict=True)]
    )
    # Timing is not what this plugin is for: only an ordinary spread check, not "slower than stock".
    results["step_time_ratio"]["flags"] = [f for f in results["step_time_ratio"]["flags"] if "SLOWER" not in f]
    results["collectives"] = collectives_verdict(results)
    return results


def collectives_verdict(results: dict[str, Any]) -> dict[str, Any]:
    """`sync_metrics` promises one collective per logging step, plus one for the Trainer's final summary log; the
    verdict compares that with the counted collectives."""
    ext, stock = results["trl_ext"], results["stock"]
    expected = ext["logging_steps"] + 1
    counted = ext["collectives_total"]
    text = (
        f"{stock['collectives_total']} -> {counted} collectives in {ext['optimizer_steps']} steps: "
        f"one per logging step ({ext['logging_steps']}) + the final summary log"
    )
    same = counted == expected
    flags = [] if same else [f"EXPECTED {expected} COLLECTIVES (one per logging step + 1), COUNTED {counted}"]
    text = text if same else f"{stock['collectives_total']} -> {counted} collectives"
    return {"same": same, "expected": expected, "text": text, "flags": flags}
