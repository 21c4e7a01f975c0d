"""Benchmark the `padding_free` plugin: padded vs packed DPO training steps on CPU, side by side in one run.

Setup: a ~20M-parameter Llama (hidden 256, 4 layers, 4 heads / 2 KV heads, intermediate 1024, vocab 32000), fp32,
synthetic preference pairs whose prompt and completion lengths are lognormal (skewed, like real preference data).
One step is TRL's real `DPOTrainer.compute_loss` (policy forward with TRL's LM head, reference forward, the DPO loss
and every metric) plus the backward, on the same examples for every variant:

- `padded`: a stock `DPOTrainer` (trl-ext not attached);
- `packed_dense`: the plugin's packing with transformers' block-diagonal attention mask (`attention: dense`);
- `packed_varlen`: the plugin's packing with per-segment varlen attention (the default on CPU).

Variants alternate within each repetition, the order rotated every repetition, one warm-up first; medians are
reported (wall time, and process CPU time, which a busy shared machine disturbs less). The padding fraction f of a
batch is the share of padded positions in the `[2 * pairs, L]` batch, and 1/(1-f) is the speed-up that skipping the
padding alone would give if cost were linear in tokens (attention is superlinear, so varlen can exceed it). Peak
memory is the peak RSS during one step on the largest batch (the kernel's high-water mark, reset right before the
step), each variant in a fresh process. Finally, whole `trainer.train()` runs (stock vs plugin, ABBA order) give
steps per second.

Run from the repository root:

    python benchmarks/padding_free.py            # full (about 15 minutes on a quiet 2-core CPU)
    python benchmarks/padding_free.py --quick    # smoke run (about 1-2 minutes)
    python benchmarks/padding_free.py --arch mistral_sw   # sliding-window model (window 64)
    python benchmarks/padding_free.py --arch mixtral      # MoE model, router auxiliary loss on
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

MODEL = dict(vocab_size=32000, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024)
DATA = dict(prompt_median=77, completion_median=77, sigma=0.8, max_prompt=300, max_completion=600)
VARIANTS = ("padded", "packed_dense", "packed_varlen")
#: `--arch`: the dense Llama above; a Mistral of the same size with a 64-token sliding window on every layer (shorter
#: than most sequences, so the window really applies); a Mixtral with 4 experts (top-2, expert width 512, so that the
#: active parameters match the Llama's) and its router auxiliary loss on (TRL adds it, coefficient 0.02).
ARCHS = ("llama", "mistral_sw", "mixtral")
ARCH = "llama"


def make_model(seed: int):
    import torch
    from transformers import MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM

    from trl_ext.testing import make_model as make_llama

    if ARCH == "llama":
        return make_llama(seed=seed, **MODEL)
    common = dict(
        vocab_size=MODEL["vocab_size"],
        hidden_size=MODEL["hidden_size"],
        num_hidden_layers=MODEL["num_layers"],
        num_attention_heads=MODEL["num_heads"],
        num_key_value_heads=MODEL["num_kv_heads"],
        max_position_embeddings=2048,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(seed)
    if ARCH == "mistral_sw":
        config = MistralConfig(intermediate_size=MODEL["intermediate_size"], sliding_window=64, **common)
        model = MistralForCausalLM(config)
    else:
        config = MixtralConfig(
            intermediate_size=MODEL["intermediate_size"] // 2,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,
            **common,
        )
        model = MixtralForCausalLM(config)
    model.config._attn_implementation_internal = "sdpa"
    return model


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--pairs", type=int, default=8, help="preference pairs per batch (2x sequences)")
    parser.add_argument("--batches", type=int, default=3, help="number of distinct batches to time")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per batch and variant")
    parser.add_argument("--train-steps", type=int, default=4, help="trainer.train() steps per run (0: skip)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant peak-memory processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="model: dense, sliding window, or MoE")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--memory-child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.batches, args.reps, args.train_steps, args.no_memory = 4, 1, 1, 2, True
    return args


# ---------------------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------------------


def make_dataset(n: int, seed: int):
    from datasets import Dataset

    from trl_ext.testing import preference_rows

    return Dataset.from_list(preference_rows(n, vocab_size=MODEL["vocab_size"], seed=seed, **DATA))


def make_trainer(tokenizer, dataset, output_dir, **overrides):
    from trl import DPOConfig, DPOTrainer

    kwargs = dict(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        max_steps=8,
        logging_steps=10**6,
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL 1.x would autocast to bf16 on CPU; the comparison is in fp32
        save_strategy="no",
        seed=0,
        max_length=None,
    )
    kwargs.update(overrides)
    return DPOTrainer(
        make_model(seed=0),
        ref_model=make_model(seed=1),
        args=DPOConfig(**kwargs),
        train_dataset=dataset,
        processing_class=tokenizer,
    )


def configs_of(trainer):
    from trl_ext.context import unwrap_causal_lm

    models = [unwrap_causal_lm(trainer.model), unwrap_causal_lm(trainer.ref_model)]
    return list({id(m.config): m.config for m in models if m is not None}.values())


@contextlib.contextmanager
def attention(trainer, impl: str | None):
    """Run the packed trainer with another attention implementation (the `dense` option is exactly the plugin's
    wrappers with the model's own `sdpa`, whose block-diagonal mask transformers builds from the packed positions)."""
    if impl is None:
        yield
        return
    configs = configs_of(trainer)
    saved = [c._attn_implementation_internal for c in configs]
    for c in configs:
        c._attn_implementation_internal = impl
    try:
        yield
    finally:
        for c, s in zip(configs, saved, strict=True):
            c._attn_implementation_internal = s


def step(trainer, batch) -> tuple[float, float]:
    """One DPO step; returns (wall seconds, process CPU seconds)."""
    import torch

    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    start, cpu = time.perf_counter(), time.process_time()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    if not torch.isfinite(loss):
        raise RuntimeError("non-finite loss")
    return elapsed, cpu


def batch_stats(batch) -> dict:
    from trl_ext.app.bench import padding_bounds

    mask = batch["attention_mask"]
    real, slots = int(mask.sum()), mask.numel()
    return {"shape": tuple(mask.shape), "real": real, "slots": slots, "f": 1 - real / slots, "mask": mask.clone(),
            **padding_bounds([mask])}  # fmt: skip


def pick_batches(dataset, pairs: int, count: int, seed: int):
    import random

    rng = random.Random(seed)
    indices = list(range(len(dataset)))
    return [[dataset[i] for i in rng.sample(indices, pairs)] for _ in range(count)]


# ---------------------------------------------------------------------------------------------------------------------
# Parts
# ---------------------------------------------------------------------------------------------------------------------


def time_steps(args, tokenizer, dataset, tmp):
    import trl_ext

    stock = make_trainer(tokenizer, dataset, tmp)
    with trl_ext.install(padding_free=True):
        packed = make_trainer(tokenizer, dataset, tmp)
        runners = {
            "padded": (stock, None),
            "packed_dense": (packed, "sdpa"),
            "packed_varlen": (packed, None),
        }
        examples = pick_batches(stock.train_dataset, args.pairs, args.batches, args.seed)
        rows = []
        for b, ex in enumerate(examples):
            batches = {"padded": stock.data_collator(ex), "packed": packed.data_collator(ex)}
            stats = batch_stats(batches["padded"])
            times = {v: [] for v in VARIANTS}
            cpu_times = {v: [] for v in VARIANTS}
            for rep in range(args.reps + 1):
                order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]
                for variant in order:
                    trainer, impl = runners[variant]
                    with attention(trainer, impl):
                        dt, cpu = step(trainer, batches["padded" if variant == "padded" else "packed"])
                    if rep:  # the first repetition is the warm-up
                        times[variant].append(dt)
                        cpu_times[variant].append(cpu)
            med = {v: statistics.median(t) for v, t in times.items()}
            cpu_med = {v: statistics.median(t) for v, t in cpu_times.items()}
            rows.append(
                {
                    **stats,
                    "batch": b,
                    **{f"t_{v}": med[v] for v in VARIANTS},
                    **{f"c_{v}": cpu_med[v] for v in VARIANTS},
                }
            )
            print(
                f"  batch {b}: {stats['shape'][0]}x{stats['shape'][1]}, {stats['real']} real tokens, "
                f"f={stats['f']:.1%} (bound {stats['bound']:.2f}x: tokens {stats['token_bound']:.2f}x, attention "
                f"{stats['attention_bound']:.2f}x): padded {med['padded']:.2f}s, "
                f"dense {med['packed_dense']:.2f}s ({med['padded'] / med['packed_dense']:.2f}x), "
                f"varlen {med['packed_varlen']:.2f}s ({med['padded'] / med['packed_varlen']:.2f}x)",
                flush=True,
            )
        assert packed._trl_ext.state["padding_free"].packed_calls > 0
    return rows


def memory_child(variant: str, args) -> None:
    """One step of `variant` on the largest batch, in this fresh process; prints peak RSS as JSON."""
    import trl_ext
    from trl_ext.testing import make_tokenizer

    tokenizer = make_tokenizer(MODEL["vocab_size"])
    dataset = make_dataset(args.pairs * 24, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = trl_ext.install(padding_free=True) if variant != "padded" else contextlib.nullcontext()
        with ctx:
            trainer = make_trainer(tokenizer, dataset, tmp)
            examples = pick_batches(trainer.train_dataset, args.pairs, args.batches, args.seed)
            batch = max((trainer.data_collator(ex) for ex in examples), key=lambda b: b["attention_mask"].numel())
            before = _status_kb("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak-RSS counter (VmHWM): measure the step, not the set-up
            with attention(trainer, "sdpa" if variant == "packed_dense" else None):
                step(trainer, batch)
            peak = _status_kb("VmHWM")
    print(json.dumps({"variant": variant, "before_kb": before, "peak_kb": peak}))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_memory(args) -> dict:
    out = {}
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--memory-child", variant, "--pairs", str(args.pairs)]
        cmd += ["--batches", str(args.batches), "--seed", str(args.seed), "--arch", args.arch]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def time_training(args, tokenizer, dataset, tmp) -> dict:
    from transformers import TrainerCallback

    import trl_ext

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, *a, **k):
            self.ends.append(time.perf_counter())

    def run(plugin: bool) -> float:
        clock = StepClock()
        overrides = dict(max_steps=args.train_steps, per_device_train_batch_size=args.pairs)
        ctx = trl_ext.install(padding_free=True) if plugin else contextlib.nullcontext()
        with ctx:
            trainer = make_trainer(tokenizer, dataset, tmp, **overrides)
            trainer.add_callback(clock)
            trainer.train()
        # steps/s over the steps after the first (which includes the optimizer's lazy state allocation)
        return (len(clock.ends) - 1) / (clock.ends[-1] - clock.ends[0])

    rates = {"stock": [], "plugin": []}
    for plugin in (False, True, True, False):  # ABBA against drift in the machine's load
        rates["plugin" if plugin else "stock"].append(run(plugin))
    return {k: statistics.mean(v) for k, v in rates.items()}


# ---------------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    global ARCH
    args = parse_args(argv)
    ARCH = args.arch
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.memory_child, args)
        return
    import trl

    from trl_ext.testing import make_tokenizer

    tokenizer = make_tokenizer(MODEL["vocab_size"])
    dataset = make_dataset(max(args.pairs * 24, 64), args.seed)
    print(
        f"padding_free benchmark: trl {trl.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads;"
        f" {ARCH} {MODEL}, fp32; {args.pairs} pairs per batch, {args.batches} batches x {args.reps} reps (+1 warm-up)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        print("One DPO step (TRL compute_loss: policy fwd + ref fwd + loss + metrics, then backward):", flush=True)
        rows = time_steps(args, tokenizer, dataset, tmp)
        from trl_ext.app.bench import padding_bounds

        bounds = padding_bounds([r.pop("mask") for r in rows])
        f, bound = bounds["padding_fraction"], bounds["bound"]
        totals = {v: sum(r[f"t_{v}"] for r in rows) for v in VARIANTS}
        cpu_totals = {v: sum(r[f"c_{v}"] for r in rows) for v in VARIANTS}
        gm = lambda xs: math.exp(statistics.mean(math.log(x) for x in xs))  # noqa: E731
        print(f"\nSummary over {len(rows)} batches (total time, all batches):")
        print(
            f"  padding fraction f = {f:.1%}; bound {bound:.2f}x, the larger of tokens 1/(1-f) = "
            f"{bounds['token_bound']:.2f}x and attention sum(L^2)/sum(len^2) = {bounds['attention_bound']:.2f}x (a "
            "step costs a*tokens + b*attention)"
        )
        for v in ("packed_dense", "packed_varlen"):
            speedup = totals["padded"] / totals[v]
            per_batch = gm([r["t_padded"] / r[f"t_{v}"] / r["bound"] for r in rows])
            cpu_speedup = cpu_totals["padded"] / cpu_totals[v]
            print(
                f"  {v:14s}: speed-up {speedup:.2f}x = {speedup / bound:.2f} x bound "
                f"(geometric mean of per-batch speed-up/bound: {per_batch:.2f}); "
                f"CPU-time speed-up {cpu_speedup:.2f}x = {cpu_speedup / bound:.2f} x bound"
            )
        if not args.no_memory:
            print("\nPeak RSS of one step on the largest batch (fresh process per variant):")
            mem = measure_memory(args)
            base = mem["padded"]["peak_kb"] - mem["padded"]["before_kb"]
            for v in VARIANTS:
                m = mem[v]
                delta = m["peak_kb"] - m["before_kb"]
                print(
                    f"  {v:14s}: peak {m['peak_kb'] / 2**20:.2f} GiB, step working set {delta / 2**20:.2f} GiB "
                    f"({delta / base:.2f}x padded)"
                )
        if args.train_steps > 1:
            print(f"\nWhole trainer.train(), {args.train_steps} steps of {args.pairs} pairs (ABBA, mean):")
            rates = time_training(args, tokenizer, dataset, tmp)
            print(
                f"  stock {rates['stock']:.3f} steps/s, padding_free {rates['plugin']:.3f} steps/s: "
                f"{rates['plugin'] / rates['stock']:.2f}x"
            )


if __name__ == "__main__":
    main()
