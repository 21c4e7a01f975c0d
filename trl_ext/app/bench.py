"""`trl-ext bench`: stock TRL against trl-ext, side by side, on one machine, in one run.

With no arguments it builds a small Llama from a config and a synthetic preference dataset with realistic skewed
(lognormal) lengths, so nothing is downloaded. For each plugin that applies it measures stock and trl-ext on the same
data and weights, alternating runs so machine noise hits both alike, and prints ratios:

- DPO training step throughput (`padding_free`), plus the loss and reward-margin curves of both runs (they must lie
  on top of each other);
- reference precompute time (`precompute_ref_batch_size`, same batch size as stock, and `"auto"`);
- collectives per optimizer step and per logging step in a 2-process run (`sync_metrics`, torchrun, gloo);
- generation memory and time under DeepSpeed ZeRO-3 (`generation`), when DeepSpeed is installed.

It writes `report.json` and `bench.png` (throughput bars and the curves) to `--out`.
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

from .. import __version__, _compat

_WORKER = "trl_ext.app._bench_worker"


# ---------------------------------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------------------------------


def _sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(
            vocab=4096, hidden=128, layers=2, heads=4, kv=2, pairs=48, batch=8, steps=5, prompt=48, completion=48
        )
    return dict(
        vocab=32000, hidden=256, layers=4, heads=4, kv=2, pairs=128, batch=8, steps=10, prompt=60, completion=60
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
            max_prompt=400,
            max_completion=400,
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
# sections
# ---------------------------------------------------------------------------------------------------------------------


def _bench_padding_free(setup: _Setup) -> dict[str, Any]:
    from transformers import TrainerCallback
    from trl import DPOTrainer

    import trl_ext

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._t)

    def run(label: str, flags: dict[str, Any]) -> dict[str, Any]:
        timer = StepTimer()
        with trl_ext.install(**flags):
            trainer = DPOTrainer(
                setup.model_fn(),
                ref_model=setup.model_fn(),
                args=setup.dpo_args(label),
                train_dataset=setup.dataset,
                processing_class=setup.tokenizer,
                callbacks=[timer],
            )
            trainer.train()
        logs = [log for log in trainer.state.log_history if "loss" in log and "train_loss" not in log]
        steady = timer.times[1:] or timer.times
        return {
            "step_seconds_median": statistics.median(steady),
            "steps_per_second": 1.0 / statistics.median(steady),
            "loss": [log["loss"] for log in logs],
            "margins": [log.get("rewards/margins") for log in logs],
            "trainer": trainer,
        }

    _progress("padding_free: stock TRL DPO steps")
    stock = run("stock", {})
    _progress("padding_free: trl-ext padding_free DPO steps")
    packed = run("padding_free", {"padding_free": True})
    # Padding fraction of the very batches the runs used.
    real = padded = 0
    loader = stock.pop("trainer").get_train_dataloader()
    packed.pop("trainer")
    for step, batch in enumerate(loader):
        if step >= setup.size["steps"]:
            break
        mask = batch["attention_mask"]
        real += int(mask.sum())
        padded += mask.numel()
    f = 1 - real / padded
    speedup = stock["step_seconds_median"] / packed["step_seconds_median"]
    max_loss_diff = max(abs(a - b) for a, b in zip(stock["loss"], packed["loss"], strict=True))
    return {
        "padding_fraction": f,
        "bound": 1 / (1 - f),
        "speedup": speedup,
        "fraction_of_bound": speedup * (1 - f),
        "stock": stock,
        "trl_ext": packed,
        "max_abs_loss_diff": max_loss_diff,
    }


def _bench_precompute(setup: _Setup) -> dict[str, Any]:
    from trl import DPOTrainer

    import trl_ext
    from trl_ext.testing import make_preference_dataset

    batch = 16
    s = setup.size
    pairs = 4 * s["pairs"]  # the precompute runs over the whole dataset: give it enough work to time

    def run(label: str, flags: dict[str, Any]) -> dict[str, Any]:
        if flags:
            cache = tempfile.mkdtemp(prefix="trl-ext-bench-cache-")
            flags = {**flags, "plugins": {"precompute_ref_batch_size": {"cache_dir": cache}}}
        # A new in-memory dataset each run, so neither TRL's cache nor ours can be hit.
        data = make_preference_dataset(
            pairs, vocab_size=s["vocab"], prompt_median=s["prompt"], completion_median=s["completion"], seed=1
        )
        box: dict[str, float] = {}
        with trl_ext.install(**flags):
            # Time only the precompute (TRL's `_precompute_ref_logps`, or trl-ext's replacement when installed), not
            # the tokenization that building the trainer also does.
            inner = DPOTrainer.__dict__["_precompute_ref_logps"]

            def timed(trainer, dataset, name, batch_size):
                start = time.perf_counter()
                try:
                    return inner(trainer, dataset, name, batch_size)
                finally:
                    box["seconds"] = box.get("seconds", 0.0) + time.perf_counter() - start

            DPOTrainer._precompute_ref_logps = timed
            try:
                trainer = DPOTrainer(
                    setup.model_fn(),
                    args=setup.dpo_args(label, precompute_ref_log_probs=True, precompute_ref_batch_size=batch),
                    train_dataset=data,
                    processing_class=setup.tokenizer,
                )
            finally:
                DPOTrainer._precompute_ref_logps = inner
        return {
            "seconds": box["seconds"],
            "pairs_per_second": pairs / box["seconds"],
            "ref_chosen_logps": list(trainer.train_dataset["ref_chosen_logps"]),
        }

    _progress(f"precompute: stock TRL, {pairs} pairs, batch {batch}")
    stock = run("stock", {})
    _progress("precompute: trl-ext, same batch size")
    same = run("same", {"precompute_ref_batch_size": batch})
    _progress("precompute: trl-ext, auto")
    auto = run("auto", {"precompute_ref_batch_size": "auto"})
    diff = max(abs(a - b) for a, b in zip(stock.pop("ref_chosen_logps"), same.pop("ref_chosen_logps"), strict=True))
    auto.pop("ref_chosen_logps")
    return {
        "pairs": pairs,
        "batch_size": batch,
        "stock": stock,
        "trl_ext": same,
        "trl_ext_auto": auto,
        "speedup": stock["seconds"] / same["seconds"],
        "speedup_auto": stock["seconds"] / auto["seconds"],
        "max_abs_ref_logp_diff": diff,
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
    return report


def _bench_collectives(setup: _Setup, quick: bool) -> dict[str, Any]:
    torchrun = Path(sys.executable).with_name("torchrun")
    results = {}
    for label in ("stock", "trl_ext"):
        _progress(f"sync_metrics: 2-process DPO, {label}")
        out = setup.out / f"collectives-{label}.json"
        cmd = [str(torchrun), "--nproc_per_node", "2", "-m", _WORKER, "collectives", "--out", str(out)]
        if label == "trl_ext":
            cmd.append("--sync-metrics")
        if quick:
            cmd.append("--quick")
        env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"2-process run ({label}) failed:\n{proc.stderr[-3000:]}")
        results[label] = json.loads(out.read_text())
    results["step_time_ratio"] = results["stock"]["step_seconds"] / results["trl_ext"]["step_seconds"]
    return results


# ---------------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------------


def _table(report: dict[str, Any]) -> str:
    rows = [("measure", "stock TRL", "trl-ext", "ratio")]
    pf = report["sections"].get("padding_free")
    if pf and "error" not in pf:
        rows.append(
            (
                "DPO step time (s)",
                f"{pf['stock']['step_seconds_median']:.3f}",
                f"{pf['trl_ext']['step_seconds_median']:.3f}",
                f"{pf['speedup']:.2f}x faster (bound {pf['bound']:.2f}x at {pf['padding_fraction']:.0%} padding; "
                f"{pf['fraction_of_bound']:.0%} of bound)",
            )
        )
        rows.append(("max |loss diff| over steps (fp32)", "", f"{pf['max_abs_loss_diff']:.2e}", "same curves"))
    pc = report["sections"].get("precompute")
    if pc and "error" not in pc:
        rows.append(
            (
                "ref precompute (s)",
                f"{pc['stock']['seconds']:.2f}",
                f"{pc['trl_ext']['seconds']:.2f} (auto {pc['trl_ext_auto']['seconds']:.2f})",
                f"{pc['speedup']:.2f}x (auto {pc['speedup_auto']:.2f}x); "
                f"{pc['pairs']} pairs, batch {pc['batch_size']}",
            )
        )
        rows.append(("max |ref logp diff|", "", f"{pc['max_abs_ref_logp_diff']:.2e}", "same values"))
    co = report["sections"].get("sync_metrics")
    if co and "error" not in co:
        rows.append(
            (
                "collectives / optimizer step",
                f"{co['stock']['collectives_per_step']:.1f}",
                f"{co['trl_ext']['collectives_per_step']:.1f}",
                f"{co['trl_ext']['collectives_total']} collectives for {co['trl_ext']['logging_steps']} logging steps "
                f"+ the final summary log (stock {co['stock']['collectives_total']})",
            )
        )
        rows.append(
            (
                "2-proc step time (s)",
                f"{co['stock']['step_seconds']:.3f}",
                f"{co['trl_ext']['step_seconds']:.3f}",
                f"{co['step_time_ratio']:.2f}x",
            )
        )
    ge = report["sections"].get("generation")
    if ge and "modes" in ge:
        for mode in ge["modes"]:
            rows.append(
                (
                    f"ZeRO-3 generation: {mode['mode']}",
                    "",
                    f"{max(mode['peak_bytes_per_rank']) / 2**20:.1f} MiB/rank, {mode['seconds']:.2f} s",
                    f"memory {mode['peak_vs_gather']:.2f}x, time {mode['time_vs_gather']:.2f}x of TRL gather"
                    + ("" if mode["same_tokens"] else "  TOKENS DIFFER"),
                )
            )
    for name, section in report["sections"].items():
        if "error" in section or "skipped" in section:
            rows.append((name, "", "", section.get("error") or section["skipped"]))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows)


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    bars, labels = [], []
    pf = report["sections"].get("padding_free", {})
    if "speedup" in pf:
        bars += [1.0, pf["speedup"], pf["bound"]]
        labels += ["DPO step\nstock", "DPO step\ntrl-ext", "padding\nbound"]
    pc = report["sections"].get("precompute", {})
    if "speedup" in pc:
        bars += [1.0, pc["speedup"], pc["speedup_auto"]]
        labels += ["ref prec.\nstock", "ref prec.\ntrl-ext", "ref prec.\nauto"]
    axes[0].bar(range(len(bars)), bars, color=["#999999", "#d62728", "#1f77b4"] * 2)
    axes[0].set_xticks(range(len(bars)), labels, fontsize=8)
    axes[0].set_ylabel("throughput relative to stock TRL")
    axes[0].set_title("throughput (higher is better)")
    for ax, key, title in ((axes[1], "loss", "training loss"), (axes[2], "margins", "rewards/margins")):
        if "stock" in pf:
            ax.plot(pf["stock"][key], "o-", color="#999999", label="stock TRL", linewidth=3)
            ax.plot(pf["trl_ext"][key], "x--", color="#d62728", label="trl-ext padding_free")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_title(f"{title} (same data; curves overlap)")
    fig.suptitle(f"trl-ext bench — {report['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trl-ext bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (about 2 minutes)")
    parser.add_argument("--model", help="path of a local model (and its tokenizer) to use instead of the built-in one")
    parser.add_argument("--out", default="bench-out", help="directory for report.json and bench.png")
    parser.add_argument(
        "--only",
        action="append",
        choices=["padding_free", "precompute", "sync_metrics", "generation"],
        help="sections",
    )
    args = parser.parse_args(argv)

    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    from ..manager import load_catalog

    # Our own progress lines replace the libraries' bars and warnings, which would bury them.
    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    _compat.check_trl_version()
    setup = _Setup(args)
    report: dict[str, Any] = {
        "trl_ext": __version__,
        "trl": _compat.installed_version("trl"),
        "torch": torch.__version__,
        "model": setup.model_desc,
        "quick": args.quick,
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
                report["sections"][section] = _bench_padding_free(setup)
            elif section == "precompute":
                report["sections"][section] = _bench_precompute(setup)
            elif section == "sync_metrics":
                report["sections"][section] = _bench_collectives(setup, args.quick)
            else:
                report["sections"][section] = _bench_generation(setup, args.quick)
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide the others
            report["sections"][section] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    report["peak_rss_mb"] = _peak_rss_mb()
    (setup.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    _plot(report, setup.out / "bench.png")
    print(f"trl-ext bench — trl {report['trl']}, {report['model']}")
    print(_table(report))
    print(f"report: {setup.out / 'report.json'}  plot: {setup.out / 'bench.png'}")
    failed = [name for name, s in report["sections"].items() if "error" in s]
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
