"""Reference log-prob precompute: TRL native vs trl-ext `precompute_ref_batch_size`, side by side in one run.

Builds a stock `DPOTrainer(precompute_ref_log_probs=True)` several times on the same skewed-length (lognormal)
synthetic preference data and the same reference model, and times only the precompute call
(`DPOTrainer._precompute_ref_logps`, which trl-ext replaces):

- `trl`: TRL's own precompute with `precompute_ref_batch_size=B` (dataset-order batches, each padded to its longest
  pair);
- `plugin`: `trl_ext.install(precompute_ref_batch_size=B)` (length-planned batches of B pairs), fresh cache;
- `plugin-auto`: `trl_ext.install(precompute_ref_batch_size="auto")`, fresh cache (probe time included);
- `plugin-cached`: the `plugin` run again, answered from its cache.

Every variant's columns are checked against TRL's (`max|diff|`). Reports wall time, pairs/s, process CPU time (stable
on a shared machine), the tokens the batches hold with padding, and peak memory (CUDA: max allocated; CPU: peak RSS
above the RSS before the precompute), each with its ratio against `trl`; best time over `--repeats` interleaved runs.

Usage:
    python benchmarks/precompute.py                       # CPU defaults (about 1-2 minutes)
    python benchmarks/precompute.py --pairs 2048 --hidden 1024 --layers 8 --max-length 1024   # a GPU-sized run

The measuring code (`PrecomputeRig`) is shared with `trl-ext bench`, which runs the same variants in interleaved
rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from .._shared import reset_peak_rss, rss_mib  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16, help="pairs per precompute batch for `trl` and `plugin`")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--prompt-median", type=float, default=24)
    p.add_argument("--completion-median", type=float, default=24)
    p.add_argument("--sigma", type=float, default=0.9, help="lognormal sigma of the lengths (skew)")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats; the best time of each is reported")
    p.add_argument("--ram-budget", default=None, help='`ram_budget` for "auto" on CPU (default: the plugin default)')
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1 keeps the CPU-time column honest on a shared machine: OpenMP threads spin)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--variants",
        default="trl,plugin,plugin-auto,plugin-cached",
        help="comma-separated subset to run (`trl` is always run: it is the reference)",
    )
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p.parse_args()


class _Peak:
    """Peak memory above the starting point: CUDA max allocated, or the process's peak RSS (VmHWM)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = (reset_peak_rss() or 0) * 2**20
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.peak = max(0, (rss_mib("VmHWM") or 0) * 2**20 - self.base)


def native_padded_tokens(dataset, batch_size: int, max_length: int) -> int:
    """Tokens TRL's dataset-order batches hold: each batch pads chosen and rejected to its longest sequence."""
    p, c, r = (np.asarray([len(x) for x in dataset[col]]) for col in ("prompt_ids", "chosen_ids", "rejected_ids"))
    longest = np.minimum(p + np.maximum(c, r), max_length)
    return int(
        sum(
            2 * len(longest[i : i + batch_size]) * longest[i : i + batch_size].max()
            for i in range(0, len(longest), batch_size)
        )
    )


@contextlib.contextmanager
def timed_precompute(box: dict, cuda: bool):
    """Time DPO's reference precompute and record its peak memory: stock TRL's `DPOTrainer._precompute_ref_logps`
    and the instance wrapper trl-ext attaches before TRL's `__init__` (which may never call the class method); only
    the outermost timed call counts."""
    from trl import DPOTrainer

    from .. import build

    original = DPOTrainer.__dict__["_precompute_ref_logps"]
    original_wrapper = build.precompute_wrapper
    depth = [0]

    def timing(call):
        def timed(*args):
            if depth[0]:
                return call(*args)
            depth[0] += 1
            try:
                with _Peak(cuda) as peak:
                    start, cpu_start = time.perf_counter(), time.process_time()
                    out = call(*args)
                    if cuda:
                        torch.cuda.synchronize()
                    box["seconds"] = box.get("seconds", 0.0) + time.perf_counter() - start
                    box["cpu_seconds"] = box.get("cpu_seconds", 0.0) + time.process_time() - cpu_start
                box["peak"] = max(box.get("peak", 0), peak.peak)
            finally:
                depth[0] -= 1
            return out

        return timed

    def timed_wrapper(ctx, method):
        return timing(original_wrapper(ctx, method))

    DPOTrainer._precompute_ref_logps = timing(original)  # type: ignore[method-assign]  # restored below
    build.precompute_wrapper = timed_wrapper  # type: ignore[assignment]
    try:
        yield box
    finally:
        DPOTrainer._precompute_ref_logps = original  # type: ignore[method-assign]
        build.precompute_wrapper = original_wrapper  # type: ignore[assignment]


class PrecomputeRig:
    """Builds `DPOTrainer(precompute_ref_log_probs=True)` for one variant and times only its precompute."""

    def __init__(self, args, policy, reference, tokenizer, data_kwargs: dict, cuda: bool, work: Path) -> None:
        self.args, self.policy, self.reference, self.tokenizer = args, policy, reference, tokenizer
        self.data_kwargs, self.cuda, self.work = data_kwargs, cuda, work

    def run(self, variant: str, cache_dir: Path | None):
        """One build; returns `(timing box, the plugin's run record, (chosen, rejected) columns, dataset)`."""
        from trl import DPOConfig, DPOTrainer

        import trl_ext

        from .bench.workload import make_preference_dataset

        args, cuda = self.args, self.cuda
        dpo_args = DPOConfig(
            output_dir=str(self.work / "out"),
            report_to=[],
            use_cpu=not cuda,
            bf16=args.dtype == "bfloat16" and cuda,
            precompute_ref_log_probs=True,
            precompute_ref_batch_size=args.batch_size,
            max_length=args.max_length,
            save_strategy="no",
        )
        # A new in-memory dataset each time: TRL's cache for those is a fresh temp file, so it always recomputes.
        dataset = make_preference_dataset(args.pairs, **self.data_kwargs)
        box: dict = {}
        kwargs = dict(args=dpo_args, train_dataset=dataset, processing_class=self.tokenizer, ref_model=self.reference)
        if variant == "trl":
            with timed_precompute(box, cuda):
                trainer = DPOTrainer(self.policy, **kwargs)
            runs: list[dict[str, Any]] = [{}]
        else:
            flag = "auto" if variant == "plugin-auto" else args.batch_size
            options = {"cache_dir": str(cache_dir)}
            if args.ram_budget is not None:
                options["ram_budget"] = args.ram_budget
            with trl_ext.install(precompute_ref_batch_size=flag, plugins={"precompute_ref_batch_size": options}):
                with timed_precompute(box, cuda):
                    trainer = DPOTrainer(self.policy, **kwargs)
                runs = trainer._trl_ext.state["precompute_ref_batch_size"].runs  # type: ignore[attr-defined]
        ds: Any = trainer.train_dataset
        cols = np.asarray(ds["ref_chosen_logps"]), np.asarray(ds["ref_rejected_logps"])
        return box, runs[0], cols, ds


def main():
    args = parse_args()
    import trl

    from .bench.workload import make_model, make_tokenizer

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tokenizer = make_tokenizer(args.vocab)
    lengths = dict(prompt_median=args.prompt_median, completion_median=args.completion_median, sigma=args.sigma)
    data_kwargs = dict(vocab_size=args.vocab, max_prompt=args.max_length, max_completion=args.max_length, **lengths)
    heads = dict(num_heads=max(4, args.hidden // 64), num_kv_heads=max(2, args.hidden // 128))
    model_kwargs = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, dtype=dtype, **heads)
    model_kwargs["max_position_embeddings"] = 2 * args.max_length
    policy = make_model(seed=0, **model_kwargs)
    reference = make_model(seed=1, **model_kwargs)
    if cuda:
        policy, reference = policy.cuda(), reference.cuda()
    work = Path(tempfile.mkdtemp(prefix="trl_ext_bench_precompute_"))

    rig = PrecomputeRig(args, policy, reference, tokenizer, data_kwargs, cuda, work)

    variants = ["trl"] + [v for v in args.variants.split(",") if v and v != "trl"]
    unknown = set(variants) - {"trl", "plugin", "plugin-auto", "plugin-cached"}
    if unknown or ("plugin-cached" in variants and "plugin" not in variants):
        raise SystemExit(f"--variants: unknown {sorted(unknown)} (plugin-cached needs plugin)")
    best: dict[str, dict] = {}
    seconds: dict[str, list[float]] = {}
    reference_cols = None
    for repeat in range(args.repeats):
        for variant in variants:
            # plugin-cached: the cache this repeat's `plugin` run wrote
            cache = work / f"cache-{repeat}-{'plugin' if variant == 'plugin-cached' else variant}"
            box, run, cols, dataset = rig.run(variant, cache)
            if variant == "trl":
                reference_cols = cols
                box["padded_tokens"] = native_padded_tokens(dataset, args.batch_size, args.max_length)
            else:
                err = max(float(np.abs(a - b).max()) for a, b in zip(cols, reference_cols, strict=True))
                box.update(max_abs_diff_vs_trl=err, padded_tokens=run.get("padded_tokens"))
            box.update(pairs=len(dataset), batches=run.get("batches"), batch_tokens=run.get("batch_tokens"))
            box["source"] = run.get("source", "trl")
            print(
                f"[repeat {repeat}] {variant:14s} {box['seconds']:8.3f} s wall {box['cpu_seconds']:8.3f} s cpu  "
                f"peak {box['peak'] / 2**20:8.1f} MiB",
                flush=True,
            )
            seconds.setdefault(variant, []).append(box["seconds"])
            if variant not in best:
                best[variant] = box
            else:  # best time of each kind over the repeats; the highest peak memory
                kept = best[variant]
                kept["seconds"] = min(kept["seconds"], box["seconds"])
                kept["cpu_seconds"] = min(kept["cpu_seconds"], box["cpu_seconds"])
                kept["peak"] = max(kept["peak"], box["peak"])

    base = best["trl"]
    device = f"cuda ({torch.cuda.get_device_name()})" if cuda else "cpu"
    print()
    print(f"trl {trl.__version__}, torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}")
    print(
        f"{args.pairs} pairs (lognormal lengths, medians {args.prompt_median:g}+{args.completion_median:g}, "
        f"sigma {args.sigma:g}, max_length {args.max_length}), model hidden {args.hidden} x {args.layers} layers, "
        f"vocab {args.vocab}, {args.dtype}, batch size {args.batch_size}, best of {args.repeats}"
    )
    header = (
        f"{'variant':14s} {'wall s':>8s} {'pairs/s':>8s} {'speedup':>8s} {'cpu s':>8s} {'speedup':>8s} "
        f"{'padded tok':>10s} {'ratio':>6s} {'peak MiB':>9s} {'ratio':>6s} {'batches':>7s} {'max|diff|':>9s}"
    )
    print(header)
    print("-" * len(header))
    for variant in variants:
        r = best[variant]
        r.update(
            pairs_per_s=r["pairs"] / r["seconds"],
            speedup_vs_trl=base["seconds"] / r["seconds"],
            cpu_speedup_vs_trl=base["cpu_seconds"] / r["cpu_seconds"] if r["cpu_seconds"] else float("inf"),
            peak_ratio_vs_trl=r["peak"] / base["peak"] if base["peak"] else float("nan"),
        )
        tokens = r.get("padded_tokens") or 0
        token_ratio = f"{tokens / base['padded_tokens']:5.2f}x" if tokens else ""
        diff = r.get("max_abs_diff_vs_trl")
        print(
            f"{variant:14s} {r['seconds']:8.3f} {r['pairs_per_s']:8.1f} {r['speedup_vs_trl']:7.2f}x "
            f"{r['cpu_seconds']:8.3f} {r['cpu_speedup_vs_trl']:7.2f}x {tokens:10d} {token_ratio:>6s} "
            f"{r['peak'] / 2**20:9.1f} {r['peak_ratio_vs_trl']:5.2f}x {str(r.get('batches') or ''):>7s} "
            f"{'' if diff is None else f'{diff:9.2e}'}"
        )
    for variant in variants[1:]:
        if variant == "plugin-cached":
            continue
        ratios = sorted(a / b for a, b in zip(seconds["trl"], seconds[variant], strict=True))
        print(
            f"{variant}: median of per-repeat speed-ups {statistics.median(ratios):.2f}x "
            f"(min {ratios[0]:.2f}x, max {ratios[-1]:.2f}x, {len(ratios)} repeats)"
        )
    if "plugin" in best:
        wall, cpu = best["plugin"]["speedup_vs_trl"], best["plugin"]["cpu_speedup_vs_trl"]
        print(
            f"\nplugin vs TRL native at batch size {args.batch_size}: {wall:.2f}x faster (wall), {cpu:.2f}x (cpu "
            f"time); target 2x: {'met' if min(wall, cpu) >= 2 else 'NOT met'}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": best}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
