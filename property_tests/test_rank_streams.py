"""Property: each rank draws from its own random stream, as a process of its own would
(Note [Per-rank generators] in fakepg.rng).

Over drawn world sizes, per-rank seeds and sequences of torch's random functions (``rand``,
``randn``, ``randint``, ``randperm``, ``normal_``, dropout), each rank's values are exactly
those of the same calls after ``torch.manual_seed(seed)`` in a process of its own (here: on
the main thread, alone), whatever the other ranks draw meanwhile; the caller's generator is
left as it was. A draw from a thread a rank starts is not covered by the per-rank streams:
then, and only then, ``run`` warns, with the message that says so and what to do.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fakepg

DRAWS: dict[str, Callable[[], torch.Tensor]] = {
    "rand": lambda: torch.rand(3),
    "randn": lambda: torch.randn(2, 2),
    "randint": lambda: torch.randint(0, 1000, (4,)).float(),
    "randperm": lambda: torch.randperm(6).float(),
    "normal_": lambda: torch.empty(3).normal_(),
    "dropout": lambda: torch.nn.functional.dropout(torch.ones(8), p=0.5),
}
# What run() warns when a thread started by a rank drew from the process's generator.
SHARED_WARNING = (
    "fakepg: torch's default generator was used while the ranks ran, so some random "
    "numbers came from the one generator every rank shares (their values depend on "
    "thread timing). Per-rank generators cover torch functions called on rank "
    "threads; a thread started by a rank, or a C++ extension that draws from the "
    "default generator, is not covered: pass it a generator of its own "
    "(torch.Generator().manual_seed(...))."
)


def _alone(seed: int, names: list[str]) -> list[list[float]]:
    """The draws of a process of its own: seeded, then the calls in order."""
    torch.manual_seed(seed)
    return [DRAWS[name]().flatten().tolist() for name in names]


def ranks_draw_their_own_streams(
    seeds: list[int], names: list[list[str]], helper: int | None
) -> None:
    world_size = len(seeds)

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[float]]:
        rank = pg.rank()
        torch.manual_seed(seeds[rank])
        if rank == helper:  # a thread this rank starts draws from the shared generator
            drawer = threading.Thread(target=lambda: torch.rand(1))
            drawer.start()
            drawer.join()
        return [DRAWS[name]().flatten().tolist() for name in names[rank]]

    before = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fakepg.run(fn, world_size)
    shared = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert torch.equal(torch.get_rng_state(), before) or helper is not None
    assert shared == ([SHARED_WARNING] if helper is not None else []), shared
    saved = torch.get_rng_state()
    try:
        for rank in range(world_size):
            assert got[rank] == _alone(seeds[rank], names[rank]), f"rank {rank}"
    finally:
        torch.set_rng_state(saved)


@st.composite
def rank_draws(draw: st.DrawFn) -> tuple[list[int], list[list[str]], int | None]:
    world_size = draw(st.integers(1, 4))
    seeds = draw(st.lists(st.integers(0, 2**31), min_size=world_size, max_size=world_size))
    calls = st.lists(st.sampled_from(sorted(DRAWS)), min_size=1, max_size=4)
    names = draw(st.lists(calls, min_size=world_size, max_size=world_size))
    helper = draw(st.none() | st.integers(0, world_size - 1))
    return seeds, names, helper


@given(rank_draws())
@settings(max_examples=25, deadline=None)
def test_each_rank_draws_its_own_stream(
    case: tuple[list[int], list[list[str]], int | None],
) -> None:
    ranks_draw_their_own_streams(*case)
