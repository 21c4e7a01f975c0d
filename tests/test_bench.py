"""`trl-ext bench`: the `--quick` run as a user runs it (every section, its numbers and its verdicts), the verdict and
table functions on crafted numbers, and the README's bench figures against the recorded run they quote."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from trl_ext.app import bench
from trl_ext.app.bench import housekeeping, plugin_sections, sections, stats
from trl_ext.app.bench import report as output

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "benchmarks" / "results" / "bench_quick.json"


@pytest.mark.slow
def test_bench_quick_writes_report_and_plot(tmp_path):
    exe = Path(sys.executable).with_name("trl-ext")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", TQDM_DISABLE="1")
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir()
    env["TMPDIR"] = str(tmp)  # what the run leaves in the temporary folder (torchrun's, torch's, datasets') shows here
    proc = subprocess.run(
        [str(exe), "bench", "--quick", "--rounds", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["quick"] is True and report["trl"] and report["model"].startswith("llama")
    assert report["rounds"] == 3 and report["load_average"]["cores"] == os.cpu_count()
    assert report["wall_seconds"] > 0
    measured = report["sections"]
    assert sorted(measured) == sorted(sections.SECTIONS) and len(sections.SECTIONS) == 6
    assert not [name for name, s in measured.items() if "error" in s or "skipped" in s], measured

    pf = measured["padding_free"]
    assert 0.2 < pf["padding_fraction"] < 0.9
    assert pf["bound"] == max(pf["token_bound"], pf["attention_bound"]) >= 1 / (1 - pf["padding_fraction"]) - 1e-9
    _check_ratio(pf["speedup"], bound=pf["bound"], rounds=3)
    assert len(pf["stock"]["pass_seconds"]) == len(pf["trl_ext"]["pass_seconds"]) == 3
    assert len(pf["stock"]["loss"]) == len(pf["trl_ext"]["loss"]) == pf["batches"] > 0
    assert len(set(pf["stock"]["loss"])) > 1  # the losses depend on the batch (policy != reference)
    diff = max(abs(a - b) for a, b in zip(pf["stock"]["loss"], pf["trl_ext"]["loss"], strict=True))
    assert pf["losses"] == stats.agreement(diff, sections.LOSS_ATOL, "losses") and pf["losses"]["same"]

    pc = measured["precompute"]
    assert pc["pairs"] == 96 and pc["batch_size"] == 16
    for key in ("speedup", "speedup_auto"):
        _check_ratio(pc[key], bound=None, rounds=3)
    assert len(pc["stock"]["seconds"]) == len(pc["trl_ext"]["seconds"]) == len(pc["trl_ext_auto"]["seconds"]) == 3
    stock_and_ext = zip(pc["stock"]["seconds"], pc["trl_ext"]["seconds"], strict=True)
    assert pc["speedup"]["ratios"] == [a / b for a, b in stock_and_ext]
    assert pc["max_abs_ref_logp"] > 1  # real log-probs of whole sequences
    assert pc["values"] == stats.agreement(
        pc["max_abs_ref_logp_diff"], sections.REF_LOGP_RTOL * pc["max_abs_ref_logp"], "values"
    )
    assert pc["values"]["same"]
    assert report["headline"]["precompute_speedup"] == pc["speedup"]["median"]
    assert pc["clock"] == "cpu" and not list(out.glob("trl-ext-bench-precompute-*"))  # caches removed

    co = measured["sync_metrics"]
    assert co["stock"]["world_size"] == 2 and co["rounds"] == 3
    assert co["stock"]["collectives_per_step"] > 5  # TRL gathers each metric every micro-step
    # exactly one per logging step, plus one for the Trainer's final summary log
    assert co["trl_ext"]["collectives_total"] == co["trl_ext"]["logging_steps"] + 1
    assert co["collectives"] == sections.collectives_verdict(co) and co["collectives"]["same"]
    _check_ratio(co["step_time_ratio"], bound=None, rounds=3)
    assert report["headline"]["sync_metrics_collectives_per_step"] == co["trl_ext"]["collectives_per_step"]

    ge = measured["generation"]
    modes = {m["mode"]: m for m in ge["modes"]}
    assert all(m["same_tokens"] for m in modes.values()) and ge["tokens"]["same"]  # greedy tokens identical
    assert max(modes["ext False"]["peak_bytes_per_rank"]) < 0.5 * max(modes["trl gather"]["peak_bytes_per_rank"])
    assert ge["repeats"] == 1

    tb = measured["token_budget"]
    _check_ratio(tb["speedup"], bound=None, rounds=3)
    assert tb["speedup"]["ratios"] == stats.ratios(
        {"a": tb["padding_free"]["train_seconds"], "b": tb["trl_ext"]["train_seconds"]}, "a", "b"
    )
    counts = tb["micro_batches_per_step"]
    assert counts["padding_free"] == tb["pairs_per_step"] // tb["pair_batch"]
    assert len(counts["token_budget"]) == tb["steps"] and all(
        c < counts["padding_free"] for c in counts["token_budget"]
    )
    assert tb["bound"] == plugin_sections.bound_verdict(tb["largest_micro_batch_tokens"], tb["token_bound"])
    assert tb["bound"]["same"] and tb["largest_micro_batch_tokens"] > 0
    assert {"loss", "logps/chosen", "rewards/margins"} <= set(tb["metric_keys"])
    assert tb["metrics"]["same"] and tb["gradient"]["same"] and tb["max_abs_grad"] > 0
    assert tb["gradient"]["tolerance"] == plugin_sections.BUDGET_RTOL * tb["max_abs_grad"]
    assert len(tb["padding_free"]["peak_mb"]) == 3
    if statistics.median(tb["padding_free"]["peak_mb"]) == 0:  # no growth to divide by: said and flagged
        assert tb["memory"]["ratio"] is None and "NOT COMPARED" in tb["memory"]["flags"][0]
    else:
        assert tb["memory"]["ratio"] is not None
    assert report["headline"]["token_budget_speedup_vs_padding_free"] == tb["speedup"]["median"]

    fl = measured["fused_logprobs"]
    _check_ratio(fl["speedup"], bound=None, rounds=3)
    assert fl["stock"]["logged"]["logps/chosen"] < -10  # real summed log-probs of whole completions
    assert {"loss", "logps/chosen", "logps/rejected", "objective/kl"} <= set(fl["metric_keys"])
    logps = [k for k in fl["metric_keys"] if k.startswith("logps/")]
    diff = plugin_sections.relative_diff(
        {k: fl["stock"]["logged"][k] for k in logps}, {k: fl["trl_ext"]["logged"][k] for k in logps}
    )
    assert fl["logps"] == stats.agreement(diff, plugin_sections.FUSED_RTOL, "log-probs") and fl["logps"]["same"]
    assert fl["metrics"]["same"] and fl["gradient"]["same"] and fl["max_abs_grad"] > 0
    # the step without full-vocabulary logits allocates less (vocab 32000 dominates this small model)
    assert fl["memory"]["ratio"] is not None and fl["memory"]["ratio"] < 1
    assert report["headline"]["fused_logprobs_speedup"] == fl["speedup"]["median"]

    # The printed table: flags on their own lines, never inside a row's text; "(one run)" only for one run.
    lines = proc.stdout.splitlines()
    assert "trl-ext bench" in proc.stdout and "median of per-round" in proc.stdout and "load average" in proc.stdout
    assert all(line.lstrip().startswith("!! ") for line in lines if "!!" in line)
    assert sum("(one run)" in line for line in lines) == len(ge["modes"])
    assert (out / "table.md").read_text() == output.markdown_table(report) + "\n"
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(out / "bench.png")
    assert image.shape[0] > 200 and image.shape[1] > 600
    _check_tidy_and_short(proc, out, tmp, kept=None)


def _check_ratio(r, bound, rounds):
    """A ratio is the median of a fixed number of per-round ratios with its spread, flagged when it looks wrong."""
    assert r["rounds"] == rounds and len(r["ratios"]) == rounds
    assert r["min"] <= r["q1"] <= r["median"] <= r["q3"] <= r["max"]
    assert ("ABOVE BOUND" in " ".join(r["flags"])) == (bound is not None and r["median"] > 1.02 * bound)
    assert ("WIDE SPREAD" in " ".join(r["flags"])) == (r["spread"] > stats.WIDE_SPREAD)


# -------------------------------------------------------------------------------------------------------------------
# verdicts and the table, on crafted numbers
# -------------------------------------------------------------------------------------------------------------------


def test_summarize_flags_ratios_above_bound_below_one_and_wide():
    ok = stats.summarize([2.0, 2.1, 1.9, 2.0], bound=3.0)
    assert ok["median"] == 2.0 and ok["flags"] == [] and ok["q1"] <= 2.0 <= ok["q3"]
    assert any("ABOVE BOUND" in f for f in stats.summarize([4.1, 4.2, 4.0], bound=2.2)["flags"])
    assert any("SLOWER" in f for f in stats.summarize([0.8, 0.9, 0.85])["flags"])
    assert any("WIDE SPREAD" in f for f in stats.summarize([1.0, 2.0, 3.0])["flags"])


def test_a_ratio_is_flagged_slower_only_when_its_text_says_slower():
    """A median below 1 whose IQR spans 1 reads "no clear difference", and is not also flagged "SLOWER" (the
    token_budget row said both)."""
    for values in ([0.9, 0.95, 1.05, 1.1, 0.97], [0.99, 1.01], [0.7, 1.2, 0.95], [0.8, 0.85, 0.9], [1.2, 1.3, 1.25]):
        r = stats.against(stats.summarize(values), "padding_free")
        slower_flag = any("SLOWER than padding_free" in f for f in r["flags"])
        assert slower_flag == (stats.direction(r) == "slower"), (values, r["flags"], stats.direction(r))
        text = output.text_table({"sections": {}, "load_average": {}}) + stats.ratio_text(r)
        assert not ("no clear difference" in text and slower_flag)
    assert stats.direction(stats.summarize([0.9, 0.95, 1.05, 1.1, 0.97])).startswith("(no clear difference")


def test_agreement_flips_when_the_numbers_differ():
    same = stats.agreement(4e-7, 1e-4, "losses")
    assert same["same"] and same["flags"] == [] and same["text"] == "same losses (within 1.0e-04)"
    differ = stats.agreement(3.2e-2, 1e-4, "losses")
    assert not differ["same"] and differ["flags"] == [differ["text"]]
    assert "LOSSES DIFFER" in differ["text"] and "3.20e-02" in differ["text"]
    assert not stats.agreement(math.nan, 1e-4, "values")["same"]  # a NaN never agrees
    assert stats.agreement(1e-4, 1e-4, "values")["same"]  # the tolerance itself is within


def test_direction_says_faster_or_slower_only_when_the_spread_does():
    def ratio(q1, median, q3):
        return {"q1": q1, "median": median, "q3": q3}

    assert stats.direction(ratio(1.5, 1.7, 1.9)) == "faster"
    assert stats.direction(ratio(0.5, 0.6, 0.9)) == "slower"
    assert stats.direction(ratio(0.9, 1.1, 1.3)).startswith("(no clear difference")
    # within 5 % of 1 the rounds do not say which is faster: the verdict that flipped between three runs
    assert stats.direction(ratio(1.03, 1.18, 1.3)).startswith("(no clear difference")
    assert stats.direction(ratio(0.9, 0.93, 0.96)).startswith("(no clear difference")


def test_one_run_says_no_direction_within_five_percent():
    """A single measurement (the ZeRO-3 generation rows) has no spread: 0.98x is not "faster"."""
    assert output._times_text(0.98, "TRL gather") == "0.98x TRL gather's (no clear difference)"
    assert output._times_text(1.03, "TRL gather") == "1.03x TRL gather's (no clear difference)"
    assert output._times_text(1.16, "TRL gather") == "1.16x TRL gather's (slower)"
    assert output._times_text(0.5, "TRL gather") == "0.50x TRL gather's (faster)"


def test_collectives_verdict_compares_the_count_with_one_per_logging_step():
    results = {
        "stock": {"collectives_total": 65},
        "trl_ext": {"collectives_total": 3, "logging_steps": 2, "optimizer_steps": 4},
    }
    assert sections.collectives_verdict(results)["same"] and sections.collectives_verdict(results)["flags"] == []
    results["trl_ext"]["collectives_total"] = 5
    verdict = sections.collectives_verdict(results)
    assert not verdict["same"] and "EXPECTED 3" in verdict["flags"][0] and "COUNTED 5" in verdict["flags"][0]


def test_plugin_section_verdicts_on_crafted_numbers():
    same = plugin_sections.memory_verdict(1.05, "padding_free")
    assert same["flags"] == [] and "the same memory" in same["text"] and "1.05x" in same["text"]
    assert "(less)" in plugin_sections.memory_verdict(0.5, "stock")["text"]
    more = plugin_sections.memory_verdict(1.3, "stock")
    assert more["flags"] == [more["text"]] and "MORE MEMORY" in more["text"]
    assert plugin_sections.memory_verdict(None, "stock")["flags"] == []  # not measured: said, not flagged
    assert plugin_sections.bound_verdict(600, 619)["same"]
    over = plugin_sections.bound_verdict(700, 619)
    assert not over["same"] and "OVER THE BOUND" in over["flags"][0]
    # relative per key, absolute for values near 0; NaN never agrees
    assert plugin_sections.relative_diff({"a": -1000.0, "b": 0.01}, {"a": -1000.1, "b": 0.01}) == pytest.approx(
        0.1 / 1000.1
    )
    assert plugin_sections.relative_diff({"b": 0.0}, {"b": 3e-6}) == pytest.approx(3e-6)
    assert math.isnan(plugin_sections.relative_diff({"a": 1.0}, {"a": math.nan}))
    assert plugin_sections.relative_diff({"a": 1.0}, {"c": 5.0}) == 0.0  # only shared keys
    slower = stats.against(stats.summarize([0.8, 0.85, 0.9]), "padding_free")
    assert any("SLOWER than padding_free" in f for f in slower["flags"]) and slower["baseline"] == "padding_free"


def test_table_reports_the_plugin_sections_and_flags_them():
    report = _recorded()
    tb, fl = report["sections"]["token_budget"], report["sections"]["fused_logprobs"]
    tb["gradient"] = stats.agreement(1.0, 1e-6, "gradient")
    fl["memory"] = plugin_sections.memory_verdict(1.5, "stock")
    table = output.text_table(report)
    flagged = [line.strip() for line in table.splitlines() if "!!" in line]
    assert "!! GRADIENT DIFFER: max |diff| 1.00e+00 > tolerance 1.0e-06" in flagged
    assert any("MORE MEMORY" in line for line in flagged)
    assert f"token_budget={tb['token_bound']}" in table and "vs padding_free" in table
    assert f"vocab {fl['vocab']}" in table


def _recorded():
    return json.loads(RECORDED.read_text())


def test_table_puts_flags_on_their_own_lines_and_reports_what_it_measured():
    report = _recorded()
    pf = report["sections"]["padding_free"]
    pf["losses"] = stats.agreement(0.5, sections.LOSS_ATOL, "losses")
    pf["speedup"] = stats.summarize([3.5, 3.6, 5.0, 6.0, 8.0], bound=pf["bound"])  # wide and above the bound
    report["sections"]["generation"]["repeats"] = 2
    table = output.text_table(report)
    rows = table.splitlines()
    flagged = [line for line in rows if "!!" in line]
    assert flagged and all(line.lstrip().startswith("!! ") for line in flagged)
    assert any("LOSSES DIFFER" in line for line in flagged) and not any("same losses" in line for line in rows)
    assert any("WIDE SPREAD" in line for line in flagged) and any("ABOVE BOUND" in line for line in flagged)
    assert "(one run)" not in table and "(best of 2 runs)" in table
    assert "time" in table and all(
        ("(slower)" in line) or ("(faster)" in line) or ("(no clear difference)" in line)
        for line in rows
        if "TRL gather's" in line and "time" in line
    )
    markdown = output.markdown_table(report)
    assert "**!! LOSSES DIFFER" in markdown and all(line.endswith("|") for line in markdown.splitlines()[2:])


def test_interleave_runs_a_fixed_number_of_alternating_rounds():
    calls = []

    def arm(name, seconds):
        def run(index):
            calls.append((index, name))
            return seconds

        return run

    times = stats.interleave({"stock": arm("stock", 2.0), "ext": arm("ext", 1.0)}, rounds=3, what="t")
    assert times == {"stock": [2.0] * 3, "ext": [1.0] * 3}
    assert calls == [(0, "stock"), (0, "ext"), (1, "ext"), (1, "stock"), (2, "stock"), (2, "ext")]
    noisy = iter([1.0, 3.0, 1.0, 1.5, 1.0, 2.0, 1.0])
    times = stats.interleave({"stock": lambda i: next(noisy), "ext": lambda i: 1.0}, rounds=4, what="t")
    assert len(times["stock"]) == 4  # the count does not depend on the spread


def test_interleave_drops_warmup_rounds_and_ratios_pair_the_rounds():
    seen = []

    def arm(scale):
        def run(index):
            seen.append(index)
            return scale * (index + 1)

        return run

    times = stats.interleave({"stock": arm(2.0), "ext": arm(1.0)}, rounds=2, what="t", warmup=1, report=None)
    assert sorted(set(seen)) == [0, 1, 2]  # the warm-up round ran (index 0), then the timed rounds 1 and 2
    assert times == {"stock": [4.0, 6.0], "ext": [2.0, 3.0]}
    assert stats.ratios(times, "stock", "ext") == [2.0, 2.0]
    paired = stats.interleave(
        {"a": None, "b": None}, rounds=3, what="t", paired=lambda i: {"a": 1.0 + i, "b": 1.0}, warmup=2, report=None
    )
    assert paired == {"a": [3.0, 4.0, 5.0], "b": [1.0, 1.0, 1.0]}
    assert stats.ratio_text(stats.summarize([2.0, 2.0])).startswith("2.00x faster [IQR 2.00-2.00, 2 rounds]")


# -------------------------------------------------------------------------------------------------------------------
# the README's bench figures come from the recorded run
# -------------------------------------------------------------------------------------------------------------------


def test_readme_quotes_the_recorded_bench_run():
    """docs/benchmarks.md's bench table is `markdown_table` of the recorded `trl-ext bench --quick` report, and the
    duration that `--help`, the README and docs/benchmarks.md state is that run's wall time."""
    report = _recorded()
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert report["quick"] is True and report["rounds"] == 5  # `trl-ext bench --quick`, the default rounds
    assert output.markdown_table(report) in page
    # `about 2.5 min`: the wall time rounded to the half minute
    assert bench.QUICK_DURATION == f"about {max(0.5, round(report['wall_seconds'] / 30) / 2):g} min"
    for text in ((REPO / "README.md").read_text(), page):
        quoted = re.findall(r"about [0-9.]+ min[^\n]*--quick|--quick[^\n]*about [0-9.]+ min", text)
        assert quoted and all(bench.QUICK_DURATION in q for q in quoted), quoted


def test_bench_help_states_the_measured_duration(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"({bench.QUICK_DURATION} on 2 shared CPU cores)" in help_text
    assert "--seconds" not in help_text  # fixed rounds: no time cap that stops on the spread


# -------------------------------------------------------------------------------------------------------------------
# a user's install: no matplotlib, no DeepSpeed; outputs written as each section finishes (issue 35, items 1 and 5)
# -------------------------------------------------------------------------------------------------------------------


class _CheapSetup:
    """What `bench.main` reads of a `sections.Setup`, without building a model."""

    def __init__(self, args):
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.model_desc = "llama (stand-in)"


def _written(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_bench_without_matplotlib_or_deepspeed_writes_report_and_table_as_sections_finish(
    tmp_path, monkeypatch, capsys
):
    recorded = _recorded()["sections"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: `import matplotlib` fails
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setattr(sections, "Setup", _CheapSetup)
    monkeypatch.setattr(sections, "padding_free", lambda setup, rounds: recorded["padding_free"])

    def precompute(setup, rounds):  # runs second: the first section is already on disk
        written = _written(setup.out)
        assert "padding_free" in written["sections"] and written["complete"] is False
        assert "DPO step fwd+bwd" in (setup.out / "table.md").read_text()
        return recorded["precompute"]

    monkeypatch.setattr(sections, "precompute", precompute)
    argv = ["--quick", "--out", str(tmp_path), "--only", "padding_free", "--only", "precompute"]
    assert bench.main([*argv, "--only", "generation"]) == 0
    captured = capsys.readouterr()
    missing = 'bench.png not drawn: matplotlib is not installed (pip install "trl-ext[bench]"'
    assert missing in captured.out and missing in captured.err  # said at the start and in the closing line
    assert not (tmp_path / "bench.png").exists()
    report = _written(tmp_path)
    assert report["complete"] is True and list(report["sections"]) == ["padding_free", "precompute", "generation"]
    assert "DeepSpeed" in report["sections"]["generation"]["skipped"]
    table = (tmp_path / "table.md").read_text()
    assert table == output.markdown_table(report) + "\n"
    row = next(line for line in table.splitlines() if line.startswith("| generation: skipped |"))
    assert 'needs DeepSpeed, which is not installed (pip install "trl-ext[deepspeed]"' in row
    assert "generation: skipped" in captured.out  # the printed table says so too


def test_bench_interrupted_keeps_the_sections_that_finished(tmp_path, monkeypatch):
    recorded = _recorded()["sections"]
    monkeypatch.setattr(sections, "Setup", _CheapSetup)
    monkeypatch.setattr(sections, "padding_free", lambda setup, rounds: recorded["padding_free"])

    def interrupted(setup, rounds):
        raise KeyboardInterrupt

    monkeypatch.setattr(sections, "precompute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--quick", "--out", str(tmp_path), "--only", "padding_free", "--only", "precompute"])
    report = _written(tmp_path)
    assert report["complete"] is False and list(report["sections"]) == ["padding_free"]
    table = (tmp_path / "table.md").read_text()
    assert "INCOMPLETE: the sections finished so far" in table and "DPO step fwd+bwd" in table


@pytest.mark.slow  # renders the whole figure (~1 s); the figure is built in the fast loop by the panel tests below
def test_plot_legends_cover_nothing_plotted():
    """Every panel's legend sits clear of its bars, error bars, points, lines and flag notes (a `!! WIDE SPREAD`
    note was hidden under the legend)."""
    report = _recorded()
    fused = report["sections"]["fused_logprobs"]
    fused["speedup"] = stats.summarize([1.0, 1.2, 1.5, 1.9, 2.3])  # wide and tall: its note sits high
    from matplotlib.transforms import Bbox

    fig = output.figure(report)
    renderer = fig.canvas.get_renderer()
    checked = 0
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        extents = [a.get_window_extent(renderer) for a in [*ax.patches, *ax.lines, *ax.texts]]
        for collection in ax.collections:  # error bars: their segments, in display coordinates
            points = [p for segment in collection.get_segments() for p in segment]
            extents.append(Bbox.null() if not points else Bbox.unit().from_extents(*_bounds(ax, points)))
        for extent in extents:
            if all(math.isfinite(v) for v in extent.extents):
                assert not box.overlaps(extent), (ax.get_title(), extent)
                checked += 1
    assert checked > 20 and any("WIDE SPREAD" in t.get_text() for ax in fig.axes for t in ax.texts)
    import matplotlib.pyplot as plt

    plt.close(fig)


# Every case draws the whole figure (~0.5 s): the fast loop keeps one of the two "not run" cases (the other is the same
# branch of `panel_note`), the skipped and the failed one; "no rows" is in the fast loop as a table row
# (`test_a_zero3_part_without_rows_is_one_flagged_row_not_an_empty_table`).
@pytest.mark.parametrize(
    ("generation", "complete", "note"),
    [
        pytest.param(None, True, "ZeRO-3 generation: not run (not among --only)", marks=pytest.mark.slow),
        (None, False, "ZeRO-3 generation: not run (the bench stopped before it)"),
        ("skipped", True, "ZeRO-3 generation: not run (needs DeepSpeed, which is not installed)"),
        ({"error": "InternalError: ZeRO-3 generation run failed:\nTraceback"}, True, "ZeRO-3 generation: FAILED ("),
        pytest.param(
            {"modes": [], "tokens": {"text": "", "flags": []}},
            True,
            "ZeRO-3 generation: no rows (",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_panel_with_nothing_to_draw_says_why_in_one_line(generation, complete, note):
    """The ZeRO-3 panel of `bench.png` when its section was not run, skipped (no DeepSpeed), failed or has no rows:
    one line that says why, no empty axes; the other panels keep their data."""
    report = _recorded()
    report["complete"] = complete
    if generation is None:
        del report["sections"]["generation"]
    elif generation == "skipped":
        report["sections"]["generation"] = _skipped_generation()
    else:
        report["sections"]["generation"] = generation
    fig = output.figure(report)
    try:
        panel = fig.axes[list(output.PANELS).index("generation")]
        texts = [t.get_text() for t in panel.texts]
        assert len(texts) == 1 and texts[0].startswith(note) and "\n" not in texts[0]
        assert texts[0] == output.panel_note(report, "generation")
        assert not panel.has_data() and not panel.get_xticks().size and not panel.get_yticks().size
        assert panel.get_legend() is None
        others = [ax for ax in fig.axes[:6] if ax is not panel]
        assert len(others) == 5 and all(ax.has_data() for ax in others)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def _skipped_generation():
    """The section as `sections.generation` returns it without DeepSpeed."""
    import builtins

    real_import = builtins.__import__

    def no_deepspeed(name, *args, **kwargs):
        if name == "deepspeed":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    builtins.__import__ = no_deepspeed
    try:
        return sections.generation(None, quick=True)
    finally:
        builtins.__import__ = real_import


def test_a_zero3_part_without_rows_is_one_flagged_row_not_an_empty_table():
    report = _recorded()
    report["sections"]["generation"] = {"modes": [], "tokens": {"text": "greedy tokens identical", "flags": []}}
    table = output.text_table(report)
    rows = [line for line in table.splitlines() if line.startswith("ZeRO-3")]
    assert len(rows) == 1 and rows[0].startswith("ZeRO-3 generation: nothing measured") and "no rows" in rows[0]
    after = table.splitlines()[table.splitlines().index(rows[0]) + 1]
    assert after.strip() == f"!! {rows[0].split('  ')[-1].strip()}"  # flagged: the run should have measured every mode
    assert "greedy tokens identical" not in table
    assert "ZeRO-3 generation: nothing measured" in output.markdown_table(report)


def _bounds(ax, points):
    xy = ax.transData.transform(points)
    return xy[:, 0].min(), xy[:, 1].min(), xy[:, 0].max(), xy[:, 1].max()


@pytest.mark.slow  # about 20 s of CPU: 6 trainer builds with their precompute
def test_precompute_section_times_cpu_after_a_warmup_round_and_removes_its_caches(tmp_path):
    import argparse

    setup = sections.Setup(argparse.Namespace(quick=True, model=None, out=str(tmp_path)))
    setup.size["pairs"] = 8  # 16 pairs: the measurement's shape, not its numbers
    pc = sections.precompute(setup, rounds=2)
    assert pc["clock"] == "cpu" and pc["warmup_rounds"] == sections.WARMUP_ROUNDS == 1
    for arm in ("stock", "trl_ext", "trl_ext_auto"):
        assert len(pc[arm]["seconds"]) == len(pc[arm]["wall_seconds"]) == 2  # the warm-up round is not kept
        # CPU time is at most the wall time of every intra-op thread torch runs (2 on an idle 2-core machine)
        threads = torch.get_num_threads()
        assert all(
            0 < cpu <= wall * threads * 1.2
            for cpu, wall in zip(pc[arm]["seconds"], pc[arm]["wall_seconds"], strict=True)
        )
    assert pc["speedup"]["ratios"] == stats.ratios(
        {"a": pc["stock"]["seconds"], "b": pc["trl_ext"]["seconds"]}, "a", "b"
    )
    assert pc["values"]["same"]
    assert not list(tmp_path.glob("trl-ext-bench-precompute-*"))  # no cache folder left behind
    assert len(pc["trl_ext_auto"]["batch_tokens"]) == 2 and all(t > 0 for t in pc["trl_ext_auto"]["batch_tokens"])
    table = output.text_table({"sections": {"precompute": pc}, "load_average": {}})
    assert "(CPU s)" in table and "auto chose " in table and " tokens per batch" in table


_BLOCKER = """
import sys
from importlib.machinery import PathFinder


class _NotInstalled(PathFinder):
    # What a user's `pip install trl-ext` (no extras) lacks is not found, as if it were not in site-packages.
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in ("matplotlib", "deepspeed"):
            return None
        return PathFinder.find_spec(name, path, target)


sys.meta_path[:] = [_NotInstalled if finder is PathFinder else finder for finder in sys.meta_path]
"""


@pytest.mark.slow
def test_bench_quick_on_a_user_install_without_the_bench_extra(tmp_path):
    """`trl-ext bench --quick` where matplotlib and DeepSpeed are not installed: no crash; the report, the table and
    the line that says how to get the plot; the ZeRO-3 generation row says it needs DeepSpeed. No empty folder is
    left behind and fewer than 20 lines come before the table."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCKER)
    env = dict(os.environ, TQDM_DISABLE="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    out = tmp_path / "out"
    (out / "mine").mkdir(parents=True)  # the user's empty folder, there before: kept
    (tmp_path / "tmp").mkdir()
    env["TMPDIR"] = str(tmp_path / "tmp")  # what the run leaves in the temporary folder shows here
    cmd = [str(Path(sys.executable).with_name("trl-ext")), "bench", "--quick", "--rounds", "1", "--out", str(out)]
    proc = subprocess.run(
        [*cmd, "--only", "padding_free", "--only", "generation"], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert 'bench.png not drawn: matplotlib is not installed (pip install "trl-ext[bench]"' in proc.stdout
    assert not (out / "bench.png").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is True and report["sections"]["padding_free"]["losses"]["same"]
    assert "needs DeepSpeed" in report["sections"]["generation"]["skipped"]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("generation: skipped")]
    assert len(rows) == 1 and 'pip install "trl-ext[deepspeed]"' in rows[0]
    assert (out / "table.md").read_text() == output.markdown_table(report) + "\n"
    _check_tidy_and_short(proc, out, tmp_path / "tmp", kept=out / "mine")


# -------------------------------------------------------------------------------------------------------------------
# housekeeping: quiet logs, no empty folders left behind
# -------------------------------------------------------------------------------------------------------------------


def _empty_folders(root: Path) -> list[Path]:
    return [Path(d) for d, subdirs, files in os.walk(root) if not subdirs and not files]


def _check_tidy_and_short(proc, out: Path, tmp: Path, kept: Path | None) -> None:
    """What a `trl-ext bench` run left: no empty folder in `--out` or its temporary folder (but a folder the user had
    there before), and fewer than 20 lines before the table (stderr's progress lines and stdout's lines above it)."""
    assert _empty_folders(out) == ([kept] if kept else []), _empty_folders(out)
    assert not list(tmp.iterdir()), list(tmp.rglob("*"))  # the temporary folder is as it was: empty
    stdout = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(stdout) if line.startswith("measure "))
    before = proc.stderr.splitlines() + stdout[:header]
    assert len(before) < 20, "\n".join(before)
    assert not [line for line in before if "|NOTICE]" in line or "[WARNING]" in line], "\n".join(before)


def test_no_empty_folders_removes_the_empty_folders_the_run_made_and_keeps_the_users(tmp_path, monkeypatch):
    registered = []
    monkeypatch.setattr(housekeeping.atexit, "register", lambda *a, **k: registered.append(a))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "out"
    (out / "mine" / "empty").mkdir(parents=True)  # the user's, before the run: kept, empty or not
    with housekeeping.no_empty_folders(out) as scratch:
        assert os.environ["TMPDIR"] == str(scratch) == tempfile.gettempdir() and scratch.parent == tmp_path
        (out / "runs" / "stock").mkdir(parents=True)  # a trainer's output_dir that nothing was written to
        (out / "runs" / "kept").mkdir()
        (out / "runs" / "kept" / "file").write_text("x")
        (out / "report.json").write_text("{}")
        (scratch / "torchelastic_x" / "attempt_0" / "0").mkdir(parents=True)
    assert os.environ["TMPDIR"] == str(tmp_path) == tempfile.gettempdir()
    assert not scratch.exists() and not registered  # nothing was left in it: removed at once
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "mine",
        "mine/empty",
        "report.json",
        "runs",
        "runs/kept",
        "runs/kept/file",
    ]

    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError), housekeeping.no_empty_folders(fresh) as scratch:
        (fresh / "runs" / "a").mkdir(parents=True)
        (scratch / "hf_datasets-x").mkdir()
        (scratch / "hf_datasets-x" / "cache.arrow").write_text("x")  # held by `datasets` until the process ends
        raise RuntimeError("a section failed")
    assert not fresh.exists()  # made by the run and left empty
    assert (scratch / "hf_datasets-x" / "cache.arrow").exists() and registered[0][:2] == (shutil.rmtree, scratch)


def test_quiet_logs_hides_the_bench_trainers_notices_and_puts_the_levels_back(monkeypatch, caplog):
    import logging

    from transformers.utils import logging as hf_logging

    from trl_ext._logging import get_logger

    monkeypatch.delenv(housekeeping.LOG_LEVEL_ENV, raising=False)
    root = get_logger("trl_ext")
    level, verbosity = root.level, hf_logging.get_verbosity()
    deepspeed = logging.getLogger(housekeeping.DEEPSPEED_LOGGER)

    def record(levelno):
        return logging.LogRecord(housekeeping.DEEPSPEED_LOGGER, levelno, __file__, 1, "Setting accelerator", (), None)

    with housekeeping.quiet_logs():
        assert root.getEffectiveLevel() == logging.WARNING and hf_logging.get_verbosity() == logging.ERROR
        assert not root.isEnabledFor(25) and root.isEnabledFor(logging.WARNING)  # NOTICE hidden, warnings shown
        assert not deepspeed.filter(record(logging.WARNING)) and deepspeed.filter(record(logging.ERROR))
    assert root.level == level and hf_logging.get_verbosity() == verbosity and deepspeed.filter(record(logging.INFO))
    monkeypatch.setenv(housekeeping.LOG_LEVEL_ENV, "info")  # the user's choice wins
    with housekeeping.quiet_logs():
        assert root.level == level
