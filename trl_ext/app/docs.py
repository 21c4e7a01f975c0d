"""The generated parts of README.md and docs/: `python -m trl_ext.app.docs` rewrites them from the plugins'
declarations and the recorded benchmark runs; `python -m trl_ext.app.docs --check` lists the parts that are out of
date and exits 1 (tests/test_figures.py runs the check).

A generated part sits between `<!-- generated: KEY -->` and `<!-- end generated: KEY -->`, where KEY names what
fills it (`GENERATORS`, each function says what it writes). Only the built-in plugins are documented, whatever
third-party plugins are installed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config import VERIFY_HELP, VERIFY_PARSER

__all__ = ["GENERATORS", "Part", "generated_parts", "main", "render", "stale"]

#: The checkout this module belongs to (README.md, docs/, benchmarks/results/).
ROOT = Path(__file__).resolve().parents[2]

_PART = re.compile(r"(<!-- generated: (?P<key>[^>]+?) -->\n)(?P<body>.*?)(<!-- end generated: (?P=key) -->)", re.S)


def _wrap(text: str) -> str:
    """Prose wrapped at the project's line length, as the hand-written text around it."""
    import textwrap

    return "\n".join(textwrap.wrap(text, 119, break_long_words=False, break_on_hyphens=False))


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _builtin_specs() -> dict[str, Any]:
    from ..manager import builtin_plugin_modules, load_catalog

    catalog = load_catalog(warn=False)[0]
    return {name: catalog.specs[name] for name in builtin_plugin_modules()}


def plugins_table(root: Path, argument: str) -> str:
    """One row per built-in plugin: its page, flag, trainers and what it does (its declared summary)."""
    rows = ["| plugin | flag | trainers | what it does |", "|---|---|---|---|"]
    for name, spec in _builtin_specs().items():
        flags = ", ".join(f"`{f}`" for f in spec.flag_names) or f"`plugins: {{{name}: {{}}}}`"
        trainers = ", ".join(spec.trainers) if spec.trainers else "all"
        rows.append(f"| [`{name}`](docs/plugins/{name}.md) | {flags} | {trainers} | {_cell(spec.summary)} |")
    return "\n".join(rows)


def settings_table(root: Path, argument: str) -> str:
    """Plugin `argument`'s flags and options, and the spelling of each flag in every source."""
    spec = _builtin_specs()[argument]
    lines = []
    for flag in spec.flag_names:
        lines.append(
            f"Flag `{flag}`: `trl_ext.install({flag}=...)`, `TRL_EXT_{flag.upper()}=...`, `{flag}: ...` in YAML "
            f"(top level or under `trl_ext:`), `--trl-ext-{flag.replace('_', '-')} ...` on `trl-ext dpo` / "
            "`online-dpo`."
        )
    if spec.option_names():
        lines.append(
            f"Options: `plugins: {{{argument}: {{<option>: <value>}}}}` in YAML or `install(plugins=...)`, "
            f"`TRL_EXT_PLUGINS='{{\"{argument}\": {{...}}}}'`."
        )
    rows = ["| setting | accepts | default | meaning |", "|---|---|---|---|"]
    for doc in spec.docs():
        key = doc.name if doc.kind == "flag" else f"plugins.{argument}.{doc.name}"
        rows.append(f"| `{key}` ({doc.kind}) | {_cell(doc.accepts)} | `{doc.default_text()}` | {_cell(doc.help)} |")
    return "\n\n".join([_wrap(" ".join(lines)), "\n".join(rows)])


def flags_table(root: Path, argument: str) -> str:
    """Every built-in flag, what it accepts and its plugin, then the core keys."""
    rows = ["| flag | accepts | plugin | meaning |", "|---|---|---|---|"]
    docs = [(doc, name) for name, spec in _builtin_specs().items() for doc in spec.docs() if doc.kind == "flag"]
    for doc, name in sorted(docs, key=lambda item: item[0].name):
        rows.append(f"| `{doc.name}` | {_cell(doc.accepts)} | [`{name}`](plugins/{name}.md) | {_cell(doc.help)} |")
    rows.append(
        "| `plugins` | `{name: {option: value}}` | any | options by plugin name; enables only a plugin that has no "
        "flag (options of a plugin whose flag is off are a `UsageError`) |"
    )
    rows.append("| `block` | `[name, ...]` | any | plugin names never to load (like pytest's `-p no:NAME`) |")
    rows.append(
        f"| `verify` | {VERIFY_PARSER.expects} (default true: 1) | core ([verify](lifecycle.md#verify-the-first-steps-"
        f"checked-against-stock)) | {_cell(VERIFY_HELP)} |"
    )
    return "\n".join(rows)


def hooks_table(root: Path, argument: str) -> str:
    """Every hook of `trl_ext.hookspecs`, in the module's order (grouped by lifecycle), with its first sentence."""
    import inspect

    from .. import hookspecs
    from ..spec import first_sentence

    rows = ["| hook | called |", "|---|---|"]
    for name, function in vars(hookspecs).items():
        if name.startswith("trl_ext_") and inspect.isfunction(function):
            rows.append(f"| `{name}` | {_cell(first_sentence(inspect.getdoc(function) or ''))} |")
    return "\n".join(rows)


def _results(root: Path, name: str) -> dict[str, Any]:
    return json.loads((root / "benchmarks" / "results" / name).read_text())


def bench_table(root: Path, argument: str) -> str:
    """`table.md` of the recorded `trl-ext bench --quick` run."""
    from .bench.report import markdown_table

    return markdown_table(_results(root, "bench_quick.json"))


#: Where the GPU proof command's `report.json` is recorded (docs/benchmarks.md, "Running it on the GPU machine").
GPU_RESULT = "gpu_bench.json"


def gpu_table(root: Path, argument: str) -> str:
    """The recorded `trl-ext bench --device cuda` run (`benchmarks/results/gpu_bench.json`), or that there is none: a
    GPU figure is measured or said to be not measured, never estimated."""
    from .bench.device import markdown, targets

    path = root / "benchmarks" / "results" / GPU_RESULT
    if not path.exists():
        return _wrap(
            f"**Not measured:** no `trl-ext bench --device cuda` run is recorded (`benchmarks/results/{GPU_RESULT}`). "
            "The fused varlen kernels, the kernel probe and every plugin's step time and memory with them have not "
            "run on a GPU."
        )
    report = json.loads(path.read_text())
    report["targets"] = targets(report)  # the verdicts by today's rules, from the recorded numbers
    return markdown(report).split("\n", 2)[2]  # without its title: the page has one


def fused_logprobs_table(root: Path, argument: str) -> str:
    """The recorded Online DPO step comparison of `benchmarks/fused_logprobs.py`."""

    def speed(variant: dict[str, Any]) -> str:
        ratio = variant["speedup_vs_stock"]
        return f"{ratio['median']:.2f}x ({ratio['q1']:.2f}-{ratio['q3']:.2f})"

    rows = [
        "| vocab | completion width | step allocation vs stock | peak RSS vs stock | step time: stock / fused "
        "| stock / fused+prompt_sharing |",
        "|---|---|---|---|---|---|",
    ]
    for case in _results(root, "fused_logprobs.json")["results"]:
        fused, both = case["variants"]["fused"], case["variants"]["fused+prompt_sharing"]
        rows.append(
            f"| {case['vocab']:,} | {case['completion_width']} | {fused['step_peak_ratio_vs_stock']:.2f}x "
            f"| {fused['peak_ratio_vs_stock']:.2f}x | {speed(fused)} | {speed(both)} |"
        )
    return "\n".join(rows)


def fused_dpo_packing_sentence(root: Path, argument: str) -> str:
    """The CPU-time ratios of the recorded `benchmarks/fused_dpo_packing.py` run, in one sentence."""
    report = _results(root, "fused_dpo_packing.json")
    cpu = report["summary"]["cpu"]
    new, old = report["runs"]["new"][0]["trl"], report["runs"]["old"][0]["trl"]

    def ratio(key: str) -> str:
        r = cpu[key]
        return f"{r['median']:.2f}x speed-up over stock in CPU time (IQR {r['q1']:.2f}-{r['q3']:.2f})"

    alone = cpu["padding_free_old"]["median"]
    return _wrap(
        f"padding_free on trl {new} (TRL's fused head): {ratio('target')}; fused_logprobs + padding_free on "
        f"trl {old}: {ratio('fused_padding_free')}, against padding_free alone there {alone:.2f}x. "
        f"The trl {old} speed-up is {cpu['relative']:.2f}x the trl {new} one."
    )


#: KEY (first word of the marker) -> the function that fills the part; the rest of the marker is its argument.
GENERATORS: dict[str, Callable[[Path, str], str]] = {
    "plugins": plugins_table,
    "settings": settings_table,
    "flags": flags_table,
    "hooks": hooks_table,
    "bench": bench_table,
    "gpu": gpu_table,
    "fused_logprobs": fused_logprobs_table,
    "fused_dpo_packing": fused_dpo_packing_sentence,
}


class Part:
    """One generated part of a file: its key and the text between its markers."""

    def __init__(self, path: Path, key: str, body: str) -> None:
        self.path, self.key, self.body = path, key, body

    def expected(self, root: Path) -> str:
        name, _, argument = self.key.partition(" ")
        if name not in GENERATORS:
            raise KeyError(f"{self.path}: unknown generated part `{self.key}`; known: {sorted(GENERATORS)}")
        return GENERATORS[name](root, argument.strip()) + "\n"


def _files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def generated_parts(root: Path = ROOT) -> list[Part]:
    """Every generated part of README.md and docs/**/*.md, in file order."""
    return [
        Part(path, m.group("key"), m.group("body")) for path in _files(root) for m in _PART.finditer(path.read_text())
    ]


def render(text: str, root: Path = ROOT, path: Path | None = None) -> str:
    """`text` with every generated part filled from its source."""
    return _PART.sub(
        lambda m: m.group(1) + Part(path or root, m.group("key"), "").expected(root) + m.group(4),
        text,
    )


def stale(root: Path = ROOT) -> list[str]:
    """`path: KEY` of every generated part whose text is not what its source gives."""
    return [
        f"{part.path.relative_to(root)}: {part.key}"
        for part in generated_parts(root)
        if part.body != part.expected(root)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trl_ext.app.docs", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--check", action="store_true", help="only list the out-of-date parts; exit 1 if any")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: the one holding this file)")
    args = parser.parse_args(argv)
    if args.check:
        out_of_date = stale(args.root)
        for line in out_of_date:
            print(f"out of date: {line} (run `python -m trl_ext.app.docs`)")
        return 1 if out_of_date else 0
    for path in _files(args.root):
        text = path.read_text()
        new = render(text, args.root, path)
        if new != text:
            path.write_text(new)
            print(f"updated {path.relative_to(args.root)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
