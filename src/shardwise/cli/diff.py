"""``shardwise diff``: compare two checkpoints key by key."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from shardwise._progress import count_bar
from shardwise.checkpoint.index import TEXT_ENCODINGS, TensorRecord
from shardwise.cli._checkpoint import _Checkpoint, _open_checkpoint
from shardwise.cli._common import EXIT_FAILED, EXIT_OK, _count, _printable, print_json
from shardwise.metadata import dtype_name


@dataclass(frozen=True, slots=True)
class _Difference:
    """One difference: ``change`` is ``"-"`` (only in A), ``"+"`` (only in B) or ``"~"`` (in
    both, differing in ``field``: ``kind``, ``dtype``, ``size`` or ``value``); ``a`` and ``b``
    what each side has there (the kind for a key on one side only; None for values, which
    ``detail`` describes)."""

    change: str
    key: str
    field: str
    a: Any = None
    b: Any = None
    detail: str | None = None

    def line(self) -> str:
        """The difference as the text output prints it."""
        if self.change == "-":
            return f"- {self.key!r}: only in A ({self.a})"
        if self.change == "+":
            return f"+ {self.key!r}: only in B ({self.b})"
        if self.field == "value":
            return f"~ {self.key!r}: {self.detail}"
        return f"~ {self.key!r}: {self.field} {self.a} in A, {self.b} in B"

    def to_json(self) -> dict[str, Any]:
        return {
            "change": self.change,
            "key": self.key,
            "field": self.field,
            "a": self.a,
            "b": self.b,
            "detail": self.detail,
        }


def _widened(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` in float64 (complex128 for complex), or None for dtypes without arithmetic
    (e.g. packed 4-bit floats): those are compared bit for bit."""
    target = torch.complex128 if tensor.dtype.is_complex else torch.float64
    try:
        return tensor.to(target)
    except (RuntimeError, TypeError):
        return None


def _compare_tensors(
    first: torch.Tensor, second: torch.Tensor, atol: float, rtol: float
) -> str | None:
    """Why two tensors of the same size and dtype differ (allclose with NaN equal to NaN), or
    None when they do not."""
    if first.numel() == 0:
        return None
    exact = atol == 0 and rtol == 0
    wide_first, wide_second = _widened(first), _widened(second)
    if wide_first is None or wide_second is None:
        # Compare the bytes of each element.
        raw_first = first.reshape(-1).view(torch.uint8).reshape(first.numel(), -1)
        raw_second = second.reshape(-1).view(torch.uint8).reshape(first.numel(), -1)
        close = (raw_first == raw_second).all(dim=1).reshape(first.shape)
    elif first.dtype.is_floating_point or first.dtype.is_complex or not exact:
        close = torch.isclose(wide_first, wide_second, rtol=rtol, atol=atol, equal_nan=True)
    else:
        close = first == second  # integers and bools: exact without a round trip
    mismatches = int((~close).sum())
    if mismatches == 0:
        return None
    position = tuple(int(i) for i in torch.unravel_index((~close).reshape(-1).nonzero()[0, 0],
                                                         close.shape))  # fmt: skip
    detail = ""
    if wide_first is not None and wide_second is not None:
        deltas = (wide_first - wide_second).abs().reshape(-1)
        finite = deltas[~deltas.isnan()]
        largest = float(finite.max()) if finite.numel() else math.nan
        detail = (
            f"; first at {list(position)}: {first[position].item()!r} vs "
            f"{second[position].item()!r}; max abs diff {largest:.6g}"
        )
    return f"values differ in {mismatches} of {first.numel()} elements{detail}"


def _short(payload: bytes) -> str:
    text = repr(payload if len(payload) <= 40 else payload[:37] + b"...")
    return text


def _compare_json(first: _Checkpoint, second: _Checkpoint, fqn: str) -> str | None:
    left, right = first.json_value(fqn), second.json_value(fqn)
    # Canonical text: NaN equals NaN and key order does not matter.
    if json.dumps(left, sort_keys=True) == json.dumps(right, sort_keys=True):
        return None
    left_text, right_text = (
        _printable(side.payload(fqn).decode()[:60]) for side in (first, second)
    )
    return f"values differ: {left_text} vs {right_text}"


def _compare_bytes(kind: str, first: bytes, second: bytes) -> str | None:
    if first == second:
        return None
    if len(first) != len(second):
        return f"{kind} values differ: {len(first)} vs {len(second)} bytes"
    where = next(i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b)
    return f"{kind} values differ first at byte {where}: {_short(first)} vs {_short(second)}"


def _diff(first: _Checkpoint, second: _Checkpoint, atol: float, rtol: float) -> list[_Difference]:
    differences = []
    keys_first, keys_second = first.entries, second.entries
    common = [fqn for fqn in keys_first if fqn in keys_second]
    # Every data file to read is checked (type, size) before the first byte is read.
    first.check_files(common)
    second.check_files(common)
    for fqn in keys_first:
        if fqn not in keys_second:
            differences.append(_Difference("-", fqn, "key", a=first.kind(fqn)))
    for fqn in keys_second:
        if fqn not in keys_first:
            differences.append(_Difference("+", fqn, "key", b=second.kind(fqn)))
    with count_bar(len(common), "comparing", unit="key") as bar:
        for fqn in common:
            bar.update(1)
            entry_first, entry_second = keys_first[fqn], keys_second[fqn]
            kind_first, kind_second = first.kind(fqn), second.kind(fqn)
            if kind_first != kind_second:
                differences.append(_Difference("~", fqn, "kind", kind_first, kind_second))
                continue
            if isinstance(entry_first, TensorRecord):
                assert isinstance(entry_second, TensorRecord)
                dtypes = entry_first.dtype, entry_second.dtype
                if dtypes[0] != dtypes[1]:
                    differences.append(
                        _Difference("~", fqn, "dtype", dtype_name(dtypes[0]), dtype_name(dtypes[1]))
                    )
                    continue
                if entry_first.size != entry_second.size:
                    differences.append(
                        _Difference(
                            "~", fqn, "size", list(entry_first.size), list(entry_second.size)
                        )
                    )
                    continue
                why = _compare_tensors(first.tensor(fqn), second.tensor(fqn), atol, rtol)
            elif kind_first in TEXT_ENCODINGS:
                why = _compare_json(first, second, fqn)
            else:
                why = _compare_bytes(kind_first, first.payload(fqn), second.payload(fqn))
            if why is not None:
                differences.append(_Difference("~", fqn, "value", detail=why))
    return differences


def run(args: argparse.Namespace) -> int:
    """Compare checkpoints ``args.a`` and ``args.b``; exit code 1 when they differ."""
    with (
        _open_checkpoint(args.a, args.storage_options) as first,
        _open_checkpoint(args.b, args.storage_options) as second,
    ):
        differences = _diff(first, second, args.atol, args.rtol)
        num_keys = len(first.entries)
        num_keys_b = len(second.entries)
    if args.json:
        print_json(
            {
                "a": args.a,
                "b": args.b,
                "atol": args.atol,
                "rtol": args.rtol,
                "equal": not differences,
                "num_keys_a": num_keys,
                "num_keys_b": num_keys_b,
                "num_differences": len(differences),
                "differences": [difference.to_json() for difference in differences],
            }
        )
        return EXIT_FAILED if differences else EXIT_OK
    for difference in differences:
        print(difference.line())
    if differences:
        print(_count(len(differences), "difference"))
        return EXIT_FAILED
    print(f"no differences ({_count(num_keys, 'key')})")
    return EXIT_OK
