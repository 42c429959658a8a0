"""Planning, pure (no I/O, no collectives), exhaustively unit-tested: :mod:`.planner` (reads,
tied tensors), :mod:`.tiling`, :mod:`.save_plan` (who writes what, from per-tensor layouts)
and :mod:`.tables` (the save protocol's per-rank tables and the coordinator's plan)."""
