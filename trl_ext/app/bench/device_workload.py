"""The workload of `trl-ext bench --device` (`device_parts`): the presets (a ~1B Llama from a config for the GPU, a
tiny one for the CPU tests; their pairs' long-tailed lengths), models initialised on the device, and the
Online DPO trainer whose generation returns one stored batch (`stored_online_trainer`, the CPU bench's too)."""

from __future__ import annotations

import contextlib
import random
from typing import Any

#: `1b`: the model and lengths of the H200 measurement (/work/shared/research/gpu.md; 853M parameters, bf16, sdpa);
#: `tiny`: the same pipeline in seconds on a CPU (float32), for the tests.
PRESETS: dict[str, dict[str, Any]] = {
    "1b": dict(
        model=dict(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4, intermediate_size=5632, vocab=32000),
        # `workload.preference_rows`'s: log-normal with `sigma`, clipped
        lengths=dict(min_prompt=32, max_prompt=512, prompt_median=128, sigma=0.8)
        | dict(min_completion=16, max_completion=1024, completion_median=192),
        pairs=8,
        micro_pairs=4,
        batches=6,
        max_length=2048,
        online_prompts=4,
        online_completion=1024,
        dtype="bfloat16",
        rounds=10,
        warmup=2,
    ),
    "tiny": dict(
        model=dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab=256),
        lengths=dict(min_prompt=4, max_prompt=16, prompt_median=8, sigma=0.8)
        | dict(min_completion=2, max_completion=24, completion_median=8),
        pairs=4,
        micro_pairs=2,
        batches=2,
        max_length=128,
        online_prompts=2,
        online_completion=16,
        dtype="float32",
        rounds=1,
        warmup=0,
    ),
}
SETTINGS = (("checkpointing_off", False), ("checkpointing_on", True))


def cuda(device: str) -> bool:
    return device.startswith("cuda")


def make_model(preset: dict[str, Any], device: str, seed: int) -> Any:
    """The preset's Llama, initialised on `device` (seconds for the 1b preset there), in the preset's dtype."""
    import torch

    from .workload import make_model as build

    m = preset["model"]
    shape = {key: m[key] for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")}
    dtype = getattr(torch, preset["dtype"])
    return build(vocab_size=m["vocab"], max_position_embeddings=4096, dtype=dtype, seed=seed, device=device, **shape)


def online_trainer(opts: Any, name: str) -> Any:
    """`stored_online_trainer` on the preset's models, prompts of 80 to 120 tokens."""
    import trl_ext

    from .workload import make_tokenizer

    preset = PRESETS[opts.preset]
    prompts, width, vocab = preset["online_prompts"], preset["online_completion"], preset["model"]["vocab"]
    lengths = [random.Random(i).randint(min(80, width), min(120, 8 * width)) for i in range(prompts)]
    models = (make_model(preset, opts.device, 0), make_model(preset, opts.device, 1))
    flags = {"fused_logprobs": True} if name == "fused_logprobs" else {}
    with trl_ext.install(flags) if flags else contextlib.nullcontext():
        return stored_online_trainer(
            models, make_tokenizer(vocab), lengths, vocab, width, output_dir=opts.tmp, use_cpu=not cuda(opts.device)
        )


def stored_online_trainer(
    models: tuple[Any, Any], tokenizer: Any, lengths: list[int], words: int, width: int, **config
):
    """An `OnlineDPOTrainer` of `models` (policy, reference) with `length_reward` (`config`: more `OnlineDPOConfig`
    fields) whose generation returns one stored batch, so that a step is scoring, loss and backward: prompts of
    `lengths` tokens (left padded, as TRL's generation returns them), 2 completions each of a third of `width` to
    `width` tokens, padded after their end, of ids below `words`; `trainer._bench_tokens` counts its real tokens."""
    import inspect
    import types

    import torch
    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from .workload import length_reward

    prompts = len(lengths)
    args = OnlineDPOConfig(
        per_device_train_batch_size=prompts,
        max_new_tokens=width,
        max_length=8192,
        report_to=[],
        bf16=False,
        save_strategy="no",
        seed=0,
        **config,
    )
    reward: Any = length_reward
    trainer: Any = OnlineDPOTrainer(
        model=models[0],
        ref_model=models[1],
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "w1"}] * prompts),
        processing_class=tokenizer,
    )
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.zeros(prompts, max(lengths), dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for row, n in enumerate(lengths):
        prompt_ids[row, -n:] = torch.randint(4, words, (n,), generator=g)
        prompt_mask[row, -n:] = 1
    completion_ids = torch.randint(4, words, (2 * prompts, width), generator=g)
    ends = torch.randint(max(1, width // 3), width + 1, (2 * prompts,), generator=g)
    completion_mask = (torch.arange(width)[None] < ends[:, None]).long()
    completions = completion_ids.masked_fill(completion_mask == 0, 0)
    tensors = (prompt_ids.repeat(2, 1), prompt_mask.repeat(2, 1), completions, completion_mask)
    batch: tuple[Any, ...] = (*(t.to(trainer.accelerator.device) for t in tensors), None)
    if "vision_inputs = self._generate(" not in inspect.getsource(OnlineDPOTrainer.training_step):
        batch = batch[:4]  # TRL < 1.16 generates no vision inputs
    trainer._generate = types.MethodType(lambda self, model, prompts, images=None: batch, trainer)
    trainer._bench_tokens = 2 * int(prompt_mask.sum()) + int(completion_mask.sum())
    return trainer
