"""Is this W-rank run the same training as one process on the global batch?

The replica check proves that the ranks agree; this proves that they train what one process
would: every rank reads its own batches (a DistributedSampler built for this world, reshuffled
each epoch, disjoint shards), the loss is scaled as one process's on the global batch (a mean,
divided by the accumulation steps once, even local batches), BatchNorm is synced and the ranks
draw different dropout masks and augmentations. Each mistake keeps the ranks in perfect sync,
so only evidence of what they fed their model can show it.

    python -m reducer launch --nproc 2 train.py   # prints the verdict after the run

:class:`SameTraining` records the evidence on rank threads (see :mod:`._evidence`) and judges
it (:func:`._findings.judge`); :func:`deliberate` declares a choice on purpose (a summed loss
with a scaled learning rate, per-rank BatchNorm) so that the report keeps quiet about it, as do
``--deliberate`` and the ``REDUCER_DELIBERATE`` environment variable (comma-separated causes).
``reducer.testing.check_same_training`` gives the verdict for a training step under test.

This module imports torch only: a script may call :func:`deliberate` under torchrun too
(where it records the choice and does nothing else).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TextIO

from ._declared import _DECLARED, _LOCK, ENV_VAR, _checked, declared, deliberate
from ._evidence import Recorder, fingerprint
from ._findings import CAUSES, Finding, Verdict, judge
from ._replay import check_same_training

__all__ = [
    "CAUSES",
    "ENV_VAR",
    "Finding",
    "SameTraining",
    "Verdict",
    "check_same_training",
    "declared",
    "deliberate",
    "fingerprint",
]


class SameTraining:
    """Record the evidence of ``world_size`` rank threads while entered, then judge it.

    ``rank_of()`` says which rank the calling thread is (None for other threads);
    ``deliberate``: causes declared up front (as ``--deliberate``), added to those the
    script declares with :func:`deliberate` while running and to ``REDUCER_DELIBERATE``.
    """

    def __init__(
        self,
        world_size: int,
        rank_of: Callable[[], int | None] | None,
        *,
        deliberate: Iterable[str] = (),
        out: TextIO | None = None,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"SameTraining: world_size must be an int >= 1, got {world_size!r}")
        self.deliberate = _checked(deliberate, "--deliberate")
        self.recorder = Recorder(world_size, rank_of or (lambda: None))
        self.out = out
        self._verdict: Verdict | None = None

    def __enter__(self) -> SameTraining:
        with _LOCK:
            _DECLARED.clear()  # a previous run's declarations are not this one's
        self.recorder.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.recorder.__exit__(exc_type, exc, tb)

    @contextmanager
    def reporting(self) -> Iterator[SameTraining]:
        """Record while entered; then print the report (not after a Ctrl-C)."""
        with self:
            yield self
        self.print_report()

    def verdict(self) -> Verdict:
        """The verdict on what the ranks did (after they ended)."""
        if self._verdict is None:
            self._verdict = judge(self.recorder.ranks, self.deliberate | declared())
        return self._verdict

    def print_report(self, out: TextIO | None = None) -> None:
        """The report, each line prefixed with ``[same-training]``."""
        stream = out or self.out or sys.stderr
        text = self.verdict().report()
        stream.write("".join(f"[same-training] {line}\n" for line in text.split("\n")))
        stream.flush()
