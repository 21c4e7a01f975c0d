"""Every cell of the scale matrix (tests/scale/matrix.py) under one engine, in one 2-process launch.

`torchrun --nproc_per_node 2 scale_matrix.py ENGINE OUT_DIR [CELL ...]`, ENGINE one of ddp, zero2, zero3, fsdp2; cells
named run in table order, also under an engine their row does not list (expected to train).
The cells run one after another in the same two processes, sharing the tokenizer, the data and the model weights
(each cell builds its own copy of the same seeded float64 model, since training changes it). Between cells
accelerate's `AcceleratorState` is reset (the process group stays): a second DeepSpeed `Accelerator` is refused
otherwise.

Each rank writes `OUT_DIR/<cell>.rank<r>.pt`: the logs, what the engine really was (distributed type, ZeRO stage,
FSDP2 modules), which trl-ext plugins the trainer got, the refusal message of a refused cell, the wall time, and on
rank 0 the final parameters (gathered to full size, float64). FSDP2 generation cells also record the most parameter
elements unsharded at once while generating.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from pathlib import Path

ENGINE, OUT = sys.argv[1], Path(sys.argv[2])
ONLY = set(sys.argv[3:])
REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))  # tests.scale.* (the table and the FSDP2 shim)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tests.scale.matrix import (  # noqa: E402
    CELLS,
    DPO_PAIRS,
    DPO_STEPS,
    ENGINES,
    MODEL,
    ONLINE_PROMPTS,
    ONLINE_STEPS,
    REF_SEED,
    REFUSE,
    Expect,
    cells_for,
)

DEEPSPEED = ENGINES[ENGINE].deepspeed
if DEEPSPEED:
    # research/deepspeed_cpu.md: skip the shm op JIT build (ZeRO does not use it; 65 s), and create the gloo state
    # before accelerate computes backend=None for DeepSpeed on CPU (every rank would think it is rank 0 of 1).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import PartialState

    STATE = PartialState(backend="gloo")
else:
    from accelerate import PartialState

    STATE = PartialState(cpu=True, backend="gloo")
if ENGINE == "fsdp2":
    from tests.scale.fsdp2_shim import enable_fsdp2_on_cpu, is_fsdp2_model

    enable_fsdp2_on_cpu()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402
from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.testing import (  # noqa: E402
    length_reward,
    make_model,
    make_preference_dataset,
    make_prompt_dataset,
    make_tokenizer,
)

PLUGINS = (
    "padding_free",
    "precompute_ref_batch_size",
    "sync_metrics",
    "generation",
    "prompt_sharing",
    "fused_logprobs",
    "token_budget",
)
RANK = STATE.process_index
TOKENIZER = make_tokenizer()
DPO_DATA = make_preference_dataset(DPO_PAIRS, seed=1, max_prompt=24, max_completion=24)
PROMPTS = make_prompt_dataset(ONLINE_PROMPTS, seed=3)


def model(eos_prone: bool = False, seed: int = MODEL["seed"]):
    m = make_model(dtype=torch.float64, **{**MODEL, "seed": seed})
    if eos_prone:
        # An untrained 256-word model almost never samples EOS, so every completion would have the same length and
        # reward: make EOS a scaled copy of another token (as tests/plugins/scripts/sync_metrics_online_dpo.py).
        with torch.no_grad():
            m.lm_head.weight[1] = 40.0 * m.lm_head.weight[7]
    return m


def engine_args(name: str, extra: dict) -> dict:
    if DEEPSPEED:
        stage = 2 if ENGINE == "zero2" else 3
        zero = {"stage": stage, "overlap_comm": False}
        if stage == 3:
            zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True)
        from tests.helpers import deepspeed_config

        off = {"enabled": False}
        config = deepspeed_config(stage, zero_optimization=zero, bf16=off, fp16=off)
        return {"deepspeed": config, "accelerator_config": {"use_configured_state": True}}
    out = {"use_cpu": True}
    if ENGINE == "fsdp2":
        out["fsdp"] = "full_shard"
        out["fsdp_config"] = {
            "version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "reshard_after_forward": extra.get("reshard_after_forward", True),
        }
    return out


def common_args(name: str, cell) -> dict:
    return dict(
        output_dir=str(OUT / "run" / name),
        per_device_train_batch_size=2,
        logging_steps=1,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping: the update is the plain gradient step
        bf16=False,  # TRL's default bf16 would cast the float64 policy (research/fsdp2_cpu.md)
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        **engine_args(name, cell.engine_args),
        **cell.args,
    )


def build(cell):
    if cell.trainer == "dpo":
        args = DPOConfig(max_steps=DPO_STEPS, max_length=64, **common_args(cell.name, cell))
        return DPOTrainer(
            model=model(),
            ref_model=model(seed=REF_SEED),
            args=args,
            train_dataset=DPO_DATA,
            processing_class=TOKENIZER,
        )
    args = OnlineDPOConfig(max_steps=ONLINE_STEPS, max_new_tokens=6, temperature=1.0, **common_args(cell.name, cell))
    return OnlineDPOTrainer(
        model=model(eos_prone=True),
        ref_model=model(eos_prone=True, seed=REF_SEED),
        reward_funcs=length_reward,
        args=args,
        train_dataset=PROMPTS,
        processing_class=TOKENIZER,
    )


def full_params(trainer) -> dict[str, torch.Tensor]:
    """The policy's parameters at full size, float64 (collective under ZeRO-3 and FSDP2: every rank calls it)."""
    wrapped = trainer.model_wrapped if DEEPSPEED else trainer.model
    policy = trainer.accelerator.unwrap_model(wrapped)
    if ENGINE == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(policy.parameters())):
            return {n: p.detach().to(torch.float64).clone() for n, p in policy.named_parameters()}
    if ENGINE == "fsdp2":
        from torch.distributed.tensor import DTensor

        return {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to(torch.float64).clone()
            for n, p in policy.named_parameters()
        }
    return {n: p.detach().to(torch.float64).clone() for n, p in policy.named_parameters()}


def watch_fsdp2_generation(trainer, record: dict) -> None:
    """Record the most policy parameter elements held unsharded at once during generation (no-grad forwards).

    FSDP2 swaps each module's registered parameter between the sharded `DTensor` and the unsharded plain tensor
    (torch `_fully_shard/_fsdp_param.py`, `to_sharded` / `to_unsharded`), so the plain tensors are exactly what is
    unsharded. Sampled before every leaf module's forward, after its FSDP unit was unsharded.
    """
    from torch.distributed.tensor import DTensor

    policy = trainer.model
    record["gen_peak_unsharded"] = 0

    def sample(module, args):
        if not torch.is_grad_enabled():
            held = sum(p.numel() for p in policy.parameters() if not isinstance(p, DTensor))
            record["gen_peak_unsharded"] = max(record["gen_peak_unsharded"], held)

    for module in policy.modules():
        if not list(module.children()) and list(module.parameters(recurse=False)):
            module.register_forward_pre_hook(sample)


def watch_head(trainer, record: dict) -> None:
    """Count the policy output head's module calls and its chunks of logits (`fused_logprobs.online.head_chunk`,
    called inside the module's call, by Online DPO and DPO on TRL < 1.15): all, those run inside a backward
    pass (a checkpointed chunk recomputed), and how many of each saw the head's weight whole (its full
    `vocab x hidden` elements as a plain tensor).

    The module call is watched by a forward hook registered before the engine wraps the model: it runs before the
    hooks DeepSpeed ZeRO-3 adds at `prepare` (forward hooks run in registration order), so the weight it sees is the
    one the call used, after ZeRO-3's gathering pre-hook and before its release.
    """
    from torch.distributed.tensor import DTensor

    from trl_ext.plugins.fused_logprobs import online

    head = trainer.model.get_output_embeddings()
    full = getattr(head.weight, "ds_numel", head.weight.numel())  # a DTensor's numel() is the global size
    counts = record["head"] = {"calls": 0, "whole": 0, "calls_backward": 0, "calls_backward_whole": 0}
    counts.update(chunks=0, chunks_whole=0, backward=0, backward_whole=0, full_numel=full)

    def is_whole() -> bool:
        weight = head.weight
        return not isinstance(weight, DTensor) and weight.data.numel() == full

    def seen(module, args, output):
        whole, backward = is_whole(), torch._C._current_graph_task_id() != -1
        counts["calls"] += 1
        counts["whole"] += whole
        counts["calls_backward"] += backward
        counts["calls_backward_whole"] += backward and whole

    head.register_forward_hook(seen)
    original = online.head_chunk

    def head_chunk(forward, hidden):
        if getattr(forward, "__self__", None) is head:
            whole = is_whole()
            backward = torch._C._current_graph_task_id() != -1
            counts["chunks"] += 1
            counts["chunks_whole"] += whole
            counts["backward"] += backward
            counts["backward_whole"] += backward and whole
        return original(forward, hidden)

    online.head_chunk = head_chunk
    record["_restore"] = lambda: setattr(online, "head_chunk", original)


def run(cell) -> dict:
    AcceleratorState._reset_state(reset_partial_state=False)
    record: dict = {"cell": cell.name, "engine": ENGINE, "rank": RANK, "world": STATE.num_processes}
    expect = cell.expect.get(ENGINE, Expect())
    start = time.perf_counter()
    options = dict(cell.options)
    if "precompute_ref_batch_size" in cell.flags:
        options["precompute_ref_batch_size"] = {"cache_dir": str(OUT / "cache" / cell.name)}
    installation = trl_ext.install(plugins=options, **cell.flags) if cell.flags else None
    try:
        try:
            trainer = build(cell)
        except trl_ext.UsageError as error:
            record["refused"] = str(error)
            return record
        if expect.kind == REFUSE:
            record["not_refused"] = True
        context = trainer.__dict__.get("_trl_ext")
        record["plugins"] = sorted(p for p in PLUGINS if context is not None and context.is_enabled(p))
        if ENGINE == "fsdp2" and cell.trainer == "online_dpo":
            watch_fsdp2_generation(trainer, record)
        if context is not None and context.is_enabled("fused_logprobs"):
            watch_head(trainer, record)
        if context is not None and context.is_enabled("precompute_ref_batch_size"):
            runs = context.state["precompute_ref_batch_size"].runs
            record["precompute_runs"] = [
                {k: v for k, v in r.items() if isinstance(v, (int, float, str))} for r in runs
            ]
        # Reference forwards during training: none when the reference log-probs were precomputed.
        record["ref_forwards"] = 0
        if trainer.ref_model is not None:

            def count(*_):
                record["ref_forwards"] += 1

            trainer.accelerator.unwrap_model(trainer.ref_model).register_forward_pre_hook(count)
        trainer.train()
        record["logs"] = [dict(entry) for entry in trainer.state.log_history]
        # `verify` (on by default): what this rank checked against stock, `(step, role, error, tolerance, reference)`
        record["math_plugins"] = list(context.math_plugins) if context is not None else []
        checked = getattr(context, "verified", None)
        record["verify"] = [list(r) for r in checked.results] if checked is not None else []
        if context is not None and context.is_enabled("prompt_sharing"):
            shared = context.state["prompt_sharing"]
            record["prompt_sharing"] = {
                "shared_calls": shared.shared_calls,
                "unshared_calls": shared.unshared_calls,
                "shared_rows": shared.rows - shared.unshared_rows,
                "attn_implementations": dict(shared.attn_implementations),
            }
        if context is not None and context.is_enabled("fused_logprobs"):
            from trl_ext.plugins.fused_logprobs.hooks import trl_ext_describe

            fused = context.state["fused_logprobs"]
            record["fused_logprobs"] = {
                "fused_calls": fused.fused_calls,
                "chunks": dict(fused.chunks),
                "self_checks": sorted(fused.self_checks),
                "describe": trl_ext_describe(trainer=trainer, context=context),
            }
        if context is not None and context.is_enabled("token_budget"):
            budget = context.state["token_budget"]
            record["token_budget"] = {
                "micro_batch_counts": list(budget.micro_batch_counts),
                "local_micro_batch_counts": list(budget.local_micro_batch_counts),
                "moved_pairs": list(budget.moved_pairs),
                "rank_tokens": list(budget.rank_tokens),
            }
        record["distributed_type"] = str(trainer.accelerator.distributed_type)
        if DEEPSPEED:
            record["zero_stage"] = trainer.model_wrapped.zero_optimization_stage()
        if ENGINE == "fsdp2":
            record["fsdp2_modules"] = is_fsdp2_model(trainer.model)
            record["fsdp2_ref_sharded"] = trainer.ref_model is not None and is_fsdp2_model(trainer.ref_model)
            record["model_numel"] = sum(p.numel() for p in full_params(trainer).values())
        params = full_params(trainer)
        record["params"] = params if RANK == 0 else {}
        record["param_dtype"] = str(next(iter(trainer.accelerator.unwrap_model(trainer.model).parameters())).dtype)
    except Exception as error:  # recorded for the test to report (or to match a strict xfail)
        record["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-3000:]}"
        raise
    finally:
        restore = record.pop("_restore", None)
        if restore is not None:
            restore()
        if installation is not None:
            installation.uninstall()
        record["seconds"] = time.perf_counter() - start
        torch.save(record, OUT / f"{cell.name}.rank{RANK}.pt")
    return record


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    # Cells named on the command line run even where the table does not list the engine (to reproduce a bug there).
    cells = [c for c in CELLS if c.name in ONLY] if ONLY else cells_for(ENGINE)
    for cell in cells:
        try:
            run(cell)
        except Exception:
            # Record and go on to the next cell only if every rank got here; a failure inside a collective would
            # leave the ranks out of step, so stop instead.
            traceback.print_exc()
            break
        dist.barrier()
    if RANK == 0:
        (OUT / "matrix_seconds.txt").write_text(f"{time.perf_counter() - begin:.1f}\n")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # research/deepspeed_cpu.md: a gloo thread finishing an all-gather can abort interpreter exit


if __name__ == "__main__":
    main()
