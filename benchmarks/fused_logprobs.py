"""Benchmark the `fused_logprobs` plugin: one Online DPO training step, stock vs fused log-probs, on CPU or GPU.

Setup (`--size`, see `SIZES`): on CPU a small Llama (hidden 128, 2 layers, 4 heads / 2 KV heads), fp32, with a large
vocabulary (32k and 150k: the LM head and the logits then dominate the step, as in real models with such
vocabularies), 2 prompts of ~100 tokens and their 4 completions of up to `--completions` tokens; on GPU (`--device
cuda`, size `gpu` by default) a Llama of hidden 1024, 8 layers, 16 heads / 8 KV heads, fp32 weights under bf16
autocast, 4 prompts and their 8 completions of up to 512 and 1024 tokens (completion lengths drawn between a third of
the width and the width, the rest padding after an end). Generation is replaced by a stored batch, so a step is the
scoring forwards of policy and reference, the loss, every metric and the backward: what the plugin changes.

Each variant lives in its own worker process (trl-ext installs globally): `stock` (trl-ext not installed) and
`fused` (`fused_logprobs=True`); with `--sharing` also `prompt_sharing` and `fused+prompt_sharing`. The parent runs
interleaved rounds (the bench's `interleave`: every variant one step per round, in flipped order, one at a time, after
one warm-up round); ratios are the medians of the per-round ratios (`summarize`). Per case it reports each variant's
median step time (wall and process CPU), the peak memory during a step and its growth over the memory held before the
step (what the step itself allocates), the speed-up over stock, both memory ratios, and the loss of each variant
(equal up to float32 round-off: the same step). On CPU the memory is the RSS (peak: the kernel's high-water mark,
reset before the step; it includes the models and the interpreter); on GPU it is the allocator's
(`torch.cuda.max_memory_allocated`, its counter reset before each step; the peak includes the models), every
clock read follows a `torch.cuda.synchronize()`, and each worker empties its allocator's cache after a step (the
workers share the GPU).

Run from the repository root (PYTHONPATH pointing at it):

    python benchmarks/fused_logprobs.py                    # vocab 32k and 150k, completions 256 and 1024
    python benchmarks/fused_logprobs.py --quick            # smoke run
    python benchmarks/fused_logprobs.py --device cuda --sharing --json fused_logprobs_gpu.json   # GPU size

`--json PATH` (or `--out`) says where every case's results go as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

#: per size: the model (besides its vocabulary) and the defaults of the run
SIZES = {
    "cpu": dict(
        model=dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256),
        vocabs="32000,150000", completions="256,1024", prompts=2, rounds=5,
    ),
    "quick": dict(
        model=dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256),
        vocabs="32000", completions="128", prompts=2, rounds=2,
    ),
    "gpu": dict(
        model=dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, intermediate_size=2816),
        vocabs="32000,150000", completions="512,1024", prompts=4, rounds=5,
    ),
}  # fmt: skip
VARIANTS = {
    "stock": {},
    "fused": {"fused_logprobs": True},
    "prompt_sharing": {"prompt_sharing": True},
    "fused+prompt_sharing": {"fused_logprobs": True, "prompt_sharing": True},
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where models and batches live")
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="model and case sizes (default: gpu on cuda, else cpu)"
    )
    parser.add_argument("--quick", action="store_true", help="the same as --size quick (a smoke run)")
    parser.add_argument("--gpu-size", action="store_true", help="the same as --size gpu")
    parser.add_argument("--vocabs", default=None, help="vocabulary sizes, comma-separated (default: the size's)")
    parser.add_argument("--completions", default=None, help="completion widths, comma-separated")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (2 completions each)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per case")
    parser.add_argument("--sharing", action="store_true", help="also prompt_sharing with and without fused_logprobs")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", "--out", dest="out", default="fused_logprobs_bench.json", help="where to write every case as JSON"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick and args.gpu_size:
        parser.error("--quick and --gpu-size name different sizes")
    args.size = args.size or ("quick" if args.quick else "gpu" if args.gpu_size or args.device == "cuda" else "cpu")
    preset = SIZES[args.size]
    for key in ("vocabs", "completions", "prompts", "rounds"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    args.cases = [(int(v), int(c)) for v in args.vocabs.split(",") for c in args.completions.split(",")]
    if args.device == "cuda" and not args.worker:
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# Worker: one variant, one process; answers "<case index>" with a JSON line per step
# ---------------------------------------------------------------------------------------------------------------------


def _online_trainer(vocab: int, completion_len: int, prompts: int, seed: int, size: str, device: str):
    import inspect
    import random

    import torch
    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from trl_ext.testing import length_reward, make_model, make_tokenizer

    tokenizer = make_tokenizer(256)  # generation is replaced: the tokenizer only decodes for the reward
    args = OnlineDPOConfig(
        output_dir="/tmp/trl_ext_bench_fused_logprobs", per_device_train_batch_size=prompts, max_steps=1,
        report_to=[], use_cpu=device == "cpu", bf16=device == "cuda", save_strategy="no",
        max_new_tokens=completion_len, seed=0, max_length=8192,
    )  # fmt: skip
    model = dict(SIZES[size]["model"], vocab_size=vocab, max_position_embeddings=4096)
    trainer = OnlineDPOTrainer(
        model=make_model(**model), ref_model=make_model(seed=1, **model),
        reward_funcs=length_reward, args=args, train_dataset=Dataset.from_list([{"prompt": "w1"}] * prompts),
        processing_class=tokenizer,
    )  # fmt: skip
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lens = [rng.randint(80, 120) for _ in range(prompts)]
    width = max(lens)
    prompt_ids = torch.zeros(prompts, width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, n in enumerate(lens):
        prompt_ids[i, width - n :] = torch.randint(4, 250, (n,), generator=g)
        prompt_mask[i, width - n :] = 1
    prompt_ids, prompt_mask = prompt_ids.repeat(2, 1), prompt_mask.repeat(2, 1)
    completion_ids = torch.randint(4, 250, (2 * prompts, completion_len), generator=g)
    lengths = torch.randint(completion_len // 3, completion_len + 1, (2 * prompts,), generator=g)
    completion_mask = (torch.arange(completion_len)[None] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    on = trainer.accelerator.device
    batch = (prompt_ids.to(on), prompt_mask.to(on), completion_ids.to(on), completion_mask.to(on), None)
    if "vision_inputs = self._generate(" not in inspect.getsource(OnlineDPOTrainer.training_step):
        batch = batch[:4]  # TRL < 1.16 returns no vision inputs
    # on the class, so that every plugin's wrapper of `_generate` sees the stored batch
    OnlineDPOTrainer._generate = lambda self, model, prompts, images=None: batch
    return trainer


class _Memory:
    """The memory of one step in MiB: `peak` (the process's most during the step) and `before` (what it held before
    it). CPU: RSS (the kernel's high-water mark, reset first); GPU: the allocator's (its peak counter reset first)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def start(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.before = torch.cuda.memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        else:
            from trl_ext._shared import reset_peak_rss

            self.before = reset_peak_rss()

    def stop(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            from trl_ext._shared import rss_mib

            self.peak = rss_mib()


def worker(args) -> None:
    import torch

    import trl_ext

    torch.set_num_threads(args.threads)
    flags = VARIANTS[args.worker]
    memory = _Memory(args.device)
    print(json.dumps({"ready": True}), flush=True)
    current = None
    for line in sys.stdin:
        case = int(line)
        if current is None or current[0] != case:
            current = None  # free the previous case's models first
            if args.device == "cuda":
                torch.cuda.empty_cache()
            vocab, width = args.cases[case]
            installation = trl_ext.install(**flags) if flags else None
            trainer = _online_trainer(vocab, width, args.prompts, args.seed, args.size, args.device)
            if installation is not None:
                installation.uninstall()  # the trainer keeps its plugins
            current = (case, trainer)
        trainer = current[1]
        trainer.model.train()
        trainer.model.zero_grad(set_to_none=True)
        memory.start()  # on GPU it synchronizes first, so the clock starts on an idle device
        start, cpu = time.perf_counter(), time.process_time()
        loss = trainer.training_step(trainer.model, {"prompt": ["w1"] * args.prompts})
        memory.stop()  # on GPU it synchronizes first, so the clock stops when the step has run
        trainer.state.global_step += 1  # as train() does: `verify` checks the first step only
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        peak = memory.peak
        if args.device == "cuda":  # the workers share the GPU: one that waits holds its models, not its step's cache
            torch.cuda.empty_cache()
        out = {"wall": wall, "cpu": cpu, "peak_mib": peak, "step_mib": peak - memory.before, "loss": float(loss)}
        print(json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Parent: interleaved rounds
# ---------------------------------------------------------------------------------------------------------------------


def _spawn(name: str, args) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", name, "--vocabs", args.vocabs, "--completions", args.completions]
    cmd += ["--prompts", str(args.prompts), "--threads", str(args.threads), "--seed", str(args.seed)]
    cmd += ["--device", args.device, "--size", args.size]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _ask(proc: subprocess.Popen, line: str) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    while True:
        out = proc.stdout.readline()
        if not out:
            raise RuntimeError(f"worker died on {line!r}")
        if out.startswith("{"):
            return json.loads(out)


def main(args) -> None:
    from trl_ext.app.bench.stats import interleave, progress, ratio_text, summarize

    names = ["stock", "fused"] + (["prompt_sharing", "fused+prompt_sharing"] if args.sharing else [])
    cuda = args.device == "cuda"
    peak_key, what = ("peak_allocated_mib", "allocated") if cuda else ("peak_rss_mib", "RSS")
    procs = {name: _spawn(name, args) for name in names}
    for proc in procs.values():  # each worker says it is ready
        assert proc.stdout is not None
        while not proc.stdout.readline().startswith("{"):
            pass
    results = []
    for case, (vocab, width) in enumerate(args.cases):
        steps: dict[str, list[dict]] = {name: [] for name in names}

        def one_round(k: int, case=case, steps=steps) -> dict[str, float]:
            order = names if k % 2 == 0 else names[::-1]
            out = {}
            for name in order:
                step = _ask(procs[name], str(case))
                if k >= 1:
                    steps[name].append(step)
                out[name] = step["wall"]
            return out

        times = interleave(
            dict.fromkeys(names), rounds=args.rounds, warmup=1, paired=one_round, what=f"vocab {vocab}, C={width}"
        )
        row: dict = {"vocab": vocab, "completion_width": width, "variants": {}}
        for name in names:
            row["variants"][name] = {
                "wall_s": statistics.median(times[name]),
                "cpu_s": statistics.median(s["cpu"] for s in steps[name]),
                peak_key: statistics.median(s["peak_mib"] for s in steps[name]),
                "step_peak_mib": statistics.median(s["step_mib"] for s in steps[name]),
                "loss": steps[name][-1]["loss"],
            }
        for name in names[1:]:
            speed = summarize([a / b for a, b in zip(times["stock"], times[name], strict=True)])
            pairs = list(zip(steps["stock"], steps[name], strict=True))
            memory = statistics.median(b["peak_mib"] / a["peak_mib"] for a, b in pairs)
            step_memory = statistics.median(b["step_mib"] / a["step_mib"] for a, b in pairs)
            mine, stock = row["variants"][name], row["variants"]["stock"]
            mine.update(speedup_vs_stock=speed, peak_ratio_vs_stock=memory, step_peak_ratio_vs_stock=step_memory)
            progress(
                f"vocab {vocab}, C={width}: {name}: step {ratio_text(speed)} stock; peak {what} {memory:.2f}x stock "
                f"({mine[peak_key]:.0f} vs {stock[peak_key]:.0f} MiB), growth of {what} during the step "
                f"{step_memory:.2f}x stock ({mine['step_peak_mib']:.0f} vs {stock['step_peak_mib']:.0f} MiB)"
            )
        results.append(row)
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    with open(args.out, "w") as f:
        header = {
            "args": {k: v for k, v in vars(args).items() if k != "worker"},
            "device": _device_name(args.device),
            "memory_measure": "torch.cuda.max_memory_allocated" if cuda else "RSS (VmHWM)",
        }
        json.dump({**header, "results": results}, f, indent=1)
    print(json.dumps(results, indent=1))


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.worker:
        worker(parsed)
    else:
        main(parsed)
