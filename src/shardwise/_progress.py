"""Byte counts for people: binary units (KiB, MiB, GiB) everywhere, in summaries and in
progress bars (tqdm on stderr), so a bar and the summary line after it say the same number.

tqdm's own ``unit_scale`` uses decimal prefixes (600 MiB shows as "629M"); the bars here scale
the count themselves and say the unit.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Protocol

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
        """Draw the final count (tqdm may have skipped the last updates) and stop."""
        if self._bar is not None:
            self._bar.refresh()
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ByteBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Counter(Protocol):
    """A count the ranks of a group share (see :class:`shardwise.collectives.SharedCounter`)."""

    def add(self, amount: int) -> None: ...

    def read(self) -> int | None: ...

    def remove(self) -> None: ...


class JobProgress:
    """The progress of a job the ranks of a group share: each rank counts the bytes it has
    done, one rank draws a bar of the whole job's bytes.

    Ranks add to ``counter`` in steps of ``step`` bytes (and whatever is left at
    :meth:`finish`); the drawing rank reads it every ``interval`` seconds on a thread. Without
    a counter (one process) the bar counts this process's bytes, which are then the job's.

    Args:
        total: Bytes of the whole job (every rank's).
        description: What is done, e.g. ``"saving /ckpt"``.
        show: Draw the bar on this rank.
        counter: The shared count, or ``None``.
    """

    def __init__(
        self,
        total: int,
        description: str,
        *,
        show: bool,
        counter: Counter | None,
        step: int = 8 << 20,
        interval: float = 0.2,
    ) -> None:
        self._bar = ByteBar(total, description, enabled=True) if show else None
        self._counter = counter
        self._step = step
        self._pending = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if self._bar is not None and counter is not None:
            self._poller = threading.Thread(
                target=self._poll, args=(interval,), name="shardwise-progress", daemon=True
            )
            self._poller.start()

    def _poll(self, interval: float) -> None:
        assert self._counter is not None and self._bar is not None
        while not self._stop.wait(interval):
            done = self._counter.read()
            if done is not None:
                self._bar.set_done(done)

    def update(self, count: int) -> None:
        """This rank has done ``count`` more bytes (thread-safe)."""
        with self._lock:
            if self._counter is None:
                if self._bar is not None:
                    self._bar.update(count)
                return
            self._pending += count
            if self._pending >= self._step:
                self._counter.add(self._pending)
                self._pending = 0

    def finish(self) -> None:
        """This rank is done: its last bytes are counted (call on every rank before the
        collective that ends the job)."""
        with self._lock:
            if self._counter is not None and self._pending:
                self._counter.add(self._pending)
                self._pending = 0

    def close(self, succeeded: bool) -> None:
        """Stop drawing. With ``succeeded`` (every rank finished), the bar ends full."""
        self.finish()
        self._stop.set()
        if self._poller is not None:
            self._poller.join()
        if self._bar is not None:
            if succeeded:
                self._bar.set_done(self._bar.total)
            self._bar.close()
            if self._counter is not None:
                self._counter.remove()


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
