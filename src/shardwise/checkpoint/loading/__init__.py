"""Every read of a checkpoint: ``load``, ``load_tensor`` and ``read_metadata`` (:mod:`.load`)
over :class:`~.reader.CheckpointReader`, the one validated reader (:mod:`.index_file`,
:mod:`.data_files`), and its one verified pass (:mod:`.fill`, :mod:`.read`).
"""
