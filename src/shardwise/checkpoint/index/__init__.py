"""The checkpoint index: typed records, the encoder, and the strict decoder (see
``docs/format.md``).

Pure: bytes in, records out, no I/O. The modules of this package, by concept:

- :mod:`.names`: the format's constants and version, file names, block checksums, the GC
  pause.
- :mod:`.records`: :class:`Index` and its records (what the decoder returns).
- :mod:`.view`: an index as DCP-style ``Metadata``, built lazily.
- :mod:`.layouts`: the tensor layouts (``grid``/``whole``/``chunks``): grids by their rule,
  the file order of grid cells, a grid's chunks built on demand.
- :mod:`.encode`: the sealed index a save writes (:func:`encode_index`).
- :mod:`.checks`, :mod:`.fields`, :mod:`.decode`: the strict decoder (:func:`decode_index`):
  shared checks, fields, layouts.
"""

from shardwise.checkpoint.index.checks import decode_text, load_json_value
from shardwise.checkpoint.index.decode import decode_index
from shardwise.checkpoint.index.encode import FileFacts, LayoutRecord, encode_index, seal
from shardwise.checkpoint.index.names import (
    BLOCK_SIZE,
    CHECKSUM_ALGORITHM,
    DATA_DIR,
    FORMAT_VERSION,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    TEXT_ENCODINGS,
    block_checksums,
    data_file_name,
    is_data_file_name,
    is_temporary_name,
    num_blocks,
    paused_gc,
)
from shardwise.checkpoint.index.records import Index, ObjectRecord, SaveFacts, TensorRecord

__all__ = [
    "BLOCK_SIZE",
    "CHECKSUM_ALGORITHM",
    "DATA_DIR",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "MAX_INDEX_BYTES",
    "TEXT_ENCODINGS",
    "FileFacts",
    "Index",
    "LayoutRecord",
    "ObjectRecord",
    "SaveFacts",
    "TensorRecord",
    "block_checksums",
    "data_file_name",
    "decode_index",
    "decode_text",
    "encode_index",
    "is_data_file_name",
    "is_temporary_name",
    "load_json_value",
    "num_blocks",
    "paused_gc",
    "seal",
]
