"""Planning, pure (no I/O, no collectives), exhaustively unit-tested.

- :mod:`.planner`: saved chunks, tied tensors, and the reads that fill a box.
- :mod:`.tiling`: whether boxes tile a tensor.
- :mod:`.save_plan`: per-tensor layouts (mesh grids) and which rank writes which bytes.
- :mod:`.tables`: a rank's table of layouts and the coordinator's plan from every table.
"""
