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
