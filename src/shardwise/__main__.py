"""``python -m shardwise``: the ``shardwise`` command line (see :mod:`shardwise.cli`)."""

from shardwise.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
