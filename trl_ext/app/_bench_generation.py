"""Benchmark of the `generation` plugin: per-rank resident parameter bytes and generation time, every mode, one run.

Run (2 processes, DeepSpeed ZeRO-3, gloo on CPU; also works on GPUs with the default backend):

    TRL_EXT_LOG_LEVEL=info torchrun --standalone --nproc_per_node 2 benchmarks/generation.py

(`benchmarks/generation.py` runs this module, which ships in the package so that `trl-ext bench` can use it.)

It trains a stock `OnlineDPOTrainer` for one step (so the DeepSpeed engine exists, with a ZeRO-3 config that uses
DeepSpeed's default prefetch / reuse-distance / live-parameter settings), then generates the same greedy completions
through the trainer module's `unwrap_model_for_generation` in each mode:

- `trl gather` / `trl no-gather`: TRL's own helper, `gather_deepspeed3_params=True` / `False`;
- `ext True`, `ext False`, `ext budget <x>` (two budgets), `ext auto`: trl-ext's `generation` plugin.

Peak resident bytes are the full-size parameter bytes materialized on the rank (`ds_status == AVAILABLE`), sampled
inside every module's forward; the local shard is not counted. Ratios are against `trl gather`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--budgets", default="0.3,0.65", help="two (or more) budgets: fractions or sizes like 40MiB")
    p.add_argument("--repeats", type=int, default=3, help="rounds over all modes (each mode's minimum is reported)")
    p.add_argument("--output-dir", default="/tmp/trl_ext_bench_generation")
    p.add_argument("--json", help="also write the results (main process) to this JSON file")
    return p.parse_args()


def main():
    args = parse_args()
    import torch
    from accelerate import PartialState

    from .jobs import _prepare_cpu_deepspeed

    _prepare_cpu_deepspeed()  # on CPU: no shm op build, the gloo state first
    state = PartialState()
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from tqdm.auto import tqdm
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    from trl.experimental.online_dpo import online_dpo_trainer as odt
    from trl.models import utils as trl_model_utils

    import trl_ext
    from trl_ext.plugins.generation import GenerationState, param_bytes

    from .bench.workload import length_reward, make_model, make_prompt_dataset, make_tokenizer

    model_kwargs = dict(
        hidden_size=args.hidden, num_layers=args.layers, num_heads=8, num_kv_heads=4, vocab_size=args.vocab
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        # DeepSpeed's default prefetch bucket / reuse distance / live parameters; norms persistent (10 * hidden).
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": False,
            "stage3_param_persistence_threshold": 10 * args.hidden,
        },
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    installation = trl_ext.install(ds3_gather_for_generation=False)
    try:
        tok = make_tokenizer(args.vocab)
        trainer = OnlineDPOTrainer(
            model=make_model(**model_kwargs),
            ref_model=make_model(**model_kwargs),
            reward_funcs=length_reward,
            args=OnlineDPOConfig(
                output_dir=args.output_dir,
                per_device_train_batch_size=2,
                max_steps=1,
                report_to=[],
                save_strategy="no",
                max_new_tokens=4,
                bf16=False,
                deepspeed=ds_config,
                accelerator_config={"use_configured_state": True},
            ),
            train_dataset=make_prompt_dataset(4, vocab_size=args.vocab),
            processing_class=tok,
        )
        trainer.train()  # builds the DeepSpeed engine and runs the ZeRO-3 hooks once
        engine, acc = trainer.model_wrapped, trainer.accelerator
        unwrapped = acc.unwrap_model(engine)
        params = list(unwrapped.parameters())
        modules = [m for m in unwrapped.modules() if list(m.parameters(recurse=False))]
        model_bytes = sum(param_bytes(p) for p in params)
        prompt = tok(["w1 w2 w3 w4 w5 w6 w7 w8", "w9 w10 w11 w12 w13 w14 w15 w16"], return_tensors="pt", padding=True)
        prompt = {k: v.to(acc.device) for k, v in prompt.items()}
        ctx = trainer._trl_ext

        peak = [0]

        def sample():
            now = sum(param_bytes(p) for p in params if p.ds_status == ZeroParamStatus.AVAILABLE)
            peak[0] = max(peak[0], now)

        for m in modules:  # wrap forward: samples fall between DeepSpeed's fetch and release hooks
            m.forward = (lambda _f: lambda *a, **k: (sample(), _f(*a, **k))[1])(m.forward)

        def generate(helper, gather):
            peak[0] = 0
            start = time.perf_counter()
            with helper(engine, acc, gather_deepspeed3_params=gather) as model, torch.no_grad():
                out = model.generate(
                    **prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
                )
            return time.perf_counter() - start, peak[0], out.tolist()

        modes = [("trl gather", None, True), ("trl no-gather", None, False)]
        modes += [("ext True", (True, {}), True), ("ext False", (False, {}), False)]
        for budget in args.budgets.split(","):
            value = float(budget) if budget.replace(".", "", 1).isdigit() and "." in budget else budget
            modes.append((f"ext budget {budget}", (False, {"budget": value}), False))
        modes.append(("ext auto", ("auto", {}), False))

        def run(name, ext, gather):
            if ext is None:
                helper = trl_model_utils.unwrap_model_for_generation  # stock TRL
            else:
                ctx.state["generation"] = states[name]  # same trainer and engine, another plugin mode
                helper = odt.unwrap_model_for_generation  # trl-ext's dispatcher
            return generate(helper, gather)

        # Round-robin over the modes, so that load from other processes hits every mode alike; the minimum time of
        # each mode is reported.
        states = {name: GenerationState(*ext) for name, ext, _ in modes if ext is not None}
        runs = {name: [] for name, _, _ in modes}
        for _ in tqdm(range(args.repeats), disable=not state.is_main_process, desc="rounds"):
            for name, ext, gather in modes:
                runs[name].append(run(name, ext, gather))
        rows, reference_tokens = [], runs[modes[0][0]][0][2]
        for name, ext, _ in modes:
            plan = states[name].plan if ext is not None else None
            rows.append(
                {
                    "mode": name,
                    "seconds": min(r[0] for r in runs[name]),
                    "peak": max(r[1] for r in runs[name]),
                    "same_tokens": all(r[2] == reference_tokens for r in runs[name]),
                    "layers": f"{len(plan.gathered_layers)}/{plan.num_layers}" if plan is not None else "",
                }
            )
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
        report = dict(model_bytes=model_bytes, world_size=dist.get_world_size(), new_tokens=args.new_tokens)
        report["repeats"] = args.repeats  # each mode's time is the best of this many runs
        report["modes"] = [
            {
                "mode": row["mode"],
                "layers_kept": row["layers"],
                "peak_bytes_per_rank": [r[i]["peak"] for r in everyone],
                "seconds": row["seconds"],
                "same_tokens": all(r[i]["same_tokens"] for r in everyone),
            }
            for i, row in enumerate(rows)
        ]
        if state.is_main_process and args.json:
            import json

            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        if state.is_main_process:
            mib = 2**20
            print(
                f"\nOnlineDPO generation under ZeRO-3, {dist.get_world_size()} ranks on {acc.device.type}: Llama "
                f"{args.layers} layers x hidden {args.hidden}, vocab {args.vocab} ({model_bytes / mib:.1f} MiB of "
                f"parameters), 2 prompts x {args.new_tokens} greedy tokens"
            )
            header = f"{'mode':<20} {'layers kept':>11} {'peak MiB r0':>11} {'peak MiB r1':>11} {'peak/gather':>11} "
            print(header + f"{'time s':>8} {'time/gather':>11} {'same tokens':>11}")
            base = report["modes"][0]
            for mode in report["modes"]:
                peaks = mode["peak_bytes_per_rank"]
                print(
                    f"{mode['mode']:<20} {mode['layers_kept']:>11} "
                    + " ".join(f"{p / mib:>11.2f}" for p in peaks[:2])
                    + f" {max(peaks) / base['peak_bytes_per_rank'][0]:>11.3f} {mode['seconds']:>8.2f}"
                    + f" {mode['seconds'] / base['seconds']:>11.2f} {str(mode['same_tokens']):>11}"
                )
    finally:
        installation.uninstall()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
