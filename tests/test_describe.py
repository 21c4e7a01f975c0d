"""What each plugin says it chose, in the one NOTICE line per trainer (`trl_ext_describe`): real trainers, read from
the log record, and compared with what the plugin's own state says it did."""

from __future__ import annotations

import logging

import pytest

import trl_ext
from trl_ext.testing import make_model, make_preference_dataset


@pytest.fixture
def notices(caplog):
    """The NOTICE messages of trl-ext (its root logger does not propagate, so caplog's handler is attached to it)."""
    root = logging.getLogger("trl_ext")
    root.addHandler(caplog.handler)
    try:
        read = _Notices(caplog)
        yield read
    finally:
        root.removeHandler(caplog.handler)


class _Notices:
    def __init__(self, caplog) -> None:
        self.caplog = caplog

    def __call__(self) -> list[str]:
        return [r.getMessage() for r in self.caplog.records if r.levelname == "NOTICE"]

    def clear(self) -> None:
        self.caplog.clear()


def _plugin_line(messages: list[str], trainer: str) -> str:
    lines = [m for m in messages if m.startswith(f"trl-ext: {trainer} gets plugins")]
    assert len(lines) == 1, messages
    return lines[0]


def test_dpo_line_says_attention_batch_size_cache_and_where_the_reference_came_from(
    tokenizer, dpo_args, notices, tmp_path
):
    from trl import DPOTrainer

    cache = tmp_path / "ref-cache"
    options = {"precompute_ref_batch_size": {"cache_dir": str(cache)}}
    lines, states = [], []
    for _ in range(2):  # the second trainer finds the reference log-probs in the cache
        with trl_ext.install(prompt_sharing=True, precompute_ref_batch_size=4, plugins=options):
            trainer = DPOTrainer(
                model=make_model(seed=0),
                args=dpo_args(precompute_ref_log_probs=True),
                train_dataset=make_preference_dataset(8),
                processing_class=tokenizer,
            )
        lines.append(_plugin_line(notices(), "DPOTrainer"))
        notices.clear()
        states.append(trainer._trl_ext.state)
    for line, state, how in zip(lines, states, ("computed", "from the cache"), strict=True):
        # TRL 1.10-1.16 precompute in `__init__`, before the line is written: it says what ran.
        assert [run["source"] for run in state["precompute_ref_batch_size"].runs] == [how.split()[-1]]
        assert f"precompute_ref_batch_size (batch size 4, cache {cache}, train: 8 pairs {how})" in line, line
        impls = state["prompt_sharing"].attn_implementations
        assert impls == {"policy": "trl_ext_shared_sdpa"}
        assert "prompt_sharing (policy: trl_ext_shared_sdpa)" in line, line


def test_prompt_sharing_says_when_its_self_check_is_off(tokenizer, dpo_args, notices):
    from trl import DPOTrainer

    with trl_ext.install(prompt_sharing=True, plugins={"prompt_sharing": {"self_check": False}}):
        DPOTrainer(
            model=make_model(seed=0),
            ref_model=make_model(seed=1),
            args=dpo_args(),
            train_dataset=make_preference_dataset(4),
            processing_class=tokenizer,
        )
    line = _plugin_line(notices(), "DPOTrainer")
    expected = "prompt_sharing (policy: trl_ext_shared_sdpa, ref: trl_ext_shared_sdpa, self-check off)"
    assert line == f"trl-ext: DPOTrainer gets plugins {expected}"


@pytest.mark.parametrize(
    ("flag", "options", "text"),
    [
        (False, {}, "generation (ds3_gather_for_generation=False)"),
        ("auto", {"budget": "40%"}, "generation (ds3_gather_for_generation='auto', budget 40% of the model)"),
    ],
)
def test_generation_says_its_flag_and_budget(notices, flag, options, text, plain_online_dpo):
    with trl_ext.install(ds3_gather_for_generation=flag, plugins={"generation": options}):
        plain_online_dpo(ref=False)
    assert _plugin_line(notices(), "OnlineDPOTrainer") == f"trl-ext: OnlineDPOTrainer gets plugins {text}"
