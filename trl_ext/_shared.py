"""Helpers the built-in plugins share (re-exported by `trl_ext.api`); nothing heavy is imported at import time."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["Ranks", "free_memory_bytes"]


class Ranks:
    """The processes of a run (`world`, this `rank`, `local_world` on this node: `LOCAL_WORLD_SIZE`, else `world`),
    and the one way trl-ext runs a collective across them: every rank calls the same methods in the same order, and
    with one process no method calls `torch.distributed` at all."""

    def __init__(self, world: int, rank: int, local_world: int | None = None) -> None:
        self.world = max(1, int(world))
        self.rank = int(rank)
        self.is_main = self.rank == 0
        if local_world is None:
            local = os.environ.get("LOCAL_WORLD_SIZE")
            local_world = int(local) if local and local.isdigit() else self.world
        self.local_world = local_world

    @classmethod
    def of(cls, accelerator: Any) -> Ranks:
        """The ranks of a trainer's `accelerate.Accelerator` (anything without `num_processes` is one process)."""
        return cls(
            int(getattr(accelerator, "num_processes", 1) or 1), int(getattr(accelerator, "process_index", 0) or 0)
        )

    def __repr__(self) -> str:
        return f"Ranks(world={self.world}, rank={self.rank})"

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (one `all_gather_object`)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (one `broadcast_object_list`)."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_rows(self, vec: Any) -> Any:
        """Every rank's 1-D tensor `vec` as the rows of a `[world, numel]` tensor, in rank order (one collective)."""
        if self.world == 1:
            return vec.unsqueeze(0)
        import torch
        import torch.distributed as dist

        out = torch.empty(self.world * vec.numel(), dtype=vec.dtype, device=vec.device)
        # torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single` and warns on the old name.
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, vec)
        return out.view(self.world, vec.numel())

    def max(self, value: int, device: Any) -> int:
        """The largest integer `value` over the ranks (one `all_reduce(MAX)` of a one-element tensor on `device`)."""
        if self.world == 1:
            return int(value)
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([int(value)], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def all_true(self, flag: bool, device: Any) -> bool:
        """True only if `flag` is True on every rank (one `max` over the ranks)."""
        return not self.max(0 if flag else 1, device)

    def any_true(self, flag: bool, device: Any) -> bool:
        """True if `flag` is True on any rank (one `max` over the ranks)."""
        return bool(self.max(1 if flag else 0, device))


def free_memory_bytes(device: Any) -> int:
    """Free memory where tensors on `device` would live: device memory on an accelerator, available RAM on CPU."""
    import torch

    kind = getattr(device, "type", "cpu")
    if kind == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    if kind == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[0])
    from deepspeed.accelerator import get_accelerator  # other accelerators (XPU, NPU, ...)

    return int(get_accelerator().available_memory(getattr(device, "index", None)))
