"""Planning, pure (no I/O, no collectives), exhaustively unit-tested.

- :mod:`.planner`: saved chunks and the reads that fill a box from them (sweep lookups, exact
  and whole-tensor fast paths); tied-tensor agreement.
- :mod:`.tiling`: whether boxes tile a tensor (a split along one dim by arithmetic, anything
  else by the overlap sweep).
- :mod:`.tables`: a rank's table of layouts (what it holds, described once per mesh) and the
  coordinator's plan from every rank's table.
- :mod:`.save_plan`: per-tensor layouts (mesh grids, memoized per mesh) and the save plan:
  which rank writes which bytes.
"""
