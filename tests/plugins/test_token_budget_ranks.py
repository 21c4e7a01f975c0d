"""token_budget on several processes: the pure parts (padding the ranks' micro-batch counts, the metrics of a step
rebuilt from every rank's per-pair values). The launched runs are the scale matrix's `dpo-token_budget` cells
(tests/scale/) and `test_accumulation_and_evaluation_equal_stock` below."""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_ext._shared import Ranks
from trl_ext.plugins.token_budget.cut import MicroBatch, Padding, Pair, balanced_plan, global_pairs, pad_to, tokens
from trl_ext.plugins.token_budget.metrics import PAIR_METRICS, ROW_SUMS, stock_values, stock_values_of_pairs
from trl_ext.testing import make_model


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


def test_pad_to_a_given_micro_batch_when_the_rank_has_none():
    other = _mb(12)
    padded = pad_to([], 2, other)
    assert len(padded) == 2 and all(isinstance(mb, Padding) and mb.weight == 0.0 for mb in padded)
    assert all(mb.inputs is other.inputs for mb in padded)


def _example(prompt: int, chosen: int, rejected: int) -> dict:
    return {"prompt_ids": [5] * prompt, "chosen_ids": [6] * chosen, "rejected_ids": [7] * rejected}


def test_global_pairs_number_stock_batches_rank_major():
    # 2 ranks x 2 stock micro-batches (the second of 1 pair: an uneven last batch)
    step = [
        [[_example(2, 3, 1), _example(1, 1, 3)], [_example(3, 3, 2)]],
        [[_example(1, 1, 1), _example(4, 4, 4)], [_example(1, 9, 1)]],
    ]
    pairs, sizes = global_pairs(step, False, None)
    assert sizes == [2, 1, 2, 1]
    assert [(p.batch, p.row, p.length) for p in pairs] == [
        (0, 0, 5),
        (0, 1, 4),
        (1, 0, 6),
        (2, 0, 2),
        (2, 1, 8),
        (3, 0, 10),
    ]
    with pytest.raises(RuntimeError, match="different numbers of stock micro-batches"):
        global_pairs([step[0], step[1][:1]], False, None)


def test_balanced_plan_keeps_weights_apart_and_balances_tokens():
    lengths = [40, 10, 12, 30, 11, 9, 35, 8]  # 2 ranks x 2 stock micro-batches of 2 pairs
    pairs = [Pair(b, j, lengths[2 * b + j]) for b in range(4) for j in range(2)]
    sizes = [2, 2, 2, 2]
    runs, owner = balanced_plan(pairs, sizes, 100, False, 2)
    # every pair once, no run over the budget unless alone
    assert sorted((p.batch, p.row) for run in runs for p in run) == sorted((p.batch, p.row) for p in pairs)
    assert all(tokens(run, False) <= 100 or len(run) == 1 for run in runs)
    # cut longest first (padded: 2 x pairs x longest), so the short pairs share one micro-batch
    assert [sorted(p.length for p in run) for run in runs] == [[40], [35], [30], [9, 10, 11, 12], [8]]
    # the most tokens first, each to the rank with fewest: 96 -> 0, 80 -> 1, 70 -> 1, 60 -> 0, 16 -> 1
    assert owner == [1, 1, 0, 0, 1]
    load = [sum(tokens(run, False) for run, r in zip(runs, owner, strict=True) if r == rank) for rank in (0, 1)]
    assert load == [156, 166]
    assert balanced_plan(pairs, sizes, 100, False, 2) == (runs, owner)  # deterministic: every rank computes it
    # pairs of stock micro-batches of different sizes weigh differently: never in one run
    runs, _ = balanced_plan(pairs[:3], [2, 1], 1000, False, 2)
    assert all(len({[2, 1][p.batch] for p in run}) == 1 for run in runs)


def test_ranks_of_one_process_need_no_collective(monkeypatch):
    """token_budget's collectives are the shared `Ranks`'; with one process they call no `torch.distributed`."""

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective ran with one process")

    for name in ("all_reduce", "all_gather_object"):
        monkeypatch.setattr(torch.distributed, name, no_collective)
    ranks = Ranks(1, 0)
    assert ranks.max(3, "cpu") == 3 and ranks.all_gather({"a": 1}) == [{"a": 1}]


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


def test_stock_values_of_pairs_that_moved_between_ranks():
    # stock: rank 0 ran batches 0 (2 pairs) and 1 (1 pair), rank 1 batches 2 and 3; the plugin ran them elsewhere
    a, b = _values(3, 0), _values(3, 1)
    stock_order = [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (3, 0)]
    both = {name: torch.cat([a[name], b[name]]) for name in a}  # values in stock_order
    moved = [4, 0, 3, 5, 2, 1]  # the plugin's order of the same pairs: rank 0 ran 3 of them, rank 1 the others
    ids = [stock_order[k] for k in moved]
    values = {name: tensor[moved] for name, tensor in both.items()}
    got = stock_values_of_pairs(
        [(ids[:3], {n: v[:3] for n, v in values.items()}), (ids[3:], {n: v[3:] for n, v in values.items()})],
        [2, 1, 2, 1],
        2,
    )
    want = stock_values([([2, 1], a), ([2, 1], b)])
    assert len(got) == 2
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys() and all(g[k] == pytest.approx(w[k], rel=1e-12) for k in w)
    with pytest.raises(RuntimeError, match="recorded"):
        stock_values_of_pairs([(ids[:3], {n: v[:3] for n, v in values.items()})], [2, 1, 2, 1], 2)


def test_stock_values_refuse_ranks_out_of_step():
    assert stock_values([([2], None), ([2], None)]) == []  # another plugin reduces the metrics on every rank
    with pytest.raises(RuntimeError, match="some ranks only"):
        stock_values([([2], _values(2, 0)), ([2], None)])
    with pytest.raises(RuntimeError, match="different numbers"):
        stock_values([([2], _values(2, 0)), ([1, 1], _values(2, 1))])


# ---------------------------------------------------------------------------------------------------------------------
# 2 processes (DDP on CPU): accumulation and evaluation
# ---------------------------------------------------------------------------------------------------------------------

SCRIPT = Path(__file__).parent / "scripts" / "token_budget_ranks.py"
WORLD = 2
#: TRL 1.16 computes per-token log-probs in float32 (trl/kernels/chunked_logprob.py), here in batches of other shapes.
#: DeepSpeed reduces gradients in float32 (its default `communication_data_type` without fp16/bf16), once per
#: backward. Measured worst, DDP: trl 1.16, 3.0e-7 on a logged value (`loss`) and 2.7e-7 on the parameter update;
#: trl 1.12 (float64 log-probs), every logged value within the 1e-12 absolute floor and 5.0e-16 on the update.
#: ZeRO-2: trl 1.16, 2.2e-7 and 4.9e-7; trl 1.12, 1.3e-7 and 1.6e-7.
RTOL = 2e-6
_TIMING = re.compile(r"runtime|per_second")
#: `logits/*` are means over tokens of each position's mean logit (8e-3 in magnitude on average for this model), which
#: cancel to as little as 4e-5; TRL 1.16's fused head computes them in float32 (measured: 1.4e-9 absolute apart in
#: batches of other shapes), so their error is taken relative to the per-position magnitude.
LOGITS_SCALE = 5e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RUNS: dict[str, dict[str, list[dict]]] = {}


def _launch(engine: str, out: Path) -> dict[str, list[dict]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", TRL_EXPERIMENTAL_SILENCE="1")
    env["PYTHONWARNINGS"] = "ignore"
    for key in list(env):
        if key.startswith("TRL_EXT_") and key != "TRL_EXT_LOG_LEVEL":
            env.pop(key)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD)]
    cmd += ["--master_port", str(_free_port()), str(SCRIPT), str(out), engine]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, f"{SCRIPT.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {
        mode: [torch.load(out / f"{mode}.rank{r}.pt", weights_only=False) for r in range(WORLD)]
        for mode in ("stock", "plugin", "refused")
    }


@pytest.fixture
def runs(tmp_path_factory):
    """The launch of an engine, once per session."""

    def get(engine: str) -> dict[str, list[dict]]:
        if engine not in _RUNS:
            _RUNS[engine] = _launch(engine, tmp_path_factory.mktemp(f"token_budget_ranks_{engine}"))
        return _RUNS[engine]

    return get


def _relative(a: float, b: float, scale: float) -> float:
    return abs(a - b) / max(scale, 1e-12) if abs(a - b) > 1e-12 else 0.0


ENGINE_TYPES = {"ddp": "DistributedType.MULTI_CPU", "zero2": "DistributedType.DEEPSPEED"}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("engine", [pytest.param("ddp"), pytest.param("zero2", marks=pytest.mark.deepspeed)])
def test_accumulation_and_evaluation_equal_stock(runs, engine):
    """Under DDP and ZeRO-2 with gradient accumulation 2, an uneven last step and evaluation: every logged value
    (training and evaluation) and the parameter update equal stock's, with the ranks in lockstep although they run
    different numbers of real micro-batches."""
    stock, plugin = runs(engine)["stock"], runs(engine)["plugin"]
    assert {r["distributed_type"] for r in stock + plugin} == {ENGINE_TYPES[engine]}
    counts = [r["micro_batch_counts"] for r in plugin]
    local = [r["local_micro_batch_counts"] for r in plugin]
    assert counts[0] == counts[1] and [max(s) for s in zip(*local, strict=True)] == counts[0], (counts, local)
    assert any(len(set(s)) > 1 for s in zip(*local, strict=True)), local  # zero-weight repeats ran
    # 3 steps (the last of one Trainer micro-step), each with more micro-batches than Trainer micro-steps: some ran
    # unsynchronised inside the step's last micro-step
    assert len(counts[0]) == 3 and min(counts[0][:2]) > 2 and counts[0][2] > 1, counts
    evals = [r["eval_micro_batch_counts"] for r in plugin]
    assert evals[0] == evals[1] and max(evals[0]) > 1, evals  # evaluation batches were cut, in lockstep too
    worst: dict[str, float] = {}
    for got, want in zip(plugin, stock, strict=True):
        assert len(got["logs"]) == len(want["logs"])
        assert any(k.startswith("eval_") for entry in want["logs"] for k in entry)
        for g, w in zip(got["logs"], want["logs"], strict=True):
            keys = {k for k in w if not _TIMING.search(k)}
            assert keys == {k for k in g if not _TIMING.search(k)}
            for key in keys:
                prefix = "eval_" if key.startswith("eval_") else ""
                scale = abs(float(w[key]))
                if "rewards/" in key and "accuracies" not in key:  # beta x differences of log-prob sums of ~100
                    scale = max(scale, 0.1 * sum(abs(float(w[f"{prefix}logps/{s}"])) for s in ("chosen", "rejected")))
                if "logits/" in key:  # see LOGITS_SCALE
                    scale = max(scale, LOGITS_SCALE)
                worst[key] = max(worst.get(key, 0.0), _relative(float(g[key]), float(w[key]), scale))
    bad = {k: e for k, e in worst.items() if e > RTOL}
    assert not bad, bad
    print(f"worst relative difference from stock: {max(worst.values()):.2e} ({max(worst, key=worst.get)})")
    start = {n: p.detach() for n, p in make_model(dtype=torch.float64, num_layers=2, seed=0).named_parameters()}
    got, want = plugin[0]["params"], stock[0]["params"]
    diff = math.sqrt(sum(float((got[n] - want[n]).pow(2).sum()) for n in want))
    step = math.sqrt(sum(float((want[n] - start[n]).pow(2).sum()) for n in want))
    assert step > 0 and diff / step <= RTOL, diff / step
    print(f"parameter update relative difference from stock: {diff / step:.2e}")


@pytest.mark.slow
@pytest.mark.distributed
def test_sync_metrics_is_refused_on_several_processes(runs):
    for record in runs("ddp")["refused"]:
        assert re.search(r"token_budget.*sync_metrics.*several processes", record["refused"]), record


def test_train_summary_reports_the_rank_balance():
    """The line logged when `train()` returns: counts from the given step on, and most / mean tokens per rank."""
    from types import SimpleNamespace

    from trl_ext.plugins.token_budget.calls import summary
    from trl_ext.plugins.token_budget.cut import Layout

    state = SimpleNamespace(
        micro_batch_counts=[9, 3, 2],
        stock_micro_batch_counts=[4, 4, 4],
        max_tokens=[500, 120, 90],
        over_budget=[1, 0, 0],
        rank_tokens=[(600, 500.0), (300, 200.0), (100, 100.0)],
        stock_largest=[(8, 40), (8, 30), (6, 20)],
        budget=128,
        packed=Layout.PACKED,
        ranks=SimpleNamespace(world=2),
    )
    assert summary(state, 3) is None
    assert summary(state, 1) == (
        "token_budget: 2 optimizer step(s) ran 5 micro-batches (stock: 8) within the budget of 128 packed tokens, the "
        "largest micro-batch 120 tokens; stock TRL's largest micro-batch from the same batches on this rank: 240 "
        "padded tokens (8 rows x 30); tokens per rank, most / mean: median 1.25, worst 1.50 over 2 ranks"
    )
    assert "; a pair of 500 tokens is over the budget of 128 and ran alone;" in summary(state, 0)
    state.stock_largest[2] = None  # a batch without a 2D `input_ids`: nothing is said about stock but that
    unmeasured = "stock TRL's micro-batches on this rank not measured (a batch of the collator has no 2D `input_ids`)"
    assert f"; {unmeasured};" in summary(state, 1)
