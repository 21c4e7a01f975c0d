"""Figures the README and docs/ state that the code or a recorded result can produce are produced here and compared:
the test counts, the generated parts (`python -m trl_ext.app.docs`: plugin and settings tables from the declarations,
benchmark tables from `benchmarks/results/*.json`), and the tests that the claims tables name."""

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


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _named_tests(row: str) -> list[tuple[str, str | None]]:
    """`(path, test or None)` for each test a table row names: `tests/a/test_x.py::name`, a following `::name` (same
    file), or a bare `test_y.py` / `test_y.py::name` (the directory of the last full path in the row)."""
    out: list[tuple[str, str | None]] = []
    path = None
    for ref in re.findall(r"`([^`]+)`", row):
        file, _, name = ref.partition("::")
        if file.startswith("tests/"):
            path = file
        elif re.fullmatch(r"test_\w+\.py", file) and path is not None:
            path = str(Path(path).parent / file)
        elif not file and name and path is not None:
            pass
        else:
            continue
        out.append((path, name or None))
    return out


def test_claims_name_tests_that_exist():
    """Each test file and test function that a table of the README or docs/ names exists."""
    named = 0
    for doc in DOCS:
        for row in (line for line in doc.read_text().splitlines() if line.startswith("| ") and "`tests/" in line):
            for path, name in _named_tests(row):
                file = ROOT / path
                assert file.exists() or path.endswith("/") and file.is_dir(), f"{doc.name}: {path} does not exist"
                if name is not None:
                    name = name.split("[", 1)[0]  # a parametrized test: its function
                    defined = re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M)
                    assert defined, f"{doc.name}: {path}::{name}"
                named += 1
    assert named >= 40


def test_scale_table_names_the_matrix_cells():
    """Each cell docs/scale.md's matrix table names is a cell of the scale matrix, and every cell is in the table."""
    from tests.scale.matrix import CELLS

    page = (ROOT / "docs" / "scale.md").read_text()
    table = page.split("## The scale matrix", 1)[1].split("\n\n| plugin / cell |", 1)[1].split("\n\n", 1)[0]
    named = {ref for row in table.splitlines()[2:] for ref in re.findall(r"`([\w-]+)`", row.split(" | ")[-1])}
    cells = {cell.name for cell in CELLS if not cell.name.endswith("-stock") and "stock_" not in cell.name}
    assert named - cells == set(), f"docs/scale.md names cells the matrix does not have: {sorted(named - cells)}"
    assert cells - named == set(), f"docs/scale.md's table leaves out the cells {sorted(cells - named)}"


def test_generated_parts_are_up_to_date():
    """The generated parts of the README and docs/ are what `python -m trl_ext.app.docs` writes now."""
    from trl_ext.app import docs

    parts = docs.generated_parts()
    keys = {part.key for part in parts}
    from trl_ext.manager import builtin_plugin_modules

    wanted = {"plugins", "flags", "hooks", "bench", "fused_logprobs", "fused_dpo_packing"}
    wanted |= {f"settings {name}" for name in builtin_plugin_modules()}
    assert wanted <= keys, f"missing generated parts: {sorted(wanted - keys)}"
    assert docs.stale() == [], "out of date; run `python -m trl_ext.app.docs`"


def test_the_generator_rewrites_a_stale_part_and_check_reports_it(tmp_path, capsys):
    """`--check` names a part whose text differs from its source and exits 1; without it the part is rewritten."""
    from trl_ext.app import docs

    (tmp_path / "docs").mkdir()
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "fused_logprobs.json").write_text((ROOT / "benchmarks" / "results" / "fused_logprobs.json").read_text())
    page = tmp_path / "docs" / "page.md"
    page.write_text("x\n<!-- generated: fused_logprobs -->\nold\n<!-- end generated: fused_logprobs -->\ny\n")
    (tmp_path / "README.md").write_text("no generated part\n")
    assert docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert "out of date: docs/page.md: fused_logprobs" in capsys.readouterr().out
    assert docs.main(["--root", str(tmp_path)]) == 0
    text = page.read_text()
    assert text.startswith("x\n<!-- generated: fused_logprobs -->\n| vocab |") and text.endswith("-->\ny\n")
    assert "| 150,000 | 1024 | 0.03x | 0.18x |" in text  # a row of the recorded run
    assert docs.main(["--check", "--root", str(tmp_path)]) == 0
    page.write_text("<!-- generated: nonsense -->\n<!-- end generated: nonsense -->\n")
    with pytest.raises(KeyError, match="unknown generated part `nonsense`"):
        docs.stale(tmp_path)
