"""The bench's statistics (`trl-ext bench` and `benchmarks/` measure with these): interleaved rounds of a fixed count,
the median of per-round ratios with its spread, and the verdicts computed from them."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def progress(msg: str) -> None:
    """One progress line on stderr, prefixed with `[trl-ext bench]`."""
    print(f"[trl-ext bench] {msg}", file=sys.stderr, flush=True)


#: A comparison whose per-round ratios spread more than this (interquartile range / median) is flagged.
WIDE_SPREAD = 0.15
#: A speed ratio says "faster" / "slower" only when its whole interquartile range is this far from 1: a difference of a
#: few percent on a shared machine flips between runs (three `--quick` runs of token_budget read "no clear difference"
#: twice, then "1.18x faster" with an IQR reaching down to 1.03).
NO_CLEAR_DIFFERENCE = 0.05


def summarize(ratios: Sequence[float], bound: float | None = None) -> dict[str, Any]:
    """Median of per-round ratios, its spread (quartiles, min, max, IQR / median) and what is suspicious about it."""
    ordered = sorted(ratios)
    median = statistics.median(ordered)
    if len(ordered) >= 4:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1, q3 = ordered[0], ordered[-1]
    spread = (q3 - q1) / median if median else float("inf")
    flags = []
    if bound is not None and median > bound * 1.02:
        flags.append(f"ABOVE BOUND {bound:.2f}x: a measuring error")
    if q3 < 1 - NO_CLEAR_DIFFERENCE:  # as `direction`: slower only when the whole interquartile range is below
        flags.append("SLOWER than stock")
    if spread > WIDE_SPREAD:
        flags.append(f"WIDE SPREAD ({spread:.0%}): rerun on a quieter machine or with more --rounds")
    return {
        "median": median,
        "q1": q1,
        "q3": q3,
        "min": ordered[0],
        "max": ordered[-1],
        "spread": spread,
        "rounds": len(ordered),
        "ratios": list(ratios),
        "bound": bound,
        "flags": flags,
    }


def agreement(max_abs_diff: float, tolerance: float, what: str) -> dict[str, Any]:
    """The verdict on two results that should agree: the same `what` when the largest absolute difference is within
    `tolerance` (a NaN difference never is); otherwise a flag that names both numbers."""
    same = bool(max_abs_diff <= tolerance)
    text = f"same {what} (within {tolerance:.1e})"
    if not same:
        text = f"{what.upper()} DIFFER: max |diff| {max_abs_diff:.2e} > tolerance {tolerance:.1e}"
    flags = [] if same else [text]
    return {"same": same, "max_abs_diff": max_abs_diff, "tolerance": tolerance, "text": text, "flags": flags}


def direction(r: dict[str, Any]) -> str:
    """What a speed ratio `stock time / trl-ext time` says: "faster" or "slower" only when the whole interquartile
    range is more than `NO_CLEAR_DIFFERENCE` away from 1 on that side, else that the rounds do not tell them apart."""
    if r["q1"] > 1 + NO_CLEAR_DIFFERENCE:
        return "faster"
    if r["q3"] < 1 - NO_CLEAR_DIFFERENCE:
        return "slower"
    return f"(no clear difference: the IQR is not beyond 1 +/- {NO_CLEAR_DIFFERENCE:.0%})"


def ratio_text(r: dict[str, Any]) -> str:
    """`2.10x faster [IQR 2.08-2.10, 5 rounds]`: the median ratio, what it says, its spread."""
    return f"{r['median']:.2f}x {direction(r)} [IQR {r['q1']:.2f}-{r['q3']:.2f}, {r['rounds']} rounds]"


def interleave(
    arms: dict[str, Any],
    *,
    rounds: int,
    what: str,
    paired: Callable[[int], dict[str, float]] | None = None,
    warmup: int = 0,
    report: Callable[[str], None] | None = progress,
) -> dict[str, list[float]]:
    """Time every arm (`name -> fn(round_index) -> seconds`, the first the baseline) once per round for exactly
    `rounds` rounds, the order flipping every round (stock, trl-ext, trl-ext, stock, ...); the seconds per arm and
    timed round. The count is fixed in advance: stopping once the ratios agree would stop on a lucky streak and bias
    the spread low. `paired(round_index) -> {name: seconds}` replaces the arms' functions for a comparison that
    interleaves inside a round. The first `warmup` rounds are not kept (round indices count them). `report` gets one
    line with the count and the time taken (None: silent)."""
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for index in range(warmup + rounds):
        if paired is not None:
            measured = paired(index)
        else:
            measured = {name: arms[name](index) for name in (names if index % 2 == 0 else names[::-1])}
        if index >= warmup:
            for name, value in measured.items():
                times[name].append(value)
    if report is not None:
        report(f"{what}: {rounds} interleaved rounds in {time.perf_counter() - start:.0f} s")
    return times


def ratios(times: dict[str, list[float]], base: str, arm: str) -> list[float]:
    """Per-round ratios `base / arm` of two arms' `interleave` times (a speed-up when the times are seconds)."""
    return [a / b for a, b in zip(times[base], times[arm], strict=True)]


def padding_bounds(masks: Sequence[Any]) -> dict[str, float]:
    """The speed-up bound of dropping the padding of batches with these 2D attention masks: a step costs
    `a * tokens + b * sum(len^2)` (attention) with `a, b >= 0`, a padded row its padded length in both, so the speed-up
    is at most the larger of the token and attention ratios (`bound`). Also each ratio and the padding fraction."""
    real = sum(int(m.sum()) for m in masks)
    padded = sum(m.numel() for m in masks)
    attn_real = sum(int(row.sum()) ** 2 for m in masks for row in m)
    attn_padded = sum(m.shape[0] * m.shape[1] ** 2 for m in masks)
    return {
        "padding_fraction": 1 - real / padded,
        "token_bound": padded / real,
        "attention_bound": attn_padded / attn_real,
        "bound": max(padded / real, attn_padded / attn_real),
    }


def against(ratio: dict[str, Any], baseline: str) -> dict[str, Any]:
    """A `summarize` result measured against `baseline` rather than stock TRL: its flags name the baseline."""
    ratio["flags"] = [f.replace("than stock", f"than {baseline}") for f in ratio["flags"]]
    ratio["baseline"] = baseline
    return ratio
