"""2-process DeepSpeed ZeRO-3 (CPU, gloo) runs of stock OnlineDPO/GRPO/RLOO trainers, with and without `generation`.

Launched by tests/plugins/test_generation.py as `torchrun --standalone --nproc_per_node 2 generation_zero3.py OUT_DIR
[MODE,...]` (modes: the keys of `MODES`). For each mode it trains a fresh tiny Llama for two steps, recording the
completions and the resident parameter bytes of every generation, then on the trained model:

- greedy generation through the trainer module's `unwrap_model_for_generation` (patched by trl-ext when installed),
  sampling the full-size parameter bytes resident on the rank from inside every module's forward;
- an exception injected in the middle of a decoding step, with the model's state compared before and after;
- greedy generation again (same tokens?) and one training step through the DeepSpeed engine.

Each rank writes `OUT_DIR/rank<r>.json`; the test asserts on those numbers.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

# DeepSpeed JIT-compiles an shm op ZeRO never uses (65 s on 2 cores); accelerate computes no backend on CPU, so
# every rank would think it is rank 0 (see /work/shared/research/deepspeed_cpu.md).
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
from accelerate import PartialState  # noqa: E402

STATE = PartialState(backend="gloo")

import torch  # noqa: E402
from _launched import leave  # noqa: E402
from deepspeed.runtime.zero import parameter_offload  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.plugins.generation import decoder_layers, external_params, param_bytes  # noqa: E402
from trl_ext.testing import length_reward, make_model, make_prompt_dataset, make_tokenizer  # noqa: E402

MODEL = dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=256)
USER_GC_KWARGS = {"use_reentrant": False, "preserve_rng_state": False}
#: A user's ZeRO-3 config with DeepSpeed's default prefetch bucket (5e7), reuse distance (1e9) and live-parameter limit
#: (1e9): the settings under which TRL's `ds3_gather_for_generation=False` alone keeps the whole model resident.
#: (HF's "auto" prefetch, 0.9 * hidden**2, is so small for this tiny model that it would hide the problem.)
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": False,
        "reduce_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
}
BUDGET_FRACTION = 0.55  # of the model's parameter bytes: room for 2 of the 4 layers (see the test)

# name -> (trainer, trl-ext flag or "stock", TRL's ds3_gather_for_generation, generation plugin options)
MODES = {
    "stock_gather": ("OnlineDPO", "stock", True, None),
    "stock_nogather": ("OnlineDPO", "stock", False, None),
    "gather": ("OnlineDPO", True, True, {}),
    "stream": ("OnlineDPO", False, True, {}),
    "budget": ("OnlineDPO", False, True, {"budget": BUDGET_FRACTION}),
    "auto": ("OnlineDPO", "auto", True, {}),
    # GRPO and RLOO generate through the same helper: stock gather vs trl-ext's bounded no-gather.
    "grpo_stock_gather": ("GRPO", "stock", True, None),
    "grpo_stream": ("GRPO", False, True, {}),
    "rloo_stock_gather": ("RLOO", "stock", True, None),
    "rloo_stream": ("RLOO", False, True, {}),
    # Construction only, trl-ext installed without its `generation` plugin: TRL's own no-gather is advised against.
    "advice": ("OnlineDPO", "advice", False, None),
}
HELPER_MODULES = {
    "OnlineDPO": "trl.experimental.online_dpo.online_dpo_trainer",
    "GRPO": "trl.trainer.grpo_trainer",
    "RLOO": "trl.trainer.rloo_trainer",
}


class Injected(RuntimeError):
    pass


def offload_of(engine):
    opt = engine.optimizer
    return getattr(opt, "parameter_offload", opt)


def snapshot(engine, unwrapped):
    """Everything the generation context must leave exactly as it found it."""
    offload = offload_of(engine)
    coord = offload.param_coordinator
    modules = list(unwrapped.modules())
    limits = {
        a: getattr(coord, a)
        for a in (
            "_PartitionedParameterCoordinator__max_reuse_dist_in_numel",
            "_PartitionedParameterCoordinator__prefetch_bucket_sz",
            "_PartitionedParameterCoordinator__max_n_available_params",
        )
    }
    return {
        "offload_hooks": [len(offload.forward_hooks), len(offload.backward_hooks)],
        "module_hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in modules),
        "limits": limits,
        "training": [m.training for m in modules],
        "gc_flags": [vars(m).get("gradient_checkpointing") for m in modules],
        "gc_funcs": [id(vars(m).get("_gradient_checkpointing_func")) for m in modules],
        "generation_config_id": id(unwrapped.generation_config),
        "generation_config": unwrapped.generation_config.to_json_string(),
        "available_nonpersistent": sorted(
            p.ds_id for p in unwrapped.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist
        ),
        "active_submodules": sum(len(p.ds_active_sub_modules) for p in unwrapped.parameters()),
        "fwd_module_stack": len(parameter_offload.FWD_MODULE_STACK),
    }


class ResidentMeter:
    """Samples the full-size parameter bytes resident on this rank from inside each module's forward.

    Wrapping `forward` (not a hook) puts every sample after DeepSpeed's fetch pre-hook and before its release
    post-hook, whatever order hooks were registered in.
    """

    def __init__(self, model):
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.params = list(model.parameters())
        self.peak = 0
        self.peak_params = []  # non-persistent parameters gathered at the peak, for failure messages
        self.modules = [m for m in model.modules() if list(m.parameters(recurse=False))]

    def sample(self):
        now = sum(param_bytes(p) for p in self.params if p.ds_status == ZeroParamStatus.AVAILABLE)
        if now > self.peak:
            self.peak = now
            self.peak_params = [
                self.names[id(p)] for p in self.params if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist
            ]

    def __enter__(self):
        for m in self.modules:
            original = m.forward

            def forward(*args, _original=original, **kwargs):
                self.sample()
                return _original(*args, **kwargs)

            m.forward = forward
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            del m.forward


def greedy(trainer, prompt, measure=False, inject_at=None, mutate=False):
    # The name as the trainer's module looks it up (patched there by trl-ext while installed).
    odt = importlib.import_module(HELPER_MODULES[trainer._test_kind])
    engine, acc = trainer.model_wrapped, trainer.accelerator
    unwrapped = acc.unwrap_model(engine)
    handle = None
    if inject_at is not None:
        calls = [0]
        target = decoder_layers(unwrapped)[1].mlp.down_proj

        def boom(module, args):
            calls[0] += 1
            if calls[0] == inject_at:
                raise Injected("injected during generation")

        handle = target.register_forward_pre_hook(boom)
    meter = ResidentMeter(unwrapped)
    start = time.perf_counter()
    try:
        with odt.unwrap_model_for_generation(
            engine,
            acc,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
        ) as model:
            if mutate:
                model.eval()
                model.generation_config.top_k = 7
            with torch.no_grad(), meter if measure else _null():
                out = model.generate(
                    input_ids=prompt["input_ids"],
                    attention_mask=prompt["attention_mask"],
                    max_new_tokens=8,
                    min_new_tokens=8,
                    do_sample=False,
                    pad_token_id=0,
                )
    finally:
        if handle is not None:
            handle.remove()
    return out.tolist(), meter.peak, time.perf_counter() - start


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def build_trainer(kind, name, out_dir, trl_flag):
    common = dict(
        output_dir=os.path.join(out_dir, name),
        per_device_train_batch_size=2,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        seed=0,
        bf16=False,
        deepspeed=DS_CONFIG,
        accelerator_config={"use_configured_state": True},
        ds3_gather_for_generation=trl_flag,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs=dict(USER_GC_KWARGS),
    )
    tok = make_tokenizer()
    model = make_model(**MODEL)
    if kind == "OnlineDPO":
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        return OnlineDPOTrainer(
            model=model,
            ref_model=make_model(**MODEL),
            reward_funcs=length_reward,
            args=OnlineDPOConfig(max_new_tokens=6, **common),
            train_dataset=make_prompt_dataset(8),
            processing_class=tok,
        )
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if kind == "GRPO" else (RLOOConfig, RLOOTrainer)
    # beta=0: no reference model (TRL cannot copy one under ZeRO-3).
    config = config_cls(num_generations=2, max_completion_length=6, beta=0.0, **common)
    return trainer_cls(
        model=model,
        reward_funcs=length_reward,
        args=config,
        train_dataset=make_prompt_dataset(8),
        processing_class=tok,
    )


def advice_mode(name, out_dir):
    kind, _, trl_flag, _ = MODES[name]
    installation = trl_ext.install()
    try:
        trainer = build_trainer(kind, name, out_dir, trl_flag)
        return {"enabled": list(trainer._trl_ext.enabled)}
    finally:
        installation.uninstall(detach=True)
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state()
        GradientState._reset_state()


def run_mode(name, out_dir):
    kind, flag, trl_flag, options = MODES[name]
    if flag == "advice":
        return advice_mode(name, out_dir)
    installation = None
    if flag != "stock":
        installation = trl_ext.install(
            ds3_gather_for_generation=flag, plugins={"generation": options} if options else {}
        )
    try:
        tok = make_tokenizer()
        trainer = build_trainer(kind, name, out_dir, trl_flag)
        trainer._test_kind = kind
        completions, train_peaks, train_peak_params = [], [], []
        policy = trainer.model  # the HF model; DeepSpeed wraps this very object
        original_generate = policy.generate

        def recording_generate(*a, **k):
            # Measured inside training too: that is where TRL's own no-gather mode holds the whole model.
            with ResidentMeter(policy) as meter:
                out = original_generate(*a, **k)
            train_peaks.append(meter.peak)
            train_peak_params.append(meter.peak_params)
            completions.append(out.tolist())
            return out

        policy.generate = recording_generate
        trainer.train()
        del policy.generate
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]

        engine = trainer.model_wrapped
        unwrapped = trainer.accelerator.unwrap_model(engine)
        layers = decoder_layers(unwrapped)
        gc_func = vars(layers[0]).get("_gradient_checkpointing_func")
        prompt = tok(["w1 w2 w3 w4", "w5 w6"], return_tensors="pt", padding=True)
        tokens, peak, gen_time = greedy(trainer, prompt, measure=True)
        params = list(unwrapped.parameters())
        result = {
            "losses": losses,
            "completions": completions,
            "greedy_tokens": tokens,
            "peak_bytes": peak,
            "train_peak_bytes": train_peaks,
            "train_peak_params": train_peak_params,
            "gen_time_s": gen_time,
            "model_bytes": sum(param_bytes(p) for p in params),
            "persistent_bytes": sum(param_bytes(p) for p in params if p.ds_persist),
            # Held by DeepSpeed for a whole forward (GRPO 1.16 makes lm_head.weight one, see the plugin).
            "external_bytes": sum(param_bytes(p) for p in external_params(unwrapped)),
            "layer_bytes": [sum(param_bytes(p) for p in lay.parameters() if not p.ds_persist) for lay in layers],
            "max_module_bytes": max(
                sum(param_bytes(p) for p in m.parameters(recurse=False) if not p.ds_persist)
                for m in unwrapped.modules()
            ),
            "gc_enabled_after_training": bool(vars(layers[0]).get("gradient_checkpointing")),
            "gc_kwargs_after_training": dict(getattr(gc_func, "keywords", {}) or {}),
        }
        if installation is not None:
            ctx = trainer._trl_ext
            state = ctx.state["generation"]
            result["generations"] = state.generations
            result["auto_gather"] = state.auto_gather
            if state.plan is not None:
                result["plan"] = {
                    "budget_bytes": state.plan.budget_bytes,
                    "gathered_layers": state.plan.gathered_layers,
                    "gathered_bytes": state.plan.gathered_bytes,
                    "reserve_bytes": state.plan.reserve_bytes,
                    "external_bytes": state.plan.external_bytes,
                }
            # Exception injected at the 3rd call of layer 1's down_proj (decoding step 3 for the streaming modes,
            # while its parameters are fetched and its release hook will never run).
            before = snapshot(engine, unwrapped)
            try:
                greedy(trainer, prompt, inject_at=3, mutate=True)
                result["exception"] = None
            except Injected as exc:
                result["exception"] = f"Injected: {exc}"
            except BaseException as exc:  # noqa: BLE001 - the test asserts the original exception came through
                result["exception"] = f"{type(exc).__name__}: {exc}"
            after = snapshot(engine, unwrapped)
            result["state_diff"] = sorted(k for k in before if before[k] != after[k])
            result["state_before"] = {k: before[k] for k in ("offload_hooks", "module_hooks", "active_submodules")}
            result["gc_kwargs_after_exception"] = dict(
                getattr(vars(layers[0]).get("_gradient_checkpointing_func"), "keywords", {}) or {}
            )
            tokens_again, _, _ = greedy(trainer, prompt)
            result["greedy_tokens_after_exception"] = tokens_again
        # One more training step through the engine: the hooks must fetch, reduce and release as before.
        ids = prompt["input_ids"]
        loss = engine(input_ids=ids, attention_mask=prompt["attention_mask"], labels=ids).loss
        engine.backward(loss)
        engine.step()
        result["engine_step_loss"] = float(loss.item())
        return result
    finally:
        if installation is not None:
            installation.uninstall()
        # Several trainers in one process: the next one builds its own Accelerator (the process group stays).
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state()
        GradientState._reset_state()


def main():
    out_dir = sys.argv[1]
    modes = sys.argv[2].split(",") if len(sys.argv) > 2 else list(MODES)
    results = {"rank": STATE.process_index, "world": STATE.num_processes, "modes": {}}
    for name in modes:
        results["modes"][name] = run_mode(name, out_dir)
    with open(os.path.join(out_dir, f"rank{STATE.process_index}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.barrier()
    leave()


if __name__ == "__main__":
    main()
