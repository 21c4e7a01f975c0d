"""`trl-ext bench`: stock TRL against trl-ext, side by side, on one machine, in one run.

With no arguments it builds a small Llama from a config and a synthetic preference dataset with realistic skewed
(lognormal) lengths, so nothing is downloaded. For each plugin that applies it measures stock and trl-ext on the same
data and weights in a fixed number of interleaved rounds (stock, trl-ext, trl-ext, stock, ...), and prints the
median of the per-round ratios with its spread, flagging a ratio above its theoretical bound, below 1, or with a wide
spread. Every verdict is computed from the numbers: results that should agree ("same losses", "same values", "same
tokens") are compared against a stated tolerance and flagged when they do not, and a speed ratio says "faster" or
"slower" only when its interquartile range is on one side of 1:

- DPO training step throughput (`padding_free`), plus the loss and reward-margin curves of both runs (they must lie
  on top of each other);
- reference precompute time (`precompute_ref_batch_size`, same batch size as stock, and `"auto"`);
- collectives per optimizer step and per logging step in a 2-process run (`sync_metrics`, torchrun, gloo);
- generation memory and time under DeepSpeed ZeRO-3 (`generation`), when DeepSpeed is installed.

It writes `report.json`, `table.md` (the table in Markdown) and `bench.png` (one panel per section, error bars =
interquartile range) to `--out`.
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
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import __version__, _compat
from ..errors import UsageError

_WORKER = "trl_ext.app._bench_worker"
#: Wall time of `trl-ext bench --quick` on 2 shared CPU cores, measured (`report.json`'s `wall_seconds` of the run
#: recorded in `benchmarks/results/bench_quick.json`); `--help` and the README state it.
QUICK_DURATION = "about 3 min"


# ---------------------------------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------------------------------


def _sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(
            vocab=2048,
            hidden=128,
            layers=2,
            heads=4,
            kv=2,
            pairs=48,
            batch=8,
            steps=3,
            prompt=40,
            completion=40,
            max_len=128,
        )
    return dict(
        vocab=32000,
        hidden=256,
        layers=4,
        heads=4,
        kv=2,
        pairs=128,
        batch=8,
        steps=10,
        prompt=60,
        completion=60,
        max_len=400,
    )


class _Setup:
    def __init__(self, args: argparse.Namespace) -> None:
        from trl_ext.testing import make_model, make_preference_dataset, make_tokenizer

        self.size = _sizes(args.quick)
        s = self.size
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
                vocab_size=vocab,
                hidden_size=s["hidden"],
                num_layers=s["layers"],
                num_heads=s["heads"],
                num_kv_heads=s["kv"],
                intermediate_size=4 * s["hidden"],
                seed=0,
            )
            n_params = sum(p.numel() for p in self.model_fn().parameters())
            self.model_desc = f"llama hidden={s['hidden']} layers={s['layers']} vocab={vocab} ({n_params / 1e6:.1f}M)"
        self.dataset = make_preference_dataset(
            s["pairs"],
            vocab_size=min(vocab, s["vocab"]),
            prompt_median=s["prompt"],
            completion_median=s["completion"],
            sigma=0.8,
            max_prompt=s["max_len"],
            max_completion=s["max_len"],
            seed=0,
        )
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


def _progress(msg: str) -> None:
    print(f"[trl-ext bench] {msg}", file=sys.stderr, flush=True)


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------------------------------
# interleaved rounds
# ---------------------------------------------------------------------------------------------------------------------

#: A comparison whose per-round ratios spread more than this (interquartile range / median) is flagged.
WIDE_SPREAD = 0.15


def summarize(ratios: Sequence[float], bound: float | None = None) -> dict[str, Any]:
    """Median of per-round ratios, its spread (quartiles, min, max, IQR / median) and what is suspicious about it."""
    ordered = sorted(ratios)
    median = statistics.median(ordered)
    if len(ordered) >= 4:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1, q3 = ordered[0], ordered[-1]
    spread = (q3 - q1) / median if median else float("inf")
    flags = []
    if bound is not None and median > bound * 1.02:
        flags.append(f"ABOVE BOUND {bound:.2f}x: a measuring error")
    if median < 1:
        flags.append("SLOWER than stock")
    if spread > WIDE_SPREAD:
        flags.append(f"WIDE SPREAD ({spread:.0%}): rerun on a quieter machine or with more --rounds")
    return {
        "median": median,
        "q1": q1,
        "q3": q3,
        "min": ordered[0],
        "max": ordered[-1],
        "spread": spread,
        "rounds": len(ordered),
        "ratios": list(ratios),
        "bound": bound,
        "flags": flags,
    }


#: Largest |loss difference| per batch, stock against `padding_free`, that still counts as the same losses: both run
#: in fp32 on the same batches and weights (DPO losses ~0.7; a reordered sum moves them by ~1e-7).
LOSS_ATOL = 1e-4
#: Largest |reference log-prob difference|, TRL's precompute against trl-ext's, relative to the largest |log-prob|,
#: that still counts as the same values: fp32, and only the batch composition (the padding) differs, which moves TRL's
#: own values by up to ~3e-5 of their size between two batch sizes.
REF_LOGP_RTOL = 1e-4


def agreement(max_abs_diff: float, tolerance: float, what: str) -> dict[str, Any]:
    """The verdict on two results that should agree: the same `what` when the largest absolute difference is within
    `tolerance` (a NaN difference never is); otherwise a flag that names both numbers."""
    same = bool(max_abs_diff <= tolerance)
    if same:
        text = f"same {what} (within {tolerance:.1e})"
        flags: list[str] = []
    else:
        text = f"{what.upper()} DIFFER: max |diff| {max_abs_diff:.2e} > tolerance {tolerance:.1e}"
        flags = [text]
    return {"same": same, "max_abs_diff": max_abs_diff, "tolerance": tolerance, "text": text, "flags": flags}


def direction(r: dict[str, Any]) -> str:
    """What a speed ratio `stock time / trl-ext time` says: "faster" or "slower" only when the whole interquartile
    range is on that side of 1, else that the rounds do not tell them apart."""
    if r["q1"] > 1:
        return "faster"
    if r["q3"] < 1:
        return "slower"
    return "(no clear difference: the IQR spans 1)"


def interleave(
    arms: dict[str, Any],
    *,
    rounds: int,
    what: str,
    paired: Any = None,
) -> dict[str, list[float]]:
    """Time every arm once per round, in turn, for exactly `rounds` rounds (stock, trl-ext, trl-ext, stock, ...: the
    order flips every round so that neither side always runs first).

    The count is fixed in advance: stopping once the ratios agree would stop on a lucky streak and bias the reported
    spread low. `arms` maps a name to `fn(round_index) -> seconds`; the first arm is the baseline. A comparison that
    interleaves more finely inside a round passes `paired(round_index) -> {name: seconds}` instead (and the arm names
    in `arms`, values unused). Returns the seconds per arm and round.
    """
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for index in range(rounds):
        if paired is not None:
            for name, value in paired(index).items():
                times[name].append(value)
        else:
            for name in names if index % 2 == 0 else names[::-1]:
                times[name].append(arms[name](index))
    _progress(f"{what}: {rounds} interleaved rounds in {time.perf_counter() - start:.0f} s")
    return times


def _ratios(times: dict[str, list[float]], base: str, arm: str) -> list[float]:
    return [a / b for a, b in zip(times[base], times[arm], strict=True)]


# ---------------------------------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------------------------------


def padding_bounds(masks: Sequence[Any]) -> dict[str, float]:
    """The speed-up bound of dropping the padding of batches with these 2D attention masks.

    A step costs `a * tokens + b * sum(len^2)` (attention) with `a, b >= 0`, and a padded row costs its padded length
    in both, so the speed-up is at most the larger of the token ratio and the attention ratio (`bound`). Also returns
    each ratio and the padding fraction.
    """
    real = sum(int(m.sum()) for m in masks)
    padded = sum(m.numel() for m in masks)
    attn_real = sum(int(row.sum()) ** 2 for m in masks for row in m)
    attn_padded = sum(m.shape[0] * m.shape[1] ** 2 for m in masks)
    return {
        "padding_fraction": 1 - real / padded,
        "token_bound": padded / real,
        "attention_bound": attn_padded / attn_real,
        "bound": max(padded / real, attn_padded / attn_real),
    }


def _bench_padding_free(setup: _Setup, rounds: int) -> dict[str, Any]:
    """Forward + backward of a DPO training step (`trainer.training_step`, TRL's real loss) on the same batches and
    weights, stock trainer against a `padding_free` trainer, one pass over the batches per arm and round."""
    import torch
    from trl import DPOTrainer

    import trl_ext

    n_batches = setup.size["steps"]

    def build(label: str) -> Any:
        # A reference that differs from the policy: with equal weights every DPO loss is exactly log 2, and the
        # loss comparison below would prove nothing.
        ref = setup.model_fn()
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.05 * p.std().nan_to_num() * torch.randn(p.shape, generator=generator, dtype=p.dtype))
        trainer = DPOTrainer(
            setup.model_fn(),
            ref_model=ref,
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

    _progress("padding_free: building stock and padding_free DPO trainers")
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
    speed = summarize(_ratios(times, "stock", "trl_ext"), bound=bound)
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


def _bench_precompute(setup: _Setup, rounds: int) -> dict[str, Any]:
    """TRL's reference precompute against trl-ext's (same batch size, and `"auto"`), timed by the measuring code of
    `benchmarks/precompute.py` (`PrecomputeRig`), one trainer build per arm and round."""
    from types import SimpleNamespace

    import numpy as np

    from . import _bench_precompute as pre

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

    def arm(variant: str):
        def run(index: int) -> float:
            box, _, cols, _ = rig.run(variant, work / f"cache-{variant}-{index}")  # a fresh cache every round
            if index == 0:
                columns[variant] = cols
            return box["seconds"]

        return run

    _progress(f"precompute: {options.pairs} pairs, batch {batch}: TRL, trl-ext, trl-ext auto")
    times = interleave(
        {name: arm(name) for name in ("trl", "plugin", "plugin-auto")},
        rounds=rounds,
        what="precompute",
    )
    diff = max(float(np.abs(a - b).max()) for a, b in zip(columns["trl"], columns["plugin"], strict=True))
    scale = max(float(np.abs(a).max()) for a in columns["trl"])
    return {
        "pairs": options.pairs,
        "batch_size": batch,
        "stock": {"seconds": times["trl"]},
        "trl_ext": {"seconds": times["plugin"]},
        "trl_ext_auto": {"seconds": times["plugin-auto"]},
        "speedup": summarize(_ratios(times, "trl", "plugin")),
        "speedup_auto": summarize(_ratios(times, "trl", "plugin-auto")),
        "max_abs_ref_logp_diff": diff,
        "max_abs_ref_logp": scale,
        "values": agreement(diff, REF_LOGP_RTOL * scale, "values"),
    }


def _bench_generation(setup: _Setup, quick: bool) -> dict[str, Any]:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return {"skipped": "DeepSpeed is not installed (pip install trl-ext[deepspeed])"}
    torchrun = Path(sys.executable).with_name("torchrun")
    out = setup.out / "generation.json"
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "trl_ext.app._bench_generation"]
    cmd += ["--json", str(out), "--output-dir", str(setup.out / "runs" / "generation")]
    cmd += (
        ["--repeats", "1", "--layers", "4", "--hidden", "256", "--new-tokens", "16"] if quick else ["--repeats", "2"]
    )
    _progress("generation: 2-process ZeRO-3 OnlineDPO, every mode (stock gather/no-gather, trl-ext modes)")
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", ACCELERATE_USE_DEEPSPEED="true")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"ZeRO-3 generation run failed:\n{proc.stderr[-3000:]}")
    report = json.loads(out.read_text())
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


def run_collectives(out: Path, extra: Sequence[str] = ()) -> dict[str, Any]:
    """Run the 2-process `collectives` worker (stock and `sync_metrics`, interleaved) under torchrun; its report."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", _WORKER, "collectives", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    proc = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"2-process run failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _bench_collectives(setup: _Setup, quick: bool, rounds: int) -> dict[str, Any]:
    _progress("sync_metrics: 2-process DPO, stock and sync_metrics in interleaved rounds")
    extra = ["--rounds", str(rounds)] + (["--quick"] if quick else [])
    results = run_collectives(setup.out / "collectives.json", extra)
    _progress(f"sync_metrics: {results['rounds']} interleaved rounds")
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
    if counted == expected:
        return {"same": True, "expected": expected, "text": text, "flags": []}
    flag = f"EXPECTED {expected} COLLECTIVES (one per logging step + 1), COUNTED {counted}"
    return {
        "same": False,
        "expected": expected,
        "text": f"{stock['collectives_total']} -> {counted} collectives",
        "flags": [flag],
    }


# ---------------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------------


def _ratio_text(r: dict[str, Any]) -> str:
    """`2.10x faster [IQR 2.08-2.10, 5 rounds]`: the median ratio, what it says, its spread."""
    return f"{r['median']:.2f}x {direction(r)} [IQR {r['q1']:.2f}-{r['q3']:.2f}, {r['rounds']} rounds]"


def _times_text(ratio: float, baseline: str) -> str:
    """A time ratio `this / baseline` from single measurements, with what it says."""
    if ratio > 1:
        return f"{ratio:.2f}x {baseline}'s (slower)"
    if ratio < 1:
        return f"{ratio:.2f}x {baseline}'s (faster)"
    return f"1.00x {baseline}'s (the same)"


def _rows(report: dict[str, Any]) -> list[tuple[str, str, str, str, list[str]]]:
    """The table's rows: `(measure, stock TRL, trl-ext, ratio or verdict, flags)`."""
    rows: list[tuple[str, str, str, str, list[str]]] = []
    sections = report["sections"]
    pf = sections.get("padding_free")
    if pf and "error" not in pf and "skipped" not in pf:
        rows.append(
            (
                f"DPO step fwd+bwd, {pf['batches']} batches, padding_free (s)",
                f"{statistics.median(pf['stock']['pass_seconds']):.3f}",
                f"{statistics.median(pf['trl_ext']['pass_seconds']):.3f}",
                f"{_ratio_text(pf['speedup'])}; bound {pf['bound']:.2f}x ({pf['padding_fraction']:.0%} padding: "
                f"tokens {pf['token_bound']:.2f}x, attention {pf['attention_bound']:.2f}x; "
                f"{pf['fraction_of_bound']:.0%} of bound)",
                pf["speedup"]["flags"],
            )
        )
        rows.append(
            (
                "same step: max |loss diff| per batch (fp32)",
                "",
                f"{pf['losses']['max_abs_diff']:.2e}",
                pf["losses"]["text"],
                pf["losses"]["flags"],
            )
        )
    pc = sections.get("precompute")
    if pc and "error" not in pc and "skipped" not in pc:
        rows.append(
            (
                f"ref precompute, {pc['pairs']} pairs, batch {pc['batch_size']} (s)",
                f"{statistics.median(pc['stock']['seconds']):.2f}",
                f"{statistics.median(pc['trl_ext']['seconds']):.2f}",
                _ratio_text(pc["speedup"]),
                pc["speedup"]["flags"],
            )
        )
        rows.append(
            (
                'ref precompute, "auto" (s)',
                "",
                f"{statistics.median(pc['trl_ext_auto']['seconds']):.2f}",
                _ratio_text(pc["speedup_auto"]),
                pc["speedup_auto"]["flags"],
            )
        )
        rows.append(
            (
                "max |ref logp diff| (fp32)",
                "",
                f"{pc['values']['max_abs_diff']:.2e}",
                f"{pc['values']['text']}: {REF_LOGP_RTOL:.0e} of the largest |logp|, {pc['max_abs_ref_logp']:.0f}",
                pc["values"]["flags"],
            )
        )
    co = sections.get("sync_metrics")
    if co and "error" not in co and "skipped" not in co:
        rows.append(
            (
                "collectives / optimizer step, 2 processes",
                f"{co['stock']['collectives_per_step']:.1f}",
                f"{co['trl_ext']['collectives_per_step']:.1f}",
                co["collectives"]["text"],
                co["collectives"]["flags"],
            )
        )
        rows.append(
            (
                "2-process step time, sync_metrics (s)",
                f"{statistics.median(co['stock']['step_seconds']):.3f}",
                f"{statistics.median(co['trl_ext']['step_seconds']):.3f}",
                _ratio_text(co["step_time_ratio"]),
                co["step_time_ratio"]["flags"],
            )
        )
    ge = sections.get("generation")
    if ge and "modes" in ge:
        repeats = ge.get("repeats", 1)
        runs = "one run" if repeats == 1 else f"best of {repeats} runs"
        for index, mode in enumerate(ge["modes"]):
            if index == 0:
                text = f"the baseline ({runs})"
            else:
                text = (
                    f"memory {mode['peak_vs_gather']:.2f}x TRL gather's (counted bytes); time "
                    f"{_times_text(mode['time_vs_gather'], 'TRL gather')} ({runs})"
                )
            rows.append(
                (
                    f"ZeRO-3 generation, 2 ranks: {mode['mode']}",
                    "",
                    f"{max(mode['peak_bytes_per_rank']) / 2**20:.1f} MiB/rank",
                    text,
                    [] if mode["same_tokens"] else ["TOKENS DIFFER from TRL gather's"],
                )
            )
        rows.append(("ZeRO-3 generation: greedy tokens", "", "", ge["tokens"]["text"], []))
    for name, section in sections.items():
        if "error" in section or "skipped" in section:
            rows.append((name, "", "", section.get("error") or section["skipped"], []))
    return rows


_HEADER = ("measure", "stock TRL", "trl-ext", "ratio: median of per-round stock/trl-ext [spread], or verdict")


def _table(report: dict[str, Any]) -> str:
    """The plain-text table; a flagged row is followed by one `!!` line per flag, under its ratio column."""
    rows = _rows(report)
    widths = [max(len(r[i]) for r in [_HEADER, *rows]) for i in range(3)]
    indent = " " * (sum(widths) + 6)
    lines = []
    header: tuple[str, str, str, str, list[str]] = (*_HEADER, [])
    for measure, stock, ext, text, flags in [header, *rows]:
        cells = (measure.ljust(widths[0]), stock.ljust(widths[1]), ext.ljust(widths[2]), text)
        lines.append("  ".join(cells))
        lines.extend(f"{indent}!! {flag}" for flag in flags)
    return "\n".join(lines)


def markdown_table(report: dict[str, Any]) -> str:
    """The table in Markdown, with a caption naming the run; a flag ends its row's last cell in bold."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    load = report["load_average"]
    caption = (
        f"`trl-ext bench{' --quick' if report['quick'] else ''}` on trl {report['trl']}, torch {report['torch']} "
        f"({load['cores']} CPU cores, load average {load['start']} -> {load['end']}; {report['model']}; "
        f"{report['rounds']} rounds; {report['wall_seconds']:.0f} s wall):"
    )
    lines = [caption, "", "| " + " | ".join(_HEADER) + " |", "|---|---|---|---|"]
    for measure, stock, ext, text, flags in _rows(report):
        last = cell(text) + "".join(f" **!! {cell(flag)}**" for flag in flags)
        lines.append(f"| {cell(measure)} | {cell(stock)} | {cell(ext)} | {last} |")
    return "\n".join(lines)


def duration_text(seconds: float) -> str:
    """`about 2.5 min`: a wall time rounded to the half minute, as `--help` and the README state it."""
    return f"about {max(0.5, round(seconds / 30) / 2):g} min"


def headline(report: dict[str, Any]) -> dict[str, float]:
    """The ratios a reader takes away: padding-free and precompute speed-ups, collectives per step, memory."""
    out: dict[str, float] = {}
    sections = report["sections"]
    if "speedup" in sections.get("padding_free", {}):
        out["padding_free_speedup"] = sections["padding_free"]["speedup"]["median"]
    if "speedup" in sections.get("precompute", {}):
        out["precompute_speedup"] = sections["precompute"]["speedup"]["median"]
        out["precompute_auto_speedup"] = sections["precompute"]["speedup_auto"]["median"]
    if "stock" in sections.get("sync_metrics", {}):
        out["stock_collectives_per_step"] = sections["sync_metrics"]["stock"]["collectives_per_step"]
        out["sync_metrics_collectives_per_step"] = sections["sync_metrics"]["trl_ext"]["collectives_per_step"]
    for mode in sections.get("generation", {}).get("modes", []):
        if mode["mode"] == "ext False":
            out["zero3_generation_memory_vs_gather"] = mode["peak_vs_gather"]
    return out


#: One colour per meaning, the same in every panel.
COLOURS = {"stock": "#7f7f7f", "trl_ext": "#d62728", "auto": "#ff7f0e", "bound": "#1f77b4", "flag": "#9467bd"}


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    sections = report["sections"]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))

    def ratio_bar(ax, x: float, r: dict[str, Any], colour: str, label: str) -> None:
        err = [[r["median"] - r["q1"]], [r["q3"] - r["median"]]]
        ax.bar(x, r["median"], color=colour, label=label, width=0.6)
        ax.errorbar(x, r["median"], yerr=err, fmt="none", ecolor="black", capsize=5, label=None)
        ax.plot([x] * len(r["ratios"]), r["ratios"], ".", color="black", alpha=0.4)
        if r["flags"]:
            ax.annotate(
                "!! " + r["flags"][0].split(":")[0],
                (x, r["q3"]),
                ha="center",
                va="bottom",
                color=COLOURS["flag"],
                fontsize=8,
                xytext=(0, 6),
                textcoords="offset points",
            )

    # 1. padding-free: speed-up with its bound as a line, and the per-batch losses of both sides.
    ax = axes[0]
    pf = sections.get("padding_free", {})
    if "speedup" in pf:
        ax.axhline(1.0, color=COLOURS["stock"], linestyle=":", label="stock TRL = 1")
        ratio_bar(ax, 0, pf["speedup"], COLOURS["trl_ext"], "trl-ext padding_free (median, IQR)")
        ax.axhline(
            pf["bound"], color=COLOURS["bound"], linestyle="--", label=f"bound (padded/real work) = {pf['bound']:.2f}x"
        )
        ax.set_xticks([0], [f"DPO step, {pf['padding_fraction']:.0%} padding"])
        inset = ax.inset_axes([0.62, 0.08, 0.35, 0.35])
        steps = range(1, len(pf["stock"]["loss"]) + 1)
        inset.plot(steps, pf["stock"]["loss"], "o-", color=COLOURS["stock"], linewidth=3)
        inset.plot(steps, pf["trl_ext"]["loss"], "x--", color=COLOURS["trl_ext"])
        inset.set_title("loss per batch (overlap)", fontsize=7)
        inset.xaxis.set_major_locator(MaxNLocator(integer=True))
        inset.tick_params(labelsize=6)
        inset.set_xlabel("batch", fontsize=6)
    ax.set_title("padding-free DPO step (higher is better)")
    ax.set_ylabel("speed-up vs stock TRL")

    # 2. precompute: same batch size and "auto".
    ax = axes[1]
    pc = sections.get("precompute", {})
    if "speedup" in pc:
        ax.axhline(1.0, color=COLOURS["stock"], linestyle=":", label="stock TRL = 1")
        ratio_bar(ax, 0, pc["speedup"], COLOURS["trl_ext"], "trl-ext, same batch size")
        ratio_bar(ax, 1, pc["speedup_auto"], COLOURS["auto"], 'trl-ext, "auto"')
        ax.set_xticks([0, 1], [f"batch {pc['batch_size']}", "auto"])
    ax.set_title("reference precompute (higher is better)")
    ax.set_ylabel("speed-up vs stock TRL")

    # 3. collectives per optimizer step (exact counts) and the step-time ratio's spread in the label.
    ax = axes[2]
    co = sections.get("sync_metrics", {})
    if "stock" in co:
        ax.bar(0, co["stock"]["collectives_per_step"], color=COLOURS["stock"], label="stock TRL", width=0.6)
        ax.bar(
            1, co["trl_ext"]["collectives_per_step"], color=COLOURS["trl_ext"], label="trl-ext sync_metrics", width=0.6
        )
        ax.errorbar(
            [0, 1],
            [co["stock"]["collectives_per_step"], co["trl_ext"]["collectives_per_step"]],
            yerr=[0, 0],
            fmt="none",
            ecolor="black",
            capsize=5,
        )  # exact counts: zero error
        r = co["step_time_ratio"]
        ax.set_xticks(
            [0, 1], ["stock", f"sync_metrics\n(step time {r['median']:.2f}x, IQR {r['q1']:.2f}-{r['q3']:.2f})"]
        )
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("collectives per optimizer step, 2 processes (exact)")
    ax.set_ylabel("collectives / step (lower is better)")

    # 4. ZeRO-3 generation: peak parameter memory per rank, relative to TRL's gather.
    ax = axes[3]
    ge = sections.get("generation", {})
    if "modes" in ge:
        names = [m["mode"] for m in ge["modes"]]
        values = [m["peak_vs_gather"] for m in ge["modes"]]
        seen: set[str] = set()
        for x, (name, value) in enumerate(zip(names, values, strict=True)):
            kind = "stock" if name.startswith("trl") else "trl_ext"
            label = {"stock": "stock TRL", "trl_ext": "trl-ext"}[kind] if kind not in seen else "_nolegend_"
            seen.add(kind)
            ax.bar(x, value, color=COLOURS[kind], width=0.6, label=label)
        ax.errorbar(range(len(names)), values, yerr=[0] * len(names), fmt="none", ecolor="black", capsize=5)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_title("ZeRO-3 generation, peak params/rank (exact)")
    ax.set_ylabel("vs TRL gather (lower is better)")
    for ax in axes:
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=7, loc="upper left")
        ax.set_ylim(bottom=0)
    load = report.get("load_average", {})
    fig.suptitle(
        f"trl-ext bench — trl {report['trl']}, {report['model']}; error bars: interquartile range of per-round "
        "ratios; "
        f"load average {load.get('start', '?')} -> {load.get('end', '?')} on {os.cpu_count()} cores",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trl-ext bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smaller model and fewer steps ({QUICK_DURATION} on 2 shared CPU cores)",
    )
    parser.add_argument("--model", help="path of a local model (and its tokenizer) to use instead of the built-in one")
    parser.add_argument("--out", default="bench-out", help="directory for report.json, table.md and bench.png")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="interleaved rounds per comparison, a fixed count (default 5; the 2-process step time: at most 3 with "
        "--quick)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadiest when shared)")
    parser.add_argument(
        "--only",
        action="append",
        choices=["padding_free", "precompute", "sync_metrics", "generation"],
        help="sections",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rounds = args.rounds
    if rounds < 1:
        raise UsageError(f"`--rounds` must be at least 1, got {rounds}.")

    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    from ..manager import load_catalog

    # Our own progress lines replace the libraries' bars and warnings, which would bury them.
    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*trl.experimental.*")
    warnings.filterwarnings("ignore", category=FutureWarning)  # the libraries' deprecation notes, not ours

    # One thread by default: on a shared machine, OpenMP threads spin while waiting for a busy core, which turns
    # another process' load into noise many times larger than the effect being measured.
    torch.set_num_threads(args.threads)
    _compat.check_trl_version()
    load_start = _load_average()
    setup = _Setup(args)
    report: dict[str, Any] = {
        "trl_ext": __version__,
        "trl": _compat.installed_version("trl"),
        "torch": torch.__version__,
        "model": setup.model_desc,
        "quick": args.quick,
        "rounds": rounds,
        "sections": {},
    }
    wanted = args.only or ["padding_free", "precompute", "sync_metrics", "generation"]
    # Each section measures the flag it is named after; the flag table says whether a plugin provides it.
    flag_of = {
        "padding_free": "padding_free",
        "precompute": "precompute_ref_batch_size",
        "sync_metrics": "sync_metrics",
        "generation": "ds3_gather_for_generation",
    }
    available = load_catalog()[0].flags
    for section in wanted:
        if flag_of[section] not in available:
            report["sections"][section] = {"skipped": f"no installed plugin provides `{flag_of[section]}`"}
            continue
        try:
            if section == "padding_free":
                report["sections"][section] = _bench_padding_free(setup, rounds)
            elif section == "precompute":
                report["sections"][section] = _bench_precompute(setup, rounds)
            elif section == "sync_metrics":
                # Its headline (collectives per step) is exact; the step-time ratio needs fewer rounds in --quick.
                report["sections"][section] = _bench_collectives(
                    setup, args.quick, min(rounds, 3) if args.quick else rounds
                )
            else:
                report["sections"][section] = _bench_generation(setup, args.quick)
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide the others
            report["sections"][section] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    report["load_average"] = {"start": load_start, "end": _load_average(), "cores": os.cpu_count()}
    report["headline"] = headline(report)
    report["peak_rss_mb"] = _peak_rss_mb()
    _plot(report, setup.out / "bench.png")
    report["wall_seconds"] = time.perf_counter() - started
    (setup.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (setup.out / "table.md").write_text(markdown_table(report) + "\n")
    load = report["load_average"]
    print(
        f"trl-ext bench — trl {report['trl']}, {report['model']}; load average {load['start']} -> {load['end']} "
        f"on {load['cores']} cores"
    )
    print(_table(report))
    flagged = [name for name, s in report["sections"].items() if _flags(s)]
    if flagged:
        print(f"!! flagged (see the ratio column): {', '.join(flagged)}")
    print(
        f"report: {setup.out / 'report.json'}  table: {setup.out / 'table.md'}  plot: {setup.out / 'bench.png'}  "
        f"({report['wall_seconds']:.0f} s)"
    )
    failed = [name for name, s in report["sections"].items() if "error" in s]
    return 1 if failed else 0


def _flags(section: dict[str, Any]) -> list[str]:
    return [f for value in section.values() if isinstance(value, dict) for f in value.get("flags", [])]


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - not on every platform
        return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
