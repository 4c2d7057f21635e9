"""Which groups the cluster calibration times, built as the planner places a plan's groups.

Global ranks fill a node before the next (`simulator/cost/placement.py`: the innermost axis is
consecutive ranks), so a group the planner keeps inside a node is consecutive ranks of one node,
and a group it stripes over nodes takes one rank per node at the same local index. Every
instance of a kind of group runs at once (as a plan's TP or CP groups do), each rank in at most
one instance; the sizes are the ones that set the link figures:

- `pair`: two consecutive ranks of a node (send/recv, and the smallest ring);
- `node`: all ranks of a node (NVLink's bus bandwidth at the node's size);
- `striped`: one rank per node, same local index (InfiniBand per GPU: every ring step crosses);
- `cross-pair`: a rank and its peer on the next node (send/recv over the network);
- `world`: every rank (a ring over both levels): priced by the fitted profile, as a check.
"""

from __future__ import annotations

from dataclasses import dataclass

from csbp.simulator.errors import InputError

RING_AND_A2A = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class GroupKind:
    name: str
    level: str  # "nvlink", "infiniband" or "check"
    per_node: int  # fewest members on one node
    instances: tuple[tuple[int, ...], ...]
    ops: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.instances[0])

    def instance_of(self, rank: int) -> tuple[int, ...] | None:
        return next((members for members in self.instances if rank in members), None)


def nodes_of(hosts: list[str], ranks_per_node: int | None = None) -> list[list[int]]:
    """Ranks by node: from each rank's host name, or blocks of `ranks_per_node` consecutive
    ranks (a forced split, for testing the across-node path on one host). Every node must hold
    the same number of consecutive ranks, as torchrun starts them and the planner assumes."""
    world = len(hosts)
    if ranks_per_node is not None:
        if ranks_per_node < 1 or world % ranks_per_node:
            raise InputError(f"--ranks-per-node {ranks_per_node}: the world size {world} must be "
                             "a multiple of it")
        return [list(range(i, i + ranks_per_node)) for i in range(0, world, ranks_per_node)]
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    out = list(nodes.values())
    if len({len(n) for n in out}) > 1 or any(n != list(range(n[0], n[0] + len(n))) for n in out):
        raise InputError("ranks per host differ or are not consecutive ("
                         + ", ".join(f"{h}: {len(r)}" for h, r in nodes.items())
                         + "): start the same --nproc-per-node on every node")
    return out


def group_kinds(nodes: list[list[int]]) -> list[GroupKind]:
    """The kinds of group to time on this node layout (see the module docstring)."""
    k, n = len(nodes[0]), len(nodes)
    kinds = []
    if k >= 2:
        pairs = tuple(tuple(node[i:i + 2]) for node in nodes for i in range(0, k - 1, 2))
        kinds.append(GroupKind("pair", "nvlink", 2, pairs, (*RING_AND_A2A, "send_recv")))
    if k > 2:
        kinds.append(GroupKind("node", "nvlink", k, tuple(map(tuple, nodes)), RING_AND_A2A))
    if n >= 2:
        striped = tuple(tuple(node[i] for node in nodes) for i in range(k))
        ops = RING_AND_A2A + (("send_recv",) if n == 2 else ())
        kinds.append(GroupKind("striped", "infiniband", 1, striped, ops))
        if n > 2:
            cross = tuple((nodes[j][i], nodes[j + 1][i]) for j in range(0, n - 1, 2) for i in range(k))
            kinds.append(GroupKind("cross-pair", "infiniband", 1, cross, ("send_recv",)))
        if k >= 2:
            everyone = (tuple(r for node in nodes for r in node),)
            kinds.append(GroupKind("world", "check", k, everyone, RING_AND_A2A))
    return kinds
