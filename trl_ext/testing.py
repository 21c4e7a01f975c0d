"""Fixtures for tests and plugin authors: tiny models, a local tokenizer and synthetic preference data, a length
reward for OnlineDPO and a counter of `torch.distributed` calls (the workload `trl-ext bench` measures).

Nothing here touches a model hub: models are built from configs with random weights, the tokenizer is a word-level
`tokenizers` tokenizer over a synthetic vocabulary, and the data is generated with skewed (lognormal) lengths like
real preference data. The library never imports this module.
"""

from __future__ import annotations

from .app.bench.workload import (
    CollectiveCounter,
    count_collectives,
    length_reward,
    make_model,
    make_preference_dataset,
    make_prompt_dataset,
    make_tokenizer,
    preference_rows,
)

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
