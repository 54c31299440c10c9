"""The same-training verdict in ``python -m reducer launch``: its flags, and the recorder a
launch enters around its ranks (the launch's only hook: see reducer.tools.launch.run)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from . import SameTraining
from ._findings import CAUSES

__all__ = ["add_arguments", "for_launch", "recording"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--same-training",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after the run, say whether it trained the same model as one process on the "
        "global batch (same batches on every rank, shuffle repeating each epoch, overlapping "
        "shards, a summed or mis-scaled loss, uneven batches, per-rank BatchNorm, one seed "
        "for every rank), from evidence recorded while the ranks run (default: on, off with "
        "--no-check)",
    )
    parser.add_argument(
        "--deliberate",
        default="",
        metavar="CAUSES",
        help="causes the same-training report keeps quiet about, comma-separated, as the "
        f"script's reducer.testing.sametrain.deliberate(...) call: {', '.join(sorted(CAUSES))}",
    )


def for_launch(args: argparse.Namespace, nproc: int) -> SameTraining | None:
    """The recorder of a launch, or None when the verdict is off (``--no-same-training``, or
    ``--no-check`` without ``--same-training``)."""
    enabled = getattr(args, "same_training", None)
    if enabled is None:
        enabled = bool(getattr(args, "check", True))
    if not enabled:
        return None
    causes = str(getattr(args, "deliberate", "") or "").split(",")
    return SameTraining(nproc, None, deliberate=causes, out=sys.stderr)


def recording(
    same: SameTraining | None, rank_of: Callable[[], int | None]
) -> AbstractContextManager[Any]:
    """While the ranks run: record (``rank_of`` tells a rank thread's rank); after them,
    print the report to the stderr of the launch."""
    if same is None:
        return contextlib.nullcontext()
    same.recorder.rank_of = rank_of
    return same.reporting()
