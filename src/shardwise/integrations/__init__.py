"""Checkpoint backends for training frameworks, each in a module of its own.

``shardwise.integrations.torchtitan`` is torchtitan's: a ``BaseCheckpointManager`` built on
:class:`shardwise.checkpoint.CheckpointManager` (``docs/torchtitan.md``). Importing this
package imports no framework; importing a backend's module imports its framework.
"""

__all__: list[str] = []
