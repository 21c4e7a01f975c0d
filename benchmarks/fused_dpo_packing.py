"""Benchmark fused_logprobs + padding_free on TRL < 1.15 against TRL >= 1.15's own fused LM head, on the same data.

On TRL >= 1.15 DPO scores with TRL's fused LM head, and padding_free packs its forward (backbone and head) over real
tokens. On TRL 1.10-1.14, `_compute_loss` takes a `log_softmax` over the padded `[2B, L, V]` logits, which padding_free
does not remove; fused_logprobs scores the completion positions of padding_free's output chunk by chunk instead.

Two child processes, one per TRL (each its own Python environment), time one DPO step (TRL's real
`DPOTrainer.compute_loss`: policy forward, reference forward, loss and every metric, then the backward) on the same
model (a ~20M-parameter Llama, vocab 32000, fp32, as benchmarks/padding_free.py) and the same batches (synthetic
preference pairs with lognormal lengths, same seed):

- newer TRL (`--new-python`, e.g. trl 1.16): `stock` and `padding_free`;
- older TRL (`--old-python`, e.g. trl 1.12): `stock`, `padding_free` and `fused+padding_free`.

Each child runs interleaved rounds (the bench's `interleave`, one warm-up round first; in each round every batch once
per variant, the order flipping every batch) and reports each variant's seconds per round. The children alternate
(new, old, new, old, ...: `--alternations`) so that a change in the machine's load hits both. Speed-ups are the
median of the per-round ratios (stock time / variant time), with their spread; the result is the ratio of
fused+padding_free's speed-up on the older TRL to padding_free's on the newer (the issue's target: within 15 %).
Wall time and process CPU time (less disturbed on a shared machine) are both given.

Run from the repository root:

    python benchmarks/fused_dpo_packing.py --new-python .venv/bin/python --old-python /path/to/trl112/bin/python
    python benchmarks/fused_dpo_packing.py ... --quick      # smoke run
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

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

MODEL = dict(vocab_size=32000, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024)
DATA = dict(prompt_median=60, completion_median=60, sigma=0.8, max_prompt=200, max_completion=300)
NEW_VARIANTS = ("stock", "padding_free")
OLD_VARIANTS = ("stock", "padding_free", "fused+padding_free")
#: The issue's target: the older TRL's speed-up within 15 % of the newer TRL's (or above it).
TARGET = 0.15

# One DPO step (compute_loss + backward, wall and CPU seconds), as the padding_free benchmark times it: this script
# runs from benchmarks/, which is then on the import path.
from padding_free import step  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-python", default=sys.executable, help="Python of the environment with TRL >= 1.15")
    parser.add_argument("--old-python", help="Python of the environment with TRL 1.10-1.14")
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--pairs", type=int, default=2, help="preference pairs per batch (2x sequences)")
    parser.add_argument("--batches", type=int, default=1, help="distinct batches per round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per child run (after a warm-up round)")
    parser.add_argument("--alternations", type=int, default=2, help="child runs per TRL, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the per-round times and the summary here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.batches, args.rounds, args.alternations = 1, 1, 1, 1
    return args


# ---------------------------------------------------------------------------------------------------------------------
# Child: one TRL, its variants
# ---------------------------------------------------------------------------------------------------------------------


def make_trainer(tokenizer, dataset, output_dir):
    from trl import DPOConfig, DPOTrainer

    from trl_ext.testing import make_model

    args = DPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL 1.x would autocast to bf16 on CPU; the comparison is in fp32
        save_strategy="no",
        seed=0,
        max_length=None,
    )
    model, ref = make_model(seed=0, **MODEL), make_model(seed=1, **MODEL)
    return DPOTrainer(model, ref_model=ref, args=args, train_dataset=dataset, processing_class=tokenizer)


def child(args) -> None:
    import random

    import torch
    import trl
    from datasets import Dataset

    import trl_ext
    from trl_ext import _compat
    from trl_ext.app.bench.stats import interleave
    from trl_ext.app.bench.workload import preference_rows
    from trl_ext.testing import make_tokenizer

    new = _compat.dpo_uses_fused_lm_head()
    variants = NEW_VARIANTS if new else OLD_VARIANTS
    tokenizer = make_tokenizer(MODEL["vocab_size"])
    dataset = Dataset.from_list(preference_rows(64, vocab_size=MODEL["vocab_size"], seed=args.seed, **DATA))
    plugins = {"stock": None, "padding_free": {"padding_free": True}}
    plugins["fused+padding_free"] = {"padding_free": True, "fused_logprobs": True}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for variant in variants:
            if plugins[variant] is None:
                trainers[variant] = make_trainer(tokenizer, dataset, tmp)
            else:
                with trl_ext.install(**plugins[variant]):
                    trainers[variant] = make_trainer(tokenizer, dataset, tmp)
        rng = random.Random(args.seed)
        data = trainers["stock"].train_dataset
        examples = [[data[i] for i in rng.sample(range(len(data)), args.pairs)] for _ in range(args.batches)]
        batches = {v: [t.data_collator(ex) for ex in examples] for v, t in trainers.items()}
        cpu: dict[str, list[float]] = {v: [] for v in variants}

        def one_round(index: int) -> dict[str, float]:
            wall, used = dict.fromkeys(variants, 0.0), dict.fromkeys(variants, 0.0)
            for b in range(args.batches):
                for variant in variants if (index + b) % 2 == 0 else variants[::-1]:
                    dt, c = step(trainers[variant], batches[variant][b])
                    wall[variant] += dt
                    used[variant] += c
            if index:
                for variant in variants:
                    cpu[variant].append(used[variant])
            return wall

        wall = interleave(dict.fromkeys(variants), rounds=args.rounds, what="DPO steps", paired=one_round, warmup=1)
        fused = trainers.get("fused+padding_free")
        if fused is not None:  # the fused path and the packing really ran
            assert fused._trl_ext.state["fused_logprobs"].fused_calls > 0
            assert fused._trl_ext.state["padding_free"].packed_calls > 0
        masks = [b["attention_mask"] for b in batches["stock"]]
    print(
        json.dumps(
            {
                "trl": trl.__version__,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "fused_head": new,
                "shapes": [list(m.shape) for m in masks],
                "padding_fraction": 1 - sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks),
                "wall": wall,
                "cpu": cpu,
            }
        )
    )


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------


def run_child(python: str, args) -> dict:
    cmd = [python, os.path.abspath(__file__), "--child", "--pairs", str(args.pairs), "--batches", str(args.batches)]
    cmd += ["--rounds", str(args.rounds), "--seed", str(args.seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{python} child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    if not args.old_python:
        raise SystemExit("--old-python (an environment with TRL 1.10-1.14) is required")
    from trl_ext.app.bench.stats import ratio_text, ratios, summarize

    runs: dict[str, list[dict]] = {"new": [], "old": []}
    started = time.perf_counter()
    for _ in range(args.alternations):
        for side, python in (("new", args.new_python), ("old", args.old_python)):
            runs[side].append(run_child(python, args))
            last = runs[side][-1]
            print(f"  {side}: trl {last['trl']}, rounds {last['wall']}", flush=True)
    first = runs["new"][0]
    print(
        f"fused_logprobs + padding_free (older TRL) vs padding_free (TRL's fused head): torch {first['torch']}, "
        f"{first['threads']} threads; Llama {MODEL}, fp32; {args.pairs} pairs per batch, batches "
        f"{first['shapes']} (padding {first['padding_fraction']:.1%}), {args.batches} batches x {args.rounds} rounds "
        f"(+warm-up) x {args.alternations} alternations; {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    if first["shapes"] != runs["old"][0]["shapes"]:
        raise RuntimeError(f"the two TRLs collated different batches: {first['shapes']} vs {runs['old'][0]['shapes']}")

    def merged(side: str, clock: str) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for run in runs[side]:
            for variant, values in run[clock].items():
                out.setdefault(variant, []).extend(values)
        return out

    summary = {}
    for clock in ("wall", "cpu"):
        new, old = merged("new", clock), merged("old", clock)
        target = summarize(ratios(new, "stock", "padding_free"))
        ours = summarize(ratios(old, "stock", "fused+padding_free"))
        packing_only = summarize(ratios(old, "stock", "padding_free"))
        relative = ours["median"] / target["median"]
        summary[clock] = {"target": target, "fused_padding_free": ours, "padding_free_old": packing_only}
        summary[clock]["relative"] = relative
        print(f"{clock} time (median of per-round ratios, stock / variant):")
        print(f"  trl {runs['new'][0]['trl']}: padding_free speed-up {ratio_text(target)}")
        print(f"  trl {runs['old'][0]['trl']}: padding_free alone {ratio_text(packing_only)}")
        print(f"  trl {runs['old'][0]['trl']}: fused_logprobs + padding_free speed-up {ratio_text(ours)}")
        verdict = "met" if relative >= 1 - TARGET else "NOT met"
        print(f"  older TRL's speed-up / newer TRL's = {relative:.2f} (target: at least {1 - TARGET:.2f}): {verdict}")
        seconds = {
            side: statistics.median(merged(side, clock)[variant])
            for side, variant in (("new", "padding_free"), ("old", "fused+padding_free"))
        }
        print(
            f"  seconds per round: padding_free on the newer TRL {seconds['new']:.2f}, fused_logprobs + padding_free "
            f"on the older {seconds['old']:.2f} ({seconds['new'] / seconds['old']:.2f}x)"
        )
        for flag in target["flags"] + ours["flags"]:
            print(f"  !! {flag}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
