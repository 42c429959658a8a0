"""Helpers for the hostile-checkpoint tests (``tests/unit/checkpoint/test_hostile.py`` and
``test_fuzz.py``): real checkpoints to attack, index rewriting (re-sealed, or with another
block size), an audit hook that records every file the library opens, state-dict snapshots,
the CLI run in-process, and an independent reference reader that says what a checkpoint
holds.

The contract under test (``docs/format.md``): whatever a checkpoint holds, every reader either
returns exactly what the index describes (and the bytes match their checksums) or raises a
:class:`~shardwise.checkpoint.CheckpointError` subclass; when it raises, it has replaced no
Python value of the target state dict (and, unless a checksum failed, changed no tensor
either), and it opens no file outside the checkpoint directory.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

import shardwise
import shardwise.checkpoint as ckpt
from shardwise import cli
from shardwise.checkpoint.index import block_checksums, seal
from shardwise.local_shards import LocalShardsWrapper

INDEX = "shardwise.json"

# -- opened files -------------------------------------------------------------------------------

_opened: list[tuple[Any, int]] = []
_recording = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    # Audit hooks cannot be removed: one hook for the whole session, active only while a
    # test records. "open" carries (path, mode, flags); flags is None for a plain open().
    if _recording and event == "open":
        _opened.append((args[0], args[2] or 0))


sys.addaudithook(_audit)

# Files a reader may open besides the checkpoint: the interpreter's and the libraries' own
# (lazy imports), and the kernel's pseudo file systems.
_CODE_DIRS = tuple(
    sorted(
        {
            os.path.realpath(path)
            for path in (
                sys.prefix,
                sys.base_prefix,
                sys.exec_prefix,
                os.path.dirname(shardwise.__file__),
                os.path.dirname(torch.__file__),
            )
        }
    )
)
_SYSTEM_DIRS = ("/proc", "/dev", "/sys")


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


@contextlib.contextmanager
def confined_opens(root: str | os.PathLike[str]) -> Iterator[list[str]]:
    """Record every file opened in the block; on exit, assert that each lies inside ``root``
    (resolved: a link is judged by its target) or is code or a pseudo file. Yields the list
    of resolved paths opened (filled when the block ends)."""
    global _recording
    real_root = os.path.realpath(root)
    assert not any(_inside(real_root, code) for code in _CODE_DIRS), "checkpoint inside code"
    del _opened[:]
    resolved: list[str] = []
    _recording = True
    try:
        yield resolved
    finally:
        _recording = False
        for item, flags in list(_opened):
            if isinstance(item, int):
                continue  # an already open descriptor (os.fdopen)
            path = os.fsdecode(item)
            if flags & os.O_NOFOLLOW:  # a link as the last component is refused, not followed
                head, tail = os.path.split(os.path.abspath(path))
                resolved.append(os.path.join(os.path.realpath(head), tail))
            else:
                resolved.append(os.path.realpath(path))
        del _opened[:]
    outside = [
        path
        for path in resolved
        if not _inside(path, real_root)
        and not any(_inside(path, d) for d in (*_CODE_DIRS, *_SYSTEM_DIRS))
    ]
    assert not outside, f"opened outside the checkpoint {real_root}: {outside}"


# -- state dicts ----------------------------------------------------------------------------


def _ints(generator: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Small integers of ``dtype`` (exact in every floating type, bfloat16 included)."""
    values = torch.randint(-50, 51, shape, generator=generator)
    if dtype == torch.bool:
        return values > 0
    if dtype.is_complex:
        return torch.complex(values.double(), -values.double() / 4).to(dtype)
    return values.to(dtype)


def mixed_state(rows: int = 64, seed: int = 0) -> dict[str, Any]:
    """A small state dict of every kind of value: several dtypes (bfloat16 included), a 0-d
    and an empty tensor, a ``rows`` x 48 float64 tensor held as two row shards of a
    LocalShardsWrapper (saved as two chunks), bytes, a BytesIO and JSON values."""
    g = torch.Generator().manual_seed(seed)
    sharded = _ints(g, (rows, 48), torch.float64)
    split = rows // 2 - 1
    return {
        "model": {
            "weight": _ints(g, (40, 50), torch.float32),
            "bias": _ints(g, (7,), torch.bfloat16),
            "half": _ints(g, (2, 3), torch.float16),
            "ids": _ints(g, (4,), torch.int64),
            "mask": _ints(g, (5,), torch.bool),
            "cplx": _ints(g, (3,), torch.complex64),
            "scale": torch.tensor(0.25),
            "empty": torch.empty(0, 3),
        },
        "sharded": LocalShardsWrapper(
            [sharded[:split].clone(), sharded[split:].clone()], [(0, 0), (split, 0)]
        ),
        "blob": bytes(range(256)) * 20,
        "stream": io.BytesIO(b"stream bytes"),
        "step": 7,
        "config": {"lr": 0.5, "name": "run", "tags": [1, "a", None]},
        "limits": [math.inf, -math.inf],
    }


def big_state(seed: int = 0) -> dict[str, Any]:
    """Tensors larger than a 1 MiB block: a 3 MiB float32 tensor held as two row shards of
    1.5 MiB (two blocks each), a 2.5 MiB bfloat16 tensor (three blocks) and a small one."""
    g = torch.Generator().manual_seed(seed)
    rows = _ints(g, (768, 1024), torch.float32)
    return {
        "rows": LocalShardsWrapper([rows[:384].clone(), rows[384:].clone()], [(0, 0), (384, 0)]),
        "plain": _ints(g, (1280, 1024), torch.bfloat16),
        "small": _ints(g, (3, 3), torch.int64),
    }


def lsw_full(wrapper: LocalShardsWrapper, size: tuple[int, ...]) -> torch.Tensor:
    """The global tensor of ``size`` that ``wrapper``'s shards describe (zeros elsewhere)."""
    shards = wrapper.local_shards()
    out = torch.zeros(size, dtype=shards[0].dtype)
    for shard, offsets in zip(shards, wrapper.local_offsets(), strict=True):
        region = out
        for dim, (offset, length) in enumerate(zip(offsets, shard.shape, strict=True)):
            region = region.narrow(dim, offset, length)
        region.copy_(shard)
    return out


def _json_round_trip(value: Any) -> Any:
    return json.loads(json.dumps(value))


def expected_values(
    state: Mapping[str, Any], sizes: Mapping[str, tuple[int, ...]]
) -> dict[str, Any]:
    """What loading ``state``'s checkpoint gives, by flat key: whole tensors (LocalShards
    assembled to the size in ``sizes``), bytes for BytesIO, JSON values after a round trip."""
    flat: dict[str, Any] = {}

    def walk(mapping: Mapping[str, Any], prefix: str) -> None:
        for key, value in mapping.items():
            name = f"{prefix}{key}"
            if type(value) is dict and value:
                walk(value, f"{name}.")
            elif isinstance(value, LocalShardsWrapper):
                flat[name] = lsw_full(value, sizes[name])
            elif isinstance(value, torch.Tensor):
                flat[name] = value.detach().clone()
            elif isinstance(value, io.BytesIO):
                flat[name] = value.getvalue()
            elif isinstance(value, bytes):
                flat[name] = value
            else:
                flat[name] = _json_round_trip(value)

    walk(state, "")
    return flat


def blank_like(state: Mapping[str, Any], reshard: bool = True) -> dict[str, Any]:
    """A target for ``state`` with other contents everywhere: tensors of the same size and
    dtype (a LocalShardsWrapper resharded into two column shards with ``reshard``, so loading
    it reads sub-boxes of the saved row chunks), placeholders for the other values."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if type(value) is dict and value:
            out[key] = blank_like(value, reshard)
        elif isinstance(value, LocalShardsWrapper):
            shards = value.local_shards()
            rows = sum(shard.shape[0] for shard in shards)
            cols = shards[0].shape[1]
            dtype = shards[0].dtype
            if reshard:
                left = cols // 3 + 1
                out[key] = LocalShardsWrapper(
                    [
                        torch.full((rows, left), -1, dtype=dtype),
                        torch.full((rows, cols - left), -1, dtype=dtype),
                    ],
                    [(0, 0), (0, left)],
                )
            else:
                out[key] = LocalShardsWrapper(
                    [torch.full_like(shard, -1) for shard in shards],
                    [tuple(o) for o in value.local_offsets()],
                )
        elif isinstance(value, torch.Tensor):
            blank = torch.full_like(value, 3) if value.dtype != torch.bool else ~value
            out[key] = blank
        else:
            out[key] = f"placeholder {key}"
    return out


def loaded_values(
    target: Mapping[str, Any], sizes: Mapping[str, tuple[int, ...]]
) -> dict[str, Any]:
    """The values of a loaded target, by flat key (as :func:`expected_values` gives them)."""
    return expected_values(target, sizes)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor`` (so NaN payloads and signed zeros compare exactly)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_values(actual: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        got = actual[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(got, torch.Tensor) and same_tensor(got, value), key
        else:
            # As JSON text: NaN equals NaN, and 1 is not 1.0 or True.
            assert type(got) is type(value) and _canonical(got) == _canonical(value), key


def _canonical(value: Any) -> Any:
    return value if isinstance(value, bytes) else json.dumps(value, sort_keys=True)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A state dict as it was: the objects themselves and copies of their contents."""

    items: tuple[tuple[str, int, Any], ...]


def _leaves(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in state.items():
        yield f"{prefix}{key}", value
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")


def _contents(value: Any) -> Any:
    if isinstance(value, LocalShardsWrapper):
        return [bits(shard).clone() for shard in value.local_shards()]
    if isinstance(value, torch.Tensor):
        return bits(value).clone()
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    if isinstance(value, dict):
        return sorted(value)
    return json.dumps(value) if not isinstance(value, bytes) else value


def snapshot(state: Mapping[str, Any]) -> Snapshot:
    return Snapshot(tuple((key, id(value), _contents(value)) for key, value in _leaves(state)))


def assert_unchanged(state: Mapping[str, Any], before: Snapshot, tensors: bool = True) -> None:
    """Every value of ``state`` is the same object with the same contents as in ``before``
    (with ``tensors=False``, the contents of tensors aside: a load that found a corrupt
    block leaves the tensors it was filling undefined)."""
    now = snapshot(state)
    assert [(k, i) for k, i, _ in now.items] == [(k, i) for k, i, _ in before.items]
    for (key, _, was), (_, _, is_) in zip(before.items, now.items, strict=True):
        if not tensors and (
            isinstance(was, torch.Tensor)
            or (isinstance(was, list) and was and isinstance(was[0], torch.Tensor))
        ):
            continue
        if isinstance(was, list) and was and isinstance(was[0], torch.Tensor):
            assert all(torch.equal(a, b) for a, b in zip(was, is_, strict=True)), key
        elif isinstance(was, torch.Tensor):
            assert torch.equal(was, is_), key
        else:
            assert was == is_, key


# -- indexes ----------------------------------------------------------------------------------


def index_bytes(path: str | os.PathLike[str]) -> bytes:
    return (Path(path) / INDEX).read_bytes()


def read_document(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed index of the checkpoint at ``path``."""
    document: dict[str, Any] = json.loads(index_bytes(path))
    return document


def write_index(path: str | os.PathLike[str], data: bytes) -> None:
    index = Path(path) / INDEX
    if index.is_symlink() or index.exists():
        index.unlink()
    index.write_bytes(data)


def resealed(document: Mapping[str, Any]) -> bytes:
    """``document`` as an index with a valid seal (its old seal dropped)."""
    return seal({key: value for key, value in document.items() if key != "index_checksum"})


def write_resealed(path: str | os.PathLike[str], document: Mapping[str, Any]) -> None:
    write_index(path, resealed(document))


_SEAL_LENGTH = len('"index_checksum":"0123456789abcdef"}')


def reseal_bytes(data: bytes) -> bytes:
    """``data`` (a sealed index, edited as bytes) with its seal recomputed: for content
    ``json.dumps`` cannot write (5000-digit integers, invalid UTF-8, raw escapes)."""
    prefix = data[:-_SEAL_LENGTH]
    digest = xxhash.xxh3_64_hexdigest(prefix).encode()
    return prefix + b'"index_checksum":"' + digest + b'"}'


def data_files(path: str | os.PathLike[str]) -> list[Path]:
    """The data files of the checkpoint at ``path``, sorted."""
    return sorted((Path(path) / "data").iterdir())


def _file_bytes(path: str | os.PathLike[str], name: str, begin: int, end: int) -> bytes:
    with open(Path(path) / name, "rb") as file:
        file.seek(begin)
        return file.read(end - begin)


def reblock(path: str | os.PathLike[str], block_size: int) -> None:
    """Rewrite the index at ``path`` with checksums of ``block_size``-byte blocks (a valid
    checkpoint whose small chunks span several blocks)."""
    document = read_document(path)
    document["checksum"]["block_size"] = block_size
    for row in document["files"]:
        if row is not None:
            name, size, data_start, _ = row
            row[3] = block_checksums(_file_bytes(path, name, data_start, size), block_size)
    write_resealed(path, document)


# -- the reference reader -----------------------------------------------------------------


class Reference:
    """What the checkpoint at ``path`` holds according to its (valid) index, read with plain
    file reads, independently of the library's planner and reader.

    Every read also checks the checksums of the file's blocks spanning the bytes it needs: a
    reader that returned the same bytes had to check them too.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self.metadata = ckpt.read_metadata(path)
        self.block_size: int | None = self.metadata.planner_data.get("block_size")

    def _info(self, index: ckpt.MetadataIndex) -> Mapping[str, Any]:
        info: Mapping[str, Any] = self.metadata.storage_data[index]
        return info

    def _bytes(self, info: Mapping[str, Any], first: int, stop: int) -> bytes:
        """The stored bytes of ``info``, after checking the file's blocks that ``[first,
        stop)`` (relative to them) touches: ``info["checksums"]`` are those of the blocks
        the stored bytes touch, the first starting at ``info["blocks_begin"]``."""
        data = _file_bytes(self.path, info["file"], info["begin"], info["end"])
        assert len(data) == info["end"] - info["begin"], "a valid index names missing bytes"
        size = self.block_size
        assert size is not None
        if stop <= first:
            return data
        file_size = os.path.getsize(Path(self.path) / info["file"])
        origin = info["blocks_begin"]
        begin = info["begin"]
        for number in range(
            (begin + first - origin) // size, (begin + stop - 1 - origin) // size + 1
        ):
            low = origin + number * size
            block = _file_bytes(self.path, info["file"], low, min(low + size, file_size))
            assert xxhash.xxh3_64_hexdigest(block) == info["checksums"][number], "block checksum"
        return data

    def tensor(
        self,
        fqn: str,
        offsets: tuple[int, ...] | None = None,
        sizes: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """The box ``offsets``/``sizes`` (default: all) of tensor ``fqn``."""
        entry = self.metadata.state_dict_metadata[fqn]
        assert isinstance(entry, ckpt.TensorStorageMetadata)
        size = tuple(entry.size)
        offsets = offsets if offsets is not None else (0,) * len(size)
        sizes = sizes if sizes is not None else size
        dtype = entry.properties.dtype
        # Copied as bytes (a trailing dim of itemsize): torch copies no elements of some
        # dtypes (int6, ...).
        out = torch.zeros((*sizes, dtype.itemsize), dtype=torch.uint8)
        for position, chunk in enumerate(entry.chunks):
            starts = [max(o, c) for o, c in zip(offsets, chunk.offsets, strict=True)]
            stops = [
                min(o + n, c + m)
                for o, n, c, m in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True)
            ]
            if any(stop <= start for start, stop in zip(starts, stops, strict=True)):
                continue
            strides = [math.prod(chunk.sizes[dim + 1 :]) for dim in range(len(size))]
            first = sum((s - c) * k for s, c, k in zip(starts, chunk.offsets, strides, strict=True))
            last = sum(
                (e - 1 - c) * k for e, c, k in zip(stops, chunk.offsets, strides, strict=True)
            )
            info = self._info(ckpt.MetadataIndex(fqn, chunk.offsets, position))
            raw = self._bytes(info, first * dtype.itemsize, (last + 1) * dtype.itemsize)
            piece = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            piece = piece.view((*chunk.sizes, dtype.itemsize))
            region = out
            for dim, (start, stop) in enumerate(zip(starts, stops, strict=True)):
                piece = piece.narrow(dim, start - chunk.offsets[dim], stop - start)
                region = region.narrow(dim, start - offsets[dim], stop - start)
            region.copy_(piece)
        return out.view(dtype).reshape(sizes)

    def value(self, fqn: str) -> Any:
        """The value of object ``fqn`` (a BytesIO's bytes; pickles are never unpickled)."""
        info = self._info(ckpt.MetadataIndex(fqn))
        if info["encoding"] == "json":
            return json.loads(info["text"])
        return self._bytes(info, 0, info["end"] - info["begin"])


# -- running the readers ----------------------------------------------------------------------


def failure(call: Callable[[], object]) -> ckpt.CheckpointError | None:
    """Run ``call``: None if it returns, the error if it raises a CheckpointError; any other
    exception propagates (and fails the test)."""
    try:
        call()
    except ckpt.CheckpointError as err:
        return err
    return None


def expect_error(call: Callable[[], object], kind: type[ckpt.CheckpointError]) -> Any:
    """Run ``call``, which must raise ``kind`` (a CheckpointError subclass); return it."""
    err = failure(call)
    assert err is not None, f"expected {kind.__name__}, nothing was raised"
    assert isinstance(err, kind), f"expected {kind.__name__}, got {type(err).__name__}: {err}"
    return err


@dataclass(frozen=True, slots=True)
class CliResult:
    code: int
    out: str
    err: str


def run_cli(*argv: str) -> CliResult:
    """``shardwise <argv>`` in this process. stdout encodes strictly as UTF-8 (as a real
    terminal does), stderr with backslash escapes (as Python's stderr does)."""
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(
        err_bytes, encoding="utf-8", errors="backslashreplace", write_through=True
    )
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return CliResult(code, out_bytes.getvalue().decode(), err_bytes.getvalue().decode())


def check_cli(result: CliResult) -> None:
    """The CLI's error contract: exit 0, 1, 2 (usage), 3 (invalid input) or 4 (storage); on 2
    and up exactly one line on stderr; never a traceback."""
    assert result.code in (0, 1, 2, 3, 4), result
    assert "Traceback" not in result.err and "Traceback" not in result.out, result
    if result.code >= 2:
        assert len(result.err.strip().splitlines()) == 1, result
