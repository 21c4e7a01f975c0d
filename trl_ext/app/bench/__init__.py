"""`trl-ext bench`: stock TRL against trl-ext, side by side, on one machine, in one run.

What each section measures, the statistics and the verdicts are in docs/benchmarks.md. The statistics live in `stats`,
the sections in `sections` and `plugin_sections`, the table, headline and plot in `report`, the device run
(`--device`) in `device`; this module is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ... import __version__, _compat
from ...errors import UsageError
from . import housekeeping, plugin_sections, sections
from . import report as output
from .stats import progress

#: Wall time of `trl-ext bench --quick` on 2 shared CPU cores, measured (`report.json`'s `wall_seconds` of the run
#: recorded in `benchmarks/results/bench_quick.json`); `--help` and the README state it.
QUICK_DURATION = "about 4 min"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trl-ext bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smaller model and fewer steps ({QUICK_DURATION} on 2 shared CPU cores)",
    )
    parser.add_argument(
        "--model", help="path of a local model directory (and its tokenizer) to use instead of the built-in one"
    )
    parser.add_argument("--out", default="bench-out", help="directory for report.json, table.md and bench.png")
    parser.add_argument(
        "--rounds",
        type=int,
        help="interleaved rounds per comparison, a fixed count (default 5; the 2-process step time: at most 3 with "
        "--quick; with --device, the preset's: 10 for 1b)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadiest when shared)")
    parser.add_argument("--only", action="append", choices=sections.SECTIONS, help="sections")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="the device proof instead of the CPU sections: every plugin against stock on this device in interleaved "
        "rounds (gradient checkpointing off and on), the fused-kernel probe and the `gpu` tests, each part under its "
        "own timeout (docs/benchmarks.md)",
    )
    parser.add_argument(
        "--preset",
        choices=("1b", "tiny"),
        help="with --device: `1b` (an 853M Llama from a config, bf16; the default on cuda) or `tiny` (a CPU)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        help="with --device: seconds for the whole run, every part's timeout within it (default 440)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rounds = args.rounds
    if rounds is not None and rounds < 1:
        raise UsageError(f"`--rounds` must be at least 1, got {rounds}.")
    if args.model and not os.path.isdir(args.model):
        what = "a file" if os.path.exists(args.model) else "not found"
        raise UsageError(f"`--model {args.model}`: {what}; give the directory of a saved model and its tokenizer.")
    if args.device is not None:
        from . import device

        preset = device.check(args.device, args.preset, args.model)
        with housekeeping.no_empty_folders(Path(args.out)):
            return device.run(args.device, preset, Path(args.out), rounds, args.time_limit or device.TIME_LIMIT)
    if args.preset is not None or args.time_limit is not None:
        raise UsageError("`--preset` and `--time-limit` go with `--device`.")
    # The libraries' notices about the bench's own trainers are not the user's business: our progress lines replace
    # them (and their bars), so that the table follows a screen of progress, not a few hundred lines of logs.
    with housekeeping.no_empty_folders(Path(args.out)), housekeeping.quiet_logs():
        return _bench(args, 5 if rounds is None else rounds, started)


def _bench(args: argparse.Namespace, rounds: int, started: float) -> int:
    """The CPU sections, their table on stdout, report.json, table.md and bench.png in `--out`."""
    import datasets
    import torch

    from ...manager import load_catalog

    datasets.disable_progress_bars()
    # One thread by default: on a shared machine, OpenMP threads spin while waiting for a busy core, which turns
    # another process' load into noise many times larger than the effect being measured.
    torch.set_num_threads(args.threads)
    _compat.check_trl_version()
    load_start = _load_average()
    setup = sections.Setup(args)
    report: dict[str, Any] = {
        "trl_ext": __version__,
        "trl": _compat.installed_version("trl"),
        "torch": torch.__version__,
        "model": setup.model_desc,
        "quick": args.quick,
        "rounds": rounds,
        "sections": {},
    }
    wanted = args.only or list(sections.SECTIONS)
    available = load_catalog()[0].flags
    can_plot = output.matplotlib_missing() is None
    progress(
        f"stock TRL against trl-ext: {len(wanted)} section(s), {rounds} interleaved rounds per comparison"
        f"{f' ({QUICK_DURATION})' if args.quick and not args.only else ''}; report.json and table.md in {setup.out} "
        "as each section finishes"
    )
    if not can_plot:
        progress(output.matplotlib_missing() or "")
    finished = False
    try:
        _run_sections(report, wanted, available, setup, args, rounds, started, load_start)
        finished = True
    finally:
        # Whatever happens (a crash, Ctrl-C), the sections that finished are in report.json and table.md.
        _write(report, setup.out, started, load_start, plot=finished and can_plot, complete=finished)
    load = report["load_average"]
    print(
        f"trl-ext bench — trl {report['trl']}, {report['model']}; load average {load['start']} -> {load['end']} "
        f"on {load['cores']} cores"
    )
    print(output.text_table(report))
    flagged = [name for name, s in report["sections"].items() if output.section_flags(s)]
    if flagged:
        print(f"!! flagged (see the ratio column): {', '.join(flagged)}")
    plot = f"plot: {setup.out / 'bench.png'}" if can_plot else output.matplotlib_missing()
    print(
        f"report: {setup.out / 'report.json'}  table: {setup.out / 'table.md'}  {plot}  "
        f"({report['wall_seconds']:.0f} s)"
    )
    failed = [name for name, s in report["sections"].items() if "error" in s]
    return 1 if failed else 0


def _write(report: dict[str, Any], out: Any, started: float, load_start: float | None, plot: bool, complete: bool):
    """report.json and table.md as they stand (the sections finished so far), and bench.png when asked."""
    import resource

    report["complete"] = complete
    report["load_average"] = {"start": load_start, "end": _load_average(), "cores": os.cpu_count()}
    report["headline"] = output.headline(report)
    report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if plot:
        output.plot(report, out / "bench.png")
    report["wall_seconds"] = time.perf_counter() - started
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "table.md").write_text(output.markdown_table(report) + "\n")


def _run_sections(report, wanted, available, setup, args, rounds, started, load_start) -> None:
    """Run the wanted sections in turn, writing report.json and table.md after each."""
    # Its headline (collectives per step) is exact; the step-time ratio of sync_metrics needs fewer rounds in --quick.
    run = {
        "padding_free": lambda: sections.padding_free(setup, rounds),
        "precompute": lambda: sections.precompute(setup, rounds),
        "sync_metrics": lambda: sections.sync_metrics(setup, args.quick, min(rounds, 3) if args.quick else rounds),
        "generation": lambda: sections.generation(setup, args.quick),
        "token_budget": lambda: plugin_sections.token_budget(setup, rounds, args.quick),
        "fused_logprobs": lambda: plugin_sections.fused_logprobs(setup, rounds, args.quick),
    }
    for section in wanted:
        # Each section measures the flag it is named after; the flag table says whether a plugin provides it.
        if sections.SECTIONS[section] not in available:
            report["sections"][section] = {"skipped": f"no installed plugin provides `{sections.SECTIONS[section]}`"}
            continue
        try:
            report["sections"][section] = run[section]()
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide the others
            report["sections"][section] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        _write(report, setup.out, started, load_start, plot=False, complete=False)


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - not on every platform
        return None
