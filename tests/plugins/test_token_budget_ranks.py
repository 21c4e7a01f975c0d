"""token_budget on several processes: the pure parts (padding the ranks' micro-batch counts, the metrics of a step
rebuilt from every rank's per-pair values). The launched runs are the scale matrix's `dpo-token_budget` cells
(tests/scale/) and `test_ddp_accumulation_and_evaluation_equal_stock` below."""

from __future__ import annotations

import pytest
import torch

from trl_ext.plugins.token_budget.cut import MicroBatch, Pair
from trl_ext.plugins.token_budget.metrics import PAIR_METRICS, ROW_SUMS, stock_values
from trl_ext.plugins.token_budget.ranks import Padding, Ranks, pad_to


def _mb(tokens: int, weight: float = 0.5) -> MicroBatch:
    return MicroBatch([Pair(0, 0, tokens)], {"tokens": tokens}, weight, tokens)


def test_pad_to_repeats_the_smallest_with_zero_weight():
    real = [_mb(30), _mb(10), _mb(10, 0.25)]
    padded = pad_to(real, 5)
    assert padded[:3] == real and not any(isinstance(mb, Padding) for mb in real)
    extra = padded[3:]
    assert len(extra) == 2 and all(isinstance(mb, Padding) for mb in extra)
    # the first of the two smallest, with weight 0 (no gradient), its inputs the same object (collated once)
    assert all(mb.weight == 0.0 and mb.inputs is real[1].inputs and mb.tokens == 10 for mb in extra)
    assert pad_to(real, 3) == real
    with pytest.raises(ValueError):
        pad_to(real, 2)
    with pytest.raises(ValueError):
        pad_to([], 1)


def test_ranks_of_one_process_need_no_collective():
    ranks = Ranks(1, "cpu")
    assert ranks.max(3) == 3 and ranks.gather({"a": 1}) == [{"a": 1}]


def _values(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {name: torch.randn(n, generator=g, dtype=torch.float64) for name in PAIR_METRICS}
    for name in ROW_SUMS:
        if name.startswith(("tokens", "correct")):
            out[name] = torch.randint(1, 9, (n,), generator=g)
        else:
            out[name] = torch.randn(n, generator=g, dtype=torch.float64)
    out["correct_c"] = torch.minimum(out["correct_c"], out["tokens_c"])
    return out


def test_stock_values_across_ranks_are_those_of_the_gathered_stock_batches():
    # two ranks, a step of two stock micro-batches (2 and 1 pairs on each rank)
    a, b = _values(3, 0), _values(3, 1)
    got = stock_values([([2, 1], a), ([2, 1], b)])
    for i, rows in enumerate((slice(0, 2), slice(2, 3))):
        part = {name: torch.cat([a[name][rows], b[name][rows]]) for name in a}  # what TRL's gather joins
        for name in PAIR_METRICS:
            assert got[i][name] == pytest.approx(part[name].mean().item(), rel=1e-12)
        tokens_c, tokens_r = part["tokens_c"].sum().item(), part["tokens_r"].sum().item()
        entropy = (part["entropy_c"].sum() + part["entropy_r"].sum()).item() / (tokens_c + tokens_r)
        assert got[i]["entropy"] == pytest.approx(entropy, rel=1e-12)
        assert got[i]["logits/chosen"] == pytest.approx(part["logits_c"].sum().item() / tokens_c, rel=1e-12)
        assert got[i]["logits/rejected"] == pytest.approx(part["logits_r"].sum().item() / tokens_r, rel=1e-12)
        # TRL divides the integer tensors (a float32 result)
        assert got[i]["mean_token_accuracy"] == (part["correct_c"].sum() / part["tokens_c"].sum()).item()
    # one rank: the single-process rebuild
    assert stock_values([([2, 1], a)])[1]["rewards/chosen"] == pytest.approx(a["rewards/chosen"][2].item())


def test_stock_values_refuse_ranks_out_of_step():
    assert stock_values([([2], None), ([2], None)]) == []  # another plugin reduces the metrics on every rank
    with pytest.raises(RuntimeError, match="some ranks only"):
        stock_values([([2], _values(2, 0)), ([2], None)])
    with pytest.raises(RuntimeError, match="different numbers"):
        stock_values([([2], _values(2, 0)), ([1, 1], _values(2, 1))])
