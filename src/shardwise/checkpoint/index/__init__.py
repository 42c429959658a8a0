"""The checkpoint index, one format (see ``docs/format.md``): pure, bytes in, records out.
Its modules (encoder, strict decoder, records, data-file layout): ``docs/architecture.md``."""

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
    UNSUPPORTED_VERSION,
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
    "UNSUPPORTED_VERSION",
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
