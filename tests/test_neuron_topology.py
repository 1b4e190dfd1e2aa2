"""`neuron-ls --topology` read, and the rule that no model or fsdp group of a mesh spans
Neuron devices that are not connected (`trn_accum.neuron.topology`), on captured output of a
trn2.48xlarge (16 Trainium2 devices in a 4 x 4 torus) in the two table layouts neuron-ls has
printed: LOGICAL NC counts, and NEURON CORE IDS ranges under instance lines."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from trn_accum.config.load import load_config
from trn_accum.neuron import topology
from trn_accum.plan.probe import Check
from trn_accum.plan.runtime_rows import row_topology

# neuron-ls --topology on a trn2.48xlarge (Neuron docs, "Neuron LS User Guide"); the ASCII
# torus drawing it prints after the table is not read
LOGICAL_NC = """\
+--------+--------+---------+--------+---------------+---------+
| NEURON | NEURON | LOGICAL | NEURON |   CONNECTED   |   PCI   |
| DEVICE | CORES  |   NC    | MEMORY |    DEVICES    |   BDF   |
+--------+--------+---------+--------+---------------+---------+
| 0      | 8      | 4       | 96 GB  | 12, 3, 4, 1   | cc:00.0 |
| 1      | 8      | 4       | 96 GB  | 13, 0, 5, 2   | b5:00.0 |
| 2      | 8      | 4       | 96 GB  | 14, 1, 6, 3   | b6:00.0 |
| 3      | 8      | 4       | 96 GB  | 15, 2, 7, 0   | cb:00.0 |
| 4      | 8      | 4       | 96 GB  | 0, 7, 8, 5    | 6f:00.0 |
| 5      | 8      | 4       | 96 GB  | 1, 4, 9, 6    | 58:00.0 |
| 6      | 8      | 4       | 96 GB  | 2, 5, 10, 7   | 59:00.0 |
| 7      | 8      | 4       | 96 GB  | 3, 6, 11, 4   | 6e:00.0 |
| 8      | 8      | 4       | 96 GB  | 4, 11, 12, 9  | 9b:00.0 |
| 9      | 8      | 4       | 96 GB  | 5, 8, 13, 10  | 84:00.0 |
| 10     | 8      | 4       | 96 GB  | 6, 9, 14, 11  | 85:00.0 |
| 11     | 8      | 4       | 96 GB  | 7, 10, 15, 8  | 9a:00.0 |
| 12     | 8      | 4       | 96 GB  | 8, 15, 0, 13  | f8:00.0 |
| 13     | 8      | 4       | 96 GB  | 9, 12, 1, 14  | e1:00.0 |
| 14     | 8      | 4       | 96 GB  | 10, 13, 2, 15 | e2:00.0 |
| 15     | 8      | 4       | 96 GB  | 11, 14, 3, 12 | f7:00.0 |
+--------+--------+---------+--------+---------------+---------+


  Neuron Device Topology
        *        *        *        *
        │        │        │        │
        ▼        ▼        ▼        ▼
  *––►[ 0 ]◄––►[ 1 ]◄––►[ 2 ]◄––►[ 3 ]◄––*
"""
LINKS = {
    int(cells[0]): {int(x) for x in cells[4].split(",")}
    for cells in (
        [c.strip() for c in line.strip("|").split("|")]
        for line in LOGICAL_NC.splitlines()
        if line.startswith("| ") and line[2].isdigit()
    )
}


def core_ids_layout(links: dict[int, set[int]], per_device: int = 4) -> str:
    """The same devices in the later layout: instance lines, NEURON CORE IDS ranges, CPU
    affinity and NUMA columns, a process line under device 0."""
    head = (
        "instance-type: trn2.48xlarge\ninstance-id: i-0123456789abcdef0\n"
        "logical-neuroncore-config: 2\n"
        "+--------+--------+----------+--------+---------------+--------------+------+------+\n"
        "| NEURON | NEURON |  NEURON  | NEURON |   CONNECTED   |     PCI      | CPU  | NUMA |\n"
        "| DEVICE | CORES  | CORE IDS | MEMORY |    DEVICES    |     BDF      | AFF. | NODE |\n"
        "+--------+--------+----------+--------+---------------+--------------+------+------+\n"
    )
    rows = []
    for d in sorted(links):
        ids = f"{d * per_device}-{d * per_device + per_device - 1}"
        near = ", ".join(map(str, sorted(links[d])))
        rows.append(f"| {d} | 4 | {ids} | 96 GB | {near} | 0000:cc:00.0 | 0-47 | 0 |")
        if d == 0:
            rows.append("|   |   |   |   |   |   | 1234 | python train.py |")
    return head + "\n".join(rows) + "\n"


def test_the_table_is_read_in_both_layouts():
    old = topology.parse_topology(LOGICAL_NC)
    assert {d: set(n) for d, n in old.links.items()} == LINKS
    assert all(len(n) == 4 and all(d in LINKS[x] for x in n) for d, n in LINKS.items())
    new = topology.parse_topology(core_ids_layout(LINKS))
    assert new.links == old.links
    for t in (old, new):
        cores = topology.core_device(t, lnc=2)
        assert len(cores) == 64 and cores[0] == cores[3] == 0 and cores[4] == 1
        assert cores[63] == 15
    at_lnc1 = topology.core_device(topology.Topology(old.links, {}), lnc=1)
    assert len(at_lnc1) == 128 and at_lnc1[7] == 0 and at_lnc1[8] == 1


@pytest.mark.parametrize("text", ["", "neuron-ls: command not found\n", "| a | b |\n| 1 | 2 |\n"])
def test_output_without_a_device_table_is_one_line(text):
    with pytest.raises(ValueError) as e:
        topology.parse_topology(text)
    assert "NEURON DEVICE and CONNECTED DEVICES" in str(e.value) and "\n" not in str(e.value)


def grid_groups(shape: dict[str, int], cores: list[int]) -> dict[str, list[list[int]]]:
    grid = np.asarray(cores).reshape(tuple(shape.values()))
    return {a: topology.axis_groups(grid, list(shape), a) for a in topology.LINKED_AXES}


def test_the_full_node_meshes_are_connected():
    t = topology.parse_topology(LOGICAL_NC)
    c2d = topology.core_device(t, lnc=2)
    cores = list(range(64))
    for shape in (
        {"data": 1, "fsdp": 16, "model": 4},  # a model group: one device's 4 cores
        {"data": 1, "fsdp": 32, "model": 2},  # the shipped 3B mesh on one node
        {"data": 4, "fsdp": 16, "model": 1},  # fsdp over devices 0-3, 4-7, ...: torus rows
        {"data": 1, "fsdp": 64, "model": 1},
    ):
        groups = grid_groups(shape, cores)
        assert topology.disconnected_groups(groups, t, c2d) == [], shape


def test_a_group_over_unlinked_devices_is_named():
    t = topology.parse_topology(LOGICAL_NC)
    c2d = topology.core_device(t, lnc=2)
    # devices 0 and 5 (cores 0-3, 20-23): no link between them
    bad = topology.disconnected_groups({"model": [[0, 1, 2, 3, 20, 21, 22, 23]]}, t, c2d)
    assert bad == [
        "model group of cores [0, 1, 2, 3, 20, 21, 22, 23] spans devices "
        "0 (links [1, 3, 4, 12]), 5 (links [1, 4, 6, 9])"
    ]
    # 0 and 2 are not linked; with 1 in the group they are (0 - 1 - 2)
    assert topology.disconnected_groups({"fsdp": [[0, 8]]}, t, c2d)
    assert topology.disconnected_groups({"fsdp": [[0, 4, 8]]}, t, c2d) == []
    # fsdp 16 x model 4 with the data axis outermost over 2 x 32 cores: data groups are
    # not NeuronLink's, so the same cores in another order pass
    shape = {"data": 2, "fsdp": 8, "model": 4}
    assert topology.disconnected_groups(grid_groups(shape, list(range(64))), t, c2d) == []
    # fsdp 8 x model 8: each model group is two linked devices, but each fsdp group holds
    # every other device (0, 2, 4, ...: two torus columns that no link joins)
    bad = topology.disconnected_groups(
        grid_groups({"fsdp": 8, "model": 8}, list(range(64))), t, c2d
    )
    assert len(bad) == 8 and all(b.startswith("fsdp group of cores [") for b in bad)
    assert "spans devices 0 (links [1, 3, 4, 12]), 2 (links" in bad[0]
    # a core neuron-ls does not list
    unknown = topology.disconnected_groups({"model": [[0, 99]]}, t, c2d)
    assert unknown == ["model group of cores [0, 99]: cores [99] not in neuron-ls"]


def test_visible_cores_and_a_real_mesh_grid():
    """8 CPU devices standing for this process's cores 0-3 and 20-23 (NEURON_RT_VISIBLE_CORES
    "0-3,20-23"): a model axis of 8 spans devices 0 and 5, refused; of 4, one device each."""
    t = topology.parse_topology(LOGICAL_NC)
    c2d = topology.core_device(t, lnc=2)
    local = jax.local_devices()
    cores = topology.visible_cores("0-3,20-23", len(local))
    assert cores == [0, 1, 2, 3, 20, 21, 22, 23]
    assert topology.visible_cores(None, 4) == [0, 1, 2, 3]
    wide = Mesh(np.asarray(local).reshape(1, 8), ("fsdp", "model"))
    grid = topology.core_grid(wide.devices, local, cores)
    groups = {"model": topology.axis_groups(grid, wide.axis_names, "model")}
    assert len(topology.disconnected_groups(groups, t, c2d)) == 1
    narrow = Mesh(np.asarray(local).reshape(2, 4), ("fsdp", "model"))
    grid = topology.core_grid(narrow.devices, local, cores)
    groups = {a: topology.axis_groups(grid, narrow.axis_names, a) for a in ("fsdp", "model")}
    assert groups["model"] == [[0, 1, 2, 3], [20, 21, 22, 23]]
    bad = topology.disconnected_groups(groups, t, c2d)  # fsdp pairs (0, 20): devices 0 and 5
    assert len(bad) == 4 and all(b.startswith("fsdp group of cores") for b in bad)
    other = topology.core_grid(narrow.devices, local[:4], cores[:4])  # half of another process
    assert topology.axis_groups(other, narrow.axis_names, "fsdp") == [[0], [1], [2], [3]]


def test_the_row_is_skipped_where_neuron_ls_is_absent(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no neuron-ls
    cfg = load_config("configs/fuji-tiny.toml", [])
    status, detail = row_topology(Check(cfg, str(tmp_path)))
    assert status == "skip" and "neuron-ls not found" in detail
