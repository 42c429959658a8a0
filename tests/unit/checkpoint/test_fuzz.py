"""A seeded mutation fuzzer for every reader of checkpoints (issue "Checkpoints from
strangers"): real checkpoints of a small mixed state dict are damaged — bits flipped, bytes
set, files truncated or extended, spans deleted or duplicated, in the index (as raw bytes, and
as parsed JSON edited and re-sealed, so the edits reach the validator rather than the seal) and
in the data files — and each damaged checkpoint is opened with ``read_metadata``, ``load``
(into a fresh, resharded target), ``load_tensor`` (a random box) and ``shardwise inspect`` /
``verify``.

Each case asserts: only a CheckpointError escapes (the CLI exits 0, 1 or 2 without a
traceback); nothing outside the checkpoint is opened; a failed load leaves the target
unchanged (its tensors aside when a checksum failed: they are then undefined, and no Python
value was replaced); a read that succeeds returns exactly what the checkpoint holds — the original
values when the index is intact or its seal must catch the damage, otherwise what the edited
index describes, read independently and checked against its checksums (``tests._hostile``).

``SHARDWISE_FUZZ_CASES`` sets the number of cases (default 2400, about 30 s on two cores);
``SHARDWISE_FUZZ_SEED`` the seed. A failure names its case; ``SHARDWISE_FUZZ_ONLY=<case>``
(e.g. ``v4/json/17``) reruns just that one.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import shardwise.checkpoint as ckpt
from tests import _hostile as h

CASES = int(os.environ.get("SHARDWISE_FUZZ_CASES", "2400"))
SEED = int(os.environ.get("SHARDWISE_FUZZ_SEED", "20261123"))
ONLY = os.environ.get("SHARDWISE_FUZZ_ONLY")

# (base checkpoint, what is mutated, share of the cases).
SUITES = [
    ("v4", "index", 2),  # raw bytes of a sealed index: the seal must catch every change
    ("v4", "json", 4),  # edited and re-sealed: the validator must catch what is wrong
    ("v4", "data", 3),
    ("v4-4k", "json", 2),  # 4 KiB blocks: chunks of several blocks, partial reads
    ("v4-4k", "data", 3),
    ("v4-null", "json", 2),  # one more file number, null (a rank that wrote nothing)
]
_WEIGHT = sum(share for _, _, share in SUITES)
# Per case: well under 50 ms; the timeout leaves room for a slow, shared machine.
_TIMEOUT = max(300, CASES // 10)

SIZES = {"sharded": (64, 48)}
STATE = h.mixed_state(rows=SIZES["sharded"][0])
ORIGINAL = h.expected_values(STATE, SIZES)


@dataclass(frozen=True, slots=True)
class Base:
    """A pristine checkpoint, in memory."""

    name: str
    index: bytes
    data: dict[str, bytes]  # file name in data/ -> contents


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Base]:
    root = tmp_path_factory.mktemp("fuzz-bases")
    ckpt.save(STATE, root / "v4")
    shutil.copytree(root / "v4", root / "v4-4k")
    h.reblock(root / "v4-4k", 4096)
    shutil.copytree(root / "v4", root / "v4-null")
    document = h.read_document(root / "v4-null")
    document["files"].append(None)
    h.write_resealed(root / "v4-null", document)
    result = {}
    for name in ("v4", "v4-4k", "v4-null"):
        files = {path.name: path.read_bytes() for path in h.data_files(root / name)}
        result[name] = Base(name, h.index_bytes(root / name), files)
    return result


# -- mutations of bytes -------------------------------------------------------------------

_TOKENS = [
    b"0", b"-1", b"1.5", b"1e999", b"NaN", b"null", b"true", b"[]", b"{}", b'"', b"\\",
    b'"\\ud800"', b"[" * 70, b"4611686018427387904", b"9" * 40, b"\xff", b"\xed\xa0\x80",
    b",", b":", b" ", b"\x00", b'"x":1,', b"\xef\xbb\xbf",
]  # fmt: skip
_BYTES = [0x00, 0x01, 0x20, 0x22, 0x2C, 0x30, 0x39, 0x5B, 0x5C, 0x7B, 0x7D, 0x7F, 0x80, 0xFF]


def _position(rng: random.Random, data: bytes, header: int) -> int:
    # Data files: a third of the edits land in the safetensors header.
    if header and rng.random() < 0.33:
        return rng.randrange(min(header, len(data)))
    return rng.randrange(len(data))


def mutate_bytes(rng: random.Random, data: bytes, header: int = 0) -> tuple[bytes, str]:
    """``data`` damaged by one random edit, and what the edit was."""
    out = bytearray(data)
    op = rng.choice(["flip", "flip", "flip", "set", "truncate", "extend", "delete", "dup", "token"])
    if op == "flip":
        bits = [
            (_position(rng, data, header), rng.randrange(8))
            for _ in range(rng.choice((1, 1, 2, 3)))
        ]
        for position, bit in bits:
            out[position] ^= 1 << bit
        what = f"flip {bits}"
    elif op == "set":
        position = _position(rng, data, header)
        out[position] = rng.choice(_BYTES) if rng.random() < 0.7 else rng.randrange(256)
        what = f"set [{position}]={out[position]:#x}"
    elif op == "truncate":
        length = rng.randrange(len(data))
        del out[length:]
        what = f"truncate to {length}"
    elif op == "extend":
        extra = rng.randbytes(rng.randint(1, 64)) if rng.random() < 0.5 else data[-64:]
        out += extra
        what = f"extend by {len(extra)}"
    elif op == "delete":
        start = _position(rng, data, header)
        length = rng.randint(1, 64)
        del out[start : start + length]
        what = f"delete [{start}:{start + length}]"
    elif op == "dup":
        start = rng.randrange(len(data))
        span = data[start : start + rng.randint(1, 64)]
        at = _position(rng, data, header)
        out[at:at] = span
        what = f"insert a copy of [{start}:{start + len(span)}] at {at}"
    else:
        at = _position(rng, data, header)
        token = rng.choice(_TOKENS)
        length = rng.randint(0, 8)
        out[at : at + length] = token
        what = f"replace [{at}:{at + length}] by {token[:20]!r}"
    if bytes(out) == data:  # an edit that changed nothing: flip a bit instead
        out[0] ^= 1
        what += " (no-op) + flip [0]"
    return bytes(out), what


def _header_length(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little") if len(data) >= 8 else 0


# -- mutations of the parsed index ------------------------------------------------------------


def _deep(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


_VALUES: list[Any] = [
    -1, 0, 1, 7, 8, 64, 4096, 2**31, 2**32, 2**40, 2**62 - 1, 2**62, 2**63, 2**64,
    0.5, 1.0, 1e308, True, False, None, "", "x", "\ud800", "\udfff", [], {}, [0], [[]],
    _deep(65), [0] * 65,
    "data/rank-00000.0123456789abcdef.safetensors", "../secret.bin", "/etc/passwd",
    "data/../data/rank-00000.0123456789abcdef.safetensors",
    "float32", "bfloat16", "int32", "uint8", "bool", "complex32", "quint8", "float8_e5m2",
    "sparse_coo", "channels_last", "json", "bytes", "bytesio", "pickle", "tensor",
    "0" * 16, "f" * 16, "xxh3_64", "crc32c", "shardwise-checkpoint",
]  # fmt: skip


def _nodes(document: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) of ``document`` below the root."""
    found = []
    stack = [document]
    while stack:
        node = stack.pop()
        keys = list(node) if isinstance(node, dict) else range(len(node))
        for key in keys:
            found.append((node, key))
            if isinstance(node[key], (dict, list)):
                stack.append(node[key])
    return found


def _replacement(rng: random.Random, old: Any, strings: list[str]) -> Any:
    if type(old) is int and rng.random() < 0.6:
        return max(-1, old + rng.choice([-64, -8, -1, 1, 8, 64, old, -old // 2]))
    if isinstance(old, str) and rng.random() < 0.5:
        return rng.choice(
            [old + "x", old[:-1], old.upper(), old[::-1], old + "\x00", rng.choice(strings)]
        )
    return copy.deepcopy(rng.choice(_VALUES))


def mutate_document(rng: random.Random, document: Any) -> tuple[Any, str]:
    """A deep copy of ``document`` with 1 to 3 random structural edits."""
    document = copy.deepcopy(document)
    strings = [key for node, key in _nodes(document) if isinstance(key, str)]
    strings += [node[key] for node, key in _nodes(document) if isinstance(node[key], str)]
    edits = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        nodes = _nodes(document)
        node, key = rng.choice(nodes)
        value = node[key]
        op = rng.random()
        if isinstance(value, list) and value and op < 0.5:
            i, j = rng.randrange(len(value)), rng.randrange(len(value))
            kind = rng.choice(["delete", "duplicate", "swap", "clear"])
            if kind == "delete":
                del value[i]
            elif kind == "duplicate":
                value.insert(j, copy.deepcopy(value[i]))
            elif kind == "swap":
                value[i], value[j] = value[j], value[i]
            else:
                value.clear()
            edits.append(f"{kind} in list at {key!r}")
        elif isinstance(value, dict) and value and op < 0.5:
            name = rng.choice(list(value))
            kind = rng.choice(["delete", "add", "rename"])
            if kind == "delete":
                del value[name]
            elif kind == "add":
                value[rng.choice(["extra", name + "2"])] = copy.deepcopy(value[name])
            else:
                value[rng.choice(strings)] = value.pop(name)
            edits.append(f"{kind} key {name!r} of {key!r}")
        else:
            node[key] = _replacement(rng, value, strings)
            edits.append(f"{key!r}: {_short(value)} -> {_short(node[key])}")
    return document, "; ".join(edits)


# Edits that keep the index well formed where they can, so that they reach the checks of
# tilings, byte ranges and checksums, and the loaders.
_DTYPE_NAMES = [
    "float32", "int32", "uint32", "float16", "bfloat16", "int16", "float64", "int64",
    "complex64", "complex128", "uint8", "int8", "bool", "float8_e4m3fn", "complex32", "quint8",
    "uint1",
]  # fmt: skip
_TEXTS = [
    "NaN", "-Infinity", "1e999", "9" * 5000, "", "[", "null", '"\\ud800"', '{"a": 1, "a": 2}',
    json.dumps(_deep(64)), json.dumps(_deep(65)), '"x"', "[1, 2", "\x00", "1 2",
]  # fmt: skip
_SEMANTIC = [
    "reshape", "flatten", "dtype", "shift", "swap", "alias", "size", "box", "declared",
    "block", "sums", "text", "encoding", "rename", "drop", "dup", "file", "null", "start",
]  # fmt: skip


@dataclass(slots=True)
class _Stored:
    """One stored byte range of an index being edited, and where its fields live."""

    fqn: str
    row: Any  # the list holding its fields
    fields: tuple[int, int]  # their positions: file, begin

    @property
    def begin(self) -> int:
        return self.fields[1]


def _parts(document: dict[str, Any]) -> tuple[list[Any], list[_Stored]]:
    """The tensors (key, size, boxes of a ``chunks`` layout) and the stored byte ranges of a
    parsed index (a single process's: ``whole`` and ``chunks`` layouts, blobs)."""
    tensors, stored = [], []
    for fqn, _, size, layout in document["tensors"]:
        if layout[0] == "whole":
            tensors.append((fqn, size, []))
            stored.append(_Stored(fqn, layout, (1, 2)))
        else:
            tensors.append((fqn, size, [(c[0], c[1]) for c in layout[1]]))
            stored += [_Stored(fqn, c, (2, 3)) for c in layout[1]]
    stored += [_Stored(r[0], r[2], (0, 1)) for r in document["objects"] if r[1] != "json"]
    return tensors, stored


def mutate_semantics(rng: random.Random, document: Any) -> tuple[Any, str]:
    """A deep copy of the index ``document`` with one edit of its meaning (a tensor reshaped
    or retyped, a byte range moved, aliased or swapped, a size, box, file size, data start,
    checksum, stored value, encoding or key changed, an entry dropped or repeated, a file
    made null)."""
    document = copy.deepcopy(document)
    tensors, stored = _parts(document)
    fqn, size, boxes = rng.choice(tensors)
    one, other = rng.choice(stored), rng.choice(stored)
    objects = {row[0]: row for row in document["objects"]}
    properties = document["properties"]
    files = [row for row in document["files"] if row is not None]
    layout = next(row for row in document["tensors"] if row[0] == fqn)[3]
    op = rng.choice(_SEMANTIC)
    if op == "reshape":  # a dim of 1 more, in front or behind: the same bytes
        front = rng.random() < 0.5
        for dims, value in [(size, 1), *((o, 0) for o, _ in boxes), *((s, 1) for _, s in boxes)]:
            dims.insert(0 if front else len(dims), value)
    elif op == "flatten" and len(size) > 1:  # row-band chunks of a 2-d tensor as 1-d
        row = math.prod(size[1:])
        size[:] = [math.prod(size)]
        for offsets, sizes in boxes:
            offsets[:] = [offsets[0] * row] if offsets else []
            sizes[:] = [math.prod(sizes)]
    elif op == "dtype":
        rng.choice(properties)[0] = rng.choice(_DTYPE_NAMES)
    elif op == "shift":
        one.row[one.begin] += rng.choice([-64, -8, -2, -1, 1, 2, 8, 64])
    elif op in ("swap", "alias"):  # two ranges trade places, or one is named twice
        for mine, theirs in zip(one.fields, other.fields, strict=True):
            if op == "swap":
                one.row[mine], other.row[theirs] = other.row[theirs], one.row[mine]
            else:
                one.row[mine] = other.row[theirs]
    elif op == "size" and size:
        size[rng.randrange(len(size))] += rng.choice([-1, 1])
    elif op == "box" and boxes and size:
        dims = rng.choice(boxes)[rng.randrange(2)]
        dims[rng.randrange(len(dims))] += rng.choice([-1, 1])
    elif op == "declared":
        entry = rng.choice(files)
        entry[1] += rng.choice([-64, -1, 1, 64, entry[1]])
    elif op == "start":
        entry = rng.choice(files)
        entry[2] += rng.choice([-64, -1, 1, 64, entry[1]])
    elif op == "block":
        document["checksum"]["block_size"] = rng.choice([4095, 4096, 8192, 1 << 20, 1 << 30])
    elif op == "sums":
        entry, theirs = rng.choice(files), rng.choice(files)
        sums = entry[3]
        entry[3] = rng.choice([theirs[3], sums + "0" * 16, sums[:-16], sums.upper(), ""])
    elif op == "text":
        objects[rng.choice(sorted(objects))][1:] = ["json", rng.choice(_TEXTS)]
    elif op == "encoding":
        encoding = rng.choice(["json", "bytes", "bytesio", "pickle"])
        objects[rng.choice(sorted(objects))][1] = encoding
    elif op == "rename":
        names = [name for name, _, _ in tensors] + sorted(objects)
        new = rng.choice([*names, "", "model", "config", "model.weight.x", fqn + "\x00"])
        next(row for row in document["tensors"] if row[0] == fqn)[0] = new
    elif op == "drop":
        if layout[0] == "chunks" and layout[1] and rng.random() < 0.5:
            del layout[1][rng.randrange(len(layout[1]))]
        else:
            rows = rng.choice([document["tensors"], document["objects"]])
            del rows[rng.randrange(len(rows))]
    elif op == "dup":
        if layout[0] == "chunks" and layout[1]:
            layout[1].append(copy.deepcopy(rng.choice(layout[1])))
        elif layout[0] == "whole":  # the one chunk, listed twice
            chunk = [[0] * len(size), list(size), layout[1], layout[2]]
            layout[:] = ["chunks", [chunk, copy.deepcopy(chunk)]]
    elif op == "file":  # a range moved to another file: a real one or a null one
        if rng.random() < 0.5:
            name = files[0][0].replace("00000", "00001")
            document["files"].append([name, 64, 8, "0" * 16])
        else:
            document["files"].append(None)
        one.row[one.fields[0]] = len(document["files"]) - 1
    elif op == "null":  # a file that holds entries is said to hold nothing
        document["files"][rng.randrange(len(document["files"]))] = None
    return document, f"{op} ({fqn}, {one.fqn}, {other.fqn})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def serialize(rng: random.Random, document: Any) -> tuple[bytes, str]:
    """An edited index as bytes, re-sealed (now and then raw UTF-8, escaped ASCII, lone
    surrogates as invalid UTF-8, or not re-sealed)."""
    ascii_only = rng.random() < 0.3
    if not isinstance(document, dict) or rng.random() < 0.05:
        text = json.dumps(document, separators=(",", ":"), ensure_ascii=ascii_only)
        return text.encode("utf-8", "surrogatepass"), "not re-sealed"
    body = {key: value for key, value in document.items() if key != "index_checksum"}
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=ascii_only)
    prefix = (text[:-1] + ("," if body else "")).encode("utf-8", "surrogatepass")
    digest = xxhash.xxh3_64_hexdigest(prefix).encode()
    return prefix + b'"index_checksum":"' + digest + b'"}', "re-sealed"


# -- one case -----------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    metadata: ckpt.Metadata | None = None
    meta_error: ckpt.CheckpointError | None = None
    load_error: ckpt.CheckpointError | None = None
    tensor_error: ckpt.CheckpointError | None = None


def _write(directory: Path, index: bytes, data: dict[str, bytes]) -> None:
    (directory / "shardwise.json").write_bytes(index)
    for name, contents in data.items():
        (directory / "data" / name).write_bytes(contents)


def _random_box(
    rng: random.Random, metadata: ckpt.Metadata | None
) -> tuple[str, list[int], list[int]]:
    tensors = {
        fqn: tuple(entry.size)
        for fqn, entry in (metadata.state_dict_metadata.items() if metadata else ())
        if isinstance(entry, ckpt.TensorStorageMetadata)
    } or {fqn: tuple(v.shape) for fqn, v in ORIGINAL.items() if isinstance(v, torch.Tensor)}
    fqn = rng.choice(sorted(tensors))
    offsets, sizes = [], []
    for extent in tensors[fqn]:
        extent = min(extent, 1 << 20)
        offset = rng.randint(0, extent)
        offsets.append(offset)
        sizes.append(rng.randint(0, extent - offset))
    return fqn, offsets, sizes


def _narrow(tensor: torch.Tensor, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        tensor = tensor.narrow(dim, offset, size)
    return tensor


def run_case(directory: Path, rng: random.Random, intact: bool) -> Outcome:
    """Open the checkpoint at ``directory`` every way and check every contract.

    Args:
        intact: Whether a read that succeeds must give the original values (the index is
            the original or sealed; the data files are the original or damaged); otherwise
            it must give what the index describes.
    """
    outcome = Outcome()
    target = h.blank_like(STATE)
    before = h.snapshot(target)
    fqn: str = ""
    box: tuple[list[int], list[int]] = ([], [])
    result: list[torch.Tensor] = []

    def read() -> None:
        outcome.metadata = ckpt.read_metadata(directory)

    def load_one() -> None:
        result.append(ckpt.load_tensor(directory, fqn, offsets=box[0], sizes=box[1]))

    with h.confined_opens(directory), warnings.catch_warnings():
        # A dtype name edited to a quantized or complex32 dtype makes torch.empty warn.
        warnings.filterwarnings("ignore", category=UserWarning, module="shardwise")
        outcome.meta_error = h.failure(read)
        outcome.load_error = h.failure(lambda: ckpt.load(target, directory))
        fqn, *box = _random_box(rng, outcome.metadata)  # type: ignore[assignment]
        outcome.tensor_error = h.failure(load_one)
        inspect = h.run_cli("inspect", str(directory))
        verify = h.run_cli("verify", str(directory))

    reference = None if intact or outcome.meta_error else h.Reference(directory)
    if outcome.meta_error is not None:
        assert isinstance(outcome.meta_error, ckpt.CheckpointFormatError), outcome.meta_error
        assert type(outcome.load_error) is type(outcome.meta_error), outcome.load_error
        assert type(outcome.tensor_error) is type(outcome.meta_error), outcome.tensor_error
    if outcome.load_error is not None:
        checksum = isinstance(outcome.load_error, ckpt.ChecksumError)
        h.assert_unchanged(target, before, tensors=not checksum)
    else:
        loaded = h.loaded_values(target, SIZES)
        if reference is None:
            expected = ORIGINAL
        else:
            expected = {
                key: reference.tensor(key, (0,) * value.dim(), tuple(value.shape))
                if isinstance(value, torch.Tensor)
                else reference.value(key)
                for key, value in loaded.items()
            }
        h.assert_same_values(loaded, expected)
    if outcome.tensor_error is None:
        (tensor,) = result
        if reference is None:
            want = _narrow(ORIGINAL[fqn], *box)
        else:
            want = reference.tensor(fqn, tuple(box[0]), tuple(box[1]))
        assert h.same_tensor(tensor, want), (fqn, box)

    # The command line: its contract, and agreement with the library.
    h.check_cli(inspect)
    h.check_cli(verify)
    if outcome.meta_error is not None:
        assert inspect.code == 3 and verify.code == 3, (inspect, verify)
    errors = (outcome.load_error, outcome.tensor_error)
    if any(isinstance(err, ckpt.ChecksumError) for err in errors):
        assert verify.code == 1, verify
    if verify.code == 0:
        assert not any(isinstance(err, ckpt.CheckpointDataError) for err in errors), errors
    return outcome


def _cases(suite: int) -> Iterator[int]:
    base, target, share = SUITES[suite]
    count = max(1, math.ceil(CASES * share / _WEIGHT))
    if ONLY is None:
        yield from range(count)
    elif ONLY.startswith(f"{base}/{target}/"):
        yield int(ONLY.rsplit("/", 1)[1])


@pytest.mark.timeout(_TIMEOUT)
@pytest.mark.parametrize("suite", range(len(SUITES)), ids=[f"{b}-{t}" for b, t, _ in SUITES])
def test_mutated_checkpoints_fail_cleanly_or_load_exactly(
    suite: int, bases: dict[str, Base], tmp_path: Path
) -> None:
    name, target, _ = SUITES[suite]
    base = bases[name]
    directory = tmp_path / "ckpt"
    (directory / "data").mkdir(parents=True)
    document = json.loads(base.index)
    outcomes: dict[str, int] = {}
    for case in _cases(suite):
        rng = random.Random(f"{SEED}/{name}/{target}/{case}")
        index, data = base.index, dict(base.data)
        if target == "index":
            index, what = mutate_bytes(rng, index)
        elif target == "json":
            mutate = mutate_semantics if rng.random() < 0.6 else mutate_document
            edited, what = mutate(rng, document)
            index, how = serialize(rng, edited)
            what += f" ({how})"
        else:
            file = rng.choice(sorted(data))
            data[file], what = mutate_bytes(rng, data[file], _header_length(data[file]))
            what = f"{file}: {what}"
        # Damage the seal can catch must load exactly or not at all; an edited, re-sealed
        # index must load what it says.
        intact = target in ("data", "index")
        _write(directory, index, data)
        try:
            outcome = run_case(directory, rng, intact)
        except BaseException as err:
            raise AssertionError(
                f"fuzz case {name}/{target}/{case} (seed {SEED}): {what}: "
                f"{type(err).__name__}: {err}"
            ) from err
        label = type(outcome.load_error).__name__ if outcome.load_error else "loaded"
        outcomes[label] = outcomes.get(label, 0) + 1
    if ONLY is None and name == "v4" and target == "index":
        assert set(outcomes) == {"CheckpointFormatError"}, outcomes  # the seal catches all
    elif ONLY is None and sum(outcomes.values()) >= 100:
        # The mutations must reach the checks, not just bounce off the first one.
        assert len(outcomes) >= 2, outcomes
        if target == "data":
            assert outcomes.get("ChecksumError", 0) and outcomes.get("loaded", 0), outcomes
