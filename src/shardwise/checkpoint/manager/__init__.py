"""A training run's checkpoints under one root: when to save, what to keep, resume with
fallback, preemption (``docs/manager.md``).

Modules by concept: :mod:`.policy` (the save and retention rules, pure), :mod:`.series` (step
directories, their records, one listing), :mod:`.deletion` (crash-safe deletion),
:mod:`.preemption` (the signal flag), :mod:`.manager` (``CheckpointManager``),
:mod:`.materialize` (a self-contained copy of an incremental checkpoint).
"""

from shardwise.checkpoint.manager.manager import CheckpointManager
from shardwise.checkpoint.manager.materialize import materialize
from shardwise.checkpoint.manager.policy import RetentionPolicy, SavePolicy
from shardwise.checkpoint.manager.series import CheckpointInfo, list_series
from shardwise.errors import RestoreFallbackWarning  # the warning restore gives, named here too

__all__ = [
    "CheckpointInfo",
    "CheckpointManager",
    "RestoreFallbackWarning",
    "RetentionPolicy",
    "SavePolicy",
    "list_series",
    "materialize",
]
