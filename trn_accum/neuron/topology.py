"""Which Neuron devices of a node are linked (`neuron-ls --topology`), and meshes that use
cores of devices that are not.

Neuron's "JAX NeuronX Known Issues" lists meshes over NeuronCores that are not connected as a
possible crash at compile or run time, and names `neuron-ls --topology` as what tells. Its
table has one row per Neuron device (a Trainium2 chip: 8 physical cores, 4 logical ones at
LNC=2), with the devices it is linked to:

    | NEURON | NEURON | LOGICAL | NEURON |   CONNECTED   |   PCI   |
    | DEVICE | CORES  |   NC    | MEMORY |    DEVICES    |   BDF   |
    | 0      | 8      | 4       | 96 GB  | 12, 3, 4, 1   | cc:00.0 |

(newer releases print NEURON CORE IDS, e.g. "0-3", in place of LOGICAL NC, and more columns;
the columns are found by their header words, so either reads). A trn2.48xlarge's 16 devices
form a 4 x 4 torus: each row names 4 neighbours.

The rule (`disconnected_groups`): every group of a mesh axis that NeuronLink carries (model,
fsdp) must use cores of devices that are connected among themselves: the devices it spans,
with the links between them, form one connected graph. Cores of one device are always
connected. Only the cores of this node count: a group's cores on other nodes talk over EFA.
Pure functions of text and integers; `trn_accum.plan.runtime_rows` runs `neuron-ls`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

LINKED_AXES = ("model", "fsdp")


@dataclasses.dataclass(frozen=True)
class Topology:
    """`links`: device -> the devices it is connected to; `cores`: device -> its logical core
    ids, in order (empty when the table does not say)."""

    links: Mapping[int, frozenset[int]]
    cores: Mapping[int, tuple[int, ...]]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _ints(text: str) -> list[int]:
    """'12, 3, 4, 1' -> [12, 3, 4, 1]; '0-3' -> [0, 1, 2, 3]; '' or 'NA' -> []."""
    out: list[int] = []
    for part in re.split(r"[,\s]+", text.strip()):
        lo, sep, hi = part.partition("-")
        if lo.isdigit() and (not sep or hi.isdigit()):
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return out


def parse_topology(text: str) -> Topology:
    """The device table of `neuron-ls --topology` (or plain `neuron-ls`) output. ValueError
    (one line) when the text holds no table with NEURON DEVICE and CONNECTED DEVICES."""
    rows = [_cells(ln) for ln in text.splitlines() if ln.strip().startswith("|")]
    # header lines: those before the first row with a device id, joined column by column
    body = next((i for i, cells in enumerate(rows) if cells and cells[0].isdigit()), len(rows))
    header = zip(*rows[:body], strict=False)  # the shortest line bounds the columns
    names = [" ".join(" ".join(col).split()) for col in header] if body else []
    if "NEURON DEVICE" not in names or "CONNECTED DEVICES" not in names:
        raise ValueError(
            f"neuron-ls output has no device table with NEURON DEVICE and CONNECTED DEVICES "
            f"columns (header {names or 'missing'})"
        )
    col = {name: i for i, name in enumerate(names)}
    links: dict[int, frozenset[int]] = {}
    cores: dict[int, tuple[int, ...]] = {}
    for cells in rows[body:]:
        if len(cells) != len(names) or not cells[0].isdigit():
            continue  # a process line under a device, or a separator
        device = int(cells[0])
        links[device] = frozenset(_ints(cells[col["CONNECTED DEVICES"]])) - {device}
        if "NEURON CORE IDS" in col:
            cores[device] = tuple(_ints(cells[col["NEURON CORE IDS"]]))
        elif "LOGICAL NC" in col and cells[col["LOGICAL NC"]].isdigit():
            cores[device] = (-1,) * int(cells[col["LOGICAL NC"]])  # a count; ids from order
    if not links:
        raise ValueError("neuron-ls output lists no Neuron device")
    return Topology(links, _number_cores(cores))


def _number_cores(cores: Mapping[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """Core ids counted through the devices in order where the table gave only counts."""
    out, next_id = {}, 0
    for device in sorted(cores):
        ids = cores[device]
        if ids and ids[0] < 0:
            ids = tuple(range(next_id, next_id + len(ids)))
        out[device] = ids
        next_id = (max(ids) + 1) if ids else next_id
    return out


def core_device(topology: Topology, lnc: int, cores_per_device: int = 8) -> dict[int, int]:
    """Logical core id -> its device: from the table's core ids, else `cores_per_device`
    physical cores per device grouped `lnc` to a logical core, numbered in device order."""
    if any(topology.cores.values()):
        return {core: d for d, ids in topology.cores.items() for core in ids}
    per = cores_per_device // lnc
    return {d * per + i: d for d in sorted(topology.links) for i in range(per)}


def visible_cores(value: str | None, count: int) -> list[int]:
    """The logical core ids of this process's `count` devices, in order:
    NEURON_RT_VISIBLE_CORES ("4-7", "0,1,2,3") when set, else 0 .. count - 1."""
    ids = _ints(value) if value else []
    return ids[:count] if len(ids) >= count else list(range(count))


def core_grid(devices: np.ndarray, local: Sequence[object], cores: Sequence[int]) -> np.ndarray:
    """The mesh's device array as logical core ids: `local[i]` (this process's devices) is
    core `cores[i]`; a device of another process is -1."""
    position = {d: cores[i] for i, d in enumerate(local)}
    flat = [position.get(d, -1) for d in np.asarray(devices).flat]
    return np.asarray(flat, dtype=int).reshape(np.shape(devices))


def axis_groups(grid: np.ndarray, axis_names: Sequence[str], axis: str) -> list[list[int]]:
    """The groups of mesh axis `axis`: for a grid of core ids shaped as the mesh (-1 for a
    device of another process), the core ids along `axis` with the other axes fixed, those
    of other processes left out."""
    i = list(axis_names).index(axis)
    rows = np.moveaxis(np.asarray(grid), i, -1).reshape(-1, grid.shape[i])
    return [[int(c) for c in row if c >= 0] for row in rows]


def _connected(devices: set[int], links: Mapping[int, frozenset[int]]) -> bool:
    """Whether `devices`, with the links among them, form one connected graph."""
    start = next(iter(devices))
    seen, todo = {start}, [start]
    while todo:
        for n in links.get(todo.pop(), frozenset()) & devices:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen == devices


def disconnected_groups(
    groups: Mapping[str, Iterable[Sequence[int]]],
    topology: Topology,
    core_to_device: Mapping[int, int],
) -> list[str]:
    """One line per group (axis name -> groups of core ids) whose devices are not connected
    among themselves, or that uses a core the table does not know."""
    bad = []
    for axis, axis_groups_ in groups.items():
        for group in axis_groups_:
            unknown = [c for c in group if c not in core_to_device]
            if unknown:
                bad.append(f"{axis} group of cores {list(group)}: cores {unknown} not in neuron-ls")
                continue
            devices = {core_to_device[c] for c in group}
            if len(devices) > 1 and not _connected(devices, topology.links):
                shown = ", ".join(
                    f"{d} (links {sorted(topology.links.get(d, ()))})" for d in sorted(devices)
                )
                bad.append(f"{axis} group of cores {list(group)} spans devices {shown}")
    return bad
