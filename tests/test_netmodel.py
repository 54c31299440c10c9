"""fakepg.netmodel: the alpha-beta formulas, presets and specs, and how the world applies them."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import fakepg
from fakepg import AlphaBeta, FixedLatency, parse_network
from reducer import ReduceOp

# Dyadic numbers, so that every formula below is exact in floating point.
ALPHA = 2.0**-10
BANDWIDTH = 2.0**20  # bytes per second
S = 2**21  # bytes: S / B = 2 seconds


@pytest.mark.parametrize(
    ("kind", "world_size", "expected"),
    [
        ("allreduce", 4, 2 * 3 * ALPHA + 2 * 3 / 4 * 2.0),
        ("allreduce", 2, 2 * ALPHA + 2.0),
        ("allgather", 4, 3 * (ALPHA + 2.0)),
        ("sparse_allreduce", 4, 3 * (ALPHA + 2.0)),
        ("broadcast", 4, 3 * ALPHA + 2.0),
        ("barrier", 4, 6 * ALPHA),
    ],
)
def test_ring_formulas(kind: str, world_size: int, expected: float) -> None:
    model = AlphaBeta(ALPHA, BANDWIDTH, "ring")
    nbytes = 0 if kind == "barrier" else S
    assert model.collective_time_s(kind, nbytes, world_size) == expected


@pytest.mark.parametrize(
    ("kind", "world_size", "expected"),
    [
        # Pipelined: the bytes cross each link once up and once down, whatever the depth.
        ("allreduce", 4, 2 * 2 * ALPHA + 2 * 2.0),
        ("allreduce", 5, 2 * 3 * ALPHA + 2 * 2.0),  # ceil(log2(5)) = 3 levels
        ("allgather", 8, 3 * ALPHA + 7 * 2.0),
        ("sparse_allreduce", 8, 3 * ALPHA + 7 * 2.0),
        ("broadcast", 8, 3 * ALPHA + 2.0),
        ("barrier", 8, 6 * ALPHA),
    ],
)
def test_tree_formulas(kind: str, world_size: int, expected: float) -> None:
    model = AlphaBeta(ALPHA, BANDWIDTH, "tree")
    nbytes = 0 if kind == "barrier" else S
    assert model.collective_time_s(kind, nbytes, world_size) == expected


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
@pytest.mark.parametrize("kind", ["allreduce", "sparse_allreduce", "allgather", "broadcast"])
def test_one_rank_crosses_no_link(algorithm: str, kind: str) -> None:
    model = AlphaBeta(ALPHA, BANDWIDTH, algorithm)  # type: ignore[arg-type]
    assert model.collective_time_s(kind, S, 1) == 0.0


def test_ring_beats_tree_on_bandwidth_and_loses_on_latency() -> None:
    ring, tree = AlphaBeta(1e-5, 1.25e9, "ring"), AlphaBeta(1e-5, 1.25e9, "tree")
    big, small = 100 << 20, 8
    assert ring.collective_time_s("allreduce", big, 64) < tree.collective_time_s(
        "allreduce", big, 64
    )
    assert ring.collective_time_s("allreduce", small, 64) > tree.collective_time_s(
        "allreduce", small, 64
    )


def test_alpha_beta_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="latency_s must be a finite number >= 0"):
        AlphaBeta(-1.0, 1e9)
    with pytest.raises(ValueError, match="bandwidth_Bps must be > 0"):
        AlphaBeta(1e-6, 0.0)
    with pytest.raises(ValueError, match="algorithm must be 'ring' or 'tree'"):
        AlphaBeta(1e-6, 1e9, "star")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown collective kind 'alltoall'"):
        AlphaBeta(1e-6, 1e9).collective_time_s("alltoall", 8, 2)


def test_presets() -> None:
    ten = fakepg.NETWORK_PRESETS["10gbe"]
    assert (ten.bandwidth_Bps, ten.latency_s, ten.algorithm) == (1.25e9, 25e-6, "ring")
    assert fakepg.NETWORK_PRESETS["10gbe-ring"].algorithm == "ring"
    hundred_tree = fakepg.NETWORK_PRESETS["100gbe-tree"]
    assert (hundred_tree.bandwidth_Bps, hundred_tree.algorithm) == (12.5e9, "tree")
    for name in ("10gbe", "25gbe", "100gbe", "ib-hdr"):
        for suffix in ("", "-ring", "-tree"):
            assert parse_network(name + suffix) is fakepg.NETWORK_PRESETS[name + suffix]
    assert str(ten) == "10gbe: ring, latency 25 us, bandwidth 1.25 GB/s"


def test_parse_network_specs() -> None:
    assert parse_network("none") is None
    assert parse_network("NONE") is None
    model = parse_network("latency=40us,bandwidth=2GB/s,algorithm=tree")
    assert isinstance(model, AlphaBeta)
    assert (model.latency_s, model.bandwidth_Bps, model.algorithm) == (40e-6, 2e9, "tree")
    model = parse_network("bandwidth=8gbit, latency=0.5ms")
    assert isinstance(model, AlphaBeta)
    assert (model.latency_s, model.bandwidth_Bps, model.algorithm) == (5e-4, 1e9, "ring")
    assert parse_network("fixed=5ms") == FixedLatency(5e-3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("20gbe", "unknown network '20gbe': use none, a preset"),
        ("latency=1us", "lacks bandwidth="),
        ("latency=1us,bandwidth=1parsec", "cannot read '1parsec'"),
        ("latency=1us,bandwidth=1gb,algorithm=star", "algorithm must be ring or tree"),
        ("speed=1gb", "'speed=1gb' is not one of latency="),
        ("fixed=1ms,latency=1us", "fixed=... takes no other field"),
    ],
)
def test_parse_network_errors_say_what_to_write(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_network(spec)


# ---------------------------------------------------------------------------------------------
# Applied by the world.


class Recording:
    """A network model that records what the world asked and answers a fixed time."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def collective_time_s(self, kind: str, nbytes: int, world_size: int) -> float:
        with self._lock:
            self.calls.append((kind, nbytes, world_size))
        return self.seconds


def test_a_collective_completes_no_earlier_than_the_model_says() -> None:
    # W = 2, ring: 2 alpha + S / B = 0.05 + 0.1 s for 4096 bytes at 40960 B/s.
    model = AlphaBeta(0.025, 40960.0, "ring")
    expected_s = model.collective_time_s("allreduce", 4096, 2)
    assert expected_s == pytest.approx(0.15)
    with fakepg.World(2, network=model) as world:
        tensors = [torch.full((1024,), float(r + 1)) for r in range(2)]
        works = [world.group(r).allreduce([tensors[r]], ReduceOp.SUM) for r in range(2)]
        for work in works:
            work.wait(timeout=10)
        started, completed = works[0].started_ns, works[0].completed_ns
        assert started is not None and completed is not None
        assert completed - started >= expected_s * 1e9
        assert torch.equal(tensors[0], torch.full((1024,), 3.0))
        assert torch.equal(tensors[1], torch.full((1024,), 3.0))


def test_collectives_queue_on_the_one_link() -> None:
    """See Note [One link per world]: three collectives issued together end one after another."""
    model = Recording(0.1)
    with fakepg.World(2, network=model) as world:
        tensors = [[torch.ones(4) for _ in range(3)] for _ in range(2)]
        works = [[world.group(r).allreduce([t]) for t in tensors[r]] for r in range(2)]
        for per_rank in works:
            for work in per_rank:
                work.wait(timeout=10)
        first_start = works[0][0].started_ns
        assert first_start is not None
        for k, work in enumerate(works[0]):
            completed = work.completed_ns
            assert completed is not None
            assert completed - first_start >= (k + 1) * 0.1e9
        done = [w.completed_ns for w in works[0]]
        assert done == sorted(done)
    assert model.calls == [("allreduce", 16, 2)] * 3


def test_the_world_names_the_collective_kind_and_size() -> None:
    model = Recording(0.0)
    with fakepg.World(2, network=model) as world:

        def per_rank(rank: int) -> None:
            pg = world.group(rank)
            pg.allreduce([torch.ones(3, dtype=torch.float64)]).wait()
            sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (5,))
            pg.allreduce([sparse]).wait()
            rows = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 3), (5, 3))  # an embedding's
            pg.allreduce([rows]).wait()
            outputs = [torch.empty(2) for _ in range(2)]
            pg.allgather([outputs], [torch.ones(2)]).wait()
            pg.broadcast([torch.ones(5)], 0).wait()
            pg.barrier().wait()

        world.run(lambda pg: per_rank(pg.rank()))
    sparse_bytes = 2 * (1 * 8 + 4)  # nnz x (one int64 index + one float32 value)
    rows_bytes = 2 * (1 * 8 + 3 * 4)  # nnz x (one int64 index + a row of 3 float32)
    assert model.calls == [
        ("allreduce", 24, 2),
        ("sparse_allreduce", sparse_bytes, 2),
        ("sparse_allreduce", rows_bytes, 2),
        ("allgather", 8, 2),
        ("broadcast", 20, 2),
        ("barrier", 0, 2),
    ]


def test_fixed_latency_has_a_name() -> None:
    assert str(FixedLatency(0.005)) == "fixed 5 ms per collective"
    assert math.isclose(FixedLatency(0.5).collective_time_s("barrier", 0, 8), 0.5)


@pytest.mark.parametrize(
    ("kind", "algorithm", "world_size", "expected"),
    [
        ("reduce", "ring", 4, 3 * ALPHA + 2.0),  # as broadcast
        ("reduce", "tree", 8, 3 * ALPHA + 2.0),  # pipelined, as broadcast
        ("reduce_scatter", "ring", 4, 3 * ALPHA + 3 / 4 * 2.0),
        ("reduce_scatter", "tree", 8, 3 * ALPHA + 7 / 8 * 2.0),
        ("all_to_all", "ring", 4, 3 * (ALPHA + 2.0 / 4)),
        ("all_to_all", "tree", 4, 3 * (ALPHA + 2.0 / 4)),
        ("gather", "ring", 4, 3 * (ALPHA + 2.0)),  # as allgather
        ("scatter", "tree", 8, 3 * ALPHA + 7 * 2.0),
        ("send", "ring", 2, ALPHA + 2.0),
        ("send", "tree", 2, ALPHA + 2.0),
    ],
)
def test_formulas_of_the_other_collectives(
    kind: str, algorithm: str, world_size: int, expected: float
) -> None:
    model = AlphaBeta(ALPHA, BANDWIDTH, algorithm)  # type: ignore[arg-type]
    assert model.collective_time_s(kind, S, world_size) == expected


def test_a_send_waits_for_the_simulated_link() -> None:
    with fakepg.World(2, network=fakepg.FixedLatency(0.2)) as world:
        got = torch.zeros(3)
        sent = world.group(0).send([torch.ones(3)], 1)
        received = world.group(1).recv([got], 0)
        received.wait(timeout=10)
        sent.wait(timeout=10)
        assert received.completed_ns is not None and received.started_ns is not None
        assert received.completed_ns - received.started_ns >= 0.2e9
        assert torch.equal(got, torch.ones(3))
