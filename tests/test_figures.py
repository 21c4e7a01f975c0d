"""Figures the README states that the code can produce are produced here and compared: the test counts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _collected(*args: str) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    match = re.search(r"(\d+)(?:/\d+)? tests? collected", out.stdout)
    assert match, out.stdout[-2000:] + out.stderr[-2000:]
    return int(match.group(1))


@pytest.mark.slow
def test_readme_test_counts():
    """The README's counts of the whole suite and of the fast loop are what pytest collects."""
    readme = (ROOT / "README.md").read_text()
    fast = re.search(r"nothing launched, nothing long: (\d+) tests", readme)
    whole = re.search(r"\(`python -m pytest -q`: (\d+) tests", readme)
    assert fast and whole, "the README's Tests section no longer states both counts"
    assert (int(whole.group(1)), int(fast.group(1))) == (_collected(), _collected("-m", "not slow"))


def test_readme_claims_name_tests_that_exist():
    """Each test the README's claims table names is a test function of that file."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### What the packing plugins promise", 1)[1].split("\n### ", 1)[0]
    named = 0
    for row in (line for line in section.splitlines() if line.startswith("| ") and "`tests/" in line):
        path = None
        for ref in re.findall(r"`([^`]+)`", row.split(" | ")[-1]):
            if ref.startswith("tests/"):
                path, _, name = ref.partition("::")
            else:
                name = ref.removeprefix("::")
            assert path is not None, row
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{path}::{name} (README claims table)"
            named += 1
    assert named >= 20


def fused_logprobs_table(report: dict) -> str:
    """The README's fused_logprobs table, from a recorded `benchmarks/fused_logprobs.py` run."""

    def speed(variant: dict) -> str:
        ratio = variant["speedup_vs_stock"]
        return f"{ratio['median']:.2f}x ({ratio['q1']:.2f}-{ratio['q3']:.2f})"

    rows = [
        "| vocab | completion width | step allocation vs stock | peak RSS vs stock | step time: stock / fused "
        "| stock / fused+prompt_sharing |",
        "|---|---|---|---|---|---|",
    ]
    for case in report["results"]:
        fused, both = case["variants"]["fused"], case["variants"]["fused+prompt_sharing"]
        rows.append(
            f"| {case['vocab']:,} | {case['completion_width']} | {fused['step_peak_ratio_vs_stock']:.2f}x "
            f"| {fused['peak_ratio_vs_stock']:.2f}x | {speed(fused)} | {speed(both)} |"
        )
    return "\n".join(rows)


def test_readme_quotes_the_recorded_fused_logprobs_run():
    """The README's fused_logprobs table is generated from the recorded benchmark run it names."""
    import json

    report = json.loads((ROOT / "benchmarks" / "results" / "fused_logprobs.json").read_text())
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- fused_logprobs table:", 1)[1].split("-->", 1)[1].split("<!-- end fused_logprobs", 1)[0]
    assert block.strip() == fused_logprobs_table(report)


def test_readme_lists_every_builtin_plugin():
    """The README's list of built-in plugins is what discovery finds."""
    from trl_ext.manager import builtin_plugin_modules

    readme = (ROOT / "README.md").read_text()
    sentence = readme.split("built-in plugins: ", 1)[1].split("(", 1)[0]
    assert set(re.findall(r"`(\w+)`", sentence)) == set(builtin_plugin_modules())
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    assert f"{words[len(builtin_plugin_modules())].capitalize()} built-in plugins" in readme
