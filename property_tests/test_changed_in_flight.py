"""Property: a tensor changed while its collective is in flight fails the collective on every
rank, with one message that says exactly which rank's which tensor changed and how; a tensor
with no bytes to move may lose its storage unharmed.

See Note [A tensor changed in flight] in fakepg._intact. Drawn: two to four ranks, an
allreduce (one tensor per rank) or an allgather (the ranks' outputs, then the input), each
tensor of shape [rows, cols] with rows 1 or 2 and cols 0 (empty), 1, 17 or 70000 (small
collectives move on the last rank's thread, large ones on the world's workers), either a
tensor of its own, a view into a larger flat buffer at an offset (as a bucket's gradients
are) or, for an allgather, every other column of a larger one, which rank changes which
of its tensors and how (resized, its storage freed, its storage one element short of what
the view spans, its memory replaced), and who moves the data (the last rank or the
workers, the world's timer behind a simulated network, or a controlled schedule's
decision). The changing rank issues first and changes its tensor
before any other rank issues: the data has not moved yet.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fakepg

ADVICE = (
    "while the collective was in flight. A collective's tensors must stay as issued until "
    "its work completes: wait() on the work (or its future) before resizing, freeing or "
    "replacing them."
)


def _span(t: torch.Tensor) -> int:
    """The bytes of its storage a non-empty tensor reaches into, from the storage's start."""
    steps = zip(t.shape, t.stride(), strict=True)
    last = t.storage_offset() + sum((n - 1) * step for n, step in steps)
    return (last + 1) * t.element_size()


CHANGES: dict[str, Callable[[torch.Tensor], object]] = {
    "resized": lambda t: t.resize_(t.numel() // 2),
    "freed": lambda t: t.untyped_storage().resize_(0),
    "shrunk": lambda t: t.untyped_storage().resize_(max(0, _span(t) - t.element_size())),
    "replaced": lambda t: setattr(t, "data", torch.zeros_like(t)),
}


class Case(NamedTuple):
    world_size: int
    kind: str  # "allreduce" or "allgather"
    shape: tuple[int, int]
    view: str  # "own", "offset", or "strided" (every other column; allgather only)
    change: str
    changer: int  # the rank that changes a tensor; it issues first
    index: int  # which of its tensors, in the order it handed them in
    mover: str  # "direct" (the last rank or the workers), "network" or "schedule"


@st.composite
def cases(draw: st.DrawFn) -> Case:
    world_size = draw(st.integers(2, 4))
    kind = draw(st.sampled_from(["allreduce", "allgather"]))
    shape = (draw(st.sampled_from([1, 2])), draw(st.sampled_from([0, 1, 17, 70000])))
    tensors = 1 if kind == "allreduce" else world_size + 1
    return Case(
        world_size,
        kind,
        shape,
        # A reduction takes contiguous tensors only; an allgather any.
        draw(st.sampled_from(["own", "offset"] + (["strided"] if kind == "allgather" else []))),
        draw(st.sampled_from(sorted(CHANGES))),
        draw(st.integers(0, world_size - 1)),
        draw(st.integers(0, tensors - 1)),
        draw(st.sampled_from(["direct", "network", "schedule"])),
    )


def _tensor(shape: tuple[int, int], value: float, view: str) -> torch.Tensor:
    rows, cols = shape
    if view == "own":
        return torch.full(shape, value)
    if view == "strided":
        return torch.full((rows, 2 * cols), value)[:, ::2]
    return torch.full((rows * cols + 5,), value)[3 : 3 + rows * cols].view(rows, cols)


def how_changed(change: str, issued: torch.Tensor) -> str | None:
    """What the error says happened to a tensor, as issued, that ``change`` (a key of
    CHANGES) changed; None where nothing fails: an empty tensor not resized."""
    if change == "resized":
        return f"was resized to [{issued.numel() // 2}]"
    if issued.numel() == 0:
        return None
    if change == "replaced":
        return "had its memory replaced (its storage reallocated, or .data swapped)"
    span = _span(issued)
    left = 0 if change == "freed" else span - issued.element_size()
    return f"had its storage freed or shrunk ({left} bytes left of the {span} it spans)"


def _expected(case: Case) -> str | None:
    """The message every rank's error carries, or None where nothing moves and nothing fails."""
    rows, cols = case.shape
    how = how_changed(case.change, _tensor(case.shape, 0.0, case.view))
    if how is None:
        return None
    what = "allreduce #0 (op=SUM)" if case.kind == "allreduce" else "allgather #0"
    whose = f"rank {case.changer}'s tensor {case.index} (torch.float32, issued with shape "
    return f"fakepg: {what}: {whose}[{rows}, {cols}]) {how} {ADVICE}"


def check_a_change_in_flight_fails_everywhere(case: Case) -> None:
    issued = threading.Event()

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[BaseException | None, list[float]]:
        rank = pg.rank()
        mine = _tensor(case.shape, float(rank + 1), case.view)
        outputs = [_tensor(case.shape, -1.0, case.view) for _ in range(case.world_size)]
        handed = [mine] if case.kind == "allreduce" else [*outputs, mine]
        if rank != case.changer:
            assert issued.wait(30)
        gather = case.kind == "allgather"
        work = pg.allgather([outputs], [mine]) if gather else pg.allreduce([mine])
        if rank == case.changer:
            CHANGES[case.change](handed[case.index])
            issued.set()
        try:
            work.wait()
        except fakepg.TensorChanged as exc:
            return exc, []
        # Unharmed: read back what did not change (an empty tensor holds nothing to read).
        return None, [float(t.sum()) for t in handed if t.numel() > 0]

    world: dict[str, object] = {}
    if case.mover == "network":
        world["network"] = fakepg.FixedLatency(0.001)
    elif case.mover == "schedule":
        world["schedule"] = fakepg.Schedule([])
    results = fakepg.run(fn, case.world_size, timeout=30, **world)  # type: ignore[arg-type]
    expected = _expected(case)
    for rank, (error, sums) in enumerate(results):
        if expected is None:
            assert error is None, (rank, error)
            assert sums == [], (rank, sums)  # every tensor of an empty case is empty
        else:
            assert isinstance(error, fakepg.TensorChanged), (rank, error)
            assert str(error) == expected, (rank, str(error), expected)


@given(cases())
@settings(max_examples=300)  # an example takes about 10 ms: the corners cost little to reach
def test_a_tensor_changed_in_flight_fails_its_collective_on_every_rank(case: Case) -> None:
    check_a_change_in_flight_fails_everywhere(case)
