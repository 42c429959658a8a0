"""``load``, ``load_tensor`` and ``read_metadata``: every read of a checkpoint.

- :mod:`.load`: match the state dict to the index, plan, read, restore objects.
- :mod:`.reader`: :class:`~.reader.CheckpointReader`, the one validated reader, over
  :mod:`.index_file` (finding and decoding the index, or saying what is there instead) and
  :mod:`.data_files` (safe opens of data files, checked reads).
- :mod:`.fill`: planned reads into destinations (straight, per row, or staged on the host).
- :mod:`.read`: the one verified pass: each checksummed block read once, checked, used.
"""
