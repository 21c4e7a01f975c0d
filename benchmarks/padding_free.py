"""Benchmark the `padding_free` plugin: padded vs packed DPO training steps on CPU, side by side in one run.

Setup: a ~20M-parameter Llama (hidden 256, 4 layers, 4 heads / 2 KV heads, intermediate 1024, vocab 32000), fp32,
synthetic preference pairs whose prompt and completion lengths are lognormal (skewed, like real preference data).
One step is TRL's real `DPOTrainer.compute_loss` (policy forward with TRL's LM head, reference forward, the DPO loss
and every metric) plus the backward, on the same examples for every variant:

- `padded`: a stock `DPOTrainer` (trl-ext not attached);
- `packed_dense`: the plugin's packing with transformers' block-diagonal attention mask (`attention: dense`);
- `packed_varlen`: the plugin's packing with per-segment varlen attention (the default on CPU).

The bench's statistics (`trl_ext.app.bench.stats`) do the rest: a fixed number of interleaved rounds (`--rounds`),
one warm-up round first, in each round every batch once per variant, the order flipping every batch; the speed-up is
the median of the per-round ratios of total time, with its interquartile range and the bench's flags (above the
bound, slower, wide spread), in wall time and in process CPU time (which a busy shared machine disturbs less). The
bound is the bench's `padding_bounds`: the larger of the token ratio 1/(1-f), f the share of padded positions, and
the attention ratio sum(L^2) / sum(len^2), since a step costs a * tokens + b * attention. Peak
memory is the peak RSS during one step on the largest batch (the kernel's high-water mark, reset right before the
step), each variant in a fresh process. Finally, whole `trainer.train()` runs (stock vs plugin, two rounds, ABBA
order) give steps per second and their per-round ratio.

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
    parser.add_argument(
        "--rounds", "--reps", dest="reps", type=int, default=3, help="interleaved rounds (fixed, after a warm-up)"
    )
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


def pick_batches(dataset, pairs: int, count: int, seed: int):
    import random

    rng = random.Random(seed)
    indices = list(range(len(dataset)))
    return [[dataset[i] for i in rng.sample(indices, pairs)] for _ in range(count)]


# ---------------------------------------------------------------------------------------------------------------------
# Parts
# ---------------------------------------------------------------------------------------------------------------------


def time_steps(args, tokenizer, dataset, tmp) -> dict:
    """Interleaved rounds (the bench's `interleave`, one warm-up round first): in each round every batch runs once per
    variant, batch by batch, the variants' order flipping every batch. Returns each variant's wall and CPU seconds per
    round (summed over the batches), each batch's median wall time per variant, and the batches' masks."""
    import trl_ext
    from trl_ext.app.bench.stats import interleave, padding_bounds

    stock = make_trainer(tokenizer, dataset, tmp)
    with trl_ext.install(padding_free=True):
        packed = make_trainer(tokenizer, dataset, tmp)
        runners = {
            "padded": (stock, None),
            "packed_dense": (packed, "sdpa"),
            "packed_varlen": (packed, None),
        }
        examples = pick_batches(stock.train_dataset, args.pairs, args.batches, args.seed)
        batches = [{"padded": stock.data_collator(ex), "packed": packed.data_collator(ex)} for ex in examples]
        per_batch = {v: [[] for _ in batches] for v in VARIANTS}
        cpu = {v: [] for v in VARIANTS}

        def one_round(index: int) -> dict[str, float]:
            wall = dict.fromkeys(VARIANTS, 0.0)
            used = dict.fromkeys(VARIANTS, 0.0)
            for b, batch in enumerate(batches):
                for variant in VARIANTS if (index + b) % 2 == 0 else VARIANTS[::-1]:
                    trainer, impl = runners[variant]
                    with attention(trainer, impl):
                        dt, c = step(trainer, batch["padded" if variant == "padded" else "packed"])
                    wall[variant] += dt
                    used[variant] += c
                    if index:  # round 0 is the warm-up
                        per_batch[variant][b].append(dt)
            if index:
                for variant in VARIANTS:
                    cpu[variant].append(used[variant])
            return wall

        wall = interleave(dict.fromkeys(VARIANTS), rounds=args.reps, what="DPO steps", paired=one_round, warmup=1)
        assert packed._trl_ext.state["padding_free"].packed_calls > 0
    for b, batch in enumerate(batches):
        stats = padding_bounds([batch["padded"]["attention_mask"]])
        shape = tuple(batch["padded"]["attention_mask"].shape)
        med = {v: statistics.median(per_batch[v][b]) for v in VARIANTS}
        print(
            f"  batch {b}: {shape[0]}x{shape[1]}, f={stats['padding_fraction']:.1%} (bound {stats['bound']:.2f}x: "
            f"tokens {stats['token_bound']:.2f}x, attention {stats['attention_bound']:.2f}x): median padded "
            f"{med['padded']:.2f}s, dense {med['packed_dense']:.2f}s, varlen {med['packed_varlen']:.2f}s",
            flush=True,
        )
    return {"wall": wall, "cpu": cpu, "masks": [batch["padded"]["attention_mask"] for batch in batches]}


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
    """Whole `trainer.train()` runs, stock and plugin: steps per second and the median per-round speed-up."""
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

    from trl_ext.app.bench.stats import interleave, ratios, summarize

    # Seconds per step; two rounds in flipped order (stock, plugin, plugin, stock) against drift in the machine's load.
    times = interleave(
        {"stock": lambda i: 1 / run(False), "plugin": lambda i: 1 / run(True)}, rounds=2, what="trainer.train()"
    )
    return {"steps_per_second": {k: [1 / t for t in v] for k, v in times.items()},
            "speedup": summarize(ratios(times, "stock", "plugin"))}  # fmt: skip


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
        f" {ARCH} {MODEL}, fp32; {args.pairs} pairs per batch, {args.batches} batches x {args.reps} rounds (+warm-up)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        print("One DPO step (TRL compute_loss: policy fwd + ref fwd + loss + metrics, then backward):", flush=True)
        from trl_ext.app.bench.stats import padding_bounds, ratio_text, ratios, summarize

        measured = time_steps(args, tokenizer, dataset, tmp)
        bounds = padding_bounds(measured["masks"])
        f, bound = bounds["padding_fraction"], bounds["bound"]
        print(f"\nSummary over {len(measured['masks'])} batches (median of the per-round ratios of total time):")
        print(
            f"  padding fraction f = {f:.1%}; bound {bound:.2f}x, the larger of tokens 1/(1-f) = "
            f"{bounds['token_bound']:.2f}x and attention sum(L^2)/sum(len^2) = {bounds['attention_bound']:.2f}x (a "
            "step costs a*tokens + b*attention)"
        )
        for v in ("packed_dense", "packed_varlen"):
            wall = summarize(ratios(measured["wall"], "padded", v), bound=bound)
            cpu = summarize(ratios(measured["cpu"], "padded", v), bound=bound)
            print(
                f"  {v:14s}: speed-up {ratio_text(wall)} = {wall['median'] / bound:.2f} x bound; CPU time "
                f"{ratio_text(cpu)} = {cpu['median'] / bound:.2f} x bound"
            )
            for flag in wall["flags"] + [f"CPU time: {flag}" for flag in cpu["flags"]]:
                print(f"  {'':14s}  !! {flag}")
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
            print(f"\nWhole trainer.train(), {args.train_steps} steps of {args.pairs} pairs (2 rounds, ABBA):")
            rates = time_training(args, tokenizer, dataset, tmp)
            per_second = {k: statistics.median(v) for k, v in rates["steps_per_second"].items()}
            print(
                f"  stock {per_second['stock']:.3f} steps/s, padding_free {per_second['plugin']:.3f} steps/s: "
                f"{ratio_text(rates['speedup'])}"
            )


if __name__ == "__main__":
    main()
