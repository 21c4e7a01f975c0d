"""Fixtures for tests and plugin authors, without a model hub (the workload `trl-ext bench` measures): tiny models
with random weights, a word-level tokenizer, synthetic preference data with skewed lengths, a length reward for
OnlineDPO, a counter of `torch.distributed` calls. The library never imports this module. `python -m trl_ext.testing
DIR` writes an offline setup for trying `trl-ext dpo` / `online-dpo` (`write_demo`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
    "write_demo",
]


def write_demo(directory: str | Path, pairs: int = 12, prompts: int = 8) -> Path:
    """Write under `directory` (overwriting) and return it: `model/` (a 2-layer Llama and its tokenizer, for
    `--model_name_or_path`), `preferences/train.jsonl` (`pairs` rows, for `trl-ext dpo --dataset_name`) and
    `prompts/train.jsonl` (`prompts` conversational rows, for `trl-ext online-dpo`, with `--reward_funcs
    trl_ext.testing:length_reward`)."""
    root = Path(directory)
    make_model(seed=0).save_pretrained(root / "model")
    make_tokenizer().save_pretrained(root / "model")
    (root / "preferences").mkdir(parents=True, exist_ok=True)
    with open(root / "preferences" / "train.jsonl", "w") as f:
        for row in preference_rows(pairs, seed=1):
            f.write(json.dumps(row) + "\n")
    (root / "prompts").mkdir(parents=True, exist_ok=True)
    with open(root / "prompts" / "train.jsonl", "w") as f:
        for row in preference_rows(prompts, seed=2):
            f.write(json.dumps({"prompt": [{"role": "user", "content": row["prompt"]}]}) + "\n")
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m trl_ext.testing DIR   (writes DIR/model, DIR/preferences, DIR/prompts)")
    print(f"wrote {write_demo(sys.argv[1])}: model/, preferences/, prompts/")
