"""Static graph: what the reducer records in the first iteration and expects after it.

# Note [Static graph]
# With static_graph=True the reducer trusts that every iteration runs the same graph. The
# first iteration only counts how often each parameter's hook fires (reentrant checkpointing
# fires some several times) and reduces everything once backward has ended, without overlap.
# Later iterations skip the graph search: the parameters unused in the first iteration are
# marked ready at the first hook call, and a parameter is ready when its hook has fired as
# often as it did in the first iteration. The first iteration's used map is kept.
# The end-of-backward reduction of the first iteration is queued at the first hook call, on
# the graph task that runs it. Inside reentrant checkpointing that is an inner backward, which
# ends before the outer one has produced every gradient; so a caller that sees the outer
# backward start (the DDP wrapper's output sink) queues it there first, with
# ``Reducer._queue_recorded_finalize``.
"""

from __future__ import annotations

__all__: list[str] = []


class StaticGraph:
    """The reducer's static-graph record: per replica and parameter, how many hook calls
    the first iteration saw, and how many this iteration still expects.

    The reducer reads and updates the per-iteration fields (``recording``, ``counting``,
    ``remaining``) straight from its hook, under its lock; the transitions between
    iterations are methods here. See Note [Static graph].
    """

    __slots__ = (
        "counting",
        "enabled",
        "finalize_queued",
        "globally_used",
        "hook_counts",
        "recording",
        "remaining",
    )

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        # This iteration is the first: hook calls are counted in ``counting``, nothing is
        # marked ready before backward ends.
        self.recording = False
        # The first iteration's end-of-backward reduction is queued already.
        self.finalize_queued = False
        self.counting: list[list[int]] = []
        # The first iteration's counts, once it finished.
        self.hook_counts: list[list[int]] | None = None
        # Later iterations: the hook calls each parameter still gets before it is ready.
        self.remaining: list[list[int]] | None = None
        # The first iteration's used map (see Note [Unused parameters] in reducer.reducer).
        self.globally_used: list[int] | None = None

    def start_iteration(self, replicas: int, count: int) -> None:
        """Reset for a new iteration of ``replicas`` x ``count`` parameters: record (the
        first one), or expect the recorded calls (later ones). Not enabled: nothing to do."""
        self.recording = False
        self.remaining = None
        if not self.enabled:
            return
        if self.hook_counts is not None:
            self.remaining = [list(counts) for counts in self.hook_counts]
        else:
            self.recording, self.finalize_queued = True, False
            self.counting = [[0] * count for _ in range(replicas)]

    def recorded_unused(self) -> set[tuple[int, int]]:
        """(replica, parameter) pairs whose hook never fired in the first iteration."""
        assert self.hook_counts is not None
        return _uncalled(self.hook_counts)

    def end_recording(self) -> set[tuple[int, int]]:
        """The first iteration's backward ended: its counts become the record. Returns the
        parameters it found unused (their hook never fired)."""
        self.hook_counts = self.counting
        return _uncalled(self.counting)

    def end_iteration(self, globally_used: list[int] | None) -> None:
        """A synced iteration finished; the first one's used map is kept for good."""
        if self.recording:
            self.globally_used = globally_used
        self.recording = False


def _uncalled(counts: list[list[int]]) -> set[tuple[int, int]]:
    return {
        (r, i)
        for r, per_replica in enumerate(counts)
        for i, calls in enumerate(per_replica)
        if calls == 0
    }
