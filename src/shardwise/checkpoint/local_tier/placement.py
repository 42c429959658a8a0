"""Which ranks hold a copy of each rank's part: nodes as torchrun defines them, replicas on a ring
of nodes. Pure: no I/O, no collectives.

A node is a block of ``local_world_size`` consecutive ranks (torchrun gives node ``n`` the ranks
``n * LOCAL_WORLD_SIZE`` to ``(n + 1) * LOCAL_WORLD_SIZE - 1``). The ``k``-th replica of rank
``r`` (``k`` from 1) is held by the rank of the same local rank ``k`` nodes further on the ring::

    holder(r, k) = (r + k * local_world_size) mod world_size

so the holders of a part are on ``replicas`` distinct nodes, none the owner's; every rank holds
exactly ``replicas`` copies and sends exactly ``replicas`` (the load is even, whatever the
sizes of the parts of one local rank); and a rank sends to the same local rank on other nodes
(on rail-optimized networks, its own rail). Any ``replicas`` nodes may be lost at once: a
part is lost only with all of its ``replicas + 1`` nodes.

With fewer other nodes than ``replicas`` (one node, or a restart on fewer nodes), the tier
degrades rather than refuses: :func:`effective_replicas` is ``min(replicas, num_nodes - 1)``,
and the caller warns once. A restart after losing a node then keeps its local copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "LOCAL_WORLD_SIZE_VARIABLE",
    "Placement",
    "Topology",
    "effective_replicas",
    "local_world_size_from_environment",
    "place_replicas",
]

#: The environment variable torchrun sets to the number of ranks of this node.
LOCAL_WORLD_SIZE_VARIABLE = "LOCAL_WORLD_SIZE"


def _positive(name: str, value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, not {value}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """The nodes of a job: ``world_size`` ranks in blocks of ``local_world_size``.

    Raises:
        TypeError: A count that is not an int.
        ValueError: A count that is not positive, or ``world_size`` not a multiple of
            ``local_world_size`` (torchrun starts the same number of ranks on every node).
    """

    world_size: int
    """Ranks of the job."""

    local_world_size: int
    """Ranks of each node (``LOCAL_WORLD_SIZE``)."""

    def __post_init__(self) -> None:
        _positive("world_size", self.world_size)
        _positive("local_world_size", self.local_world_size)
        if self.world_size % self.local_world_size:
            raise ValueError(
                f"world_size {self.world_size} is not a multiple of local_world_size "
                f"{self.local_world_size}: the local tier needs the same number of ranks on "
                "every node (torchrun's --nproc-per-node)"
            )

    @property
    def num_nodes(self) -> int:
        """Nodes of the job."""
        return self.world_size // self.local_world_size

    def node_of(self, rank: int) -> int:
        """The node of ``rank``."""
        self._check_rank(rank)
        return rank // self.local_world_size

    def ranks_of(self, node: int) -> range:
        """The ranks of ``node``."""
        if type(node) is not int or not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node!r} is not one of the {self.num_nodes} nodes")
        return range(node * self.local_world_size, (node + 1) * self.local_world_size)

    def _check_rank(self, rank: int) -> None:
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is not one of the {self.world_size} ranks")


def local_world_size_from_environment(environ: Mapping[str, str], world_size: int) -> int:
    """``LOCAL_WORLD_SIZE`` from ``environ``, or ``world_size`` (one node) when it is unset.

    Raises:
        ValueError: It is not a positive decimal integer dividing ``world_size``.
    """
    text = environ.get(LOCAL_WORLD_SIZE_VARIABLE)
    if text is None:
        return world_size
    # ASCII digits only: int() takes Unicode digits, spaces and underscores.
    if not text.isascii() or not text.isdigit() or int(text) == 0:
        raise ValueError(f"{LOCAL_WORLD_SIZE_VARIABLE}={text!r} is not a positive integer")
    value = int(text)
    Topology(world_size=world_size, local_world_size=value)
    return value


def effective_replicas(replicas: int, num_nodes: int) -> int:
    """The replicas a job of ``num_nodes`` nodes holds when ``replicas`` are asked for: each on
    another node than its owner's, so at most ``num_nodes - 1``."""
    if type(replicas) is not int or replicas < 0:
        raise ValueError(f"replicas must be an int >= 0, not {replicas!r}")
    _positive("num_nodes", num_nodes)
    return min(replicas, num_nodes - 1)


@dataclass(frozen=True, slots=True)
class Placement:
    """Who holds which copy: :func:`place_replicas`'s answer."""

    topology: Topology
    requested: int
    """The replicas asked for."""
    replicas: int
    """The replicas held (:func:`effective_replicas`)."""
    holders: tuple[tuple[int, ...], ...]
    """For each rank, the ranks that hold a replica of its part, nearest node first."""

    @property
    def degraded(self) -> bool:
        """Whether fewer replicas are held than were asked for (too few nodes)."""
        return self.replicas < self.requested

    def held_by(self, rank: int) -> tuple[int, ...]:
        """The ranks whose parts ``rank`` holds a replica of, in the order of ``k``."""
        self.topology._check_rank(rank)
        size = self.topology.world_size
        step = self.topology.local_world_size
        return tuple((rank - k * step) % size for k in range(1, self.replicas + 1))


def place_replicas(topology: Topology, replicas: int) -> Placement:
    """The holders of every rank's replicas (module docstring: the ring rule).

    Raises:
        ValueError: ``replicas`` is not an int >= 0.
    """
    held = effective_replicas(replicas, topology.num_nodes)
    size, step = topology.world_size, topology.local_world_size
    holders = tuple(
        tuple((rank + k * step) % size for k in range(1, held + 1)) for rank in range(size)
    )
    return Placement(topology=topology, requested=replicas, replicas=held, holders=holders)
