"""The scale matrix: every plugin under DDP, ZeRO-2, ZeRO-3 and FSDP2 on 2 CPU ranks (gloo), against stock TRL.

One 2-process launch per engine runs every cell of that engine (tests/scale/scripts/scale_matrix.py); the launch is
shared by all the tests of that engine (a session-wide cache), so `pytest -k fsdp2` launches only the FSDP2 engine.
The table of cells, their expectations and the tolerance of each engine (with the reason) are in
tests/scale/matrix.py. Test ids are `<engine>-<cell>`.

Marked `scale` (with `distributed`, and `deepspeed` for ZeRO): `pytest -m "not scale"` skips the matrix.
`SCALE_MATRIX_CELLS=a,b` limits each launch to those cells (while working on a cell; the others' tests then fail).
"""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import helpers
from tests.scale.matrix import CELLS, ENGINES, FUSED_CHUNK, MODEL, REFUSE, TRL_DPO_FUSED_HEAD, WORLD, cell

SCRIPT = Path(__file__).parent / "scripts" / "scale_matrix.py"
_RUNS: dict[str, dict] = {}

#: Keys of `log_history` that are timings, not results.
_TIMING = re.compile(r"runtime|per_second")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(engine: str, out: Path) -> dict:
    env = helpers.launch_env(DS_BUILD_OPS="0")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD)]
    cmd = [*torchrun, "--master_port", str(_free_port()), str(SCRIPT), engine, str(out)]
    only = [name for name in os.environ.get("SCALE_MATRIX_CELLS", "").split(",") if name]
    cmd += [c.name for c in CELLS if c.runs_on(engine) and c.name in only]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    records = {}
    for c in CELLS:
        if c.runs_on(engine) and (out / f"{c.name}.rank0.pt").exists():
            records[c.name] = [torch.load(out / f"{c.name}.rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {
        "rc": proc.returncode,
        "output": proc.stdout[-3000:] + proc.stderr[-6000:],
        "cells": records,
        "seconds": seconds,
    }


@pytest.fixture(scope="session")
def engine_run(tmp_path_factory):
    def get(engine: str) -> dict:
        if engine not in _RUNS:
            _RUNS[engine] = _launch(engine, tmp_path_factory.mktemp(f"scale-{engine}"))
        return _RUNS[engine]

    return get


def _records(run: dict, name: str) -> list[dict]:
    assert name in run["cells"], f"cell {name} did not run (launch rc {run['rc']}):\n{run['output']}"
    records = run["cells"][name]
    for r in records:
        assert "error" not in r, f"{name} failed on rank {r['rank']}:\n{r['error']}"
    return records


def _initial_params() -> dict[str, torch.Tensor]:
    from trl_ext.testing import make_model

    return {n: p.detach().clone() for n, p in make_model(dtype=torch.float64, **MODEL).named_parameters()}


def _update_error(got: dict, want: dict, start: dict) -> float:
    """|| (got - start) - (want - start) || / || want - start ||: the relative error of the whole update."""
    diff = math.sqrt(sum(float((got[n] - want[n]).pow(2).sum()) for n in want))
    step = math.sqrt(sum(float((want[n] - start[n].to(want[n].dtype)).pow(2).sum()) for n in want))
    assert step > 0, "the stock run did not move the parameters: nothing is compared"
    return diff / step


_REWARDS = re.compile(r"^(eval_)?rewards/(chosen|rejected|margins)$")
BETA = 0.1  # DPOConfig's and OnlineDPOConfig's default, used by every cell


def _log_errors(got: list[dict], want: list[dict], skip: tuple[str, ...]) -> dict[str, float]:
    """Worst relative difference per logged key, over every logging step (absolute floor 1e-12).

    DPO rewards are `beta * (logps - ref_logps)`, differences of log-probs of ~100: their error is relative to
    `beta * (|logps/chosen| + |logps/rejected|)`, not to the (near-zero) reward itself. The precompute plugin stores
    reference log-probs as float32 (4e-7 relative of ~100 is ~4e-5 absolute, ~4e-6 on a reward of 0.01).
    """
    assert len(got) == len(want), (len(got), len(want))
    worst: dict[str, float] = {}
    for g, w in zip(got, want, strict=True):
        keys = {k for k in w if not _TIMING.search(k) and k not in skip}
        assert keys <= set(g), f"missing logged keys {sorted(keys - set(g))}"
        for key in keys:
            a, b = float(g[key]), float(w[key])
            scale = abs(b)
            match = _REWARDS.match(key)
            if match:
                prefix = match.group(1) or ""
                scale = max(
                    scale, BETA * sum(abs(float(w.get(f"{prefix}logps/{s}", 0.0))) for s in ("chosen", "rejected"))
                )
            err = abs(a - b) / max(scale, 1e-12) if abs(a - b) > 1e-12 else 0.0
            worst[key] = max(worst.get(key, 0.0), err)
    return worst


def _params(engine: str, c) -> list:
    marks = [pytest.mark.scale, pytest.mark.distributed]
    if ENGINES[engine].deepspeed:
        marks.append(pytest.mark.deepspeed)
    expect = c.expect[engine]
    if expect.xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=expect.xfail))
    return pytest.param(engine, c.name, marks=marks, id=f"{engine}-{c.name}")


MATRIX = [_params(e, c) for e in ENGINES for c in CELLS if c.runs_on(e) and c.baseline]
STOCK = [_params(e, c) for e in ENGINES for c in CELLS if c.runs_on(e) and not c.baseline]


def _assert_verified(record: dict) -> None:
    """`verify` (on by default) checked the first step of every cell whose plugins change the math against stock, on
    every rank, under the engine, within its tolerance; it checked nothing where no plugin changes the math."""
    if not record["math_plugins"]:
        assert record["verify"] == [], record["verify"]
        return
    assert record["verify"], f"verify did not check {record['math_plugins']} on rank {record['rank']}"
    assert {step for step, *_ in record["verify"]} == {1}, record["verify"]
    assert all(error <= tolerance for _, _, error, tolerance, _ in record["verify"]), record["verify"]


@pytest.mark.parametrize("engine,name", STOCK)
def test_stock_runs_under_engine(engine_run, engine, name):
    """The stock baseline really trained under the engine (no silent fallback to another engine)."""
    run = engine_run(engine)
    for record in _records(run, name):
        assert record["plugins"] == []
        assert record["ref_forwards"] > 0  # the reference is computed on the fly, the baseline of precompute cells
        assert record["world"] == WORLD
        _assert_engine(engine, record)


def _assert_engine(engine: str, record: dict) -> None:
    if engine == "ddp":
        assert record["distributed_type"] == "DistributedType.MULTI_CPU"
        assert record["param_dtype"] == "torch.float64"
    elif engine in ("zero2", "zero3"):
        assert record["distributed_type"] == "DistributedType.DEEPSPEED"
        assert record["zero_stage"] == int(engine[-1])
        assert record["param_dtype"] == "torch.float64"  # bf16/fp16 off: DeepSpeed trains the float64 model as is
    else:
        assert record["distributed_type"] == "DistributedType.FSDP"
        assert record["fsdp2_modules"], "the policy holds no FSDP2 module: the run was not sharded"
        assert record["param_dtype"] == "torch.float64"


def _assert_fused(c, record: dict) -> None:
    """fused_logprobs really scored in chunks inside the head module's call (Online DPO, DPO on TRL < 1.15),
    recomputing each chunk in backward with the head's weight whole (under ZeRO-3 gathered again for the
    recomputation, under FSDP2 unsharded by the root's pre-backward hook); DPO on TRL >= 1.15: left to TRL."""
    fused, head = record["fused_logprobs"], record["head"]
    if c.trainer == "dpo" and TRL_DPO_FUSED_HEAD:
        assert fused["describe"] == "left TRL's own fused LM head in place", fused
        assert fused["fused_calls"] == 0 and fused["chunks"] == {} and fused["self_checks"] == [], fused
        return
    assert fused["chunks"] == {"policy": FUSED_CHUNK, "ref": FUSED_CHUNK}, fused
    assert fused["self_checks"] == ["policy", "ref"], fused
    assert fused["fused_calls"] > 0, fused
    assert head["whole"] == head["calls"] and head["calls_backward_whole"] == head["calls_backward"], head
    # chunks inside the module's call (from the packed row with a packing plugin), recomputed in backward
    assert head["backward"] > 0 and head["calls_backward"] == 0, head
    assert head["chunks_whole"] == head["chunks"] and head["backward_whole"] == head["backward"], head


def _assert_token_budget(records: list[dict]) -> None:
    """token_budget ran every step in lockstep: the same number of micro-batches on every rank, though the ranks got
    different numbers of real ones in some step (so zero-weight repeats ran) and several in some step (so micro-batches
    ran without gradient synchronisation before the step's last); pairs moved between ranks to balance tokens."""
    budget = [r["token_budget"] for r in records]
    counts = [b["micro_batch_counts"] for b in budget]
    local = [b["local_micro_batch_counts"] for b in budget]
    assert counts[0] and all(c == counts[0] for c in counts), counts
    assert all(len(c) == len(counts[0]) for c in local), local
    assert [max(step) for step in zip(*local, strict=True)] == counts[0], (counts, local)
    assert any(len(set(step)) > 1 for step in zip(*local, strict=True)), f"the ranks never cut differently: {local}"
    assert max(counts[0]) > 1, counts
    assert sum(sum(b["moved_pairs"]) for b in budget) > 0, "no pair ran on another rank than stock's"
    assert all(b["rank_tokens"] == budget[0]["rank_tokens"] for b in budget) and budget[0]["rank_tokens"]


@pytest.mark.parametrize("engine,name", MATRIX)
def test_cell_matches_stock(engine_run, engine, name):
    """Each cell equals stock TRL under the same engine (logged values, parameter update), or refuses as declared."""
    c = cell(name)
    expect = c.expect[engine]
    run = engine_run(engine)
    records = _records(run, name)
    if expect.kind == REFUSE:
        for record in records:
            assert "refused" in record, f"{name} under {engine} must refuse with a UsageError, but it trained"
            assert re.search(expect.match, record["refused"], re.S), record["refused"]
        return
    for record in records:
        assert "refused" not in record, f"{name} under {engine} was refused: {record['refused']}"
        _assert_engine(engine, record)
        assert set(record["plugins"]) == {p if p != "ds3_gather_for_generation" else "generation" for p in c.flags}
        if "prompt_sharing" in c.flags:
            # the plugin really shared prompts, in every scoring forward, with its own attention
            shared = record["prompt_sharing"]
            assert shared["shared_calls"] > 0 and shared["shared_rows"] > 0, shared
            assert shared["unshared_calls"] == 0, shared
            assert set(shared["attn_implementations"].values()) == {"trl_ext_shared_sdpa"}, shared
        if "fused_logprobs" in c.flags:
            _assert_fused(c, record)
        if c.args.get("precompute_ref_log_probs"):
            # the plugin really precomputed: no reference forward while training
            assert record["precompute_runs"], record
            assert record["ref_forwards"] == 0, record["ref_forwards"]
        _assert_verified(record)
    if "token_budget" in c.flags:
        _assert_token_budget(records)
    stock = _records(run, c.baseline)
    tol = c.tolerance(engine)
    for got, want in zip(records, stock, strict=True):
        errors = _log_errors(got["logs"], want["logs"], c.by_design)
        bad = {k: e for k, e in errors.items() if e > tol}
        assert not bad, f"{engine}/{name}: logged values differ from stock beyond {tol:g}: {bad}"
    err = _update_error(records[0]["params"], stock[0]["params"], _initial_params())
    assert err <= tol, f"{engine}/{name}: parameter update differs from stock by {err:.2e} (tolerance {tol:g})"


@pytest.mark.scale
@pytest.mark.distributed
def test_fsdp2_generation_memory(engine_run):
    """Under FSDP2 generation holds one decoder layer at a time (plus accelerate's unsharded norm + lm_head tail), with
    and without the generation plugin's `ds3_gather_for_generation=False`; with `reshard_after_forward=False` it holds
    the whole model, which is why the plugin refuses `False` there (cell online-generation_false_no_reshard)."""
    from trl_ext.testing import make_model

    reference = make_model(**MODEL)
    layers = reference.model.layers
    layer = max(sum(p.numel() for p in m.parameters()) for m in layers)
    total = sum(p.numel() for p in reference.parameters())
    one_layer_bound = total - (len(layers) - 1) * layer  # everything but the layers, and one layer
    run = engine_run("fsdp2")
    for name in ("online-stock", "online-generation_false"):
        for record in _records(run, name):
            assert record["model_numel"] == total
            assert 0 < record["gen_peak_unsharded"] <= one_layer_bound < total, (name, record["gen_peak_unsharded"])
    for record in _records(run, "online-stock_no_reshard"):
        assert record["gen_peak_unsharded"] == total
