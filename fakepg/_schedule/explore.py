"""How a schedule decides past its explicit choices: a random walk, or probabilistic
concurrency testing (PCT), each drawing what it needs lazily, for as long as the run has
choice points. See Note [Exploration] in :mod:`fakepg._schedule.timeline`.

# Guarantees: an exploration belongs to one Schedule; its methods are called by that
# schedule's scheduler, one decision at a time under the scheduler's lock, and between runs.
# What it draws is remembered, so that running the schedule again takes the same decisions.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

# A source of draws: ``draw(n)`` is an int in [0, n). Hypothesis's random (st.randoms()) draws
# from the example's data, so its draws shrink toward 0.
Draw = Callable[[int], int]

# Beyond this many draws in one run, the natural option (0) is taken: Hypothesis bounds what
# one example may draw, and no race found so far needed a deviation that late.
MAX_DRAWS = 2000

# PCT's base priorities are drawn from [0, _PRIORITIES); a lowered one is negative.
_PRIORITIES = 1 << 16


class Draws:
    """The draws of a source, remembered in order: the n-th draw of every run is the first
    run's n-th (what makes an explored schedule a value), drawn anew only past them."""

    def __init__(self, draw: Draw) -> None:
        self._draw: Draw | None = draw
        self._values: list[int] = []
        self._next = 0

    def rewind(self) -> None:
        self._next = 0

    def draw(self, n: int) -> int:
        if self._next < len(self._values):
            value = self._values[self._next] % n
        elif self._draw is None:
            value = 0
        else:
            try:
                value = int(self._draw(n)) % n
            except BaseException:
                # The source is spent: a Hypothesis example that drew all it may (it marks
                # itself overrun, and raises StopTest, which must not end a rank's thread) or
                # that is over. The rest of the run takes the natural order.
                self._draw, value = None, 0
            self._values.append(value)
        self._next += 1
        return value

    @property
    def count(self) -> int:
        return self._next


@dataclass
class Horizon:
    """The number of steps (choice points) a run is expected to have: the longest run seen so
    far by the schedules that share it (as Coyote's PCT scheduler learns it); ``steps`` until
    one was seen."""

    steps: int = 64

    def saw(self, steps: int) -> None:
        self.steps = max(self.steps, steps)


class Exploration:
    """Decides at each choice point past a schedule's explicit choices."""

    name = "natural"

    def __init__(self, draw: Draw) -> None:
        self.draws = Draws(draw)

    def start(self) -> None:
        """A run begins: the same draws again, in the same order."""
        self.draws.rewind()

    def decide(self, step: int, keys: Sequence[Hashable]) -> int:
        """The option to take at choice point ``step`` among ``len(keys)`` (``keys``: who each
        option runs, for priorities)."""
        return 0

    def finish(self, steps: int) -> None:
        """A run ended after ``steps`` choice points."""

    def describe(self) -> str:
        return self.name


class Walk(Exploration):
    """A uniform random choice at every choice point (up to :data:`MAX_DRAWS`)."""

    name = "walk"

    def decide(self, step: int, keys: Sequence[Hashable]) -> int:
        if self.draws.count >= MAX_DRAWS:
            return 0
        return self.draws.draw(len(keys))


@dataclass
class _Run:
    """One run's PCT state: the steps where a priority changes, and the lowered priorities."""

    changes: list[int] = field(default_factory=list)
    lowered: dict[Hashable, int] = field(default_factory=dict)


class Pct(Exploration):
    """Probabilistic concurrency testing (Burckhardt et al., ASPLOS 2010): every actor that
    runs (a rank's thread, a rank's callbacks, the completion of collectives) gets a random
    priority when first seen, and at each choice point the highest-priority option is taken;
    at ``depth - 1`` change points, drawn uniformly over the run's expected number of steps
    (``horizon``), the actor about to be chosen drops below every other. A bug of depth d is
    then hit with probability at least 1 / (n k^(d-1)) for n actors and k steps.

    All priorities equal (draws of 0, where Hypothesis shrinks them) is the natural order."""

    name = "pct"

    def __init__(self, draw: Draw, *, depth: int, horizon: Horizon) -> None:
        super().__init__(draw)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"Pct: depth must be an int >= 1, got {depth!r}")
        self.depth = depth
        self.horizon = horizon
        self._base: dict[Hashable, int] = {}
        self._run = _Run()

    def change_points(self) -> list[int]:
        """The change points of a run: ``depth - 1`` steps uniform over the horizon."""
        return sorted(self.draws.draw(self.horizon.steps) for _ in range(self.depth - 1))

    def start(self) -> None:
        super().start()
        self._base.clear()
        self._run = _Run(changes=self.change_points())

    def _priority(self, key: Hashable) -> int:
        lowered = self._run.lowered.get(key)
        if lowered is not None:
            return lowered
        base = self._base.get(key)
        if base is None:
            base = self._base[key] = self.draws.draw(_PRIORITIES)
        return base

    def _best(self, keys: Sequence[Hashable]) -> int:
        priorities = [self._priority(k) for k in keys]
        return priorities.index(max(priorities))  # ties: the first, as the natural order

    def decide(self, step: int, keys: Sequence[Hashable]) -> int:
        best = self._best(keys)
        for j, at in enumerate(self._run.changes):
            if at == step:
                self._run.lowered[keys[best]] = -(j + 1)
                best = self._best(keys)
        return best

    def finish(self, steps: int) -> None:
        self.horizon.saw(steps)

    @property
    def changes(self) -> tuple[int, ...]:
        """This run's change points."""
        return tuple(self._run.changes)

    def describe(self) -> str:
        return f"pct (depth {self.depth})"
