"""Warnings shown at the user's line: the first frame outside the shardwise package, however
deep inside it the warning was raised (a fixed ``stacklevel`` is right for one call path only:
the local tier warns from ``restore`` and ``restore_local``, from ``save`` and from torchtitan's
backend, at different depths)."""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn_at_caller"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """Warn ``message`` as ``category``, attributed to the innermost frame that is not
    shardwise's own (a frame of a thread's start, when shardwise's code is all there is)."""
    level = 2  # the caller of this function
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
