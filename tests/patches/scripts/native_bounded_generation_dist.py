"""2-process DeepSpeed ZeRO-3 (CPU, gloo) generation through the patched TRL's `unwrap_model_for_generation`.

Launched by tests/patches/test_native_bounded_generation.py as `torchrun --standalone --nproc_per_node 2
native_bounded_generation_dist.py OUT_DIR`. A tiny Llama is trained for one step with DeepSpeed's default
coordinator settings (prefetch bucket 5e7, reuse distance 1e9, live parameters 1e9), then generates greedily with
`gather_deepspeed3_params=True` and `False`, sampling the full-size parameter bytes resident (`ds_status` AVAILABLE)
on the rank from inside every module's forward; then an exception is injected during a `False` generation. Each rank
writes `OUT_DIR/rank<r>.json`.
"""

import importlib
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

# DeepSpeed JIT-compiles an shm op ZeRO never uses; accelerate computes no backend on CPU (see
# /work/shared/research/deepspeed_cpu.md).
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
from accelerate import PartialState  # noqa: E402

STATE = PartialState(backend="gloo")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
from trl.models.utils import unwrap_model_for_generation  # noqa: E402

from trl_ext.testing import make_model  # noqa: E402

LIMITS = (
    "_PartitionedParameterCoordinator__max_reuse_dist_in_numel",
    "_PartitionedParameterCoordinator__prefetch_bucket_sz",
    "_PartitionedParameterCoordinator__max_n_available_params",
)
# No stage3_* settings: DeepSpeed's defaults, under which stock TRL's no-gather generation keeps the whole model.
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "overlap_comm": False, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
}


class Injected(RuntimeError):
    pass


def full_bytes(param):
    return param.ds_numel * param.element_size()


def generate(engine, accelerator, prompt, gather, inject=False):
    unwrapped = accelerator.unwrap_model(engine)
    params = list(unwrapped.parameters())
    peak = [0]

    def sample():
        peak[0] = max(peak[0], sum(full_bytes(p) for p in params if p.ds_status == ZeroParamStatus.AVAILABLE))

    # Wrapping `forward` samples after DeepSpeed's fetch pre-hook and before its release post-hook.
    modules = [m for m in unwrapped.modules() if list(m.parameters(recurse=False))]
    for module in modules:
        module.forward = lambda *a, _f=module.forward, **k: (sample(), _f(*a, **k))[1]
    calls = [0]

    def boom(module, args):
        calls[0] += 1
        if inject and calls[0] == 3:
            raise Injected("injected during generation")

    handle = unwrapped.model.layers[1].mlp.down_proj.register_forward_pre_hook(boom)
    try:
        with unwrap_model_for_generation(engine, accelerator, gather_deepspeed3_params=gather) as model:
            with torch.no_grad():
                out = model.generate(**prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    finally:
        handle.remove()
        for module in modules:
            del module.forward
    return out.tolist(), peak[0]


def main():
    out_dir = sys.argv[1]
    torch.manual_seed(0)
    model = make_model(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=256)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=DS_CONFIG))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    engine, optimizer = accelerator.prepare(model, optimizer)
    coordinator = engine.optimizer.parameter_offload.param_coordinator
    user_limits = {name: getattr(coordinator, name) for name in LIMITS}

    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    for _ in range(2):  # two steps: the second runs with a complete trace (prefetching)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    prompt = {
        "input_ids": torch.tensor([[3, 4, 5, 6], [0, 0, 7, 8]]),
        "attention_mask": torch.tensor([[1] * 4, [0, 0, 1, 1]]),
    }
    gathered_tokens, gathered_peak = generate(engine, accelerator, prompt, gather=True)
    bounded_tokens, bounded_peak = generate(engine, accelerator, prompt, gather=False)
    limits_after = {name: getattr(coordinator, name) for name in LIMITS}
    try:
        generate(engine, accelerator, prompt, gather=False, inject=True)
        exception = None
    except Injected as exc:
        exception = str(exc)
    limits_after_exception = {name: getattr(coordinator, name) for name in LIMITS}
    tokens_again, _ = generate(engine, accelerator, prompt, gather=False)
    loss = engine(input_ids=ids, labels=ids).loss  # training still works after generation
    engine.backward(loss)
    engine.step()

    unwrapped = accelerator.unwrap_model(engine)
    result = {
        "user_limits": user_limits,
        "limits_after": limits_after,
        "limits_after_exception": limits_after_exception,
        "exception": exception,
        "model_bytes": sum(full_bytes(p) for p in unwrapped.parameters()),
        "gathered_tokens": gathered_tokens,
        "bounded_tokens": bounded_tokens,
        "tokens_again": tokens_again,
        "gathered_peak": gathered_peak,
        "bounded_peak": bounded_peak,
        "loss_after": float(loss.item()),
    }
    with open(os.path.join(out_dir, f"rank{STATE.process_index}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
