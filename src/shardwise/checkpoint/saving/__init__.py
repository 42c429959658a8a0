"""``save`` and ``async_save``: snapshot, plan, write, commit (``docs/architecture.md``)."""
