"""Subcommands that are another tool with one thing settled: ``whatif`` (simulate's bucket-cap
sweep), ``trace`` (simulate writing a timeline) and ``check`` (launch with the replica check
required). Each takes every option of the tool it runs, so nothing is said twice."""

from __future__ import annotations

import argparse
import sys

__all__ = ["Check", "Trace", "Whatif"]

# The caps a what-if compares by default: one bucket per parameter, small, medium, torch's
# cap for every bucket, and torch's default (25 MiB after a first bucket of 1 MiB).
DEFAULT_CAPS = "0,1,5,25,default"


class Whatif:
    """What if the bucket cap were ...? The step time predicted per bucket cap, and the best.

    python -m reducer whatif --model transformer-block --width 512 --world-size 64 \\
        --network 10gbe                                   # measure one rank, then predict
    python -m reducer whatif --model gpt2 --world-size 256 --network nccl-dgx-h100 \\
        --gpu h100 --caps 1,5,25,100                      # a real model by shape, predicted

    A small built-in model is measured on one rank (every step verified), then its step is
    predicted at --world-size ranks on --network for each cap; a model by shape is predicted
    outright (simulate --predict). It is ``simulate --sweep-bucket-cap CAPS``: every option of
    simulate applies.
    """

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        from reducer.tools import simulate

        simulate.add_arguments(parser)
        parser.add_argument(
            "--caps",
            dest="sweep_bucket_cap",
            metavar="MB,MB,...",
            help=f"the bucket caps to compare, in MiB ('default': torch's; default {DEFAULT_CAPS})",
        )
        parser.set_defaults(sweep_bucket_cap=DEFAULT_CAPS)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from reducer.tools import simulate

        return simulate.run(args)


class Trace:
    """A Chrome / Perfetto timeline of a step: what every rank did, or the predicted step.

    python -m reducer trace --model transformer-block --world-size 4 --network 10gbe \\
        -o trace.json                                     # open in ui.perfetto.dev
    python -m reducer trace --model gpt2 --world-size 64 --network nccl-dgx-h100 -o gpt2.json

    It is ``simulate --trace FILE``: every option of simulate applies. A small model runs on
    threads (one track per rank: forward, backward, each bucket's collective, the optimizer);
    a model by shape writes its predicted step (compute, and one track per process group).
    """

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        from reducer.tools import simulate

        simulate.add_arguments(parser)
        parser.add_argument(
            "-o",
            "--output",
            dest="trace",
            metavar="FILE",
            help="where to write the timeline (default trace.json)",
        )
        parser.set_defaults(trace="trace.json")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from reducer.tools import simulate

        if args.sweep_bucket_cap is not None:
            print(
                "trace: a timeline is one run's; drop --sweep-bucket-cap (whatif compares caps)",
                file=sys.stderr,
            )
            return 2
        return simulate.run(args)


class Check:
    """Did my ranks stay in sync? Run a torchrun script on rank threads, checked at every step.

    python -m reducer check --nproc 2 train.py --its-args ...
    python -m reducer check --nproc 4 --check-keep-going -m my_package.train

    At every optimizer step every rank's parameters and gradients are compared bit for bit
    (the fake world reduces in one order, so any difference is a bug); at the first
    divergence the ranks stop, the cause is named (a reduction skipped, a division missing,
    a no_sync left on ...), and the exit code is 3. It is ``launch`` with the check required:
    every option of launch applies (see reducer.tools.check for the check as a library).
    """

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        from reducer.tools import launch

        launch.add_arguments(parser)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from reducer.tools import launch

        if not args.check:
            print(
                "check: the replica check is what check runs; to run without it use "
                "`python -m reducer launch --no-check`",
                file=sys.stderr,
            )
            return 2
        return launch.run(args)
