"""``shardwise diff``: compare two checkpoints key by key."""

from __future__ import annotations

import argparse
import json
import math

import torch

from shardwise._progress import count_bar
from shardwise.checkpoint.index import TEXT_ENCODINGS, TensorRecord
from shardwise.cli._checkpoint import _Checkpoint, _open_checkpoint
from shardwise.cli._common import EXIT_FAILED, EXIT_OK, _count, _printable
from shardwise.metadata import dtype_name


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


def _diff(first: _Checkpoint, second: _Checkpoint, atol: float, rtol: float) -> list[str]:
    differences = []
    keys_first, keys_second = first.entries, second.entries
    common = [fqn for fqn in keys_first if fqn in keys_second]
    # Every data file to read is checked (type, size) before the first byte is read.
    first.check_files(common)
    second.check_files(common)
    for fqn in keys_first:
        if fqn not in keys_second:
            differences.append(f"- {fqn!r}: only in A ({first.kind(fqn)})")
    for fqn in keys_second:
        if fqn not in keys_first:
            differences.append(f"+ {fqn!r}: only in B ({second.kind(fqn)})")
    with count_bar(len(common), "comparing", unit="key") as bar:
        for fqn in common:
            bar.update(1)
            entry_first, entry_second = keys_first[fqn], keys_second[fqn]
            kind_first, kind_second = first.kind(fqn), second.kind(fqn)
            if kind_first != kind_second:
                differences.append(f"~ {fqn!r}: kind {kind_first} in A, {kind_second} in B")
                continue
            if isinstance(entry_first, TensorRecord):
                assert isinstance(entry_second, TensorRecord)
                dtypes = entry_first.dtype, entry_second.dtype
                if dtypes[0] != dtypes[1]:
                    differences.append(
                        f"~ {fqn!r}: dtype {dtype_name(dtypes[0])} in A, "
                        f"{dtype_name(dtypes[1])} in B"
                    )
                    continue
                if entry_first.size != entry_second.size:
                    differences.append(
                        f"~ {fqn!r}: size {list(entry_first.size)} in A, "
                        f"{list(entry_second.size)} in B"
                    )
                    continue
                why = _compare_tensors(first.tensor(fqn), second.tensor(fqn), atol, rtol)
            elif kind_first in TEXT_ENCODINGS:
                why = _compare_json(first, second, fqn)
            else:
                why = _compare_bytes(kind_first, first.payload(fqn), second.payload(fqn))
            if why is not None:
                differences.append(f"~ {fqn!r}: {why}")
    return differences


def run(args: argparse.Namespace) -> int:
    """Compare checkpoints ``args.a`` and ``args.b``; exit code 1 when they differ."""
    with (
        _open_checkpoint(args.a, args.storage_options) as first,
        _open_checkpoint(args.b, args.storage_options) as second,
    ):
        differences = _diff(first, second, args.atol, args.rtol)
        num_keys = len(first.entries)
    for line in differences:
        print(line)
    if differences:
        print(_count(len(differences), "difference"))
        return EXIT_FAILED
    print(f"no differences ({_count(num_keys, 'key')})")
    return EXIT_OK
