"""The checkpoint index: typed records, the encoders, and one strict decoder for every
version (see ``docs/format.md``).

Pure: bytes in, records out, no I/O. The modules of this package, by concept:

- :mod:`.names`: the format's constants, file names, block checksums, the GC pause.
- :mod:`.records`: :class:`Index` and its records (what a decoder returns).
- :mod:`.view`: an index as DCP-style ``Metadata``, built lazily.
- :mod:`.encode`: versions 2 and 3 (one row per chunk), and :func:`build_index`.
- :mod:`.layouts`: version 4's tensor layouts (``grid``/``whole``/``chunks``), the layout rule
  per value, the file order of grid cells, and the coordinator's planning from tables.
- :mod:`.v4`: version 4's encoder and decoder.
- :mod:`.checks`, :mod:`.fields`, :mod:`.decode`, :mod:`.legacy`: the strict decoder
  (:func:`decode_index`): shared checks, shared fields, versions 2-4, version 1.
"""

from shardwise.checkpoint.index.checks import decode_text, load_json_value
from shardwise.checkpoint.index.decode import decode_index
from shardwise.checkpoint.index.encode import build_index, encode_index, seal
from shardwise.checkpoint.index.names import (
    ALIASES_VERSION,
    BLOCK_SIZE,
    CHECKSUM_ALGORITHM,
    DATA_DIR,
    FORMAT_VERSION,
    INDEX_NAME,
    LAYOUT_VERSION,
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
    "ALIASES_VERSION",
    "BLOCK_SIZE",
    "CHECKSUM_ALGORITHM",
    "DATA_DIR",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "LAYOUT_VERSION",
    "MAX_INDEX_BYTES",
    "TEXT_ENCODINGS",
    "Index",
    "ObjectRecord",
    "SaveFacts",
    "TensorRecord",
    "block_checksums",
    "build_index",
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
