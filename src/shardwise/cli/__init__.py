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

Every command takes ``--storage-options JSON`` (fsspec's options for its URLs) and ``--json``
(its result as one JSON object). Exit codes: 0 success, 1 verification or comparison failed, 2
bad usage, 3 invalid or corrupt input, 4 storage failure (2 to 4: one line on stderr, never a
traceback). Progress bars (on stderr) appear only when stderr is a terminal. See
``docs/cli.md``.

Layout: :mod:`~shardwise.cli._app` parses arguments, dispatches without importing torch (so
``--help`` is instant) and maps exceptions to exit codes, one module per command (``inspect``,
``verify``, ``diff``, ``consolidate``, ``convert_dcp``, ``materialize``, ``ls``) does the work
and is imported when it runs, :mod:`~shardwise.cli._common` holds what they share that needs no
torch (exit codes, the usage error, text, JSON output, ``--storage-options``), and
:mod:`~shardwise.cli._checkpoint` the commands' view of a checkpoint over
:class:`~shardwise.checkpoint.loading.reader.CheckpointReader`, the one validated reader: no
command parses an index or opens a data file itself.
"""

from shardwise.cli._app import main, parse_size

__all__ = ["main", "parse_size"]
