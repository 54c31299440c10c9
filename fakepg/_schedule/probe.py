"""Looking at a thread from another one: where it is (its innermost Python frame, where that
is a place it may wait for the world without a scheduling point), whether the OS has it
asleep, and how much CPU time it has had. See Note [Blocked outside the scheduler] in
:mod:`fakepg.schedule`.

# Note [A look at a thread]
# A look costs a few microseconds: the CPU time comes from the thread's CPU clock (one
# clock_gettime, Linux's per-thread clock id made from its native id), the state from one
# positional read of /proc/self/task/<tid>/stat, opened at the probe's first look and kept
# open (each read makes the kernel write the file anew; opening it each time, a path lookup
# in /proc, cost twice the read: 12 against 4 microseconds on an idle machine, 34 under
# load, 14 looks per scheduled example of torch's DDP), and the frame only when the CPU time
# says the thread may have moved since the last look (a thread that has not run is where it
# was). The CPU time is read first and last: only a look during which the thread did not run
# at all is taken as what it says, so that the state, the frame and the CPU time describe
# one moment (the file read releases the GIL: a thread just woken may run then and block
# elsewhere, on the scheduler's lock say; read in another order, its old CPU time and new
# state looked like its old wait).
# It was two opens of /proc files and every thread's frames per look, about 70 microseconds.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import weakref
from types import FrameType
from typing import Any

# (where, state, ran): where is (frame id, instruction) if the innermost frame is a blocking
# site, else None; state as /proc shows it ("S" asleep, "D" asleep uninterruptibly, "R"
# running or runnable, "?" unknown); ran the CPU time in ns (None where the OS does not say).
Sample = tuple[Any, str, int | None]

HAS_PROC = os.path.isdir("/proc/self/task")
_SCHEDULE_DIR = os.path.dirname(os.path.abspath(__file__))
FAKEPG_DIR = os.path.dirname(_SCHEDULE_DIR)


def asleep(sample: Sample) -> bool:
    """Asleep at a blocking site in this look."""
    return sample[0] is not None and sample[1] in ("S", "D")


def stalled(samples: list[Sample], count: int) -> bool:
    """The last ``count`` looks show the thread asleep at one blocking site, without having run
    in between (where the OS does not say, look three times as often)."""
    if not HAS_PROC:
        count *= 3  # the frame alone says less: look longer
    last = samples[-count:]
    if len(last) < count:
        return False
    where, ran = last[0][0], last[0][2]
    return where is not None and all(
        w == where and state in ("S", "D") and r == ran for w, state, r in last
    )


class ThreadProbe:
    """Looks at one thread. See Note [A look at a thread]."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        tid = thread.native_id
        self._stat = f"/proc/self/task/{tid}/stat" if HAS_PROC and tid is not None else None
        self._fd: int | None = None  # the stat file, once opened (closed with the probe)
        # Linux's clock id of one thread's CPU time (glibc's pthread_getcpuclockid, from the
        # native id: unlike a pthread handle, it stays safe to use once the thread has ended).
        self._clock = ((~tid) << 3) | 6 if self._stat is not None and tid is not None else None

    def look(self, last: Sample | None = None) -> Sample:
        """Where the thread is, its state and its CPU time; ``last``: the previous look, whose
        ``where`` still holds if the thread has not run since.

        The CPU time is read before and after the rest: a thread that ran in between (its state
        and frame then belong to different moments) shows as running. Reading the files and
        the frames releases the GIL, so it may run then."""
        thread = self.thread
        if thread.ident is None:
            return (None, "?", None)
        if self._clock is None or self._stat is None:
            return (self._where(), "S", None)
        try:
            before = time.clock_gettime_ns(self._clock)
            state = self._state(self._stat_fd(self._stat))
        except (OSError, ValueError, IndexError):
            return (self._where(), "?", None)
        # Not run since the last look: it is where it was.
        where = last[0] if last is not None and last[2] == before else self._where()
        try:
            after = time.clock_gettime_ns(self._clock)
        except OSError:
            return (where, "?", None)
        # A thread that ran during the look: nothing in it to compare with the next one.
        return (where, state, after) if after == before else (None, "R", None)

    def _stat_fd(self, stat: str) -> int:
        """The thread's stat file (``stat``), opened once (see Note [A look at a thread])."""
        fd = self._fd
        if fd is None:
            fd = self._fd = os.open(stat, os.O_RDONLY | os.O_CLOEXEC)
            weakref.finalize(self, os.close, fd)
        return fd

    @staticmethod
    def _state(fd: int) -> str:
        """The state letter in the thread's /proc stat file, open as ``fd`` (a read from
        offset 0 shows the thread as it is now; once it has ended, the read fails)."""
        return os.pread(fd, 1024, 0).rsplit(b")", 1)[1].split()[0].decode()

    def _where(self) -> Any:
        """(frame id, instruction) if the innermost frame is a blocking site, else None."""
        ident = self.thread.ident
        frame = None if ident is None else current_frames().get(ident)
        # Only where a thread may wait for the world without a point (see Note [Blocked
        # outside the scheduler]); elsewhere a sleeping thread is slow, not blocked.
        return None if frame is None or not blocking_site(frame) else (id(frame), frame.f_lasti)

    def still_stalled(self, at: Sample | None) -> bool:
        """One look: asleep where it was last seen blocked (``at``), without having run since."""
        if at is None or at[2] is None:
            return False
        where, state, ran = self.look(at)
        return state in ("S", "D") and (where, ran) == (at[0], at[2])


# The innermost Python frames of a thread that waits without a scheduling point: a wait of
# the threading module (this project's DDP waits for a hook's future on an Event), and
# autograd's engine (torch's C++ DDP waits for its buckets' futures inside backward).
_ENGINE_FRAMES = frozenset({"_engine_run_backward", "run_backward"})
_THREADING_WAITS = frozenset({"wait", "acquire", "join", "_wait_for_tstate_lock"})


def blocking_site(frame: FrameType) -> bool:
    code = frame.f_code
    if not code.co_filename.endswith("threading.py"):
        return code.co_name in _ENGINE_FRAMES
    if code.co_name not in _THREADING_WAITS:
        return False  # a thread's own start (_bootstrap...)
    # Not Thread.start waiting for the new thread to run (the world's timer starts so), and
    # not the scheduler's own waits (a holder that was just handed the turn wakes from one).
    outer: FrameType | None = frame
    while outer is not None and outer.f_code.co_filename.endswith("threading.py"):
        if outer.f_code.co_name == "start":
            return False
        outer = outer.f_back
    if outer is None:
        return True
    caller = os.path.abspath(outer.f_code.co_filename)
    return os.path.dirname(caller) != _SCHEDULE_DIR and caller not in _IDLE_WAITS


# Where the fake world's own threads wait for work, never for the world: a completion lane
# between callbacks, a kept thread between jobs. A lane just handed its next callback is on
# its way from its idle wait to the turn; on a busy machine it can still sleep there (waking,
# it waits for the GIL) for two looks. Taken for blocked outside, it would never be seen
# blocked again (it next waits for the turn, a wait of the scheduler's own), and every
# decision would wait for it to settle: see Note [Blocked outside the scheduler] in
# fakepg.schedule.
_IDLE_WAITS = frozenset(os.path.join(FAKEPG_DIR, f) for f in ("completion.py", "_threads.py"))


def internal(filename: str) -> bool:
    """Frames of the fake world and of threading: not what the user needs to see."""
    where = os.path.dirname(os.path.abspath(filename))
    return where in (FAKEPG_DIR, _SCHEDULE_DIR) or filename.endswith("threading.py")


def current_frames() -> dict[int, FrameType]:
    """``sys._current_frames()``, safe while other threads start.

    # Note [Reading every thread's frame]
    # On CPython before 3.12, sys._current_frames() holds the interpreter's thread-list lock
    # while it builds its dict, and the allocation can start a garbage collection whose
    # finalizers release the GIL; a thread being started meanwhile (a rank, the world's
    # timer) waits for that lock while it holds the GIL, and neither can go on: a hang of
    # every thread (CPython gh-106883). No collection starts while the collector is off.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()
