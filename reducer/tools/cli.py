"""``python -m reducer`` (or ``ddp-reducer``): the command line. Each subcommand lives in a
module of its own (or, for a tool with one thing settled, in :mod:`reducer.tools.shortcuts`).

python -m reducer simulate    simulate N ranks on threads, verify every step, show timings;
                              --predict: a step on a real cluster
python -m reducer whatif      the step time per bucket cap, and the best
python -m reducer trace       a Chrome / Perfetto timeline of a step
python -m reducer launch      run a torchrun-style training script on N rank threads
python -m reducer check       launch with the replica check required
python -m reducer validate    run the validation suite on fakepg, gloo or NCCL
python -m reducer benchmark   list or run the repository's benchmark scripts
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

# name -> (where, one-line help). ``where`` is a module, or "module:Class", that provides
# add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "simulate": (
        "reducer.tools.simulate",
        "simulate data-parallel training of N ranks on threads, every step verified; "
        "--predict: one step on a real cluster",
    ),
    "whatif": ("reducer.tools.shortcuts:Whatif", "the step time per bucket cap, and the best"),
    "trace": ("reducer.tools.shortcuts:Trace", "a Chrome / Perfetto timeline of a step"),
    "launch": ("reducer.tools.launch", "run a torchrun-style training script on N rank threads"),
    "check": (
        "reducer.tools.shortcuts:Check",
        "launch a torchrun script with the replica check: did the ranks stay in sync?",
    ),
    "validate": ("reducer.tools.validate", "run the validation suite on a real or fake backend"),
    "benchmark": ("reducer.tools.benchmarks", "list or run the repository's benchmark scripts"),
}


def _load(where: str) -> Any:
    module_name, _, attribute = where.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


def _prog() -> str:
    """How the user called the command line: the console script or ``python -m reducer``."""
    return "ddp-reducer" if Path(sys.argv[0]).name == "ddp-reducer" else "python -m reducer"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (it may pull in heavy dependencies,
    and one subcommand's import must not break the others). Without a command, the help
    lists every tool, the models and the network and cluster presets."""
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="A Python DDP gradient reducer, a threaded fake process group, and tools\n"
        "to simulate, predict, check and validate data-parallel training.",
        epilog=None if command is not None else _epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (where, help_text) in SUBCOMMANDS.items():
        if name != command:
            subparsers.add_parser(name, help=help_text)
            continue
        tool = _load(where)
        sub = subparsers.add_parser(
            name,
            help=help_text,
            description=(tool.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        tool.add_arguments(sub)
        sub.set_defaults(_run=tool.run)
    return parser


def _epilog() -> str:
    from . import catalog

    return f"Run `{_prog()} COMMAND --help` for a command's options.\n\n" + (
        catalog.simulate_epilog()
    )


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if a in SUBCOMMANDS), None)
    args = build_parser(command).parse_args(args_list)
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
