"""Pure planning (no I/O, no collectives), unit-tested exhaustively (docs/architecture.md)."""
