"""``scontrol show topology`` as Slurm prints it, read into switches, without a controller."""

from __future__ import annotations

from pathlib import Path

from clients.slurm import SlurmSwitch, SlurmTopology, parse_topology
from clients.slurmrest_protocol import SlurmRest, expand_hostlist

# The lab's topology (two racks, a node on a leaf of its own, a top switch over them) as Slurm
# 22.05's scontrol prints it: the leaves' nodes as topology.conf lists them (leaf-b's written here
# as a range), the top switch's as hostlist ranges, which 24.11 and 26.05 print alike.
SCONTROL_22_05 = """\
SwitchName=leaf-a Level=0 LinkSpeed=1 Nodes=gpu1,gpu2,spare1
SwitchName=leaf-b Level=0 LinkSpeed=1 Nodes=gpu[3-4],spare2
SwitchName=node-inf1 Level=0 LinkSpeed=1 Nodes=inf1
SwitchName=top Level=1 LinkSpeed=1 Nodes=gpu[1-4],inf1,spare[1-2] Switches=leaf-a,leaf-b,node-inf1
"""


def test_leaf_and_upper_switches_with_their_nodes_expanded() -> None:
    switches = parse_topology(SCONTROL_22_05, expand_hostlist)
    assert [(s.name, s.level, s.leaf) for s in switches] == [
        ("leaf-a", 0, True),
        ("leaf-b", 0, True),
        ("node-inf1", 0, True),
        ("top", 1, False),
    ]
    assert switches[1].nodes == ["gpu3", "gpu4", "spare2"]
    assert switches[3].nodes == ["gpu1", "gpu2", "gpu3", "gpu4", "inf1", "spare1", "spare2"]
    assert switches[3].switches == ["leaf-a", "leaf-b", "node-inf1"]


def test_a_node_belongs_to_its_leaf_switches_only() -> None:
    topology = SlurmTopology(switches=parse_topology(SCONTROL_22_05, expand_hostlist))
    assert [s.name for s in topology.leaves_of("gpu4")] == ["leaf-b"]
    assert [s.name for s in topology.leaves_of("inf1")] == ["node-inf1"]
    assert topology.leaves_of("free1") == []  # in no switch (the top one is never a leaf)


def test_three_levels_zero_padded_ranges_and_empty_fields() -> None:
    out = (
        "SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n[001-003]\n"
        "SwitchName=s1 Level=0 LinkSpeed=1 Nodes=n[004-005]\n"
        "SwitchName=s2 Level=1 LinkSpeed=1 Nodes=n[001-005] Switches=s[0-1]\n"
        "SwitchName=s3 Level=2 LinkSpeed=1 Nodes=(null) Switches=s2\n"
        "\n"
    )
    switches = parse_topology(out, expand_hostlist)
    assert switches[0] == SlurmSwitch(name="s0", level=0, nodes=["n001", "n002", "n003"])
    assert switches[2].switches == ["s0", "s1"]
    assert switches[3] == SlurmSwitch(name="s3", level=2, nodes=[], switches=["s2"])


def test_no_output_is_no_switches() -> None:
    """22.05 prints nothing on stdout without a topology plugin (its error goes to stderr, exit
    0); 26.05 prints nothing at all."""
    assert parse_topology("", expand_hostlist) == []


def test_slurmrestd_serves_no_topology_and_says_so(tmp_path: Path) -> None:
    key = tmp_path / "jwt.key"
    key.write_bytes(b"k" * 32)
    topology = SlurmRest("http://restapi:6820", version="v0.0.42", key_file=key).topology()
    assert topology.switches == []
    assert "slurmrestd v0.0.42 serves no switch topology" in topology.note
    assert "GPUFLEET_SLURM_BACKEND=cli" in topology.note


def test_a_line_cut_short_is_left_out_and_said_the_others_read() -> None:
    """scontrol before 23.11 cuts each line at 512 characters: a top switch over many nodes ends
    mid-hostlist. That switch is left out, saying so; the leaves (all a node's domain needs) stay."""
    out = (
        "SwitchName=leaf-a Level=0 LinkSpeed=1 Nodes=gpu[001-064]\n"
        "SwitchName=top Level=1 LinkSpeed=1 Nodes=gpu[001-128],cpu[0\n"
        "SwitchName=odd Level=x LinkSpeed=1 Nodes=gpu1\n"
    )
    notes: list[str] = []
    switches = parse_topology(out, expand_hostlist, notes)
    assert [s.name for s in switches] == ["leaf-a"] and len(switches[0].nodes) == 64
    assert len(notes) == 2 and "switch top" in notes[0] and "Level=x" in notes[1]
