"""Byte counts for people: binary units (KiB, MiB, GiB) everywhere, in summaries and in
progress bars (tqdm on stderr), so a bar and the summary line after it say the same number.

tqdm's own ``unit_scale`` uses decimal prefixes (600 MiB shows as "629M"); the bars here scale
the count themselves and say the unit.
"""

from __future__ import annotations

import sys
from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(count: int | float) -> str:
    """``"512 B"``, ``"1.5 KiB"``, ``"600.0 MiB"``, ``"2.0 GiB"``."""
    value = float(count)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(count)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _scale(total: int) -> tuple[str, int]:
    """The unit a bar of ``total`` bytes counts in, and its size in bytes."""
    divisor = 1
    for unit in _UNITS:
        if total < 1024 * divisor or unit == _UNITS[-1]:
            return unit, divisor
        divisor *= 1024
    raise AssertionError("unreachable")


class ByteBar:
    """A progress bar of ``total`` bytes in one binary unit, shown when ``enabled``.

    ``update(n)`` takes bytes. Without a terminal, or when not ``enabled``, nothing is drawn
    and updates cost one comparison.

    Args:
        total: The job's bytes (the whole job's, not one rank's share).
        description: What is being done, e.g. ``"saving /ckpt"``.
        enabled: Draw the bar (default: when stderr is a terminal).
        file: Where to draw (default stderr).
    """

    def __init__(
        self,
        total: int,
        description: str,
        enabled: bool | None = None,
        file: Any = None,
    ) -> None:
        file = sys.stderr if file is None else file
        if enabled is None:
            enabled = bool(getattr(file, "isatty", lambda: False)())
        self.total = total
        self.done = 0
        self._bar: Any = None
        if not enabled:
            return
        from tqdm import tqdm  # type: ignore[import-untyped]

        unit, self._divisor = _scale(total)
        decimals = 0 if unit == "B" else 1
        self._bar = tqdm(
            total=total / self._divisor,
            unit=unit,
            desc=description,
            file=file,
            leave=False,
            bar_format=(
                f"{{desc}}: {{percentage:3.0f}}%|{{bar}}| {{n:.{decimals}f}}/"
                f"{{total:.{decimals}f}} {unit} [{{elapsed}}<{{remaining}}, {{rate_fmt}}]"
            ),
        )

    def update(self, count: int) -> None:
        """``count`` more bytes are done."""
        self.done += count
        if self._bar is not None:
            self._bar.update(count / self._divisor)

    def set_done(self, done: int) -> None:
        """``done`` bytes are done in all (for counts that arrive as totals)."""
        if done > self.done:
            self.update(done - self.done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ByteBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def count_bar(total: int, description: str, unit: str, enabled: bool | None = None) -> Any:
    """A tqdm bar of ``total`` things (keys, files) on stderr, drawn when stderr is a
    terminal (or when ``enabled``)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit=unit,
        desc=description,
        file=sys.stderr,
        disable=not (sys.stderr.isatty() if enabled is None else enabled),
        leave=False,
    )
