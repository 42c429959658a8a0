"""The preemption notice: a signal handler that only raises a flag in this process.

Schedulers warn a job before they kill it (SLURM sends SIGTERM, or the signal of
``--signal=USR1@90``; Kubernetes sends SIGTERM). The handler does nothing else: the manager's
next ``save`` call shares the flag with every rank in the collective it runs anyway, so a
notice that reached one rank makes every rank save (``docs/manager.md``, *Preemption*).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

__all__ = ["PreemptionNotice"]


class PreemptionNotice:
    """Handlers for ``signals`` that record that one arrived; :meth:`close` puts back the ones
    they replaced.

    Raises:
        ValueError: Not called from the main thread (Python runs handlers only there), or a
            signal that cannot be caught.
    """

    def __init__(self, signals: Iterable[int | signal.Signals]) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        wanted = [signal.Signals(number) for number in signals]
        if wanted and threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "preemption_signals need the manager to be made in the main thread: Python "
                "runs signal handlers only there"
            )
        try:
            for number in wanted:
                self._previous[number] = signal.signal(number, self._handle)
        except (OSError, ValueError, RuntimeError):
            self.close()
            raise

    def _handle(self, number: int, frame: FrameType | None) -> None:
        del frame
        self.received = signal.Signals(number)

    @property
    def pending(self) -> bool:
        """Whether a signal arrived and was not yet acted on."""
        return self.received is not None

    def clear(self) -> None:
        """Forget the signal (the preemption save is done)."""
        self.received = None

    def close(self) -> None:
        """Put back the handlers these replaced."""
        while self._previous:
            number, handler = self._previous.popitem()
            signal.signal(number, handler)
