"""``python -m reducer``: the command line. Each subcommand lives in a module of its own.

python -m reducer simulate    simulate N ranks on threads, verify every step, show timings
python -m reducer validate    run the validation suite on fakepg, gloo or NCCL
python -m reducer launch      run a torchrun-style training script on N rank threads
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

# name -> (module, one-line help). A module provides add_arguments(parser) and run(args) -> int.
_SUBCOMMANDS = {
    "simulate": ("reducer.tools.simulate", "simulate data-parallel training of N ranks on threads"),
    "validate": ("reducer.tools.validate", "run the validation suite on a real or fake backend"),
    "launch": ("reducer.tools.launch", "run a torchrun-style training script on N rank threads"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (it may pull in heavy dependencies,
    and one subcommand's import must not break the others)."""
    parser = argparse.ArgumentParser(
        prog="python -m reducer",
        description="A Python DDP gradient reducer, a threaded fake process group, and tools "
        "to simulate and validate data-parallel training.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in _SUBCOMMANDS.items():
        if name != command:
            subparsers.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if a in _SUBCOMMANDS), None)
    args = build_parser(command).parse_args(args_list)
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
