"""Multi-level topology (domain > node > GPU) and HybridEP's domain partition.

Contiguous ranks number GPUs domain-major: contiguous rank
``c = (domain * nodes_per_domain + node) * gpus_per_node + gpu``, so the S
ranks of one domain are ``[d*S, (d+1)*S)`` and a rank's offset in its domain
is ``c % S``. The launcher's global ranks need not be laid out that way;
:class:`Topology` keeps the renumbering both ways.

The partition, for G ranks in domains of S:

- gather phase: each rank receives the experts of every other rank of its
  domain (ordered pairs ``(src, dst)``, same domain, ``src != dst``);
- token phase: tokens leave a domain only for the rank with the same offset
  in another domain (ordered pairs, different domains, same offset).

S = 1 is plain EP: no gather pairs, and the token pairs are every ordered
pair of distinct ranks. Pairs are ordered because both phases move bytes in
both directions (all-gather; dispatch and combine). When only a fraction of
the experts is migrated, the tokens for the rest also use the gather pairs.
"""

from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

Pair = Tuple[int, int]

LEVELS = ("node", "domain", "inter")
"""Link level of a pair of distinct ranks: same node, same domain (other node), other domain."""


def _check(world_size: int, domain_size: int) -> None:
    for name, v in (("world_size", world_size), ("domain_size", domain_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be a positive integer, got {v!r}")
    if world_size % domain_size:
        raise ValueError(f"domain_size: {domain_size} does not divide world_size {world_size}")


def gather_pairs(world_size: int, domain_size: int) -> List[Pair]:
    """Ordered (src, dst) contiguous-rank pairs of the intra-domain expert gather."""
    _check(world_size, domain_size)
    s = domain_size
    return [(src, dst) for d in range(world_size // s) for src in range(d * s, (d + 1) * s)
            for dst in range(d * s, (d + 1) * s) if src != dst]


def token_pairs(world_size: int, domain_size: int) -> List[Pair]:
    """Ordered (src, dst) contiguous-rank pairs of the inter-domain token all-to-all."""
    _check(world_size, domain_size)
    s = domain_size
    return [(src, dst) for src in range(world_size) for dst in range(src % s, world_size, s)
            if dst // s != src // s]


def num_gather_pairs(world_size: int, domain_size: int) -> int:
    """``G * (S - 1)``: each rank receives from its S - 1 domain peers."""
    _check(world_size, domain_size)
    return world_size * (domain_size - 1)


def num_token_pairs(world_size: int, domain_size: int) -> int:
    """``G * (G/S - 1)``: each rank sends to one rank in each other domain."""
    _check(world_size, domain_size)
    return world_size * (world_size // domain_size - 1)


@dataclass(frozen=True)
class RankCoord:
    domain: int
    node: int
    """Node index inside the domain."""
    gpu: int
    """GPU index inside the node."""


class Topology:
    """``num_domains`` x ``nodes_per_domain`` x ``gpus_per_node`` ranks and their renumbering.

    ``global_ranks[c]`` is the launcher's global rank of contiguous rank ``c``
    (identity when omitted)."""

    def __init__(self, num_domains: int, nodes_per_domain: int, gpus_per_node: int,
                 global_ranks: Optional[Sequence[int]] = None):
        for name, v in (("num_domains", num_domains), ("nodes_per_domain", nodes_per_domain),
                        ("gpus_per_node", gpus_per_node)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Topology.{name}: must be a positive integer, got {v!r}")
        self.num_domains, self.nodes_per_domain, self.gpus_per_node = num_domains, nodes_per_domain, gpus_per_node
        g = self.world_size
        order = list(range(g)) if global_ranks is None else [int(r) for r in global_ranks]
        if sorted(order) != list(range(g)):
            raise ValueError(f"Topology.global_ranks: must be a permutation of 0..{g - 1}, got {order}")
        self._to_global = order
        self._to_contiguous = [0] * g
        for c, r in enumerate(order):
            self._to_contiguous[r] = c

    @classmethod
    def from_placement(cls, domain_of_rank: Sequence[Hashable], node_of_rank: Sequence[Hashable]) -> "Topology":
        """Build from each global rank's domain label and node label (a host name, say).

        Domains, nodes inside a domain and GPUs inside a node are numbered in
        the order of their smallest global rank, so the renumbering is
        deterministic. Every node must lie in one domain, and the sizes must be
        uniform."""
        if len(domain_of_rank) != len(node_of_rank):
            raise ValueError(f"from_placement: {len(domain_of_rank)} domain labels but {len(node_of_rank)} node labels")
        domains: Dict[Hashable, Dict[Hashable, List[int]]] = {}
        domain_of_node: Dict[Hashable, Hashable] = {}
        for rank, (dom, node) in enumerate(zip(domain_of_rank, node_of_rank)):
            if domain_of_node.setdefault(node, dom) != dom:
                raise ValueError(f"from_placement: node {node!r} is in domains {domain_of_node[node]!r} and {dom!r}")
            domains.setdefault(dom, {}).setdefault(node, []).append(rank)
        if not domains:
            raise ValueError("from_placement: no ranks")
        nodes_per_domain = {len(nodes) for nodes in domains.values()}
        gpus_per_node = {len(r) for nodes in domains.values() for r in nodes.values()}
        if len(nodes_per_domain) != 1:
            raise ValueError(f"from_placement: domains have different node counts {sorted(nodes_per_domain)}")
        if len(gpus_per_node) != 1:
            raise ValueError(f"from_placement: nodes have different GPU counts {sorted(gpus_per_node)}")
        # dicts keep insertion order, i.e. the order of each label's smallest global rank
        order = [r for nodes in domains.values() for ranks in nodes.values() for r in ranks]
        return cls(len(domains), nodes_per_domain.pop(), gpus_per_node.pop(), order)

    @classmethod
    def from_nodes(cls, nodes, domain_size: int) -> "Topology":
        """Domains of ``domain_size`` consecutive ranks of an expert-parallel group laid over the nodes of
        ``nodes`` (a :class:`ds_uniep.topology.GroupTopology`, the one description of which ranks share
        a node); ranks here are the group's. Domains must be made of whole nodes."""
        G = len(nodes.ranks)
        _check(G, domain_size)
        return cls.from_placement([g // domain_size for g in range(G)], [nodes.node_of(g) for g in range(G)])

    # ----------------------------------------------------------------- numbering
    @property
    def world_size(self) -> int:
        return self.num_domains * self.nodes_per_domain * self.gpus_per_node

    @property
    def domain_size(self) -> int:
        return self.nodes_per_domain * self.gpus_per_node

    def contiguous_rank(self, global_rank: int) -> int:
        return self._to_contiguous[global_rank]

    def global_rank(self, contiguous_rank: int) -> int:
        return self._to_global[contiguous_rank]

    def coord(self, global_rank: int) -> RankCoord:
        c = self.contiguous_rank(global_rank)
        domain, rest = divmod(c, self.domain_size)
        node, gpu = divmod(rest, self.gpus_per_node)
        return RankCoord(domain, node, gpu)

    def rank_of(self, coord: RankCoord) -> int:
        """Global rank at ``coord``."""
        if not (0 <= coord.domain < self.num_domains and 0 <= coord.node < self.nodes_per_domain
                and 0 <= coord.gpu < self.gpus_per_node):
            raise ValueError(f"rank_of: {coord} outside {self.num_domains}x{self.nodes_per_domain}x"
                             f"{self.gpus_per_node}")
        return self.global_rank((coord.domain * self.nodes_per_domain + coord.node) * self.gpus_per_node + coord.gpu)

    def level(self, a: int, b: int) -> str:
        """Link level between two distinct global ranks (one of :data:`LEVELS`)."""
        ca, cb = self.coord(a), self.coord(b)
        if a == b:
            raise ValueError(f"level: a rank has no link to itself ({a})")
        if ca.domain != cb.domain:
            return "inter"
        return "node" if ca.node == cb.node else "domain"

    # ----------------------------------------------------------------- partition
    def domain_groups(self) -> List[List[int]]:
        """Global ranks of each domain (the gather groups), in offset order."""
        s = self.domain_size
        return [[self.global_rank(c) for c in range(d * s, (d + 1) * s)] for d in range(self.num_domains)]

    def offset_groups(self) -> List[List[int]]:
        """Global ranks with the same offset in every domain (the token groups), in domain order."""
        s = self.domain_size
        return [[self.global_rank(c) for c in range(o, self.world_size, s)] for o in range(s)]

    def gather_pairs(self) -> List[Pair]:
        """Ordered global-rank pairs of the expert gather."""
        return [(self.global_rank(a), self.global_rank(b)) for a, b in gather_pairs(self.world_size, self.domain_size)]

    def token_pairs(self) -> List[Pair]:
        """Ordered global-rank pairs of the token all-to-all."""
        return [(self.global_rank(a), self.global_rank(b)) for a, b in token_pairs(self.world_size, self.domain_size)]

    def count_by_level(self, pairs: Iterable[Pair]) -> Dict[str, int]:
        """How many of ``pairs`` use each link level."""
        out = {lvl: 0 for lvl in LEVELS}
        for a, b in pairs:
            out[self.level(a, b)] += 1
        return out

    def __repr__(self) -> str:
        return (f"Topology(num_domains={self.num_domains}, nodes_per_domain={self.nodes_per_domain}, "
                f"gpus_per_node={self.gpus_per_node})")
