"""The `trl-ext` command line: `trl-ext plugins [NAME]`, `trl-ext doctor`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__, _compat
from ..errors import UsageError, did_you_mean

_VERSIONED = ("trl", "transformers", "torch", "accelerate", "deepspeed", "peft", "pluggy")


def _cmd_plugins(args: argparse.Namespace) -> int:
    import os

    from ..config import _parse_block
    from ..manager import load_catalog

    # `--block NAME` and `TRL_EXT_BLOCK`, as for every other command.
    env_block = _parse_block(os.environ.get("TRL_EXT_BLOCK", ""), "environment variable $TRL_EXT_BLOCK")
    args.block = list(dict.fromkeys([*(args.block or ()), *env_block]))
    catalog = load_catalog(args.block)[0]
    if args.order:
        return _print_order(catalog)
    if args.name:
        return _plugin_page(catalog, args.name)
    trl_version = _compat.installed_version("trl")
    trl_ok = _compat.is_supported_trl(trl_version)
    rows = []
    applies = "yes" if trl_ok else f"no (trl {trl_version} is not {_compat.SUPPORTED_TRL_SPEC})"
    for name, spec in catalog.specs.items():
        flags, options = ", ".join(spec.flag_names) or f"plugins.{name}", ", ".join(spec.option_names()) or "-"
        trainers = ", ".join(spec.trainers) if spec.trainers else "all"
        rows.append((name, _kind(catalog, name), flags, options, trainers, applies, spec.summary))
    for name in args.block or ():
        rows.append((name, "blocked", "-", "-", "-", "no (blocked)", ""))
    if not rows:
        print("No trl-ext plugins are installed.")
        return 0
    header = ("plugin", "kind", "flags", "options", "trainers", "applies", "summary")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    # Each flag and option with what it accepts, its default and one line of help, from the declarations.
    for name, spec in catalog.specs.items():
        print(f"\n{name}: {spec.summary}" if spec.summary else f"\n{name}:")
        _print_settings(name, spec)
    for name, why in sorted(catalog.broken.items()):
        print(f"\n{name}: NOT LOADED ({why})")
    from ..config import VERIFY_HELP, VERIFY_PARSER

    print(f"\ncore settings:\n  flag   verify: {VERIFY_PARSER.expects}; default true. {VERIFY_HELP}")
    return 0


def _kind(catalog, name: str) -> str:
    plugin = catalog.plugins[name]
    return (
        "built-in"
        if name in catalog.builtin
        else f"third-party ({getattr(plugin, '__name__', type(plugin).__name__)})"
    )


def _print_order(catalog) -> int:
    """`trl-ext plugins --order`: per trainer and method, the plugins whose `trl_ext_call` runs, outermost first."""
    from ..calls import chains, declared
    from ..manager import make_plugin_manager

    pm = make_plugin_manager(catalog=catalog)
    print(
        "Trainer methods plugins take part in (`trl_ext_call`), outermost first; TRL's method runs last, and a "
        "trainer runs the plugins enabled for it only. The models are prepared before the reference precompute's "
        "chain runs; `verify` checks each scoring method's chain as a whole."
    )
    for trainer_class in _compat.TRAINERS:
        applying = [name for name, spec in catalog.specs.items() if spec.applies_to(trainer_class)]
        found = chains(catalog, pm.hook.trl_ext_call, trainer_class, applying)
        print(f"\n{trainer_class}:")
        for method, impls in found.items():
            replacing = {
                i.plugin_name
                for i in impls
                if method in declared(catalog.specs[i.plugin_name].replaces, trainer_class)
            }
            links = [f"{i.plugin_name} (replaces)" if i.plugin_name in replacing else i.plugin_name for i in impls]
            print(f"  {method}: {' > '.join(links)} > TRL")
        if not found:
            print("  no plugin takes part in its method calls")
    return 0


def _print_settings(name: str, spec) -> None:
    if not spec.flag_names:
        print(f"  enabled by naming it: `plugins: {{{name}: {{...}}}}`")
    for doc in spec.docs():
        key = doc.name if doc.kind == "flag" else f"plugins.{name}.{doc.name}"
        print(f"  {doc.kind:<6} {key}: {doc.accepts}; default {doc.default_text()}. {doc.help}".rstrip())


def _plugin_page(catalog, name: str) -> int:
    """`trl-ext plugins NAME`: the plugin's module docstring (a summary) and its flags and options."""
    import inspect

    if name not in catalog.specs:
        if name in catalog.broken:
            raise UsageError(catalog.broken_message(name))
        hint = did_you_mean(name, catalog.specs)
        blocked = " It is blocked." if name in catalog.blocked else ""
        raise UsageError(
            f"No trl-ext plugin `{name}`.{blocked}{hint} Installed: {', '.join(catalog.specs) or 'none'} "
            "(`trl-ext plugins` lists them)."
        )
    spec = catalog.specs[name]
    trainers = ", ".join(spec.trainers) if spec.trainers else "every trainer trl-ext attaches to"
    print(f"{name} ({_kind(catalog, name)}; applies to {trainers})\n")
    doc = inspect.getdoc(catalog.plugins[name]) or spec.summary or "(no documentation)"
    print(doc.rstrip() + "\n")
    print("Flags and options (what each accepts, its default):")
    _print_settings(name, spec)
    return 0


def _attention_backends() -> list[str]:
    """Attention implementations a packed (padding-free) forward can use here, and what is missing."""
    out = ["eager", "sdpa"]
    try:
        import transformers.utils as tu

        checks = {
            "flash_attention_2": getattr(tu, "is_flash_attn_2_available", lambda: False),
            "flash_attention_3": getattr(tu, "is_flash_attn_3_available", lambda: False),
        }
        for name, available in checks.items():
            out.append(name if available() else f"{name} (not available: needs CUDA and the flash-attn kernels)")
    except Exception as exc:  # noqa: BLE001
        out.append(f"flash attention: unknown ({exc})")
    try:
        import trl_ext.toolkit.packing.attention  # noqa: F401 - trl-ext's per-segment attention

        out.append("trl-ext varlen (per-segment attention for packed rows on CPU/GPU)")
    except ImportError:
        pass
    return out


def _fused_kernels() -> str:
    """The fused varlen kernels the packing plugins may choose here, what each takes, and where they are not used."""
    try:
        import torch

        from ..toolkit.packing import kernels
    except Exception as exc:  # noqa: BLE001 - said, not raised
        return f"unknown ({exc})"
    found = kernels.installed_kernels()
    if not found:
        return "none (torch.nn.attention.varlen needs torch >= 2.10; flash-attn >= 2.3 not installed)"
    parts = []
    for name, kernel in found.items():
        lacks = [what for what, has in (("window_size", kernel.windows), ("scale", kernel.scales)) if not has]
        missing = " (no " + ", no ".join(lacks) + ": such models run per segment)" if lacks else ""
        parts.append(name + missing)
    where = "CUDA bf16/fp16 only"
    if getattr(torch.version, "hip", None):
        where += "; not used on ROCm (not measured there)"
    return f"{', '.join(parts)}: {where}; each call pattern probed on the device before it trains"


def _dpo_scoring() -> str:
    """How the installed DPOTrainer scores (the probed layout, docs/versions.md)."""
    try:
        if _compat.dpo_has_fused_head():
            return "TRL's fused LM head (fused_logprobs leaves it in place)"
        helpers = _compat.dpo_logits_helpers()
    except Exception as exc:  # noqa: BLE001 - a TRL that does not import: said, not raised
        return f"unknown (trl.trainer.dpo_trainer does not import: {exc})"
    if not helpers:
        return f"unknown layout ({_compat.DPO_UNKNOWN_LOGITS_HELPERS.name}: fused_logprobs refuses DPO)"
    return f"full logits, read through {' + '.join(helpers)} (fused_logprobs scores inside the output head)"


def _cmd_doctor(args: argparse.Namespace) -> int:
    print(f"trl-ext {__version__}  (Python {sys.version.split()[0]})")
    ok = True
    for dist in _VERSIONED:
        version = _compat.installed_version(dist)
        note = ""
        if dist == "trl":
            supported = _compat.is_supported_trl(version)
            ok = ok and supported
            note = "supported" if supported else f"NOT supported: trl-ext needs trl{_compat.SUPPORTED_TRL_SPEC}"
            if supported:
                note += f"; DPO scoring: {_dpo_scoring()}"
                fact = _compat.dpo_training_refusal()
                if fact is not None:
                    ok = False
                    note += "\n" + " " * 15 + fact.refusal("DPOTrainer CANNOT TRAIN here")
        elif dist == "deepspeed" and version is None:
            note = "optional: `pip install trl-ext[deepspeed]` for ZeRO-3"
        elif version is None and dist not in ("peft",):
            ok = False
            note = "MISSING"
        print(f"  {dist:<13} {version or '-':<12} {note}")
    try:
        import torch

        devices = ["cpu"]
        if torch.cuda.is_available():
            devices.append(f"cuda x{torch.cuda.device_count()} ({torch.cuda.get_device_name(0)})")
        print(f"  devices       {', '.join(devices)}")
    except Exception as exc:  # noqa: BLE001
        print(f"  devices       unknown ({exc})")
    print(f"  attention     {', '.join(_attention_backends())}")
    print(f"  fused varlen  {_fused_kernels()}")
    print("OK" if ok else "PROBLEMS FOUND (see above)")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-ext", description="Plugins for stock Hugging Face TRL trainers.")
    parser.add_argument("--version", action="version", version=f"trl-ext {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plugins", help="list built-in and installed third-party plugins, their flags, and whether each applies"
    )
    p.add_argument("name", nargs="?", help="one plugin: its documentation, flags and options")
    p.add_argument("--block", action="append", metavar="NAME", help="leave plugin NAME out (repeatable)")
    p.add_argument("--order", action="store_true", help="per trainer and method, which plugins run in which order")
    p.set_defaults(func=_cmd_plugins)
    d = sub.add_parser("doctor", help="print versions, whether they are supported, and the attention backends")
    d.set_defaults(func=_cmd_doctor)
    sub.add_parser(
        "bench", help="stock TRL vs trl-ext side by side (see `trl-ext bench --help`)", add_help=False
    ).set_defaults(func=None)
    jobs = (
        ("dpo", "TRL's own DPO script with trl-ext installed (every `trl dpo` argument, plus --trl-ext-<flag> VALUE)"),
        (
            "online-dpo",
            "an Online DPO script with trl-ext installed (OnlineDPOConfig and ModelConfig arguments, --reward_funcs, "
            "plus --trl-ext-<flag> VALUE)",
        ),
    )
    for job, what in jobs:
        j = sub.add_parser(job, help=f"run {what}; `trl-ext {job} --help` lists them", add_help=False)
        j.set_defaults(func=None, job=job)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "bench":
            from .bench import main as bench_main

            return bench_main(argv[1:])
        if argv and argv[0] in ("dpo", "online-dpo"):
            # Everything after the command belongs to TRL's parser (plus --trl_ext_* flags).
            from .jobs import main_job

            return main_job(argv[0], argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as exc:
        print(f"trl-ext: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
