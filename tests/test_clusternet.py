"""fakepg.clusternet: NCCL's cost model on a two-level topology, gloo's ring, the presets."""

from __future__ import annotations

import pytest

import fakepg
from fakepg import AlphaBeta, GlooModel, NcclModel, Topology, parse_network

MIB = 1 << 20
NODE = Topology(8, 100e9, 4, 12.5e9, "test")


def test_ring_allreduce_on_one_node_is_nccls_formula() -> None:
    ring = NcclModel(NODE, "ring")
    algorithm, protocol, seconds = ring.choice("allreduce", 100 * MIB, 8)
    assert (algorithm, protocol) == ("ring", "Simple")
    # NCCL tuning.cc: base 8.4 us + 2(n-1) steps of 3.4 us (NVLink, Simple); busbw 100 GB/s.
    latency = (8.4 + 14 * 3.4) * 1e-6
    assert seconds == pytest.approx(latency + 2 * 7 / 8 * 100 * MIB / 100e9, rel=1e-12)


def test_across_nodes_the_nics_bound_the_bus_and_latency_grows() -> None:
    ring = NcclModel(NODE, "ring")
    one_node = ring.collective_time_s("allreduce", 100 * MIB, 8)
    two_nodes = ring.collective_time_s("allreduce", 100 * MIB, 16)
    # 4 NICs x 12.5 GB/s = 50 GB/s, half NVLink's 100; 2(n-1) = 30 steps, 2 of them across
    # the network (14 us each), the others on NVLink (3.4 us).
    latency = (8.4 + 28 * 3.4 + 2 * 14.0) * 1e-6
    assert two_nodes == pytest.approx(latency + 2 * 15 / 16 * 100 * MIB / 50e9, rel=1e-12)
    assert two_nodes > 1.9 * one_node


def test_the_pipelined_tree_is_not_slower_than_the_ring_on_large_messages() -> None:
    ring, tree = NcclModel(NODE, "ring"), NcclModel(NODE, "tree")
    big = 100 * MIB
    assert tree.collective_time_s("allreduce", big, 256) < 1.2 * ring.collective_time_s(
        "allreduce", big, 256
    )
    # The alpha-beta link's tree is pipelined too.
    a_ring, a_tree = AlphaBeta(8e-6, 12.5e9, "ring"), AlphaBeta(8e-6, 12.5e9, "tree")
    assert a_tree.collective_time_s("allreduce", big, 256) < 1.1 * a_ring.collective_time_s(
        "allreduce", big, 256
    )


def test_small_messages_take_the_low_latency_protocol_and_the_tree_across_many_nodes() -> None:
    auto = NcclModel(NODE)
    assert auto.choice("allreduce", 4096, 8)[1] == "LL"
    assert auto.choice("allreduce", 100 * MIB, 8)[:2] == ("ring", "Simple")
    assert auto.choice("allreduce", 4096, 256)[0] == "tree"  # log-depth latency wins
    for size in (0, 4096, MIB, 100 * MIB):
        for world in (2, 8, 64, 256):
            forced = [NcclModel(NODE, a).collective_time_s("allreduce", size, world)
                      for a in ("ring", "tree")]  # fmt: skip
            assert auto.collective_time_s("allreduce", size, world) == min(forced)


def test_every_call_pays_a_fixed_cost() -> None:
    nccl = NcclModel(NODE)
    assert nccl.collective_time_s("allreduce", 0, 8) >= 6.6e-6  # NCCL's base latency
    # 25 buckets of 1 MiB cost more than one of 25 MiB: the sign the 1 MB cap must show.
    many = 25 * nccl.collective_time_s("allreduce", MIB, 16)
    one = nccl.collective_time_s("allreduce", 25 * MIB, 16)
    assert many > one
    gloo = GlooModel(NODE, 25e-6, 2.5e9, 100e-6)
    assert gloo.collective_time_s("allreduce", 0, 2) == pytest.approx(100e-6 + 2 * 25e-6)
    assert nccl.collective_time_s("allreduce", 100 * MIB, 1) == 0.0


def test_gloo_copies_gpu_tensors_through_the_host() -> None:
    cpu = GlooModel(NODE, 25e-6, 2.5e9, 100e-6)
    gpu = GlooModel(NODE, 25e-6, 2.5e9, 100e-6, copy_Bps=10e9)
    s = 100 * MIB
    assert gpu.collective_time_s("allreduce", s, 16) == pytest.approx(
        cpu.collective_time_s("allreduce", s, 16) + 2 * s / 10e9
    )


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Topology(8, 0.0, 4, 12.5e9), "intra_Bps"),
        (lambda: Topology(8, 100e9, 4, 0.0), "nic_Bps"),
        (lambda: Topology(0, 100e9, 4, 12.5e9), "gpus_per_node"),
        (lambda: Topology(8, 100e9, 0, 12.5e9), "nics_per_node"),
        (lambda: GlooModel(NODE, 25e-6, 0.0, 1e-4), "tcp_Bps"),
        (lambda: NcclModel(NODE, "butterfly"), "algorithm"),  # type: ignore[arg-type]
        (lambda: NcclModel(NODE, compute_slowdown=-0.1), "compute_slowdown must be in"),
        (lambda: NcclModel(NODE, compute_slowdown=1.0), "compute_slowdown must be in"),
        (lambda: NcclModel(NODE, compute_slowdown=float("nan")), "compute_slowdown"),
    ],
)
def test_bad_fields_are_named(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_a_world_that_does_not_fill_whole_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match="world_size 12 is not a multiple of gpus_per_node 8"):
        NcclModel(NODE).collective_time_s("allreduce", MIB, 12)
    assert NODE.nodes(6) == 1  # within one node, any count


def test_nccl_presets_slow_compute_by_their_channels_share_of_the_sms() -> None:
    # Note [Communication slowing compute]: 8 channels (one CUDA block, one SM each) of the
    # V100's 80 SMs, of the H100's 132.
    presets = fakepg.CLUSTER_PRESETS
    for name in ("nccl-dgx1-v100", "nccl-v100-1nic"):
        assert presets[name].compute_slowdown == 8 / 80  # type: ignore[union-attr]
    for name in ("nccl-dgx-h100", "nccl-dgx-h200"):
        assert presets[name].compute_slowdown == 8 / 132  # type: ignore[union-attr]
    assert "compute slowed 0.1 in flight" in str(presets["nccl-dgx1-v100"])
    assert "slowed" not in str(NcclModel(NODE))


def test_presets_parse_and_name_their_machines() -> None:
    for name, model in fakepg.CLUSTER_PRESETS.items():
        assert parse_network(name) is model
        assert name in str(model)
        assert model.collective_time_s("allreduce", 25 * MIB, 32) > 0
    with pytest.raises(ValueError, match="nccl-dgx1-v100"):
        parse_network("nccl-dgx9")


def test_a_forced_protocol_costs_what_the_tuner_would_pick_it_at() -> None:
    nccl = NcclModel(NODE)
    # 16 ranks on two nodes, Simple ring: base 8.4 us + 28 NVLink steps of 3.4 us + 2 network
    # steps of 14 us (tuning.cc), 4 bytes at the 50 GB/s of the node's NICs.
    latency = (8.4 + 28 * 3.4 + 2 * 14.0) * 1e-6
    assert nccl.time_s("allreduce", 4, 16, "ring", "Simple") == pytest.approx(
        latency + 2 * 15 / 16 * 4 / 50e9, rel=1e-12
    )
    # The tuner's pick is the cheapest of the forced ones.
    algorithm, protocol, seconds = nccl.choice("allreduce", MIB, 16)
    forced = {(a, p): nccl.time_s("allreduce", MIB, 16, a, p)
              for a in ("ring", "tree") for p in ("LL", "LL128", "Simple")}  # fmt: skip
    assert seconds == min(forced.values()) == forced[(algorithm, protocol)]
    assert nccl.time_s("allreduce", MIB, 1, "ring", "LL") == 0.0


@pytest.mark.parametrize(
    ("kind", "algorithm", "protocol", "match"),
    [
        ("allreduce", "ring", "LL64", "protocol"),
        ("allreduce", "nvls", "LL", "algorithm"),
        ("allgather", "tree", "LL", "tree serves allreduce only"),
        ("gossip", "ring", "LL", "unknown collective kind"),
    ],
)
def test_a_forced_protocol_names_what_is_wrong(
    kind: str, algorithm: str, protocol: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        NcclModel(NODE).time_s(kind, MIB, 16, algorithm, protocol)
