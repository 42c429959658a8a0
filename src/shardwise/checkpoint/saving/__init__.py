"""``save`` and ``async_save``: snapshot, plan, write, commit.

- :mod:`.save`: the algorithm (describe → tables → coordinator plan → write → file facts →
  index → commit → outcome) and ``async_save``.
- :mod:`.snapshot`: step 1, a rank's state described and checked (tied keys found; staged to
  host memory for ``async_save``).
- :mod:`.writer`: a rank's data file, checksummed while written.
- :mod:`.build_index`: the coordinator's index from the plan and the ranks' file facts,
  checked to read back as built.
- :mod:`.outcome`: what every rank returns.
- :mod:`.lock`: one save per path at a time (a heartbeat lock).
- :mod:`.report`: the job's progress bar and log line (loads use them too).
"""
