"""Per-rank generators: what each rank draws is what a process of its own would draw.

Barriers force the worst interleaving (every rank seeds before any draws), so a shared
generator would fail these tests every time, not by chance.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fakepg
from fakepg import FakeProcessGroup, rng

WORLD = 4


def alone(seed: int, draw: callable) -> object:  # type: ignore[valid-type]
    """What ``draw()`` gives in a process of its own seeded with ``seed`` (on this thread,
    with its state restored afterwards)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return draw()  # type: ignore[operator]


def test_manual_seed_per_rank_gives_each_rank_its_own_stream() -> None:
    seeded = threading.Barrier(WORLD)

    def fn(pg: FakeProcessGroup) -> list[torch.Tensor]:
        torch.manual_seed(100 + pg.rank())
        seeded.wait(10)  # every rank has seeded before any draws
        draws = []
        for _ in range(3):
            draws.append(torch.randn(1000))  # large: torch drops the GIL, ranks overlap
            draws.append(torch.empty(5).uniform_())
            draws.append(torch.randint(0, 100, (7,)))
            draws.append(torch.randperm(9))
        return draws

    for rank, draws in enumerate(fakepg.run(fn, WORLD)):

        def reference() -> list[torch.Tensor]:
            out = []
            for _ in range(3):
                out += [torch.randn(1000), torch.empty(5).uniform_()]
                out += [torch.randint(0, 100, (7,)), torch.randperm(9)]
            return out

        want = alone(100 + rank, reference)
        assert all(torch.equal(a, b) for a, b in zip(draws, want, strict=True)), rank  # type: ignore[call-overload]


def test_dropout_masks_and_initialization_follow_the_ranks_seed() -> None:
    seeded = threading.Barrier(WORLD)

    def build_and_drop() -> tuple[list[torch.Tensor], torch.Tensor]:
        net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.LSTM(8, 4, 2, dropout=0.5))
        x = torch.ones(3, 8)
        out = net[1](net[0](x))
        lstm_out, _ = net[2](out.unsqueeze(1))
        return [p.detach().clone() for p in net.parameters()], torch.cat(
            [out.flatten(), lstm_out.flatten()]
        )

    def fn(pg: FakeProcessGroup) -> tuple[list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(7 * pg.rank())
        seeded.wait(10)
        return build_and_drop()

    for rank, (params, dropped) in enumerate(fakepg.run(fn, WORLD)):
        want_params, want_dropped = alone(7 * rank, build_and_drop)  # type: ignore[misc]
        assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))
        assert torch.equal(dropped, want_dropped), rank


def test_a_ranks_cpu_dropout_is_torchs_own_values_gradient_and_draws(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """F.dropout of a CPU tensor on a rank thread is computed without the dispatch mode (it
    would raise here) and still gives what a process of its own gets: the values, the
    gradient, and the generator's next draws."""
    seeded = threading.Barrier(WORLD)

    def step() -> list[torch.Tensor]:
        x = torch.linspace(-1, 1, 64).reshape(8, 8).requires_grad_()
        y = nn.functional.dropout(x, 0.3) * torch.arange(64.0).reshape(8, 8)
        y.sum().backward()
        assert x.grad is not None
        return [y.detach(), x.grad, torch.rand(3)]

    def fn(pg: FakeProcessGroup) -> list[torch.Tensor]:
        torch.manual_seed(11 + pg.rank())
        seeded.wait(10)
        return step()

    def refuse(*args: object) -> None:
        raise AssertionError("the dispatch mode ran for a CPU dropout")

    monkeypatch.setattr(rng._InjectGenerator, "__init__", refuse)
    for rank, got in enumerate(fakepg.run(fn, WORLD)):
        want = alone(11 + rank, step)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), rank  # type: ignore[call-overload]


def test_checkpoint_replays_each_ranks_own_dropout_mask() -> None:
    """preserve_rng_state saves and restores the rank's state: the recomputed forward in
    backward draws the forward's mask, so gradients equal those without checkpointing."""
    seeded = threading.Barrier(WORLD)

    def grads(use_checkpoint: bool) -> list[torch.Tensor]:
        layer = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Tanh())
        x = torch.ones(4, 16, requires_grad=True)
        if use_checkpoint:
            y = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=True)
        else:
            y = layer(x)
        torch.randn(100)  # draws between forward and backward move the stream on
        y.sum().backward()
        return [p.grad.clone() for p in layer.parameters() if p.grad is not None]

    def fn(pg: FakeProcessGroup) -> list[torch.Tensor]:
        torch.manual_seed(pg.rank())
        seeded.wait(10)
        return grads(use_checkpoint=True)

    for rank, got in enumerate(fakepg.run(fn, WORLD)):
        want = alone(rank, lambda: grads(use_checkpoint=False))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), rank  # type: ignore[call-overload]


def test_ranks_start_from_the_callers_state_and_leave_it_alone() -> None:
    """Like a forked process: a rank that never seeds draws what the caller would draw next;
    and the caller's generator has not moved when run returns."""
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    per_rank = fakepg.run(lambda pg: torch.randn(6), WORLD)
    assert torch.equal(torch.get_rng_state(), before)
    want = torch.randn(6)
    assert all(torch.equal(got, want) for got in per_rank)


def test_torch_get_and_set_rng_state_are_the_ranks() -> None:
    def fn(pg: FakeProcessGroup) -> bool:
        torch.manual_seed(pg.rank())
        state = torch.get_rng_state()
        a = torch.rand(3)
        torch.set_rng_state(state)
        return torch.equal(a, torch.rand(3)) and torch.initial_seed() == pg.rank()

    assert fakepg.run(fn, WORLD) == [True] * WORLD


def test_a_thread_a_rank_starts_draws_from_the_shared_generator_and_run_says_so() -> None:
    def fn(pg: FakeProcessGroup) -> None:
        helper = threading.Thread(target=lambda: torch.randn(3))
        helper.start()
        helper.join()

    with pytest.warns(RuntimeWarning, match="torch's default generator was used while the ranks"):
        fakepg.run(fn, 2)


def test_without_per_rank_generators_ranks_share_the_process_generator() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    fakepg.run(lambda pg: torch.randn(2), 2, per_rank_rng=False)
    assert not torch.equal(torch.get_rng_state(), before)


def test_samplers_and_random_split_draw_from_the_ranks_stream() -> None:
    def draws() -> tuple[list[int], list[int]]:
        split = torch.utils.data.random_split(range(10), [5, 5])[0].indices
        loader = torch.utils.data.DataLoader(range(6), batch_size=6, shuffle=True)
        return list(split), next(iter(loader)).tolist()

    def fn(pg: FakeProcessGroup) -> tuple[list[int], list[int]]:
        torch.manual_seed(pg.rank())
        return draws()

    for rank, got in enumerate(fakepg.run(fn, 2)):
        assert got == alone(rank, draws)


def _noisy(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(x, 0.5) + torch.rand(x.shape) + torch.dropout(x, 0.1, True)


def test_torchscript_still_compiles_what_the_per_rank_wrappers_wrap() -> None:
    fakepg.run(lambda pg: None, 1)  # the wrappers are installed by the first run
    assert torch.jit.script(_noisy)(torch.ones(4)).shape == (4,)
    assert torch.jit.script(nn.Dropout(0.5))(torch.ones(4)).shape == (4,)
