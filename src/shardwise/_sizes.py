"""Byte sizes as people write them: ``500MB``, ``5GB``, ``1GiB``, ``1.5GB`` or a number of bytes.

One parser for every size shardwise takes (``save_safetensors(max_shard_size=...)``,
``consolidate(max_shard_size=...)``, ``shardwise consolidate --max-shard-size``). Decimal
units (KB, MB, GB, TB) are powers of 1000, as Hugging Face counts them (``save_pretrained``'s
``max_shard_size="5GB"`` is 5,000,000,000 bytes); KiB, MiB, GiB, TiB are powers of 1024. Case
does not matter. Pure: no torch, so the command line's ``--help`` stays fast.
"""

from __future__ import annotations

import numbers
import re

__all__ = ["parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(value: object, name: str = "size") -> int:
    """A positive byte count from an int or a string with a unit.

    Args:
        value: A positive int of bytes, or a string: ``"500MB"``, ``"2GB"``, ``"1GiB"``,
            ``"1.5GB"``, ``"1048576"`` (decimal units are powers of 1000, ``*iB`` units of
            1024; case does not matter).
        name: The argument's name, for the messages (``"max_shard_size"``).

    Returns:
        The number of bytes (a fractional count of bytes is rounded down).

    Raises:
        TypeError: ``value`` is neither an int nor a str (a float, a bool).
        ValueError: A string that is no size with a known unit, or a size that is not positive.

    >>> parse_size("5GB"), parse_size("1KiB"), parse_size(512)
    (5000000000, 1024, 512)
    """
    if isinstance(value, str):
        match = _PATTERN.fullmatch(value)
        unit = _UNITS.get(match.group(2).lower()) if match else None
        if match is None or unit is None:
            raise ValueError(
                f"invalid {name} {value!r}: use a number of bytes or a number with a unit "
                f"(KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 500MB or 1GiB"
            )
        size = int(float(match.group(1)) * unit)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        size = int(value)
    else:
        raise TypeError(
            f"{name} must be an int number of bytes or a str with a unit (e.g. 5_000_000_000 "
            f'or "5GB"), got {value!r}'
        )
    if size <= 0:
        raise ValueError(f"invalid {name} {value!r}: it must be positive")
    return size
