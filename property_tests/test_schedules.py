"""Property: under the fake world's controlled scheduler, a race is a schedule.

Every racy program shows its race under some schedule that Hypothesis finds and shrinks to
at most one switch away from the natural order or the adversarial one (which completes
collectives as late as allowed: a missing wait shows there with no switch at all), and fails
on every replay of it; every race-free
program gives the same bits under every schedule. The racy programs are the two shapes that
races between ranks and their collectives take: a tensor written while its collective is in
flight, and a result read without waiting for it. ``property_tests/test_mutants.py`` checks
that a scheduler which ignores its choices, or completes collectives at once, lets a race
through: the property then fails. A deadlock is reported as one under every schedule, with
its reason and what each rank waits for. And a schedule decides alike on a slow machine:
however late the fake world's own threads reach their turn, and whenever the monitor that
sees waits outside any point starts (with the run, or only once a holder holds the turn).
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

import fakepg
import fakepg._schedule.monitor
from fakepg import _threads
from fakepg._schedule.actors import Wake
from fakepg._schedule.scheduler import Scheduler
from fakepg.completion import Lane
from reducer.testing import fewest_deviations, schedules

SEARCH = settings(max_examples=200, database=None, deadline=None, derandomize=True)

Program = Callable[[fakepg.FakeProcessGroup], list[float]]


def write_in_flight(pg: fakepg.FakeProcessGroup) -> list[float]:
    t = torch.ones(2) * (pg.rank() + 1)
    work = pg.allreduce([t])
    t.div_(pg.size())  # written while the allreduce may not have read it
    work.wait()
    return t.tolist()


def read_without_waiting(pg: fakepg.FakeProcessGroup) -> list[float]:
    t, u = torch.ones(1) * (pg.rank() + 1), torch.ones(1) * (pg.rank() + 1)
    first, _second = pg.allreduce([t]), pg.allreduce([u])
    first.wait()  # the second allreduce is never waited for
    return t.tolist() + u.tolist()


def write_before_issuing(pg: fakepg.FakeProcessGroup) -> list[float]:
    t = (torch.ones(2) * (pg.rank() + 1)).div_(pg.size())
    pg.allreduce([t]).wait()
    return t.tolist()


def read_after_waiting(pg: fakepg.FakeProcessGroup) -> list[float]:
    t, u = torch.ones(1) * (pg.rank() + 1), torch.ones(1) * (pg.rank() + 1)
    works = [pg.allreduce([t]), pg.allreduce([u])]
    for work in works:
        work.wait()
    return t.tolist() + u.tolist()


RACY: dict[str, tuple[Program, list[list[float]]]] = {
    "write in flight": (write_in_flight, [[1.5, 1.5]] * 2),
    "read without waiting": (read_without_waiting, [[3.0, 3.0]] * 2),
}
RACE_FREE: dict[str, tuple[Program, list[list[float]]]] = {
    "write before issuing": (write_before_issuing, [[1.5, 1.5]] * 2),
    "read after waiting": (read_after_waiting, [[3.0, 3.0]] * 2),
}


def race_is_found_and_shrunk(name: str) -> None:
    """The property for the racy program ``name``: some schedule shows its race, shrunk to
    at most one switch from the natural or the adversarial order, and every replay of that
    schedule shows it."""
    program, right = RACY[name]

    def wrong(schedule: fakepg.Schedule) -> bool:
        return fakepg.run(program, 2, schedule=schedule, timeout=20) != right

    found = fewest_deviations(find(schedules(), wrong, settings=SEARCH), wrong)
    switches = sum(1 for c in found.choices if c)
    assert switches == 1 or (switches == 0 and found.adversarial), found
    for _ in range(20):
        assert wrong(fakepg.Schedule(found.choices, adversarial=found.adversarial))


@pytest.mark.parametrize("name", sorted(RACY))
def test_a_race_is_a_schedule_found_and_shrunk(name: str) -> None:
    race_is_found_and_shrunk(name)


@pytest.mark.parametrize("name", sorted(RACE_FREE))
@given(schedule=schedules())
@settings(max_examples=25, deadline=None)
def test_race_free_code_gives_the_same_bits_under_every_schedule(
    name: str, schedule: fakepg.Schedule
) -> None:
    program, right = RACE_FREE[name]
    assert fakepg.run(program, 2, schedule=schedule, timeout=20) == right


# -------------------------------------------------------------------------------------------
# The exploration itself: PCT reaches the whole run; completions, replays and C++ waits.

PCT = settings(max_examples=100, database=None, deadline=None, derandomize=True)


def after_a_prefix(pg: fakepg.FakeProcessGroup) -> list[float]:
    """As a DDP class's constructor does: a broadcast per parameter first, then the race."""
    for _ in range(10):
        pg.broadcast([torch.ones(1)], 0).wait()
    return write_in_flight(pg)


def change_points_reach_the_end() -> None:
    """Property: under PCT, a change point falls in the last quarter of a run's choice points
    for some drawn schedule (they are uniform over the run, not its first steps); and PCT
    alone finds a race that follows a constructor's broadcasts."""

    def late_change(schedule: fakepg.Schedule) -> bool:
        fakepg.run(after_a_prefix, 2, schedule=schedule, timeout=20)
        changes = getattr(schedule.explore, "changes", ())
        return any(c >= 0.75 * schedule.used for c in changes if c < schedule.used)

    find(schedules(explore="pct", depth=2), late_change, settings=PCT)

    def wrong(schedule: fakepg.Schedule) -> bool:
        return fakepg.run(after_a_prefix, 2, schedule=schedule, timeout=20) != [[1.5, 1.5]] * 2

    find(schedules(explore="pct", adversarial=False), wrong, settings=PCT)


def test_pct_change_points_reach_the_end_of_the_run() -> None:
    change_points_reach_the_end()


def two_in_flight(pg: fakepg.FakeProcessGroup) -> list[float]:
    """Two collectives in flight at once; the callbacks of each rank note which completed
    first (1.0: the first issued, 2.0: the second)."""
    order: list[float] = []
    works = [pg.allreduce([torch.ones(1)]) for _ in range(2)]
    for i, work in enumerate(works):

        def note(_f: object, i: int = i) -> None:
            order.append(float(i + 1))

        work.get_future().then(note)
    for work in works:
        work.wait()
    return order


def every_completion_order_is_drawn() -> None:
    """Property: of two collectives in flight together, either may complete first: some
    schedule completes the later one first, on every replay of it; and that order is one
    switch away from the natural one (the later collective completed at one point where the
    earlier one would), which the shrinking reports: the schedule this search finds deviates
    at several points, and dropping them one at a time leaves more than one, so the single
    switch is found only by fewest_deviations' last stage."""

    def newest_first(schedule: fakepg.Schedule) -> bool:
        return fakepg.run(two_in_flight, 2, schedule=schedule, timeout=20)[0][:1] == [2.0]

    found = find(schedules(), newest_first, settings=SEARCH)
    for _ in range(5):
        assert newest_first(found.recorded())
    shrunk = fewest_deviations(found, newest_first)
    assert sum(1 for c in shrunk.choices if c) == 1, (found.recorded(), shrunk)
    for _ in range(5):
        assert newest_first(shrunk)


def test_every_completion_order_is_drawn() -> None:
    every_completion_order_is_drawn()


def issues_twice(pg: fakepg.FakeProcessGroup) -> list[float]:
    """Each rank issues two collectives back to back, then waits for both."""
    works = [pg.allreduce([torch.ones(1) * (pg.rank() + 1 + k)]) for k in range(2)]
    for work in works:
        work.wait()
    return [float(k) for k in range(2)]


def issue_order(schedule: fakepg.Schedule) -> list[tuple[int | None, str]]:
    fakepg.run(issues_twice, 2, schedule=schedule, timeout=20)
    return [(e.rank, e.collective[:12]) for e in schedule.timeline if e.event == "issue"]


def a_rank_is_preempted_at_its_issue() -> None:
    """Property: a rank may be preempted right after it issues a collective (an issue is a
    point at which any other actor may run): some schedule has rank 1 issue its first
    collective between rank 0's first and second (in the natural order each rank issues
    both before the other runs), on every replay of it."""
    wanted = [(0, "allreduce #0"), (1, "allreduce #0"), (0, "allreduce #1"), (1, "allreduce #1")]

    def interleaved(schedule: fakepg.Schedule) -> bool:
        return issue_order(schedule) == wanted

    assert not interleaved(fakepg.Schedule())
    found = find(schedules(), interleaved, settings=SEARCH)
    for _ in range(5):
        assert interleaved(found.recorded())


def test_a_rank_is_preempted_at_its_issue() -> None:
    a_rank_is_preempted_at_its_issue()


PROGRAMS: dict[str, Program] = {
    "two in flight": two_in_flight,
    "write in flight": write_in_flight,
    "read without waiting": read_without_waiting,
}


def replay_is_the_run(name: str, schedule: fakepg.Schedule) -> None:
    """Property: a schedule that ran prints as one that, pasted back, takes every step the
    run took (completion policy included) and gives the same results. Before its first run,
    a drawn schedule has taken no decision and prints as drawn as it runs."""
    program = PROGRAMS[name]
    if schedule.explore is not None:
        assert schedule.choices == () and schedule.used == 0 and schedule.timeline == []
        mode = ", adversarial=True" if schedule.adversarial else ""
        assert repr(schedule).endswith(f", drawn as it runs>{mode})"), repr(schedule)
    first = fakepg.run(program, 2, schedule=schedule, timeout=20)
    pasted = eval(repr(schedule), {"Schedule": fakepg.Schedule})
    assert fakepg.run(program, 2, schedule=pasted, timeout=20) == first, (schedule, pasted)
    assert pasted.timeline == schedule.timeline, (schedule, pasted)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@given(schedule=schedules())
@settings(max_examples=25, deadline=None)
def test_a_printed_schedule_replays_its_run(name: str, schedule: fakepg.Schedule) -> None:
    replay_is_the_run(name, schedule)


def ddp_step(pg: fakepg.FakeProcessGroup) -> list[float]:
    """torch's C++ DDP: each rank waits for its buckets inside backward, in C++."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    model(torch.ones(1, 2) * (pg.rank() + 1)).sum().backward()
    return [float(g) for p in model.parameters() for g in p.grad.reshape(-1)]  # type: ignore[union-attr]


def monitor_starts(*, lazily: bool) -> None:
    """The next run's monitor thread starts with the run, or only once a holder has held the
    turn for a while, as after a run that took someone outside or one that took nobody (Note
    [How often the monitor looks] in fakepg._schedule.monitor): both must see every wait
    outside a point."""
    fakepg._schedule.monitor._last_run_outside = not lazily


def ddp_averages_under_schedule(
    world_size: int, schedule: fakepg.Schedule, *, lazily: bool = False
) -> None:
    """Property: torch's DDP averages under every schedule (a rank blocked in C++ backward is
    seen as blocked, and the others go on), within a short timeout, whenever the monitor
    starts."""
    monitor_starts(lazily=lazily)
    grads = fakepg.run_torch(ddp_step, world_size, schedule=schedule, timeout=5)
    mean = sum(r + 1 for r in range(world_size)) / world_size
    assert grads == [[mean, mean, 1.0]] * world_size, grads


@given(world_size=st.integers(1, 3), schedule=schedules(), lazily=st.booleans())
@settings(max_examples=10, deadline=None)
def test_torch_ddp_averages_under_every_schedule(
    world_size: int, schedule: fakepg.Schedule, lazily: bool
) -> None:
    ddp_averages_under_schedule(world_size, schedule, lazily=lazily)


def sends_first(pg: fakepg.FakeProcessGroup) -> list[float]:
    """Every rank sends to the next one before it receives from the previous one, waiting
    for each: every send waits for a receive that is never issued."""
    size, rank = pg.size(), pg.rank()
    pg.send([torch.ones(1)], (rank + 1) % size).wait()
    pg.recv([torch.ones(1)], (rank - 1) % size).wait()
    return []


def deadlock_is_reported(world_size: int, schedule: fakepg.Schedule) -> None:
    """Property: under every schedule, a ring of ranks that each send before receiving is a
    deadlock, reported as one (not a timeout) with its reason: no actor can move; what each
    rank waits for; and, in its note, the lowest stuck rank."""
    with pytest.raises(fakepg.ScheduleDeadlock) as failure:
        fakepg.run(sends_first, world_size, schedule=schedule, timeout=20)
    text = str(failure.value)
    assert text.startswith(
        "fakepg: deadlock under the controlled schedule (no actor can move); "
    ), text
    for rank in range(world_size):
        assert f"rank {rank} waits for send/recv #0" in text, text
    # Reported for the lowest stuck rank (every rank is stuck here).
    notes = getattr(failure.value, "__notes__", [])
    assert f"raised on rank 0 of {world_size} in fakepg.run" in notes, notes


@given(world_size=st.integers(2, 3), schedule=schedules())
@settings(max_examples=10, deadline=None)
def test_a_deadlock_is_reported_with_its_reason(world_size: int, schedule: fakepg.Schedule) -> None:
    deadlock_is_reported(world_size, schedule)


def callbacks_on_every_lane(pg: fakepg.FakeProcessGroup) -> list[float]:
    """Three collectives, each with a callback on the rank's lane, waited for through it:
    every lane runs a callback, goes idle, and is woken for the next. First the rank starts a
    helper thread, as training code does (a prefetcher, a logger): it waits in Thread.start
    for that thread to run, holding the turn."""
    threading.Thread(target=lambda: None, name="a rank's helper", daemon=True).start()
    out = []
    for i in range(3):
        future = pg.allreduce([torch.ones(1) * (pg.rank() + i)]).get_future()
        out.append(float(future.then(lambda f: f.value()[0] * 2).wait()))
    return out


@contextlib.contextmanager
def slow_machine(how: str, delay_s: float) -> Iterator[None]:
    """The fake world's own threads as a busy machine runs them, ``delay_s`` late:

    - ``"wakes"``: a lane woken for its next callback sleeps on in its idle wait (its wake
      reaches it late, as a thread that waits for a core or for the GIL);
    - ``"pauses"``: a lane on its way to its next callback stops in a wait of its own, which
      the monitor takes for blocked outside (it is not: it comes back by itself);
    - ``"starts"``: a new thread runs late, so whoever starts one waits in ``Thread.start``."""
    with pytest.MonkeyPatch.context() as patch:
        if how == "starts":
            # Every job on a new thread (none idle), each late to run: whoever starts one (a
            # deciding holder posting a callback to a lane with no thread) waits in
            # Thread.start, a wait for a thread, never for the world.
            patch.setattr(_threads, "_idle", _NoneIdle())
            bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

            def late_start(self: threading.Thread) -> None:
                time.sleep(delay_s)
                bootstrap(self)

            patch.setattr(threading.Thread, "_bootstrap_inner", late_start)
        elif how == "wakes":
            init = Lane.__init__

            def late_wakes(self: Lane, owner: Any, rank: int, level: int) -> None:
                init(self, owner, rank, level)
                self.wake = _LateWake(self.wake, owner.lock, delay_s)  # type: ignore[assignment]

            patch.setattr(Lane, "__init__", late_wakes)
        else:
            acquire = Scheduler.lane_acquire

            def paused(self: Scheduler, rank: int, level: int) -> None:
                threading.Event().wait(delay_s)
                acquire(self, rank, level)

            patch.setattr(Scheduler, "lane_acquire", paused)
        yield


class _NoneIdle(list):  # type: ignore[type-arg]
    """The kept threads' idle list, seen as empty by a job's start (a new thread for every
    job); the threads still put themselves in it, and leave it once idle for long."""

    def __bool__(self) -> bool:
        return False


class _LateWake:
    """A lane's condition whose ``notify`` reaches the waiting lane ``delay_s`` late; its
    ``wait`` is the condition's own, so the lane sleeps in the very frame it always does."""

    def __init__(self, cond: threading.Condition, lock: Any, delay_s: float) -> None:
        self._cond, self._lock, self._delay_s = cond, lock, delay_s
        self.wait = cond.wait
        self.notify_all = cond.notify_all

    def notify(self) -> None:
        def late() -> None:
            with self._lock:
                self._cond.notify()

        timer = threading.Timer(self._delay_s, late)
        timer.daemon = True
        timer.start()


def a_slow_machine_decides_alike(
    world_size: int, schedule: fakepg.Schedule, how: str, delay_s: float
) -> None:
    """Property: a schedule decides alike however late the fake world's own threads reach
    their turn. Lanes woken late, and threads started late, take every step the undelayed run
    took (a lane's idle wait and a thread's start are no waits for the world: nothing here is
    ever blocked outside), and lanes taken for blocked outside on their way come back at their
    wait for the turn: the run ends, with the same results, never a deadlock."""
    first = fakepg.run(callbacks_on_every_lane, world_size, schedule=schedule, timeout=10)
    timeline = list(schedule.timeline)
    assert not [e for e in timeline if e.event == "blocked outside"], schedule.format()
    with slow_machine(how, delay_s):
        again = fakepg.run(callbacks_on_every_lane, world_size, schedule=schedule, timeout=10)
    assert again == first
    if how != "pauses":
        assert schedule.timeline == timeline, schedule.format()


@given(
    world_size=st.integers(1, 3),
    schedule=schedules(),
    how=st.sampled_from(["wakes", "pauses", "starts"]),
    delay_s=st.sampled_from([0.002, 0.01]),
)
@settings(max_examples=10, deadline=None)
def test_a_slow_machine_decides_alike(
    world_size: int, schedule: fakepg.Schedule, how: str, delay_s: float
) -> None:
    a_slow_machine_decides_alike(world_size, schedule, how, delay_s)


def waits_on_its_callbacks_event(pg: fakepg.FakeProcessGroup) -> list[float]:
    """A rank that waits for its collective's callback on a threading.Event, as this
    project's DDP waits for a comm hook's future: a wait no scheduling point sees."""
    done = threading.Event()
    t = torch.ones(1) * (pg.rank() + 1)
    pg.allreduce([t]).get_future().then(lambda _: done.set())
    assert done.wait(30)
    return t.tolist()


def a_wait_outside_is_seen(
    world_size: int, schedule: fakepg.Schedule, *, lazily: bool = False
) -> None:
    """Property: a rank asleep in a wait of the threading module that no point sees (an Event
    its callback sets) is seen blocked outside, under every schedule, whenever the monitor
    starts: the others go on, the callback runs, the rank wakes, and the sum is exact, well
    within a short timeout."""
    monitor_starts(lazily=lazily)
    results = fakepg.run(waits_on_its_callbacks_event, world_size, schedule=schedule, timeout=5)
    total = float(sum(range(1, world_size + 1)))
    assert results == [[total]] * world_size, results


@given(world_size=st.integers(1, 3), schedule=schedules(), lazily=st.booleans())
@settings(max_examples=10, deadline=None)
def test_a_wait_outside_any_point_is_seen(
    world_size: int, schedule: fakepg.Schedule, lazily: bool
) -> None:
    a_wait_outside_is_seen(world_size, schedule, lazily=lazily)


def callbacks_issue_collectives(pg: fakepg.FakeProcessGroup) -> list[float]:
    """Each rank's callback of its first collective issues a second one and chains a callback
    to it, which runs on the rank's lane of level 1 (Note [Completion lanes])."""

    def then(f: torch.futures.Future[list[torch.Tensor]]) -> torch.futures.Future[torch.Tensor]:
        inner = pg.allreduce([f.value()[0] * 2]).get_future()
        return inner.then(lambda g: g.value()[0] + 1)

    outer = pg.allreduce([torch.ones(1) * (pg.rank() + 1)]).get_future().then(then)
    return [float(outer.wait().wait())]


_ACTOR = re.compile(r"rank (\d+)( callbacks( \(level ([1-9]\d*)\))?)?")


_EVENTS = {"run", "issue", "wait", "resume", "complete", "callback", "return", "blocked outside"}


def the_timeline_names_every_actor(world_size: int, schedule: fakepg.Schedule) -> None:
    """Property: every step of a timeline names who took it as errors and printed schedules
    do: "world" for a completion; "rank r" for a rank's own thread (the only actors that
    return); "rank r callbacks" for its lane of level 0, "rank r callbacks (level k)" for a
    deeper one (the only actors that run callbacks: here #0's at level 0, #1's, which #0's
    callback issues, a level deeper than that callback ran), r being the step's rank. Each
    step is one of the documented events; a completion and a callback name their collective;
    an issue and a completion show what the collective moves, the other steps nothing (a
    run, a return, a callback); a step where the turn goes to an actor follows another
    actor's step, and is a "resume" of what it waited for if it waited, else a "run"; and
    the steps a choice decided show, in order, the non-zero decisions of the run."""
    results = fakepg.run(callbacks_issue_collectives, world_size, schedule=schedule, timeout=10)
    total = float(sum(range(1, world_size + 1)))
    assert results == [[2 * total * world_size + 1]] * world_size, results
    marks = [e.choice[0] for e in schedule.timeline if e.choice is not None]
    assert marks == [c for c in schedule.recorded().choices if c], schedule.format()
    on_lanes: set[int | None] = set()  # the ranks whose #0 callback ran on a lane
    previous = None
    waits: dict[str, str] = {}  # actor -> what it waits for, from its "wait" to its "resume"
    for e in schedule.timeline:
        assert e.event in _EVENTS, e
        if e.event == "wait":
            waits[e.actor] = e.collective
        elif e.event in ("resume", "run"):
            # The turn goes back to a waiting actor as a "resume" of what it waited for; to
            # one parked at a point as a "run".
            assert e.collective == waits.pop(e.actor, ""), schedule.format()
            assert (e.event == "resume") == bool(e.collective), schedule.format()
        if e.event in ("complete", "callback"):
            assert re.fullmatch(r"allreduce #[01] \(op=SUM\)", e.collective), e
        if e.event in ("complete", "issue"):
            assert e.tensors == "float32[1]", e
        if e.event in ("run", "return", "blocked outside", "callback"):
            assert e.tensors == "" and (e.event == "callback" or e.collective == ""), e
        if e.event in ("run", "resume"):
            assert previous is None or previous.actor != e.actor, schedule.format()
        previous = e
        if e.actor == "world":
            assert e.event == "complete" and e.rank is None, e
            continue
        named = _ACTOR.fullmatch(e.actor)
        assert named is not None and int(named[1]) == e.rank, e
        if e.event == "callback":  # (none where a collective completed before its then())
            # #1 is issued from #0's callback: its callback runs a level deeper than #0's ran
            # (on the rank's thread, and no step, where #0 had completed before its then()).
            first = e.collective.startswith("allreduce #0")
            level = 0 if first else int(e.rank in on_lanes)
            assert named[2] and int(named[4] or 0) == level, e
            if first:
                on_lanes.add(e.rank)
        if e.event == "return":
            assert not named[2], e


@given(world_size=st.integers(1, 3), schedule=schedules())
@settings(max_examples=10, deadline=None)
def test_the_timeline_names_every_actor(world_size: int, schedule: fakepg.Schedule) -> None:
    the_timeline_names_every_actor(world_size, schedule)


def callbacks_run_in_each_policys_order(world_size: int, first: int, adversarial: bool) -> None:
    """Property: a collective's callbacks, posted to its ranks' lanes in the order the ranks
    chained them, run oldest first in the natural order, newest first in the adversarial one
    (Note [Controlled scheduling]), whichever rank runs first (the one choice drawn here)."""
    schedule = fakepg.Schedule([first], adversarial=adversarial)
    fakepg.run(callbacks_on_every_lane, world_size, schedule=schedule, timeout=10)
    for k in range(3):
        name = f"allreduce #{k} (op=SUM)"
        issued = [e.rank for e in schedule.timeline if e.event == "issue" and e.collective == name]
        ran = [e.rank for e in schedule.timeline if e.event == "callback" and e.collective == name]
        assert sorted(issued) == list(range(world_size)), schedule.format()
        assert ran == (issued[::-1] if adversarial else issued), schedule.format()


@given(
    world_size=st.integers(2, 4),
    first=st.integers(0, 3),
    adversarial=st.booleans(),
)
@settings(max_examples=20, deadline=None)
def test_callbacks_run_in_each_policys_order(
    world_size: int, first: int, adversarial: bool
) -> None:
    callbacks_run_in_each_policys_order(world_size, first, adversarial)


# Choices that are not a sequence or mapping of ints, and the message each gets.
_NOT_CHOICES: dict[str, tuple[object, str]] = {
    "a string": ("01", "Schedule: choices must be a sequence of ints, got '01'"),
    "a number": (3, "Schedule: choices must be a sequence of ints, got 3"),
    "a negative choice at a point": (
        {0: -2},
        "Schedule: the choice at point 0 must be an int >= 0, got -2",
    ),
    "a negative point": ({-1: 1}, "Schedule: a choice's point must be an int >= 0, got -1"),
    "a point not an int": ({"a": 1}, "Schedule: a choice's point must be an int >= 0, got 'a'"),
}


@st.composite
def schedule_arguments(draw: st.DrawFn) -> tuple[object, object, object, str | None]:
    """Arguments of ``Schedule`` and the message they must get (None: taken): valid choices
    (a list or a mapping of ints >= 0), or a list with one wrong entry after a drawn prefix
    of valid ones (the message names its index), or another wrong kind; a bool
    ``adversarial`` or not; no exploration or a string in its place."""
    # (one wrong entry thrice: a zero before it is the corner an off-by-one check misses)
    kinds = ["list", "mapping", *["one wrong entry"] * 3, *_NOT_CHOICES]
    kind = draw(st.sampled_from(kinds))
    expected: str | None = None
    choices: object
    if kind == "list":
        choices = draw(st.lists(st.integers(0, 5), max_size=6))
    elif kind == "mapping":
        choices = draw(st.dictionaries(st.integers(0, 9), st.integers(0, 5), max_size=3))
    elif kind == "one wrong entry":
        prefix = draw(st.lists(st.sampled_from([0, 0, 1, 3]), max_size=4))
        wrong = draw(st.sampled_from([-1, -7, True, False, 1.0, "1", None]))
        choices = [*prefix, wrong, *draw(st.lists(st.integers(0, 3), max_size=2))]
        expected = f"Schedule: choices[{len(prefix)}] must be an int >= 0, got {wrong!r}"
    else:
        choices, expected = _NOT_CHOICES[kind]
    adversarial = draw(st.sampled_from([False, True, 1, None]))
    explore = draw(st.sampled_from([None, "walk"]))
    if expected is None and not isinstance(adversarial, bool):
        expected = f"Schedule: adversarial must be a bool, got {adversarial!r}"
    if expected is None and explore is not None:
        expected = (
            "Schedule: explore must be an exploration (draw one with "
            f"reducer.testing.schedules()), got {explore!r}"
        )
    return choices, adversarial, explore, expected


def a_schedule_takes_its_arguments_or_names_them(
    choices: object, adversarial: object, explore: object, expected: str | None
) -> None:
    """Property: ``Schedule`` takes choices (a sequence of ints >= 0, or a mapping from
    points >= 0 to such ints), a bool ``adversarial`` and an exploration or None, and refuses
    anything else with a ValueError that names the argument, the index or point, and what was
    given; a schedule not yet run has an empty timeline, no choice point used, and prints as
    its choices (the points that are not 0) and policy, which paste back."""
    if expected is None:
        schedule = fakepg.Schedule(choices, adversarial=adversarial)  # type: ignore[arg-type]
        assert schedule.timeline == [] and schedule.used == 0
        pasted = eval(repr(schedule), {"Schedule": fakepg.Schedule})
        sparse = {i: c for i, c in enumerate(schedule.choices) if c}  # (trailing zeros: none)
        assert {i: c for i, c in enumerate(pasted.choices) if c} == sparse, repr(schedule)
        assert pasted.adversarial == adversarial
        return
    with pytest.raises(ValueError, match="^" + re.escape(expected) + "$"):
        fakepg.Schedule(choices, adversarial=adversarial, explore=explore)  # type: ignore[arg-type]


@given(schedule_arguments())
def test_a_schedule_takes_its_arguments_or_names_them(
    case: tuple[object, object, object, str | None],
) -> None:
    a_schedule_takes_its_arguments_or_names_them(*case)


def the_baton_wakes_its_waiter_however_often_signalled(signals: list[int]) -> None:
    """Property: an actor's wait for the turn (fakepg._schedule.actors.Wake) ends once it is
    signalled, however many signals come while it waits (a hand-over, then an abort), and a
    wait that no signal ends times out; no signal ever fails."""
    lock, wake = threading.Lock(), Wake()
    for count in signals:
        ended = threading.Event()

        def waiter(timeout: float, ended: threading.Event) -> None:
            with lock:
                wake.wait_locked(lock, timeout)
            ended.set()

        thread = threading.Thread(target=waiter, args=(0.02 if count == 0 else 30.0, ended))
        thread.start()
        while True:  # until it waits (its flag is set under the lock, as it releases it)
            with lock:
                if wake.waiting:
                    break
            time.sleep(0.0005)
        with lock:
            for _ in range(count):
                wake.signal_locked()
        assert ended.wait(10), f"a wait signalled {count} time(s) did not end"
        thread.join(10)


@given(signals=st.lists(st.integers(0, 3), min_size=1, max_size=4))
@settings(max_examples=20, deadline=None)
def test_the_baton_wakes_its_waiter_however_often_signalled(signals: list[int]) -> None:
    the_baton_wakes_its_waiter_however_often_signalled(signals)


def wakes_then_issues(pg: fakepg.FakeProcessGroup, *, slow: str) -> list[float]:
    """A rank that waits outside any point for its collective's callback (a threading.Event),
    then issues a second collective. ``slow``: "rank", the rank takes 3 ms to reach that issue
    once woken; "lane", the callback takes 3 ms to return after waking it (so the rank is
    back at a point first)."""
    done = threading.Event()
    first = torch.ones(1) * (pg.rank() + 1)

    def then(_: object) -> None:
        done.set()
        if slow == "lane":
            time.sleep(0.003)

    pg.allreduce([first]).get_future().then(then)
    assert done.wait(30)
    if slow == "rank":
        time.sleep(0.003)
    second = first * 2
    pg.allreduce([second]).wait()
    return [*first.tolist(), *second.tolist()]


def an_outside_threads_speed_decides_nothing(
    world_size: int, schedule: fakepg.Schedule, lazily: bool
) -> None:
    """Property: a thread that was blocked outside any point and is woken by the segment that
    runs (a callback sets its Event) is waited for before the next decision, until it is back
    at a point or blocked again (Note [Blocked outside the scheduler]): so the decisions do not
    depend on whether it gets there before the segment ends or after. A run where the woken
    rank is slow and one where the callback is slow take the same steps, to the same sums."""
    runs = []
    for slow in ("rank", "lane"):
        monitor_starts(lazily=lazily)
        results = fakepg.run(
            functools.partial(wakes_then_issues, slow=slow),
            world_size,
            schedule=schedule,
            timeout=10,
        )
        total = float(sum(range(1, world_size + 1)))
        assert results == [[total, 2 * total * world_size]] * world_size, results
        runs.append([(e.actor, e.event, e.collective, e.choice) for e in schedule.timeline])
    assert runs[0] == runs[1], schedule.format()


@given(world_size=st.integers(1, 3), schedule=schedules(), lazily=st.booleans())
@settings(max_examples=10, deadline=None)
def test_an_outside_threads_speed_decides_nothing(
    world_size: int, schedule: fakepg.Schedule, lazily: bool
) -> None:
    an_outside_threads_speed_decides_nothing(world_size, schedule, lazily)


def the_monitors_start_decides_nothing(
    world_size: int, schedule: fakepg.Schedule, workload: str
) -> None:
    """Property: when the monitor thread starts (with the run, or once a holder has held the
    turn for a while) changes when a wait outside a point is seen, never what the schedule
    decides: both runs take the same steps, "blocked outside" included, to the same results.
    And a run that took nobody outside lets the next start lazily; one that took someone,
    not."""
    run: Callable[[], object] = {
        "event": lambda: fakepg.run(
            waits_on_its_callbacks_event, world_size, schedule=schedule, timeout=5
        ),
        "callbacks": lambda: fakepg.run(
            callbacks_on_every_lane, world_size, schedule=schedule, timeout=5
        ),
    }[workload]
    monitor_starts(lazily=False)
    first = run()
    timeline = list(schedule.timeline)
    outside = any(e.event == "blocked outside" for e in timeline)
    assert fakepg._schedule.monitor._last_run_outside == outside
    monitor_starts(lazily=True)
    again = run()
    assert again == first
    assert schedule.timeline == timeline, schedule.format()
    assert fakepg._schedule.monitor._last_run_outside == outside


@given(
    world_size=st.integers(1, 3),
    schedule=schedules(),
    workload=st.sampled_from(["event", "callbacks"]),
)
@settings(max_examples=10, deadline=None)
def test_the_monitors_start_decides_nothing(
    world_size: int, schedule: fakepg.Schedule, workload: str
) -> None:
    the_monitors_start_decides_nothing(world_size, schedule, workload)
