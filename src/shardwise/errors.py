"""The exceptions shardwise raises beyond the built-in ones.

Hierarchy::

    ValueError
    └── MetadataFormatError          a JSON metadata document shardwise cannot read

User mistakes otherwise raise the built-in ``ValueError``/``TypeError``/``RuntimeError``
with the upstream ``torch.distributed._shard`` messages, which are part of the API contract.
"""

from __future__ import annotations

__all__ = ["MetadataFormatError"]


class MetadataFormatError(ValueError):
    """A JSON metadata document is malformed, of an unknown version, or names an unknown value."""
