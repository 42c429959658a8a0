"""The local tier of a series: frequent checkpoints in node-local memory, each rank's part also
held by ranks on other nodes, so that a restart restores without reading shared storage
(``docs/local-tier.md``).

One module per concept: ``tier`` (the ``LocalTier`` settings), ``placement`` (which ranks hold
which replica), ``agreement`` (the step a restart restores and who sends which part: pure),
``directory`` (the tier's directory on one node), ``parts`` (a part's files as bytes:
read, written, packed, verified), ``transport`` (messages between ranks, sizes first) and
``node`` (the local saves and restores of one rank, which ``CheckpointManager`` calls).
"""

from __future__ import annotations

from shardwise.checkpoint.local_tier.agreement import (
    HeldStep,
    Holdings,
    Transfer,
    TransferPlan,
    Verdict,
    choose_step,
    parse_gathered,
    parse_holdings,
    parse_needs,
    plan_transfers,
)
from shardwise.checkpoint.local_tier.directory import PartRecord, Space, TierDirectory
from shardwise.checkpoint.local_tier.placement import (
    Placement,
    Topology,
    effective_replicas,
    local_world_size_from_environment,
    place_replicas,
)
from shardwise.checkpoint.local_tier.tier import LocalTier, job_id_from_environment
from shardwise.errors import LocalTierWarning

__all__ = [
    "HeldStep",
    "Holdings",
    "LocalTier",
    "LocalTierWarning",
    "PartRecord",
    "Placement",
    "Space",
    "TierDirectory",
    "Topology",
    "Transfer",
    "TransferPlan",
    "Verdict",
    "choose_step",
    "effective_replicas",
    "job_id_from_environment",
    "local_world_size_from_environment",
    "parse_gathered",
    "parse_holdings",
    "parse_needs",
    "place_replicas",
    "plan_transfers",
]
