"""Every read of a checkpoint, over :class:`~.reader.CheckpointReader` (its modules:
``docs/architecture.md``)."""
