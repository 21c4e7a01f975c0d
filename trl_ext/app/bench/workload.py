"""The bench's workload: tiny models built from configs, a local word-level tokenizer, synthetic preference data with
skewed (lognormal) lengths, a length reward and a collective counter; nothing touches a model hub. `trl-ext bench` and
its workers build what they measure from these; `trl_ext.testing` offers them to tests and plugin authors.
"""

from __future__ import annotations

import contextlib
import math
import random
from typing import Any

__all__ = [
    "CollectiveCounter",
    "count_collectives",
    "length_reward",
    "make_model",
    "make_preference_dataset",
    "make_prompt_dataset",
    "make_tokenizer",
    "preference_rows",
]

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def make_tokenizer(vocab_size: int = 256):
    """A word-level fast tokenizer whose words are `w0 ... w{n}`; pad, eos, bos and unk are special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    tokenizer.padding_side = "left"
    # A chat template so conversational datasets and OnlineDPO's generation prompt work too.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}{% endif %}"
    )
    return tokenizer


def make_model(
    arch: str = "llama",
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    attn_implementation: str = "sdpa",
    dtype: Any = None,
    seed: int = 0,
    device: Any = None,
):
    """A randomly initialised `LlamaForCausalLM` or `Qwen2ForCausalLM` built from a config (on `device`, if given)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    config_cls, model_cls = classes[arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = model_cls(config)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model


def _lognormal_len(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(math.exp(rng.gauss(math.log(median), sigma))))))


def preference_rows(
    n: int,
    vocab_size: int = 256,
    prompt_median: float = 12,
    completion_median: float = 10,
    sigma: float = 0.8,
    max_prompt: int = 128,
    max_completion: int = 128,
    seed: int = 0,
    min_prompt: int = 1,
    min_completion: int = 1,
) -> list[dict[str, str]]:
    """Rows of `{"prompt", "chosen", "rejected"}` text with lognormal (skewed) lengths."""
    rng = random.Random(seed)
    n_words = vocab_size - len(SPECIAL_TOKENS)

    def text(median: float, low: int, high: int) -> str:
        return " ".join(f"w{rng.randrange(n_words)}" for _ in range(_lognormal_len(rng, median, sigma, low, high)))

    completion = (completion_median, min_completion, max_completion)
    return [
        {
            "prompt": text(prompt_median, min_prompt, max_prompt),
            "chosen": " " + text(*completion),
            "rejected": " " + text(*completion),
        }
        for _ in range(n)
    ]


def make_preference_dataset(n: int = 16, **kwargs: Any):
    """A `datasets.Dataset` of text preference pairs (see `preference_rows` for the options)."""
    from datasets import Dataset

    return Dataset.from_list(preference_rows(n, **kwargs))


def make_prompt_dataset(n: int = 8, vocab_size: int = 256, seed: int = 0, prompt_median: float = 6):
    """A `datasets.Dataset` of conversational prompts for `OnlineDPOTrainer`."""
    from datasets import Dataset

    rows = preference_rows(n, vocab_size=vocab_size, prompt_median=prompt_median, seed=seed)
    return Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])


def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A deterministic reward function for OnlineDPO tests: longer completions score higher."""
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(float(len(str(text).split())))
    return out


#: Every collective and point-to-point call `torch.distributed` exposes (checked on torch 2.13, where recent code
#: prefers the newer names such as `all_gather_single`; a counter that misses one silently undercounts).
COLLECTIVE_NAMES = tuple(
    """
    all_gather all_gather_coalesced all_gather_into_tensor all_gather_object all_gather_single _all_gather_base
    all_reduce all_reduce_coalesced all_to_all all_to_all_single barrier broadcast broadcast_object_list gather
    gather_object monitored_barrier reduce reduce_scatter reduce_scatter_single reduce_scatter_tensor scatter
    scatter_object_list send recv isend irecv
    """.split()
)


class CollectiveCounter:
    """Counts `torch.distributed` calls made while `enabled`, made by `count_collectives()`.

    A call made from inside another counted call (e.g. `all_gather_object` using `all_gather`) is not counted again:
    `total` is the number of collectives the caller asked for. `by_name` splits `total` by function name.
    """

    def __init__(self) -> None:
        self.total = 0
        self.by_name: dict[str, int] = {}
        self.enabled = True
        self._depth = 0

    def reset(self) -> None:
        self.total = 0
        self.by_name.clear()

    def _wrap(self, name: str, function: Any) -> Any:
        import functools

        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0 and self.enabled:
                self.total += 1
                self.by_name[name] = self.by_name.get(name, 0) + 1
            self._depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def count_collectives() -> CollectiveCounter:
    """Wrap every `torch.distributed` collective (for the rest of the process) and return the counter.

    Call it before importing code that binds these functions by name; accelerate and TRL look them up on the module
    at call time, so they are counted.
    """
    import torch.distributed as dist

    counter = CollectiveCounter()
    for name in COLLECTIVE_NAMES:
        function = getattr(dist, name, None)
        if function is not None:
            setattr(dist, name, counter._wrap(name, function))
    return counter
