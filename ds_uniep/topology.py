"""One description of the machine: which ranks share a node.

A node is a run of ``node_size`` consecutive global ranks, the way torchrun, the DeepSpeed
launcher and mpirun's by-slot mapping (its default) number processes. ``node_size`` is
``"uniep": {"topology": {"node_size": L}}`` where set (to emulate several nodes on one host,
say), else the launcher's local world size (:data:`LOCAL_SIZE_VARS`), else the whole world is
one node. Everything that asks which ranks share a node reads it here: the two-level dispatch
(:mod:`ds_uniep.twolevel`), the backend choice (:func:`ds_uniep.backend.resolve`) and HybridEP's
sites (``site_size`` auto; :meth:`ds_uniep.hybrid.topology.Topology.from_nodes`).

:class:`GroupTopology` is that description restricted to one expert-parallel group: its nodes
(the group's ranks on each node, in group order), each rank's node and local index, the node
groups and the cross-node groups of ranks with the same local index.
"""

import datetime
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as torch_dist

#: Environment variables holding the number of processes on this node, first match wins: torchrun
#: (LOCAL_WORLD_SIZE), the DeepSpeed launcher (LOCAL_SIZE), Open MPI, MPICH's hydra, MVAPICH, Slurm.
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                   "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def node_size(config=None, world_size: Optional[int] = None) -> int:
    """Ranks per node: ``config.node_size`` (a :class:`ds_uniep.config.TopologyConfig`) unless
    "auto", else the launcher's local world size, else ``world_size`` (default: the process
    group's; 1 without one): a single node."""
    configured = getattr(config, "node_size", "auto")
    if configured != "auto":
        return int(configured)
    for var in LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    if world_size is None:
        world_size = torch_dist.get_world_size() if torch_dist.is_initialized() else 1
    return world_size


@dataclass(frozen=True)
class GroupTopology:
    """An expert-parallel group of ranks laid over nodes of ``node_size`` consecutive global ranks.

    ``ranks[g]`` is the global rank of group rank ``g``; ``me`` this process's group rank."""

    ranks: Tuple[int, ...]
    node_size: int
    me: int = 0

    def __post_init__(self):
        if self.node_size < 1:
            raise ValueError(f"topology: node_size must be a positive integer, got {self.node_size}")
        if not 0 <= self.me < len(self.ranks):
            raise ValueError(f"topology: group rank {self.me} outside a group of {len(self.ranks)}")

    @property
    def nodes(self) -> List[List[int]]:
        """Group ranks on each node the group touches, nodes in the order of their global index,
        ranks in group order inside a node."""
        by_node: Dict[int, List[int]] = {}
        for g, r in enumerate(self.ranks):
            by_node.setdefault(r // self.node_size, []).append(g)
        return [by_node[n] for n in sorted(by_node)]

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def spans_nodes(self) -> bool:
        """The group's ranks are on more than one node."""
        return self.num_nodes > 1

    @property
    def uniform(self) -> bool:
        """Every node holds the same number of the group's ranks (what the two-level path needs)."""
        return len({len(n) for n in self.nodes}) == 1

    @property
    def ranks_per_node(self) -> int:
        """The group's ranks on each node (the largest count where nodes differ)."""
        return max(len(n) for n in self.nodes)

    def node_of(self, g: int) -> int:
        """Node (index among :attr:`nodes`) of group rank ``g``."""
        return next(i for i, n in enumerate(self.nodes) if g in n)

    def local_of(self, g: int) -> int:
        """Index of group rank ``g`` among its node's ranks of the group."""
        return self.nodes[self.node_of(g)].index(g)

    def node_label(self, n: int) -> int:
        """The global node index (``global rank // node_size``) of the group's node ``n``."""
        return self.ranks[self.nodes[n][0]] // self.node_size

    def node_group(self) -> List[int]:
        """Group ranks of this rank's node, in local order."""
        return self.nodes[self.node_of(self.me)]

    def cross_group(self) -> List[int]:
        """Group ranks with this rank's local index on every node, in node order."""
        local = self.local_of(self.me)
        return [n[local] for n in self.nodes]

    def describe(self) -> str:
        sizes = sorted({len(n) for n in self.nodes})
        per = str(sizes[0]) if len(sizes) == 1 else "/".join(map(str, sizes))
        return f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''} of {per} rank{'s' if per != '1' else ''}"


def group_topology(config, group, ep_size: int) -> GroupTopology:
    """The :class:`GroupTopology` of the expert-parallel ``group`` (``ep_size`` ranks; None with 1)
    under ``config`` (a ``TopologyConfig``). An explicit ``node_size`` smaller than the world must
    divide it."""
    world = torch_dist.get_world_size() if torch_dist.is_initialized() else 1
    size = node_size(config, world)
    if getattr(config, "node_size", "auto") != "auto" and size < world and world % size:
        raise ValueError(f'"uniep": {{"topology": {{"node_size": {size}}}}} must divide the world size {world}')
    if ep_size == 1 or group is None:
        rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
        return GroupTopology((rank, ), size, 0)
    ranks = tuple(torch_dist.get_process_group_ranks(group))
    return GroupTopology(ranks, size, torch_dist.get_rank(group))


_GROUPS: Dict[Tuple[int, ...], object] = {}


def subgroup(global_ranks: Sequence[int], timeout_s: float):
    """A process group of ``global_ranks`` (its collectives time out after ``timeout_s``), made once
    per process and set of ranks; only its members call this (local synchronisation). None for one
    rank."""
    key = tuple(global_ranks)
    if len(key) == 1:
        return None
    if key not in _GROUPS:
        _GROUPS[key] = torch_dist.new_group(list(key), timeout=datetime.timedelta(seconds=timeout_s),
                                            use_local_synchronization=True)
    return _GROUPS[key]
