"""What the torchrun-launched test scripts share (imported as `_launched`: a launched script's folder is first on
`sys.path`): the CPU process group, the float64 models, the comparison of logged values, and the exit.

`start()` must run before torch or TRL touch accelerate (the process-level `PartialState` decides the backend).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn


def start() -> Any:
    """The process-level state on CPU processes with gloo; one intra-op thread per rank; no progress bars."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from accelerate import PartialState

    state = PartialState(cpu=True, backend="gloo")
    import torch

    torch.set_num_threads(1)
    return state


def sharpened_models(policy_seed: int = 0, ref_seed: int = 1) -> tuple[Any, Any]:
    """The policy and reference models: tiny float64 Llamas whose output head is scaled by 8 (a next-token
    distribution far from uniform, so a misplaced token moves the log-probs a lot)."""
    import torch

    from trl_ext.testing import make_model

    models = make_model(dtype=torch.float64, seed=policy_seed), make_model(dtype=torch.float64, seed=ref_seed)
    with torch.no_grad():
        for model in models:
            model.get_output_embeddings().weight.mul_(8)
    return models


#: What the launched DPO runs' configs say: CPU, SGD, a log every step, no integrations, no checkpoints, seed 0, bf16
#: off.
DPO_ARGS = dict(optim="sgd", logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, bf16=False)


def dpo_args(output_dir: str, **kwargs: Any) -> Any:
    """A `DPOConfig` writing to `output_dir`: `DPO_ARGS` (max length 64) and `kwargs`."""
    from trl import DPOConfig

    return DPOConfig(output_dir=output_dir, **{**DPO_ARGS, "max_length": 64, **kwargs})


def is_timing(key: str) -> bool:
    return key.endswith(("runtime", "per_second"))


def differing(
    stock: Iterable[Mapping[str, float]],
    other: Iterable[Mapping[str, float]],
    rel: float,
    abs_tol: float | Any,
    skip: tuple[str, ...] = (),
) -> list[tuple[str, float, float]]:
    """`(key, stock, other)` of every logged value (timings and `skip` aside) that is not within `rel` / `abs_tol`
    (a number, or a function of the key and the stock log giving one)."""
    bad = []
    for s, p in zip(stock, other, strict=True):
        for key, value in s.items():
            if is_timing(key) or key in skip:
                continue
            atol = abs_tol(key, s) if callable(abs_tol) else abs_tol
            if not math.isclose(p[key], value, rel_tol=rel, abs_tol=atol):
                bad.append((key, value, p[key]))
    return bad


def leave() -> NoReturn:
    """Close the process group and exit without the interpreter's teardown (gloo's threads can outlive it and abort a
    rank that succeeded; research/deepspeed_cpu.md)."""
    import torch

    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def finish(state: Any, bad: list, what: str, line: str) -> NoReturn:
    """Fail this rank with the differences, or print `line` and leave: wait for every rank, close the process group,
    and exit without the interpreter's teardown (gloo's threads can outlive it and abort a rank that succeeded;
    research/deepspeed_cpu.md)."""
    if bad:
        raise SystemExit(f"rank {state.process_index}: {what}: {bad}")
    print(f"rank {state.process_index}: {line}", flush=True)
    state.wait_for_everyone()
    leave()
