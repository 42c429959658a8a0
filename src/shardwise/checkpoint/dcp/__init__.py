"""DCP storage plugins: ``torch.distributed.checkpoint.save/load/async_save`` with shardwise
checkpoints underneath (``docs/dcp.md``).

``dcp.save(state_dict, storage_writer=StorageWriter(path))`` writes a shardwise checkpoint
(sealed JSON index, checksummed safetensors data files, no pickle) that
``shardwise.checkpoint.load``, ``shardwise verify`` and every CLI command read;
``dcp.load(state_dict, storage_reader=StorageReader(path))`` loads any shardwise checkpoint,
resharded by DCP's planner, every byte verified, nothing unpickled.

Importing this module imports ``torch.distributed.checkpoint``.
"""

from shardwise.checkpoint.dcp.reader import StorageReader
from shardwise.checkpoint.dcp.writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
