"""The ``shardwise`` command line (also ``python -m shardwise``).

Commands::

    shardwise inspect PATH [--json]        what a checkpoint holds, and how it was saved
    shardwise verify PATH                  read every byte, check every checksum and every
                                           data file's safetensors header
    shardwise diff A B [--atol --rtol]     compare two checkpoints key by key
    shardwise consolidate PATH OUT [--prefix P] [--dtype D] [--config FILE]
                                   [--max-shard-size SIZE]
                                           a Hugging Face model directory (safetensors files
                                           from_pretrained loads)
    shardwise convert-dcp DCP_DIR OUT      a torch.distributed.checkpoint directory into a
                                           shardwise checkpoint, without running pickled code

Every command takes ``--storage-options JSON`` (fsspec's options for its URLs). Exit codes: 0
success, 1 verification or comparison failed, 2 bad usage or unreadable input (storage
failures included: one line on stderr, never a traceback). Progress bars (on stderr) appear
only when stderr is a terminal. See ``docs/cli.md``.

Layout: :mod:`~shardwise.cli._app` parses arguments and dispatches without importing torch
(so ``--help`` is instant), one module per command (``inspect``, ``verify``, ``diff``,
``consolidate``, ``convert_dcp``) does the work and is imported when it runs,
:mod:`~shardwise.cli._common` holds what they share that needs no torch (exit codes, text,
``--storage-options``), and :mod:`~shardwise.cli._checkpoint` the commands' view of a
checkpoint over :class:`~shardwise.checkpoint.loading.reader.CheckpointReader`, the one validated
reader: no command parses an index or opens a data file itself.
"""

from shardwise.cli._app import main, parse_size

__all__ = ["main", "parse_size"]
