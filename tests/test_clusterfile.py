"""fakepg.clusterfile: a cluster in TOML or JSON, read into NCCL's or gloo's model; the cluster
presets of current machines; a cluster's node count and per-hop latencies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fakepg
from fakepg import NcclModel, Topology, load_cluster, parse_network

MIB = 1 << 20

EXAMPLE = """\
name = "my-h100-cluster"
nodes = 4
gpus_per_node = 8
nics_per_node = 8

[intra_node]
bandwidth = "450 GB/s"
latency = "3.4 us"

[inter_node]
bandwidth = "400 Gbit/s"
latency = "14 us"

[library]
name = "nccl"
algorithm = "auto"
launch = "0 us"
compute_slowdown = 0.06
"""


def _write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_documented_example_reads_as_written(tmp_path: Path) -> None:
    model = load_cluster(_write(tmp_path, EXAMPLE))
    assert isinstance(model, NcclModel)
    t = model.topology
    assert (t.node_count, t.gpus_per_node, t.nics_per_node) == (4, 8, 8)
    assert (t.intra_Bps, t.nic_Bps) == (450e9, 50e9)  # 400 Gbit/s is 50 GB/s
    assert (t.intra_latency_s, t.nic_latency_s) == (3.4e-6, 14e-6)
    assert (model.algorithm, model.launch_s, model.compute_slowdown) == ("auto", 0.0, 0.06)
    assert model.name == t.name == "my-h100-cluster"
    assert t.capacity == 32
    # NCCL's own latencies, stated: the same costs as the preset of these machines.
    preset = fakepg.CLUSTER_PRESETS["nccl-dgx-h100"]
    for world in (8, 16, 32):
        assert model.choice("allreduce", 4, world)[2] == pytest.approx(
            preset.choice("allreduce", 4, world)[2], rel=1e-12
        )


def test_json_reads_as_toml_does(tmp_path: Path) -> None:
    toml = load_cluster(_write(tmp_path, EXAMPLE))
    json_text = fakepg.dumps_cluster(toml, "json")
    assert load_cluster(_write(tmp_path, json_text, "cluster.json")) == toml
    assert parse_network(str(tmp_path / "cluster.json")) == toml  # --network FILE


@pytest.mark.parametrize("name", sorted(fakepg.CLUSTER_PRESETS))
@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_every_preset_written_and_read_back_costs_the_same(
    tmp_path: Path, name: str, fmt: str
) -> None:
    preset = fakepg.CLUSTER_PRESETS[name]
    again = load_cluster(_write(tmp_path, fakepg.dumps_cluster(preset, fmt), f"c.{fmt}"))
    assert type(again) is type(preset) and str(again) == str(preset)
    for world in (2, 8, 16, 64):
        for kind in ("allreduce", "allgather", "broadcast"):
            assert again.collective_time_s(kind, MIB, world) == preset.collective_time_s(
                kind, MIB, world
            )


def test_a_nic_is_written_in_bits_per_second() -> None:
    data = fakepg.cluster_to_dict(fakepg.CLUSTER_PRESETS["nccl-dgx-h100"])
    assert data["inter_node"] == {"bandwidth": "400 Gbit/s"}
    assert data["intra_node"] == {"bandwidth": "450 GB/s"}


def test_gloo_reads_its_own_settings(tmp_path: Path) -> None:
    text = """
gpus_per_node = 8
nics_per_node = 1
[intra_node]
bandwidth = "100 GB/s"
[inter_node]
bandwidth = "100 Gbps"
[library]
name = "gloo"
tcp_bandwidth = "2.5 GB/s"
step_latency = "25 us"
call = "100 us"
"""
    model = load_cluster(_write(tmp_path, text))
    assert isinstance(model, fakepg.GlooModel)
    assert (model.tcp_Bps, model.latency_s, model.call_s, model.copy_Bps) == (
        2.5e9, 25e-6, 100e-6, 0.0
    )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (EXAMPLE.replace("nics_per_node = 8", "nic_per_node = 8"),
         r"the file: unknown key\(s\) 'nic_per_node'"),
        (EXAMPLE.replace("gpus_per_node = 8\n", ""), r"gpus_per_node: missing"),
        (EXAMPLE.replace("nodes = 4", "nodes = 0"), r"nodes: expected an integer of 1 or more"),
        (EXAMPLE.replace('"400 Gbit/s"', '"400 Gibit/s"'),
         r"inter_node.bandwidth: cannot read '400 Gibit/s' as a rate > 0: write a number with "
         r"one of the units B, kB"),
        (EXAMPLE.replace('"450 GB/s"', '"0 GB/s"'), r"intra_node.bandwidth: cannot read '0 GB/s'"),
        (EXAMPLE.replace('"14 us"', '"-1 us"'), r"inter_node.latency: cannot read '-1 us'"),
        (EXAMPLE.replace('name = "nccl"', 'name = "mpi"'),
         r"library.name: expected 'nccl' or 'gloo', got 'mpi'"),
        (EXAMPLE.replace('name = "nccl"', 'name = "gloo"'),
         r"library: unknown key\(s\) 'algorithm', 'compute_slowdown', 'launch'"),
        (EXAMPLE.replace('algorithm = "auto"', 'algorithm = "double-tree"'),
         r"algorithm must be 'ring', 'tree' or 'auto'"),
        (EXAMPLE.replace("[library]", "[library"), r"not valid TOML"),
        (EXAMPLE.replace("[intra_node]\n", ""),
         r"the file: unknown key\(s\) 'bandwidth', 'latency'"),
    ],
)  # fmt: skip
def test_a_bad_file_names_itself_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=message) as raised:
        load_cluster(path)
    assert str(raised.value).startswith(str(path))


def test_a_file_that_is_not_there_or_not_json_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read the cluster file"):
        load_cluster(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match=r"not valid JSON"):
        load_cluster(_write(tmp_path, "{", "c.json"))
    with pytest.raises(ValueError, match=r"ends in .toml or .json"):
        load_cluster(_write(tmp_path, "", "c.yaml"))
    with pytest.raises(ValueError, match=r"dumps_cluster: fmt must be"):
        fakepg.dumps_cluster(fakepg.CLUSTER_PRESETS["nccl-dgx-h100"], "yaml")


# -- the topology's node count and latencies --------------------------------------------------


def test_a_world_must_fit_the_clusters_nodes() -> None:
    cluster = Topology(8, 450e9, 8, 50e9, "four", node_count=4)
    assert cluster.nodes(32) == 4 and cluster.nodes(8) == 1
    with pytest.raises(ValueError, match=r"world_size 40 does not fit in its 4 nodes of 8 GPUs"):
        cluster.nodes(40)
    with pytest.raises(ValueError, match=r"node_count must be an integer >= 1"):
        Topology(8, 450e9, 8, 50e9, node_count=0)


def test_a_slower_network_hop_costs_only_across_nodes() -> None:
    base = Topology(8, 450e9, 8, 50e9)
    slow = Topology(8, 450e9, 8, 50e9, nic_latency_s=28e-6)  # twice NCCL's Simple 14 us
    fast, late = NcclModel(base, "ring"), NcclModel(slow, "ring")
    assert late.collective_time_s("allreduce", 4, 8) == fast.collective_time_s("allreduce", 4, 8)
    # Two nodes: 2 network steps of ring Simple, each 14 us longer (LL and LL128 scaled too).
    assert late.time_s("allreduce", MIB, 16, "ring", "Simple") == pytest.approx(
        fast.time_s("allreduce", MIB, 16, "ring", "Simple") + 2 * 14e-6, rel=1e-12
    )
    assert late.time_s("allreduce", 4, 16, "ring", "LL") == pytest.approx(
        fast.time_s("allreduce", 4, 16, "ring", "LL") + 2 * 2.7e-6, rel=1e-12
    )


def test_nvlink_latency_scales_the_steps_inside_a_node() -> None:
    base = NcclModel(Topology(8, 450e9, 8, 50e9), "ring")
    slow = NcclModel(Topology(8, 450e9, 8, 50e9, intra_latency_s=6.8e-6), "ring")
    # One node, 2(n-1) = 14 NVLink steps of ring Simple, each 3.4 us longer.
    assert slow.time_s("allreduce", MIB, 8, "ring", "Simple") == pytest.approx(
        base.time_s("allreduce", MIB, 8, "ring", "Simple") + 14 * 3.4e-6, rel=1e-12
    )


# -- the presets ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "nvlink", "nics", "nic"),
    [
        ("nccl-dgx-a100", 300e9, 8, 25e9),  # NVLink3 600 GB/s both ways; 8 x 200 Gb/s HDR
        ("nccl-dgx-h100", 450e9, 8, 50e9),  # NVLink4 900 GB/s both ways; 8 x 400 Gb/s NDR
        ("nccl-dgx-h200", 450e9, 8, 50e9),
        ("nccl-h100-8x200g", 450e9, 8, 25e9),  # H100 nodes with 8 x 200 Gb/s NICs
    ],
)
def test_the_presets_of_current_machines(name: str, nvlink: float, nics: int, nic: float) -> None:
    model = fakepg.CLUSTER_PRESETS[name]
    assert isinstance(model, NcclModel)
    t = model.topology
    assert (t.gpus_per_node, t.intra_Bps, t.nics_per_node, t.nic_Bps) == (8, nvlink, nics, nic)
    assert name in fakepg.CLUSTER_DESCRIPTIONS
    assert t.name == name.removeprefix("nccl-") or name == "nccl-h100-8x200g"
    # Across nodes the NICs bound the bus: 8 x 200 Gb/s halves what 8 x 400 Gb/s gives.
    assert t.bus_Bps(16) == min(nvlink, nics * nic)


def test_every_preset_is_described() -> None:
    assert set(fakepg.CLUSTER_DESCRIPTIONS) == set(fakepg.CLUSTER_PRESETS)


def test_the_file_format_is_json_serialisable_as_written() -> None:
    for preset in fakepg.CLUSTER_PRESETS.values():
        assert json.loads(json.dumps(fakepg.cluster_to_dict(preset)))


def test_the_docs_example_file_is_the_one_the_page_shows_and_it_reads() -> None:
    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "howto" / "cli.md").read_text()
    shown = page.split("```toml\n", 1)[1].split("```", 1)[0]
    example = root / "docs" / "howto" / "cluster.toml"
    assert shown == example.read_text()
    model = load_cluster(example)
    assert isinstance(model, NcclModel)
    assert (model.topology.node_count, model.topology.nic_Bps) == (4, 25e9)
