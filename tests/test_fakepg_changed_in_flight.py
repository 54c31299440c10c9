"""A tensor resized, freed or replaced while its collective is in flight fails the collective
on every rank with TensorChanged, on every way the data moves (see Note [A tensor changed in
flight] in fakepg._intact); without the look, the kernels read freed memory or reduce part of
a shrunk tensor, silently."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

import fakepg
from fakepg import FakeProcessGroup

CHANGES: dict[str, Callable[[torch.Tensor], object]] = {
    "was resized to [3]": lambda t: t.resize_(3),
    "had its storage freed or shrunk": lambda t: t.untyped_storage().resize_(0),
    "had its memory replaced": lambda t: setattr(t, "data", torch.zeros_like(t)),
}
# Small: moved on the last rank's thread; large: on the world's workers.
SIZES = (17, 100_000)


def _changed_by_rank_0(
    change: Callable[[torch.Tensor], object], numel: int, **world: object
) -> list[BaseException | None]:
    """Rank 0 changes its tensor after issuing an allreduce, before rank 1 issues it; what
    each rank's wait raised."""
    issued = threading.Event()

    def fn(pg: FakeProcessGroup) -> BaseException | None:
        t = torch.full((numel,), float(pg.rank() + 1))
        if pg.rank() == 0:
            work = pg.allreduce([t])
            change(t)
            issued.set()
        else:
            assert issued.wait(30)
            work = pg.allreduce([t])
        try:
            work.wait()
        except fakepg.TensorChanged as exc:
            return exc
        return None

    return fakepg.run(fn, 2, timeout=30, **world)  # type: ignore[arg-type]


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("how", list(CHANGES))
def test_a_tensor_changed_in_flight_fails_the_collective_on_every_rank(
    how: str, numel: int
) -> None:
    errors = _changed_by_rank_0(CHANGES[how], numel)
    for error in errors:
        assert isinstance(error, fakepg.TensorChanged)
        text = str(error)
        assert text.startswith("fakepg: allreduce #0 (op=SUM): rank 0's tensor 0 "), text
        assert f"issued with shape [{numel}]) {how}" in text, text
        assert "wait() on the work" in text


def test_a_change_is_seen_where_a_network_delays_the_data() -> None:
    """With a network model the data lands on the world's timer, after the last rank joined:
    the look is made then, not at the join."""
    resize = CHANGES["was resized to [3]"]
    errors = _changed_by_rank_0(resize, 17, network=fakepg.FixedLatency(0.01))
    assert all(isinstance(e, fakepg.TensorChanged) for e in errors), errors


def test_a_change_is_seen_under_a_schedule() -> None:
    """Under a controlled schedule a decision moves the data: it looks first."""
    errors = _changed_by_rank_0(
        CHANGES["had its storage freed or shrunk"], 17, schedule=fakepg.Schedule([])
    )
    assert all(isinstance(e, fakepg.TensorChanged) for e in errors), errors


def test_the_change_is_named_by_its_rank_and_tensor_index() -> None:
    """An input that views a flat buffer at an offset (as a bucket's gradients do), after
    two outputs: the third tensor rank 1 handed in."""
    issued = threading.Event()

    def fn(pg: FakeProcessGroup) -> str:
        flat = torch.zeros(8)
        a, b = flat[:4], flat[4:].view(2, 2)
        assert a.storage_offset() == 0 and b.storage_offset() == 4
        if pg.rank() == 0:
            assert issued.wait(30)
            work = pg.allgather([[torch.zeros(2, 2), torch.zeros(2, 2)]], [b])
        else:
            work = pg.allgather([[torch.zeros(2, 2), torch.zeros(2, 2)]], [b])
            flat.untyped_storage().resize_(0)
            issued.set()
        with pytest.raises(fakepg.TensorChanged) as info:
            work.wait()
        return str(info.value)

    for text in fakepg.run(fn, 2, timeout=30):
        assert "rank 1's tensor 2 (torch.float32, issued with shape [2, 2]) had its storage" in (
            text
        ), text
        assert "(0 bytes left of the 32 it spans)" in text, text


def test_a_tensor_changed_after_its_wait_is_the_users_to_change() -> None:
    def fn(pg: FakeProcessGroup) -> list[float]:
        t = torch.full((17,), float(pg.rank() + 1))
        pg.allreduce([t]).wait()
        t.resize_(3)
        u = torch.ones(5)
        pg.allreduce([u]).wait()
        return t.tolist() + u.tolist()

    for result in fakepg.run(fn, 2, timeout=30):
        assert result == [3.0] * 3 + [2.0] * 5


def test_sparse_tensors_are_not_looked_at() -> None:
    def fn(pg: FakeProcessGroup) -> torch.Tensor:
        t = torch.sparse_coo_tensor([[0, 2]], [1.0, float(pg.rank())], (4,))
        work = pg.allreduce([t])
        work.wait()
        return work.result()[0].to_dense()

    for result in fakepg.run(fn, 2, timeout=30):
        assert result.tolist() == [2.0, 0.0, 1.0, 0.0]
