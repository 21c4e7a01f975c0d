"""Benchmark the `prompt_sharing` plugin: stock vs padding_free vs padding_free + prompt_sharing DPO steps on CPU.

Setup: a small Llama (hidden 256, 4 layers, 4 heads / 2 KV heads, intermediate 1024, vocab 8000), fp32, synthetic
preference pairs with lognormal lengths, on two data shapes:

- `prompt_heavy`: prompts ~4x the responses (prompt tokens >= half of the padded-free tokens);
- `ultrafeedback`: prompts ~30% of the tokens (UltraFeedback's prefix:completion ratio is about 0.42, Wang & Hegde
  2024 README).

One step is TRL's real `DPOTrainer.compute_loss` (policy forward with TRL's LM head, reference forward, the loss and
every metric) plus the backward, on the same batches for every variant. Each variant lives in its own worker process
(trl-ext installs globally, so each process holds one configuration): `stock` (trl-ext not installed), `padding_free`
and `padding_free+prompt_sharing`. The parent runs interleaved rounds: in each round every variant runs one step on the
same batch, in flipped order, one at a time (the others wait), after one warm-up round (the bench's `interleave`, a
fixed count). Ratios are the bench's: the median of the per-round ratios with its interquartile range and flags
(`summarize`). Reported per data shape:

- the token bound of sharing over packing alone, sum over pairs of (2P + C + R) / sum of (P + C + R), and a FLOP bound
  that also counts attention (superlinear in length, so sharing can beat the token bound by a little); `--layout`
  reports the larger of the token and the attended-pairs ratios as its bound (a step costs a * tokens + b * pairs);
- the measured ratio padding_free / prompt_sharing (flagged above the larger of the two bounds), and the same over
  stock; the target is >= 0.85x the token bound over padding_free;
- each variant's median step time (wall and process CPU; CPU time is less disturbed by other jobs on the machine) and
  peak RSS during a step (the kernel's high-water mark, reset before the step).

With `--online`, the same for one `OnlineDPOTrainer.training_step` (stock vs prompt_sharing) with fixed completions
(generation replaced by a stored batch, so the step times the scoring forwards, the loss and the backward).

Run from the repository root (PYTHONPATH pointing at it):

    python benchmarks/prompt_sharing.py                # about 10 minutes on a quiet 2-core CPU
    python benchmarks/prompt_sharing.py --quick        # smoke run
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

MODEL = dict(vocab_size=8000, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024)
SHAPES = {
    "prompt_heavy": dict(prompt_median=240, completion_median=60, sigma=0.5, max_prompt=600, max_completion=200),
    "ultrafeedback": dict(prompt_median=60, completion_median=140, sigma=0.6, max_prompt=300, max_completion=400),
}
VARIANTS = {"stock": {}, "padding_free": {"padding_free": True}, "prompt_sharing": {"padding_free": True,
            "prompt_sharing": True}}  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--pairs", type=int, default=6, help="preference pairs per batch")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per data shape")
    parser.add_argument("--online", action="store_true", help="also time an Online DPO training step")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="prompt_sharing_bench.json", help="where to write every round as JSON")
    parser.add_argument(
        "--layout",
        action="store_true",
        help="instead: in one process, one model, the shared vs the unshared packed layout of the same batches "
        "(policy forward with TRL's fused head + backward), interleaved, process CPU time; isolates the layout from "
        "the machine's load and from the other plugins' code",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.rounds = 3, 2
    return args


# ---------------------------------------------------------------------------------------------------------------------
# Worker: one variant, one process; answers "step <shape> <round>" with a JSON line
# ---------------------------------------------------------------------------------------------------------------------


def _peak_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the RSS high-water mark (Linux >= 4.0)
    except OSError:
        pass


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _batches(tokenizer, shape: str, pairs: int, rounds: int, seed: int) -> list[list[dict]]:
    from datasets import Dataset

    from trl_ext.testing import preference_rows

    rows = preference_rows(pairs * (rounds + 1), vocab_size=MODEL["vocab_size"], seed=seed, **SHAPES[shape])
    return Dataset.from_list(rows), [list(range(i * pairs, (i + 1) * pairs)) for i in range(rounds + 1)]


def _dpo_trainer(tokenizer, dataset, flags: dict):
    from trl import DPOConfig, DPOTrainer

    from trl_ext.testing import make_model

    args = DPOConfig(
        output_dir="/tmp/trl_ext_bench_prompt_sharing", per_device_train_batch_size=8, max_steps=1, report_to=[],
        use_cpu=True, bf16=False, save_strategy="no", seed=0, max_length=None,
    )  # fmt: skip
    return DPOTrainer(
        make_model(**MODEL), ref_model=make_model(seed=1, **MODEL), args=args, train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip


def _online_trainer(tokenizer, flags: dict, prompts: list[list[int]], completion_len: int):
    import torch
    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from trl_ext.testing import length_reward, make_model

    args = OnlineDPOConfig(
        output_dir="/tmp/trl_ext_bench_prompt_sharing_online", per_device_train_batch_size=len(prompts),
        max_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no", max_new_tokens=completion_len,
        seed=0, max_length=4096,
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": "w1"}] * len(prompts))
    trainer = OnlineDPOTrainer(
        model=make_model(**MODEL), ref_model=make_model(seed=1, **MODEL), reward_funcs=length_reward, args=args,
        train_dataset=data, processing_class=tokenizer,
    )  # fmt: skip
    # Fixed generation: left-padded prompts (repeated twice, as TRL does), completions of random lengths.
    g = torch.Generator().manual_seed(0)
    width = max(len(p) for p in prompts)
    prompt_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, p in enumerate(prompts):
        prompt_ids[i, width - len(p) :], prompt_mask[i, width - len(p) :] = torch.tensor(p), 1
    prompt_ids, prompt_mask = prompt_ids.repeat(2, 1), prompt_mask.repeat(2, 1)
    completion_ids = torch.randint(3, MODEL["vocab_size"], (2 * len(prompts), completion_len), generator=g)
    lengths = torch.randint(completion_len // 3, completion_len + 1, (2 * len(prompts),), generator=g)
    completion_mask = (torch.arange(completion_len)[None] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    import inspect

    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask, None)
    if "vision_inputs = self._generate(" not in inspect.getsource(OnlineDPOTrainer.training_step):
        batch = batch[:4]  # TRL < 1.16 returns no vision inputs
    trainer._generate = lambda model, prompts, images=None: batch
    return trainer


def worker(args) -> None:
    import torch

    import trl_ext
    from trl_ext.testing import make_tokenizer

    torch.set_num_threads(args.threads)
    flags = VARIANTS[args.worker]
    installation = trl_ext.install(**flags) if flags else None
    tokenizer = make_tokenizer(MODEL["vocab_size"])
    jobs = {}
    for shape in SHAPES:
        dataset, index = _batches(tokenizer, shape, args.pairs, args.rounds, args.seed)
        trainer = _dpo_trainer(tokenizer, dataset, flags)
        examples = [[trainer.train_dataset[i] for i in idx] for idx in index]
        jobs[shape] = (trainer, [trainer.data_collator(ex) for ex in examples])
    if args.online and args.worker != "padding_free":  # padding_free does not apply to Online DPO
        import random

        rng = random.Random(args.seed)
        prompts = [[rng.randrange(4, MODEL["vocab_size"]) for _ in range(rng.randint(150, 300))] for _ in range(3)]
        trainer = _online_trainer(tokenizer, flags, prompts, completion_len=60)
        jobs["online"] = (trainer, [{"prompt": ["w1"] * len(prompts)}] * (args.rounds + 1))
    print(json.dumps({"ready": sorted(jobs)}), flush=True)
    for line in sys.stdin:
        shape, k = line.split()
        trainer, batches = jobs[shape]
        batch = batches[int(k)]
        trainer.model.train()
        trainer.model.zero_grad(set_to_none=True)
        _peak_reset()
        start, cpu = time.perf_counter(), time.process_time()
        if shape == "online":
            loss = trainer.training_step(trainer.model, batch)
            trainer.state.global_step += 1  # as train() does: `verify` checks the first step only
        else:
            loss = trainer.compute_loss(trainer.model, batch)
            loss.backward()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        out = {"wall": wall, "cpu": cpu, "peak_mib": _peak_rss_mib(), "loss": float(loss)}
        if shape != "online":
            mask, completion = batch["attention_mask"], batch["completion_mask"]
            pairs = mask.shape[0] // 2
            prompt = (mask - completion)[:pairs].sum().item()
            responses = completion.sum().item()
            out["tokens"] = {"P": prompt, "CR": responses, "padded": mask.numel(), "real": int(mask.sum())}
            lens = (mask - completion).sum(1)[:pairs].tolist(), completion.sum(1).tolist()
            out["pairs"] = [(lens[0][i], lens[1][i], lens[1][pairs + i]) for i in range(pairs)]
        print(json.dumps(out), flush=True)
    if installation is not None:
        installation.uninstall()


# ---------------------------------------------------------------------------------------------------------------------
# Parent: interleaved rounds
# ---------------------------------------------------------------------------------------------------------------------


def _spawn(name: str, args) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", name, "--pairs", str(args.pairs), "--rounds", str(args.rounds)]
    cmd += ["--threads", str(args.threads), "--seed", str(args.seed)] + (["--online"] if args.online else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    return proc


def _ask(proc: subprocess.Popen, line: str) -> dict:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    while True:
        out = proc.stdout.readline()
        if not out:
            raise RuntimeError(f"worker died on {line!r}")
        if out.startswith("{"):
            return json.loads(out)


def _flops(pairs: list[tuple[int, int, int]], shared: bool) -> float:
    """Forward FLOPs of the packed (`shared=False`) or the shared layout: linear layers and LM head per token, plus
    QK^T and AV per attended (query, key) pair; the backward scales both alike, so only the ratio is used."""
    h, i, v, layers = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["vocab_size"], MODEL["num_layers"]
    kv = h // MODEL["num_heads"] * MODEL["num_kv_heads"]
    per_token = layers * (2 * h * (2 * h + 2 * kv) + 3 * 2 * h * i) + 2 * h * v
    per_pair = layers * 2 * 2 * h
    tokens, attended = _work(pairs, shared)
    return tokens * per_token + attended * per_pair


def _work(pairs: list[tuple[int, int, int]], shared: bool) -> tuple[int, int]:
    """Tokens run and (query, key) pairs attended by the packed or the shared layout of `(P, C, R)` pairs."""
    tokens = attended = 0
    for p, c, r in pairs:
        if shared and p >= 2:
            prefix = p - 1
            tokens += prefix + (1 + c) + (1 + r)
            attended += prefix * (prefix + 1) // 2
            attended += sum(b * prefix + b * (b + 1) // 2 for b in (1 + c, 1 + r))
        else:
            tokens += (p + c) + (p + r)
            attended += sum(n * (n + 1) // 2 for n in (p + c, p + r))
    return tokens, attended


def _layout_work(layout) -> tuple[int, int]:
    """Tokens run and (query, key) pairs attended by a `SharedLayout`: per group, the prefix causally, then each
    branch over the prefix and itself."""
    tokens = attended = 0
    for ps, pe, branches in layout.groups:
        prefix = pe - ps
        tokens += prefix
        attended += prefix * (prefix + 1) // 2
        for bs, be, _ in branches:
            b = be - bs
            tokens += b
            attended += b * prefix + b * (b + 1) // 2
    return tokens, attended


def main(args) -> None:
    from trl_ext.app.bench.stats import interleave, ratio_text, ratios, summarize

    procs = {name: _spawn(name, args) for name in VARIANTS}
    for name, proc in procs.items():
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {name} failed to start")
            if line.startswith('{"ready"'):
                break
    names = list(VARIANTS)
    jobs = list(SHAPES) + (["online"] if args.online else [])
    report = {"args": vars(args), "model": MODEL, "shapes": SHAPES, "results": {}}
    for shape in jobs:
        variants = names if shape != "online" else ["stock", "prompt_sharing"]
        rounds = []

        def one_round(k: int, shape=shape, variants=variants, rounds=rounds) -> dict[str, float]:
            order = variants if k % 2 == 0 else variants[::-1]
            res = {name: _ask(procs[name], f"{shape} {k}") for name in order}
            if k:  # round 0 warms up
                rounds.append(res)
            return {name: res[name]["wall"] for name in variants}

        wall = interleave(dict.fromkeys(variants), rounds=args.rounds, what=shape, paired=one_round, warmup=1)
        cpu = {n: [r[n]["cpu"] for r in rounds] for n in variants}
        result: dict = {"rounds": rounds}
        result["median_wall_s"] = {n: statistics.median(w) for n, w in wall.items()}
        result["peak_rss_mib"] = {n: max(r[n]["peak_mib"] for r in rounds) for n in variants}
        result["median_cpu_s"] = {n: statistics.median(c) for n, c in cpu.items()}
        result["prompt_sharing_over_stock"] = summarize(ratios(wall, "stock", "prompt_sharing"))
        # process CPU time: less disturbed than wall time when other jobs share the machine
        result["prompt_sharing_over_stock_cpu"] = summarize(ratios(cpu, "stock", "prompt_sharing"))
        if shape != "online":
            tok = [r["stock"]["tokens"] for r in rounds]
            shared_bound = [(2 * t["P"] + t["CR"]) / (t["P"] + t["CR"]) for t in tok]
            pack_bound = [t["padded"] / t["real"] for t in tok]
            prompt_share = sum(2 * t["P"] for t in tok) / sum(2 * t["P"] + t["CR"] for t in tok)
            flop_bound = [_flops(r["stock"]["pairs"], False) / _flops(r["stock"]["pairs"], True) for r in rounds]
            bound = statistics.median(shared_bound)
            # A step costs a * tokens + b * attended pairs: sharing gains at most the larger of the two bounds.
            work_bound = max(bound, statistics.median(flop_bound))
            over_pf = summarize(ratios(wall, "padding_free", "prompt_sharing"), bound=work_bound)
            result.update(
                prompt_share_of_packed_tokens=round(prompt_share, 3),
                token_bound_over_packing=round(bound, 3),
                flop_bound_over_packing=round(statistics.median(flop_bound), 3),
                prompt_sharing_over_padding_free=over_pf,
                prompt_sharing_over_padding_free_cpu=summarize(
                    ratios(cpu, "padding_free", "prompt_sharing"), bound=work_bound
                ),
                fraction_of_bound=round(over_pf["median"] / bound, 3),
                padding_free_over_stock=summarize(ratios(wall, "stock", "padding_free")),
                packing_bound_over_stock=round(statistics.median(pack_bound), 3),
                product_bound_over_stock=round(statistics.median(pack_bound) * bound, 3),
            )
        report["results"][shape] = result
        print(f"== {shape}:", flush=True)
        for key, value in result.items():
            if key == "rounds":
                continue
            if isinstance(value, dict) and "median" in value:  # a ratio: its median, spread and flags
                print(f"  {key}: {ratio_text(value)}" + "".join(f"\n    !! {flag}" for flag in value["flags"]))
            else:
                print(f"  {key}: {value}")
    for proc in procs.values():
        proc.stdin.close()
        proc.wait(timeout=120)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


def layout_only(args) -> None:
    import torch

    import trl_ext
    from trl_ext.app.bench.stats import interleave, ratio_text, ratios, summarize
    from trl_ext.plugins.prompt_sharing import forward as fw
    from trl_ext.plugins.prompt_sharing.layout import build_layout, prompt_end_from_completion_mask
    from trl_ext.testing import make_tokenizer

    torch.set_num_threads(args.threads)
    tokenizer = make_tokenizer(MODEL["vocab_size"])
    with trl_ext.install(prompt_sharing=True, plugins={"prompt_sharing": {"self_check": False}}):
        for shape in SHAPES:
            dataset, index = _batches(tokenizer, shape, args.pairs, args.rounds, args.seed)
            trainer = _dpo_trainer(tokenizer, dataset, {})
            model = trainer.model
            forward = fw.make_causal_lm_forward(model.forward.__wrapped__, trainer._trl_ext.state["prompt_sharing"])
            token_bounds, attention_bounds = [], []

            def one_round(
                k: int, trainer=trainer, model=model, fwd=forward, index=index, work=(token_bounds, attention_bounds)
            ) -> dict[str, float]:
                batch = trainer.data_collator([trainer.train_dataset[i] for i in index[k]])
                ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
                kwargs = dict(input_ids=ids, attention_mask=mask, use_cache=False, fused_lm_head=True,
                              labels=ids.masked_fill(completion == 0, -100))  # fmt: skip
                prompt_end = prompt_end_from_completion_mask(completion, mask)
                layouts = {"unshared": build_layout(ids, mask, None), "shared": build_layout(ids, mask, prompt_end)}
                times = {}
                for name in sorted(layouts, reverse=bool(k % 2)):
                    model.zero_grad(set_to_none=True)
                    start = time.process_time()
                    out = fwd(**kwargs, trl_ext_prompt_sharing=layouts[name].to_batch())
                    out.log_probs.sum().backward()
                    times[name] = time.process_time() - start
                if k:  # batch 0 warms up
                    # from the layouts themselves: rows of different pairs with the same prompt share it too
                    (t_packed, a_packed), (t_shared, a_shared) = (_layout_work(layouts[n]) for n in layouts)
                    work[0].append(t_packed / t_shared)
                    work[1].append(a_packed / a_shared)
                return times

            times = interleave(
                {"unshared": None, "shared": None}, rounds=args.rounds, what=shape, paired=one_round, warmup=1
            )
            # A step costs a * tokens + b * attended pairs (a, b >= 0): the speed-up is at most the larger ratio.
            tb, ab = statistics.median(token_bounds), statistics.median(attention_bounds)
            bound = max(tb, ab)
            r = summarize(ratios(times, "unshared", "shared"), bound=bound)
            print(f"== {shape} (layout only, CPU time): unshared/shared {ratio_text(r)}; bound {bound:.3f} (tokens "
                  f"{tb:.3f}, attention {ab:.3f}); fraction of bound {r['median'] / bound:.3f}; of the token ratio "
                  f"{r['median'] / tb:.3f}", flush=True)  # fmt: skip
            for flag in r["flags"]:
                print(f"   !! {flag}", flush=True)
            if any(flag.startswith("ABOVE BOUND") for flag in r["flags"]):
                print("   !! above the work bound: the measurement does not isolate the work here (e.g. the smaller "
                      "working set of the shared layout runs faster per token); claim the bound, not this ratio",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.worker:
        worker(parsed)
    elif parsed.layout:
        layout_only(parsed)
    else:
        main(parsed)
