"""Benchmark the `token_budget` plugin: micro-batches cut by tokens against fixed pair counts, at equal peak memory.

Setup (`--size`, see `SIZES`): on CPU a Llama of hidden 256, 4 layers, 4 heads / 2 KV heads, intermediate 1024, vocab
32000, fp32; on GPU (`--device cuda`, size `gpu` by default) hidden 1024, 8 layers, 16 heads / 8 KV heads,
intermediate 2816, vocab 32000, fp32 weights under bf16 autocast, 32 pairs per step. Preference pairs have skewed
lengths (lognormal prompt and completions; a pair holds 64 to 2048 tokens, `--quick`: 32 to 512). Every
configuration trains on the same data with the same global batch per optimizer step (`--pairs` pairs:
`per_device_train_batch_size x gradient_accumulation_steps`), so every step consumes the same pairs:

- `stock`: TRL's padded micro-batches of `--stock-batch` pairs;
- `padding_free`: packed micro-batches with the largest `per_device_train_batch_size` (a power of two dividing
  `--pairs`) whose peak memory stays under the limit;
- `token_budget`: padding_free's packing, micro-batches cut by tokens, with the largest budget of a grid (x1.25
  steps) whose peak memory stays under the same limit.

The limit (`--limit-mb`, default: padding_free's peak at `--stock-batch` pairs per micro-batch) is on the peak memory
of `--memory-steps` training steps above what the process held before `train()`. On CPU that is the peak RSS (the
kernel's high-water mark, reset before `train()`), each configuration in a fresh process (an allocator that keeps
freed memory would hide later peaks); on GPU `torch.cuda.max_memory_allocated` (its counter reset before `train()`),
each configuration in this process, since the allocator's counters are exact per run. Step times come from whole
`trainer.train()` runs of the three configurations in one process, interleaved with the bench's statistics
(`trl_ext.app.bench.stats`: a warm-up round, then `--rounds` rounds, the order flipping every round); the speed-ups
are medians of per-round ratios of `train()` wall time (on GPU with `torch.cuda.synchronize()` before each clock
read). The script also prints micro-batches per step, the largest micro-batch in tokens, and how well the
token_budget peaks follow a linear fit against the budget.

Run from the repository root (PYTHONPATH pointing at it):

    python benchmarks/token_budget.py            # full (long on a 2-core CPU)
    python benchmarks/token_budget.py --quick    # smoke run (a few minutes)
    python benchmarks/token_budget.py --device cuda --json token_budget_gpu.json   # GPU size, a few minutes

`--json PATH` writes the results (with the arguments, the device and the memory measure) to PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

#: per size: the model, the lognormal data (prompt + longer completion of a pair is clipped to [low, high] by the
#: max_* values), and the defaults of the run
SIZES = {
    "cpu": dict(
        model=dict(
            vocab_size=32000, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024
        ),
        data=dict(prompt_median=120, completion_median=100, sigma=0.9, max_prompt=1024, max_completion=1024),
        low=64, high=2048, pairs=16, stock_batch=2, steps=3, rounds=5, first_budget=1024,
    ),
    "quick": dict(
        model=dict(vocab_size=4096, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
        data=dict(prompt_median=30, completion_median=25, sigma=0.9, max_prompt=256, max_completion=256),
        low=32, high=512, pairs=8, stock_batch=2, steps=2, rounds=3, first_budget=256,
    ),
    "gpu": dict(
        model=dict(
            vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, intermediate_size=2816
        ),
        data=dict(prompt_median=120, completion_median=100, sigma=0.9, max_prompt=1024, max_completion=1024),
        low=64, high=2048, pairs=32, stock_batch=4, steps=2, rounds=3, first_budget=4096,
    ),
}  # fmt: skip
#: the budgets tried grow by this factor from `--first-budget` until the peak passes the limit
GRID = 1.25


def make_dataset(n: int, size: str, seed: int):
    from datasets import Dataset

    from trl_ext.testing import preference_rows

    preset = SIZES[size]
    rows = preference_rows(4 * n, vocab_size=preset["model"]["vocab_size"], seed=seed, **preset["data"])
    low = preset["low"]
    kept = [
        r for r in rows if len(r["prompt"].split()) + max(len(r["chosen"].split()), len(r["rejected"].split())) >= low
    ]
    return Dataset.from_list(kept[:n])


@functools.cache
def _models(size: str) -> tuple:
    """The policy (seed 0) and reference (seed 1) of `size`, built once per process: a random init of the GPU size
    takes seconds on the host."""
    from trl_ext.testing import make_model

    model = SIZES[size]["model"]
    return make_model(**model, seed=0), make_model(**model, seed=1)


def make_trainer(config: dict, size: str, device: str, dataset, out: str):
    from trl import DPOConfig, DPOTrainer

    from trl_ext.testing import make_tokenizer

    model = SIZES[size]["model"]
    args = DPOConfig(
        output_dir=out,
        per_device_train_batch_size=config["batch"],
        gradient_accumulation_steps=config["accumulation"],
        max_steps=config["steps"],
        learning_rate=1e-5,
        max_length=None,
        report_to=[],
        use_cpu=device == "cpu",  # on GPU the Trainer moves the models there
        save_strategy="no",
        logging_steps=10**6,
        bf16=device == "cuda",
        seed=0,
    )
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer = DPOTrainer(
        copy.deepcopy(_models(size)[0]),  # every trainer trains its own copy
        ref_model=copy.deepcopy(_models(size)[1]),
        args=args,
        train_dataset=dataset,
        processing_class=make_tokenizer(model["vocab_size"]),
    )
    for callback in (PrinterCallback, ProgressCallback):  # the logs of every timed run would flood the output
        trainer.remove_callback(callback)
    return trainer


def install_kwargs(config: dict) -> dict:
    kwargs = {}
    if config["packing"]:
        kwargs["padding_free"] = True
    if config.get("budget"):
        kwargs["token_budget"] = config["budget"]
    return kwargs


def memory_child(config: dict, size: str, seed: int) -> None:
    """Train `config` for its steps in this fresh process; print the peak RSS above the start of training as JSON."""
    import trl_ext
    from trl_ext._shared import reset_peak_rss, rss_mib

    dataset = make_dataset(config["pairs_total"], size, seed)
    with tempfile.TemporaryDirectory() as tmp, trl_ext.install(**install_kwargs(config)):
        trainer = make_trainer(config, size, "cpu", dataset, tmp)
        before = reset_peak_rss()  # measure training, not the set-up
        trainer.train()
        peak = rss_mib()
    print(json.dumps({"peak_mb": peak - before}))


def cuda_peak_mb(config: dict, args) -> float:
    """Train `config` for its steps in this process; the most memory the allocator held above what it held before
    `train()` (`torch.cuda.max_memory_allocated`, its counter reset first), in MiB."""
    import gc

    import torch

    import trl_ext

    dataset = make_dataset(config["pairs_total"], args.size, args.seed)
    with tempfile.TemporaryDirectory() as tmp, trl_ext.install(**install_kwargs(config)):
        trainer = make_trainer(config, args.size, "cuda", dataset, tmp)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return (peak - before) / 2**20


def peak_mb(config: dict, args) -> float:
    if args.device == "cuda":
        return cuda_peak_mb(config, args)
    cmd = [sys.executable, __file__, "--memory-child", json.dumps(config), "--seed", str(args.seed)]
    cmd += ["--size", args.size]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"memory child {config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mb"]


def configure(args) -> tuple[dict[str, dict], dict]:
    """Pick padding_free's batch size and token_budget's budget under the memory limit (fresh processes)."""
    from trl_ext.app.bench.stats import progress

    base = dict(pairs_total=args.pairs * args.memory_steps, steps=args.memory_steps)
    stock = dict(base, batch=args.stock_batch, accumulation=args.pairs // args.stock_batch, packing=False)
    peaks: dict[str, float] = {}
    limit = args.limit_mb
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= args.pairs and args.pairs % b == 0]
    if limit is None:  # the limit is the peak at `--stock-batch`: smaller batches fit, no need to measure them
        batches = [b for b in batches if b >= args.stock_batch]
    if args.device == "cuda":  # the process's first run allocates once-only buffers (cuBLAS workspaces): not counted
        peak_mb(dict(base, batch=batches[0], accumulation=args.pairs // batches[0], packing=True), args)
    chosen_batch = None
    for batch in batches:
        config = dict(base, batch=batch, accumulation=args.pairs // batch, packing=True)
        peaks[f"padding_free@{batch}"] = peak = peak_mb(config, args)
        progress(f"padding_free, {batch} pairs per micro-batch: peak {peak:.0f} MiB")
        if limit is None and batch == args.stock_batch:
            limit = peak
        if limit is not None and peak <= limit:
            chosen_batch = batch
        elif limit is not None and batch > args.stock_batch:
            break
    budgets: dict[int, float] = {}
    budget, chosen_budget = args.first_budget, None
    largest = args.pairs * 2 * SIZES[args.size]["high"]  # every pair of a step in one micro-batch
    while budget <= 2 * largest:
        config = dict(base, batch=args.stock_batch, accumulation=args.pairs // args.stock_batch, packing=True)
        budgets[budget] = peak = peak_mb(dict(config, budget=budget), args)
        progress(f"token_budget {budget}: peak {peak:.0f} MiB")
        if peak > limit:
            break
        chosen_budget = budget
        budget = round(budget * GRID)
    if chosen_batch is None or chosen_budget is None:
        raise SystemExit(f"nothing fits under {limit:.0f} MiB: raise --limit-mb or lower --first-budget")
    steps = dict(steps=args.steps)
    configs = {
        "stock": dict(stock, **steps),
        "padding_free": dict(base, batch=chosen_batch, accumulation=args.pairs // chosen_batch, packing=True, **steps),
        "token_budget": dict(stock, packing=True, budget=chosen_budget, **steps),
    }
    return configs, dict(limit_mb=limit, padding_free_peaks=peaks, token_budget_peaks=budgets)


def linear_fit_error(points: dict[int, float]) -> float | None:
    """Largest relative distance of a peak from the least-squares line of peak against budget."""
    if len(points) < 3:
        return None
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return max(abs(y - (my + slope * (x - mx))) / y for x, y in zip(xs, ys, strict=True))


def time_steps(configs: dict[str, dict], args, dataset) -> tuple[dict, dict]:
    """Interleaved whole `train()` runs of every configuration in this process, timed whole (the plugin's re-collation
    happens before the Trainer's step callbacks, so they would not see it)."""
    import trl_ext
    from trl_ext.app.bench.stats import interleave

    trainers, stack = {}, contextlib.ExitStack()
    tmp = stack.enter_context(tempfile.TemporaryDirectory())
    for name, config in configs.items():
        with trl_ext.install(**install_kwargs(config)):
            trainers[name] = make_trainer(config, args.size, args.device, dataset, os.path.join(tmp, name))

    def sync() -> None:
        if args.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def arm(name: str):
        def run(index: int) -> float:
            sync()
            start = time.perf_counter()
            trainers[name].train()
            sync()
            return time.perf_counter() - start

        return run

    with stack:
        times = interleave({n: arm(n) for n in configs}, rounds=args.rounds, warmup=1, what="train() runs")
    state = trainers["token_budget"]._trl_ext.state["token_budget"]
    counts = state.micro_batch_counts[-args.steps :]
    shape = dict(micro_batches_per_step=counts, max_tokens=max(state.max_tokens[-args.steps :]))
    return times, shape


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where models and batches live")
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="model and data size (default: gpu on cuda, else cpu)"
    )
    parser.add_argument("--quick", action="store_true", help="the same as --size quick (a smoke run)")
    parser.add_argument("--gpu-size", action="store_true", help="the same as --size gpu")
    parser.add_argument("--pairs", type=int, default=None, help="pairs per optimizer step (default: the size's)")
    parser.add_argument("--stock-batch", type=int, default=None, help="stock's pairs per micro-batch")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per timed train()")
    parser.add_argument("--memory-steps", type=int, default=None, help="steps per memory run (default: --steps)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
    parser.add_argument("--limit-mb", type=float, default=None)
    parser.add_argument("--first-budget", type=int, default=None, help="smallest budget of the grid")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results to this file as JSON")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick and args.gpu_size:
        parser.error("--quick and --gpu-size name different sizes")
    args.size = args.size or ("quick" if args.quick else "gpu" if args.gpu_size or args.device == "cuda" else "cpu")
    args.quick = args.size == "quick"
    preset = SIZES[args.size]
    for key in ("pairs", "stock_batch", "steps", "rounds", "first_budget"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    args.memory_steps = args.memory_steps or args.steps
    if args.device == "cuda" and not args.memory_child:
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")
    return args


def main() -> None:
    args = parse_args()
    if args.memory_child:
        memory_child(json.loads(args.memory_child), args.size, args.seed)
        return

    from trl_ext.app.bench.stats import against, ratio_text, ratios, summarize

    configs, memory = configure(args)
    dataset = make_dataset(args.pairs * args.steps, args.size, args.seed)
    times, shape = time_steps(configs, args, dataset)
    results = {
        "device": device_name(args.device),
        "memory_measure": "torch.cuda.max_memory_allocated" if args.device == "cuda" else "peak RSS (VmHWM)",
        "args": {k: v for k, v in vars(args).items() if k != "memory_child"},
        "configs": configs,
        "memory": memory,
        "token_budget_peak_vs_linear_fit": linear_fit_error(memory["token_budget_peaks"]),
        "seconds": times,
        "token_budget_vs_padding_free": against(
            summarize(ratios(times, "padding_free", "token_budget")), "padding_free"
        ),
        "token_budget_vs_stock": summarize(ratios(times, "stock", "token_budget")),
        "padding_free_vs_stock": summarize(ratios(times, "stock", "padding_free")),
        **shape,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    pf, tb = configs["padding_free"], configs["token_budget"]
    print(
        f"memory limit {memory['limit_mb']:.0f} MiB: padding_free {pf['batch']} pairs per micro-batch, "
        f"token_budget {tb['budget']} tokens"
    )
    stock_count = configs["stock"]["accumulation"]
    print(
        f"token_budget micro-batches per step {shape['micro_batches_per_step']} (stock {stock_count}, "
        f"padding_free {pf['accumulation']}), largest {shape['max_tokens']} tokens"
    )
    for key in ("token_budget_vs_padding_free", "token_budget_vs_stock", "padding_free_vs_stock"):
        print(f"{key}: {ratio_text(results[key])} {' '.join(results[key]['flags'])}")
    fit = results["token_budget_peak_vs_linear_fit"]
    print(
        f"token_budget peak vs budget: within {fit:.0%} of a linear fit"
        if fit is not None
        else "(too few budgets for a fit)"
    )
    print(json.dumps(results, default=str))


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


if __name__ == "__main__":
    main()
