"""`token_budget="auto"` (the budget measured from memory before the first step) and the prompt counted once under
prompt_sharing.

The real-trainer tests reuse the equality harness of tests/plugins/token_budget_harness.py (the same float64 models,
data, SGD steps and tolerances).
"""

from __future__ import annotations

import logging
import math

import pytest

import trl_ext
from trl_ext import UsageError
from trl_ext.plugins.token_budget.auto import HEADROOM, STATE_KEY, AutoBudget, Probe, choose
from trl_ext.plugins.token_budget.cut import Layout, Pair, as_layout, cut_step, layout, pair_length, tokens

from ..equivalence import one_thread
from .token_budget_harness import (
    PLUGIN,
    _assert_same_run,
    _records,
    _state,
    _train,
)

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)

# ---------------------------------------------------------------------------------------------------------------------
# The flag and options
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["auto", "AUTO", " auto "])
def test_flag_accepts_auto(value):
    with trl_ext.install(token_budget=value) as installation:
        assert installation.config.token_budget == "auto"


@pytest.mark.parametrize("value", ["lots", "automatic", 0, -5, 2.5, True])
def test_flag_refuses_other_values(value):
    with pytest.raises(UsageError, match='`token_budget` must be a positive integer, "auto" or None'):
        trl_ext.install(token_budget=value)


@pytest.mark.parametrize("value", ["lots", 0, 1.5, "150%", True])
def test_bad_ram_budget_is_a_usage_error(value):
    with pytest.raises(UsageError, match="ram_budget"):
        trl_ext.install(token_budget="auto", plugins={PLUGIN: {"ram_budget": value}})


# ---------------------------------------------------------------------------------------------------------------------
# Choosing the budget from the probes (pure)
# ---------------------------------------------------------------------------------------------------------------------

MIB = 2**20


def test_choose_takes_the_heaviest_step_when_every_probe_fit():
    fitting = [Probe(1, 100, 10 * MIB), Probe(2, 200, 20 * MIB)]
    assert choose(fitting, memory=1000 * MIB, cap=200, failed=None) == 200


def test_choose_follows_the_line_through_the_two_largest_probes():
    # 5 MiB fixed + 0.1 MiB per token: HEADROOM x 100 MiB is reached at (90 - 5) / 0.1 = 850 tokens.
    fitting = [Probe(1, 100, 15 * MIB), Probe(2, 200, 25 * MIB), Probe(4, 400, 45 * MIB)]
    budget = choose(fitting, memory=100 * MIB, cap=10_000, failed=1200)
    assert budget == pytest.approx((HEADROOM * 100 - 5) / 0.1, abs=1)


def test_choose_stays_below_the_size_that_failed_and_at_or_above_what_fit():
    fitting = [Probe(1, 100, 15 * MIB), Probe(2, 200, 25 * MIB)]
    assert choose(fitting, memory=100 * MIB, cap=10_000, failed=300) == 299
    # a line that allows less than the largest fitting probe still keeps that probe's size
    assert choose([Probe(1, 100, 95 * MIB)], memory=100 * MIB, cap=10_000, failed=200) == 100
    assert choose(fitting, memory=100 * MIB, cap=250, failed=400) == 250


def test_choose_through_zero_when_memory_does_not_rise():
    # CPU peak RSS may not grow between two small probes (allocator reuse): projected through zero from the largest
    fitting = [Probe(1, 100, 8 * MIB), Probe(2, 200, 8 * MIB)]
    assert choose(fitting, memory=100 * MIB, cap=10**6, failed=10**5) == math.floor(200 * HEADROOM * 100 / 8)


def test_choose_needs_a_probe_that_fit():
    with pytest.raises(ValueError):
        choose([], memory=MIB, cap=10, failed=5)


def test_auto_line_names_budget_and_memory():
    result = AutoBudget(850, Layout.PACKED, 100 * MIB, "cuda", (Probe(1, 100, 15 * MIB),), "memory")
    line = result.line()
    assert '"auto" chose 850 packed tokens' in line and "100 MiB on cuda" in line and "memory" in line


# ---------------------------------------------------------------------------------------------------------------------
# The layout: the prompt counted once under prompt_sharing (pure)
# ---------------------------------------------------------------------------------------------------------------------


def _example(prompt: int, chosen: int, rejected: int) -> dict:
    return {"prompt_ids": [5] * prompt, "chosen_ids": [6] * chosen, "rejected_ids": [7] * rejected}


def test_layout_follows_the_packing_collator():
    from trl_ext.plugins.padding_free.hooks import PaddingFreeCollator
    from trl_ext.plugins.prompt_sharing.layout import PromptSharingCollator
    from trl_ext.toolkit.packing.glue import AnnotatingCollator

    assert layout(None) is Layout.PADDED and not Layout.PADDED
    assert layout(PaddingFreeCollator(dict)) is Layout.PACKED and Layout.PACKED
    assert layout(PromptSharingCollator(dict)) is Layout.PROMPT_SHARED and Layout.PROMPT_SHARED
    assert layout(object()) is Layout.PACKED  # a third-party packing collator that declares nothing

    class Odd(AnnotatingCollator):
        token_layout = "interleaved"

    with pytest.raises(UsageError, match="declares `token_layout` 'interleaved'"):
        layout(Odd(dict))
    assert as_layout(True) is Layout.PACKED and as_layout(False) is Layout.PADDED
    assert as_layout(Layout.PROMPT_SHARED) is Layout.PROMPT_SHARED


def test_pair_length_per_layout():
    pair = _example(10, 4, 6)
    assert pair_length(pair, Layout.PADDED, None) == 16
    assert pair_length(pair, Layout.PACKED, None) == 30
    # the shared row: the prompt less its last token once, then each completion after a copy of that token
    assert pair_length(pair, Layout.PROMPT_SHARED, None) == 9 + (1 + 4) + (1 + 6)
    # booleans keep their meaning
    assert pair_length(pair, True, None) == 30 and pair_length(pair, False, None) == 16
    # truncated: both sequences counted (keep_end may leave the pair unshared)
    assert pair_length(pair, Layout.PROMPT_SHARED, 12) == 24


def test_cut_counts_the_prompt_once_when_shared():
    examples = [[_example(20, 3, 3), _example(20, 2, 4)]]
    packed, _ = cut_step(examples, 60, list, Layout.PACKED)
    shared, _ = cut_step(examples, 60, list, Layout.PROMPT_SHARED)
    assert [mb.tokens for mb in packed] == [46, 46]  # 2 x (20 + 3) each: two micro-batches
    assert [mb.tokens for mb in shared] == [54]  # (19 + 4 + 4) + (19 + 3 + 5): one
    assert tokens([Pair(0, 0, 27), Pair(0, 1, 27)], Layout.PROMPT_SHARED) == 54


# ---------------------------------------------------------------------------------------------------------------------
# Real trainers
# ---------------------------------------------------------------------------------------------------------------------


def _shared_row_tokens(inputs: dict) -> int:
    """Tokens of the one row prompt_sharing lays a collated micro-batch out as."""
    from trl_ext.plugins.prompt_sharing.layout import LAYOUT_KEY, SharedLayout

    shared = SharedLayout.from_batch(inputs[LAYOUT_KEY], inputs["input_ids"])
    assert shared is not None
    return int(shared.gather.numel())


@pytest.mark.slow
def test_auto_trains_equal_to_stock(dpo_args, tokenizer):
    """`"auto"` measures the budget at construction with training steps whose random state, metrics, token count and
    gradients are put back: the run equals stock, the budget is logged once and shown by `describe`."""
    with _records() as records:
        plugin = _train(dpo_args, tokenizer, {PLUGIN: "auto"})
    _assert_same_run(_train(dpo_args, tokenizer, None), plugin)
    trainer = plugin[0]
    result = trainer._trl_ext.state[STATE_KEY]
    assert isinstance(result, AutoBudget) and result.probes
    assert _state(trainer).budget == result.budget > 0
    chosen = [r for r in records if '"auto" chose' in r.getMessage()]
    assert len(chosen) == 1 and f"chose {result.budget} padded tokens" in chosen[0].getMessage()
    assert chosen[0].levelno > logging.INFO
    from trl_ext.plugins.token_budget.hooks import trl_ext_describe

    assert trl_ext_describe(trainer, trainer._trl_ext) == f"budget=auto:{result.budget} padded tokens"


@pytest.mark.slow
def test_auto_refuses_when_one_pair_does_not_fit(dpo_args, tokenizer):
    with pytest.raises(UsageError, match="heaviest pair"):
        _train(dpo_args, tokenizer, {PLUGIN: "auto", "plugins": {PLUGIN: {"ram_budget": 1}}})


#: Under prompt_sharing on this data, some pairs share a micro-batch that would exceed this budget if each pair's
#: prompt counted twice.
SHARED_BUDGET = 40


@pytest.mark.slow
def test_prompt_shared_micro_batches_hold_the_budget_and_equal_stock(dpo_args, tokenizer, monkeypatch):
    """Under prompt_sharing the budget counts each pair's prompt once: every micro-batch of several pairs lays out as
    a shared row of at most the budget's tokens (its count is exactly the row's), at least one holds pairs that
    counted twice would not fit, and the run still equals stock."""
    from trl_ext.plugins.token_budget import step

    cut = []  # (the step's examples, its micro-batches)

    def recording_cut_step(examples, *args, **kwargs):
        micro_batches, over = step_cut_step(examples, *args, **kwargs)
        cut.append((examples, micro_batches))
        return micro_batches, over

    step_cut_step = step.cut_step
    monkeypatch.setattr(step, "cut_step", recording_cut_step)
    plugin = _train(dpo_args, tokenizer, {PLUGIN: SHARED_BUDGET, "prompt_sharing": True})
    monkeypatch.undo()
    assert as_layout(_state(plugin[0]).packed) is Layout.PROMPT_SHARED
    assert cut
    counted_twice = []
    for examples, micro_batches in cut:
        for mb in micro_batches:
            assert mb.tokens == _shared_row_tokens(mb.inputs)
            assert len(mb.pairs) == 1 or mb.tokens <= SHARED_BUDGET
            if len(mb.pairs) > 1:
                counted_twice.append(sum(pair_length(examples[p.batch][p.row], True, None) for p in mb.pairs))
    assert max(counted_twice) > SHARED_BUDGET, "no micro-batch needs the prompt counted once: lower SHARED_BUDGET"
    _assert_same_run(_train(dpo_args, tokenizer, None), plugin)
