"""GPU benchmark of the packing plugins' attention: stock DPO vs padding_free vs prompt_sharing on one CUDA device.

Measures what docs/research on the H200 found slow (one SDPA call per sequence per layer) against the fused varlen
kernel (`trl_ext/toolkit/packing/kernels.py`). The workload is that measurement's: a LlamaForCausalLM from a config
(hidden 2048, 16 layers, 16 heads / 4 KV heads, intermediate 5632, vocab 32000: 853M parameters), bf16 weights,
`attn_implementation="sdpa"`, a separate reference model, 8 pairs per step, `max_length` 2048, synthetic pairs with
log-normal lengths (prompts 32-512 tokens, completions 16-1024), 6 batches. Each variant is its own `DPOTrainer` on
copies of the same weights; one step is TRL's real `compute_loss` (policy and reference forwards, loss, metrics), the
backward and (unless `--no-optimizer`) a fused AdamW step, between `torch.cuda.synchronize()` calls, with
`torch.cuda.max_memory_allocated` reset before it.

For gradient checkpointing off and on (`--checkpointing both`, the default; TRL's DPOConfig turns it on by default),
warm-up rounds then interleaved rounds (the bench's `interleave`: every variant once per round on that round's batch,
the order flipping every round). Reported per variant: the median step time, the median of the per-round ratios
stock / variant with its interquartile range, the step peak (peak allocated memory above what was allocated before
the step), the attention each trainer logged (fused
kernel or per-segment loop), and the first step's loss against stock's. `--segments` adds padding_free and
prompt_sharing with `attention: segments` (the per-segment loop), to measure the kernel against the loop. The JSON is
written after each checkpointing setting (`benchmarks/results/gpu_packing.json`), so a run cut short keeps what it
measured.

Run from the repository root (under 5 minutes on one H100 with the defaults):

    python benchmarks/gpu_packing.py
    python benchmarks/gpu_packing.py --segments --no-optimizer   # 5 trainers: leave out AdamW's states on 80 GB
    python benchmarks/gpu_packing.py --tiny        # CPU smoke run: a tiny model, one round
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu_packing.json"

#: The H200 measurement's model (docs: /work/shared/research/gpu.md) and a tiny one for the CPU smoke run.
MODEL = dict(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4, intermediate_size=5632, vocab_size=32000)
TINY_MODEL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=256)
DATA = dict(prompt=(32, 512, 128), completion=(16, 1024, 192), sigma=0.8)  # (min, max, median) tokens
TINY_DATA = dict(prompt=(4, 16, 8), completion=(2, 24, 8), sigma=0.8)
VARIANTS = ("stock", "padding_free", "prompt_sharing")
SEGMENT_VARIANTS = ("padding_free[segments]", "prompt_sharing[segments]")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed interleaved rounds per checkpointing setting")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--pairs", type=int, default=8, help="preference pairs per step")
    parser.add_argument("--batches", type=int, default=6, help="distinct batches (round i runs batch i mod this)")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--checkpointing", choices=("off", "on", "both"), default="both")
    parser.add_argument("--segments", action="store_true", help="also time the per-segment loop variants")
    parser.add_argument("--no-optimizer", dest="optimizer", action="store_false", help="time forward + backward only")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiny", action="store_true", help="CPU smoke run: tiny model and data, one round, no warm-up, float32"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.pairs < 1 or args.batches < 1 or args.warmup < 0:
        parser.error("--rounds, --pairs and --batches must be >= 1, --warmup >= 0")
    if args.tiny:
        args.device, args.rounds, args.warmup, args.pairs, args.batches, args.max_length = "cpu", 1, 0, 2, 2, 128
    return args


def variants(args) -> tuple[str, ...]:
    return VARIANTS + (SEGMENT_VARIANTS if args.segments else ())


# ---------------------------------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------------------------------


def _length(rng: random.Random, low: int, high: int, median: int, sigma: float) -> int:
    return int(min(high, max(low, round(math.exp(rng.gauss(math.log(median), sigma))))))


def make_rows(n: int, vocab: int, data: dict, seed: int) -> list[dict[str, str]]:
    """Preference pairs of the tokenizer's words `w0 ...` with log-normal lengths clipped to `data`'s ranges."""
    from trl_ext.app.bench.workload import SPECIAL_TOKENS

    rng = random.Random(seed)
    words = vocab - len(SPECIAL_TOKENS)

    def text(spec) -> str:
        return " ".join(f"w{rng.randrange(words)}" for _ in range(_length(rng, *spec, data["sigma"])))

    return [
        {
            "prompt": text(data["prompt"]),
            "chosen": " " + text(data["completion"]),
            "rejected": " " + text(data["completion"]),
        }
        for _ in range(n)
    ]


def make_model(size: dict, device, dtype, seed: int):
    """The Llama of `trl-ext bench --device`'s presets (`trl_ext.app.bench.device_workload.make_model`), in `dtype`."""
    from trl_ext.app.bench.device_workload import make_model as preset_model

    model = {**size, "vocab": size["vocab_size"]}
    return preset_model({"model": model, "dtype": str(dtype).replace("torch.", "")}, device, seed)


def make_trainer(policy, ref, tokenizer, dataset, args, output_dir):
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.pairs,
        max_length=args.max_length,
        report_to=[],
        use_cpu=args.device == "cpu",
        bf16=False,  # bf16 weights (GPU) or fp32 (the CPU smoke run): no autocast
        save_strategy="no",
        logging_steps=10**6,
        gradient_checkpointing=False,  # set per setting below, as `Trainer.train` would
        seed=args.seed,
    )
    return DPOTrainer(
        copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )


def build_trainers(args, tokenizer, dataset, output_dir) -> dict:
    """One trainer per variant, each on copies of the same policy and reference weights."""
    import torch

    import trl_ext

    dtype = torch.float32 if args.tiny else torch.bfloat16
    size = TINY_MODEL if args.tiny else MODEL
    policy = make_model(size, args.device, dtype, seed=args.seed)
    ref = make_model(size, args.device, dtype, seed=args.seed + 1)
    trainers = {}
    for name in variants(args):
        plugin = name.split("[")[0]
        if plugin == "stock":
            trainers[name] = make_trainer(policy, ref, tokenizer, dataset, args, output_dir)
            continue
        attention = "segments" if name.endswith("[segments]") else "auto"
        with trl_ext.install(**{plugin: True}, plugins={plugin: {"attention": attention}}):
            trainers[name] = make_trainer(policy, ref, tokenizer, dataset, args, output_dir)
    del policy, ref
    return trainers


def attention_of(trainer) -> str | None:
    """The packed attention the trainer logged (`varlen_attn (CUDA, bf16)`, `per-segment loop (...)`), if any."""
    from trl_ext.toolkit.packing.kernels import describe_choice

    context = getattr(trainer, "_trl_ext", None)
    if context is None:
        return None
    for state in context.state.values():
        choice = getattr(state, "kernels", {}).get("policy")
        if choice is not None:
            return describe_choice(choice)
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------------


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def step(trainer, batch, optimizer, device) -> tuple[float, float | None, float]:
    """One DPO step: (seconds, step peak GB or None on CPU, loss). The step peak is the peak allocated memory above
    what was allocated before the step (the weights and optimizer states of every variant's trainer)."""
    import torch

    cuda = str(device).startswith("cuda")
    trainer.model.zero_grad(set_to_none=True)
    _sync(device)
    before = 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else None
    if not torch.isfinite(loss):
        raise RuntimeError("non-finite loss")
    return seconds, peak, loss.item()


def set_checkpointing(trainer, on: bool) -> None:
    model = trainer.model
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.train()


def batch_tokens(batches: list) -> list[dict[str, int]]:
    return [{"padded": int(b["attention_mask"].numel()), "real": int(b["attention_mask"].sum())} for b in batches]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    import trl
    from datasets import Dataset

    from trl_ext.app.bench.workload import make_tokenizer

    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        print("gpu_packing: no CUDA device (use --tiny for the CPU smoke run)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    size, data = (TINY_MODEL, TINY_DATA) if args.tiny else (MODEL, DATA)
    tokenizer = make_tokenizer(size["vocab_size"])
    rows = make_rows(args.pairs * args.batches * 4, size["vocab_size"], data, args.seed)
    dataset = Dataset.from_list(rows)
    report = {
        "script": "benchmarks/gpu_packing.py",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "device": torch.cuda.get_device_name() if str(args.device).startswith("cuda") else platform.processor(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "model": {**size, "dtype": "float32" if args.tiny else "bfloat16", "attn_implementation": "sdpa"},
        "data": {**data, "pairs": args.pairs, "max_length": args.max_length},
        "rounds": args.rounds,
        "warmup": args.warmup,
        "optimizer": "AdamW (fused)" if args.optimizer else None,
        "settings": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        trainers = build_trainers(args, tokenizer, dataset, tmp)
        stock = trainers["stock"]
        rng = random.Random(args.seed)
        train = stock.train_dataset
        picks = [rng.sample(range(len(train)), args.pairs) for _ in range(args.batches)]
        collated = {
            name: [t.data_collator([train[i] for i in pick]) for pick in picks] for name, t in trainers.items()
        }
        report["batches"] = batch_tokens(collated["stock"])
        settings = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
        for checkpointing in settings:
            key = "checkpointing_on" if checkpointing else "checkpointing_off"
            report["settings"][key] = measure(trainers, collated, args, checkpointing)
            report["seconds"] = time.perf_counter() - start
            write(report, args.out)
    print(json.dumps(summary(report), indent=1))
    return 0


def measure(trainers: dict, batches: dict, args, checkpointing: bool) -> dict:
    """Interleaved rounds of every variant on its own collated batches (its collator adds its plugin's metadata),
    after each variant's first step on the same weights (its loss, compared with stock's)."""
    import torch

    from trl_ext.app.bench.stats import interleave, progress, ratios, summarize

    optimizers = {}
    cuda = str(args.device).startswith("cuda")
    for name, trainer in trainers.items():
        set_checkpointing(trainer, checkpointing)
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        optimizers[name] = torch.optim.AdamW(params, lr=1e-6, fused=cuda) if args.optimizer else None
    prepared = {name: [trainers[name]._prepare_inputs(b) for b in bs] for name, bs in batches.items()}
    first = {name: step(t, prepared[name][0], None, args.device)[2] for name, t in trainers.items()}
    peaks: dict[str, list[float]] = {name: [] for name in trainers}
    count = len(next(iter(prepared.values())))

    def arm(name):
        def run(index):
            seconds, peak, _ = step(trainers[name], prepared[name][index % count], optimizers[name], args.device)
            if peak is not None and index >= args.warmup:
                peaks[name].append(peak)
            return seconds

        return run

    what = f"gradient checkpointing {'on' if checkpointing else 'off'}"
    times = interleave({n: arm(n) for n in trainers}, rounds=args.rounds, what=what, warmup=args.warmup)
    result: dict = {}
    for name in trainers:
        entry = {
            "step_median_s": statistics.median(times[name]),
            "step_s": times[name],
            "step_peak_gb": max(peaks[name]) if peaks[name] else None,
            "attention": attention_of(trainers[name]),
            "first_loss": first[name],
            "first_loss_rel_diff": abs(first[name] - first["stock"]) / max(1e-12, abs(first["stock"])),
        }
        if name != "stock":
            entry["speedup"] = summarize(ratios(times, "stock", name))
            stock_peak = result["stock"]["step_peak_gb"]
            entry["peak_ratio"] = entry["step_peak_gb"] / stock_peak if stock_peak else None
        result[name] = entry
        progress(f"{what}: {name}: {entry['step_median_s']:.3f} s, attention {entry['attention']}")
    return result


def summary(report: dict) -> dict:
    """Per setting and variant: median step, speed-up [IQR], peak ratio, attention."""
    out = {}
    for key, setting in report["settings"].items():
        rows = {}
        for name, entry in setting.items():
            s = entry.get("speedup")
            rows[name] = {
                "step_s": round(entry["step_median_s"], 4),
                "speedup": None if s is None else f"{s['median']:.2f}x [{s['q1']:.2f}-{s['q3']:.2f}]",
                "peak_gb": entry["step_peak_gb"],
                "peak_ratio": entry.get("peak_ratio"),
                "attention": entry["attention"],
            }
        out[key] = rows
    return out


def write(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
