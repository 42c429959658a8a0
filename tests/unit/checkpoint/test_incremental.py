"""Incremental saves in one process (``docs/format.md``, *Incremental checkpoints*): the index
of version 5, what is written and what is referenced, loads that equal full ones, and hostile
references refused."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.index import decode_index, seal
from shardwise.checkpoint.index.names import parse_reference
from shardwise.cli import main as cli_main
from shardwise.errors import CheckpointDataError, CheckpointError, CheckpointFormatError


def _state(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "base": torch.randn(64, 32, generator=generator),
            "frozen": torch.randn(40, generator=generator),
            "adapter": torch.randn(4, 32, generator=generator),
            "empty": torch.zeros(0, 3),
            "scale": torch.tensor(2.0),
        },
        "step": 1,
        "blob": b"abc",
    }


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    model = {key: torch.full_like(value, -7.0) for key, value in state["model"].items()}
    return {"model": model, "step": 0, "blob": b""}


def _document(path: Path) -> dict[str, Any]:
    return json.loads((path / "shardwise.json").read_bytes())


def _own_bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in (path / "data").iterdir())


def _series(tmp_path: Path, saves: int = 3) -> tuple[dict[str, Any], list[Path]]:
    """A series of ``saves`` checkpoints; between saves only the adapter changes."""
    state = _state()
    paths = [tmp_path / f"step-{n:08d}" for n in range(saves)]
    ckpt.save(state, paths[0], incremental=True)
    for previous, path in itertools.pairwise(paths):
        state["model"]["adapter"].add_(1.0)
        state["step"] += 1
        ckpt.save(state, path, base=previous)
    return state, paths


def test_a_series_writes_only_what_changed_and_loads_like_a_full_save(tmp_path: Path) -> None:
    state, paths = _series(tmp_path)
    first, last = _document(paths[0]), _document(paths[-1])
    assert first["format_version"] == last["format_version"] == 5
    assert [name for name, *_ in last["files"][1:]] == [
        f"../{paths[0].name}/{first['files'][0][0]}"
    ]
    # The adapter (512 bytes) and the blob are written; the 10 KiB base is not.
    assert _own_bytes(paths[-1]) < 2 * 1024 < _own_bytes(paths[0])
    for path in paths[1:]:
        index = decode_index((path / "shardwise.json").read_bytes())
        assert index.format_version == 5
        assert index.references == [f"../{paths[0].name}/{first['files'][0][0]}"]
    full = tmp_path / "full"
    ckpt.save(state, full)
    assert _document(full)["format_version"] == 4
    loaded, expected = _blank(state), _blank(state)
    ckpt.load(loaded, paths[-1])
    ckpt.load(expected, full)
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value)
        assert torch.equal(loaded["model"][key], expected["model"][key])
    assert (loaded["step"], loaded["blob"]) == (3, b"abc")
    part = ckpt.load_tensor(paths[-1], "model.base", offsets=[8, 4], sizes=[3, 5])
    assert torch.equal(part, state["model"]["base"][8:11, 4:9])
    metadata = ckpt.read_metadata(paths[-1])
    assert metadata.version == "5"


def test_a_save_where_nothing_changed_writes_no_data_file(tmp_path: Path) -> None:
    state = {"w": torch.randn(16, 4), "step": 3}
    ckpt.save(state, tmp_path / "a", incremental=True)
    ckpt.save(state, tmp_path / "b", base=tmp_path / "a")
    document = _document(tmp_path / "b")
    assert document["files"][0] is None and len(document["files"]) == 2
    assert not (tmp_path / "b" / "data").exists() or not any((tmp_path / "b" / "data").iterdir())
    out = {"w": torch.zeros(16, 4), "step": 0}
    ckpt.load(out, tmp_path / "b")
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3


def test_the_digest_decides_not_the_autograd_state(tmp_path: Path) -> None:
    """A frozen weight changed in place (no grad, same version-less view) is written again."""
    state = _state()
    frozen = torch.nn.Parameter(state["model"]["frozen"], requires_grad=False)
    state["model"]["frozen"] = frozen
    ckpt.save(state, tmp_path / "a", incremental=True)
    with torch.no_grad():
        frozen.data[3] += 1e-6  # through .data: invisible to the version counter
    ckpt.save(state, tmp_path / "b", base=tmp_path / "a")
    index = decode_index((tmp_path / "b" / "shardwise.json").read_bytes())
    assert index.tensors["model.frozen"].chunks[0].file.startswith("data/")
    assert index.tensors["model.base"].chunks[0].file.startswith("../a/")
    loaded = _blank(state)
    ckpt.load(loaded, tmp_path / "b")
    assert torch.equal(loaded["model"]["frozen"], frozen)


def test_a_dtype_change_is_written_even_with_equal_bytes(tmp_path: Path) -> None:
    ckpt.save({"t": torch.zeros(8, dtype=torch.int32)}, tmp_path / "a", incremental=True)
    ckpt.save({"t": torch.zeros(8, dtype=torch.float32)}, tmp_path / "b", base=tmp_path / "a")
    # Same bytes, same size: the reference is correct, and the dtype is the new one.
    out = {"t": torch.ones(8)}
    ckpt.load(out, tmp_path / "b")
    assert torch.equal(out["t"], torch.zeros(8))
    ckpt.save({"t": torch.zeros(8, dtype=torch.float64)}, tmp_path / "c", base=tmp_path / "b")
    index = decode_index((tmp_path / "c" / "shardwise.json").read_bytes())
    assert index.tensors["t"].chunks[0].file.startswith("data/")  # 64 bytes, not 32


def test_a_base_must_be_a_committed_sibling(tmp_path: Path) -> None:
    state = _state()
    ckpt.save(state, tmp_path / "a", incremental=True)
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="same series root"):
        ckpt.save(state, tmp_path / "other" / "b", base=tmp_path / "a")
    with pytest.raises(ValueError, match="cannot build on itself"):
        ckpt.save(state, tmp_path / "a", base=tmp_path / "a")
    with pytest.raises(CheckpointError, match="not committed"):
        ckpt.save(state, tmp_path / "b", base=tmp_path / "missing")
    # A base of version 4 records no digests: everything is written, and the result is v5.
    ckpt.save(state, tmp_path / "v4")
    ckpt.save(state, tmp_path / "c", base=tmp_path / "v4")
    index = decode_index((tmp_path / "c" / "shardwise.json").read_bytes())
    assert index.references == [] and index.format_version == 5


def test_cli_commands_read_an_incremental_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state, paths = _series(tmp_path)
    assert cli_main(["verify", str(paths[-1])]) == 0
    assert cli_main(["inspect", str(paths[-1])]) == 0
    out = capsys.readouterr().out
    assert f"reads 1 data file of 1 earlier checkpoint ({paths[0].name}) beside it" in out
    assert cli_main(["inspect", "--json", str(paths[-1])]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format_version"] == 5 and len(summary["referenced_files"]) == 1
    out = tmp_path / "hf"
    assert cli_main(["consolidate", str(paths[-1]), str(out)]) == 0
    from safetensors.torch import load_file

    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["model.base"], state["model"]["base"])
    assert torch.equal(tensors["model.adapter"], state["model"]["adapter"])


# -- hostile references --------------------------------------------------------------------


def _rewrite(path: Path, change: Any) -> None:
    """Change the index of ``path`` (a JSON document) and seal it again."""
    document = _document(path)
    del document["index_checksum"]
    change(document)
    (path / "shardwise.json").write_bytes(seal(document))


def _load_error(path: Path, state: dict[str, Any]) -> BaseException:
    with pytest.raises(CheckpointError) as info:
        ckpt.load(_blank(state), path)
    return info.value


@pytest.mark.parametrize(
    "name",
    [
        "../../elsewhere/data/rank-00000.0123456789abcdef.safetensors",
        "../a/b/data/rank-00000.0123456789abcdef.safetensors",
        "../../data/rank-00000.0123456789abcdef.safetensors",
        ".././data/rank-00000.0123456789abcdef.safetensors",
        "/etc/data/rank-00000.0123456789abcdef.safetensors",
        "../step-1/data/../../rank-00000.0123456789abcdef.safetensors",
        "../step-1/data/rank-00000.0123456789abcdef.safetensors/x",
        "..\\step-1\\data\\rank-00000.0123456789abcdef.safetensors",
        "../step\x00/data/rank-00000.0123456789abcdef.safetensors",
    ],
)
def test_a_reference_outside_the_series_root_is_refused(tmp_path: Path, name: str) -> None:
    state, paths = _series(tmp_path, saves=2)
    assert parse_reference(name) is None

    def change(document: dict[str, Any]) -> None:
        document["files"][-1][0] = name

    _rewrite(paths[-1], change)
    error = _load_error(paths[-1], state)
    assert isinstance(error, CheckpointFormatError)
    assert "is not a data file name" in str(error)


def test_a_reference_in_a_version_4_index_is_refused(tmp_path: Path) -> None:
    state, paths = _series(tmp_path, saves=2)

    def change(document: dict[str, Any]) -> None:
        document["format_version"] = 4
        del document["digests"]

    _rewrite(paths[-1], change)
    assert "is not a data file name" in str(_load_error(paths[-1], state))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d["digests"].pop(), "digests must be a list"),
        (lambda d: d["digests"].__setitem__(0, "0" * 31), "malformed chunk digests"),
        (lambda d: d["digests"].__setitem__(0, "A" * 32), "malformed chunk digests"),
        (
            lambda d: d["tensors"].__setitem__(
                0, ["model.adapter", 0, [4, 32], ["grid", [4, 32], [0, 0, 0]]]
            ),
            "no grid layouts",
        ),
    ],
)
def test_malformed_version_5_fields_are_refused(tmp_path: Path, change: Any, match: str) -> None:
    state, paths = _series(tmp_path, saves=2)
    _rewrite(paths[-1], change)
    error = _load_error(paths[-1], state)
    assert isinstance(error, CheckpointFormatError) and match in str(error)


def test_a_missing_referenced_file_is_refused_and_says_why(tmp_path: Path) -> None:
    state, paths = _series(tmp_path, saves=2)
    for entry in (paths[0] / "data").iterdir():
        entry.unlink()
    error = _load_error(paths[-1], state)
    assert isinstance(error, CheckpointDataError)
    assert "missing" in str(error) and "materialize" in str(error)


def test_a_checkpoint_copied_alone_fails_clearly(tmp_path: Path) -> None:
    state, paths = _series(tmp_path, saves=2)
    (tmp_path / "copy").mkdir()
    shutil.copytree(paths[-1], tmp_path / "copy" / "alone")
    error = _load_error(tmp_path / "copy" / "alone", state)
    assert isinstance(error, CheckpointDataError) and "materialize" in str(error)


def test_a_range_past_the_end_of_a_referenced_file_is_refused(tmp_path: Path) -> None:
    state, paths = _series(tmp_path, saves=2)

    def past_the_end(document: dict[str, Any]) -> None:
        for row in document["tensors"]:
            if row[0] == "model.base":
                row[3][2] = document["files"][-1][1]  # begins at the declared end

    _rewrite(paths[-1], past_the_end)
    error = _load_error(paths[-1], state)
    assert isinstance(error, CheckpointFormatError) and "past the declared size" in str(error)


def test_a_referenced_file_shorter_than_declared_is_refused(tmp_path: Path) -> None:
    state, paths = _series(tmp_path, saves=2)
    (file,) = (paths[0] / "data").iterdir()
    os.truncate(file, file.stat().st_size - 1)
    error = _load_error(paths[-1], state)
    assert isinstance(error, CheckpointDataError) and "truncated" in str(error)


def test_a_linked_sibling_is_not_followed(tmp_path: Path) -> None:
    state, paths = _series(tmp_path, saves=2)
    moved = tmp_path.parent / f"{tmp_path.name}-moved"
    paths[0].rename(moved)
    paths[0].symlink_to(moved)
    error = _load_error(paths[-1], state)
    assert isinstance(error, CheckpointDataError) and "link" in str(error)
    linked_data = tmp_path / "step-00000000"
    linked_data.unlink()
    linked_data.mkdir()
    (linked_data / "data").symlink_to(moved / "data")
    error = _load_error(paths[-1], state)
    assert isinstance(error, CheckpointDataError) and "link" in str(error)


def test_a_corrupt_referenced_block_is_caught(tmp_path: Path) -> None:
    state, paths = _series(tmp_path, saves=2)
    (file,) = (paths[0] / "data").iterdir()
    data = bytearray(file.read_bytes())
    data[-20] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(ckpt.ChecksumError):
        ckpt.load(_blank(state), paths[-1])


# -- a property: any sequence of changes loads back exactly ----------------------------------


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.sets(st.sampled_from(["a", "b", "c", "d"])), min_size=1, max_size=5))
def test_any_sequence_of_changes_loads_back_exactly(
    tmp_path: Path, changes: list[set[str]]
) -> None:
    root = tmp_path / f"series-{os.urandom(4).hex()}"
    root.mkdir()
    state = {key: torch.arange(24.0).reshape(4, 6) + n for n, key in enumerate("abcd")}
    previous = root / "s0"
    ckpt.save(state, previous, incremental=True)
    for number, changed in enumerate(changes, start=1):
        for key in changed:
            state[key][number % 4, number % 6] += number
        path = root / f"s{number}"
        ckpt.save(state, path, base=previous)
        index = decode_index((path / "shardwise.json").read_bytes())
        written = {
            key
            for key, record in index.tensors.items()
            if record.chunks[0].file.startswith("data/")
        }
        assert written == changed
        previous = path
    out = {key: torch.zeros(4, 6) for key in state}
    ckpt.load(out, previous)
    assert all(torch.equal(out[key], state[key]) for key in state)


# -- materialize -----------------------------------------------------------------------------


def test_materialize_makes_a_self_contained_copy(tmp_path: Path) -> None:
    state, paths = _series(tmp_path)
    before = {path: (path / "shardwise.json").read_bytes() for path in paths}
    out = tmp_path / "elsewhere" / "copy"
    assert cli_main(["materialize", str(paths[-1]), str(out)]) == 0
    assert {path: (path / "shardwise.json").read_bytes() for path in paths} == before
    document = _document(out)
    assert document["format_version"] == 4 and "digests" not in document
    assert all(name.startswith("data/") for name, *_ in document["files"])
    # It holds exactly its entries (not the whole referenced files) and moves anywhere.
    assert _own_bytes(out) < _own_bytes(paths[0]) + _own_bytes(paths[-1])
    moved = tmp_path / "moved"
    shutil.move(out, moved)
    loaded = _blank(state)
    ckpt.load(loaded, moved)
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    assert (loaded["step"], loaded["blob"]) == (3, b"abc")
    assert cli_main(["verify", str(moved)]) == 0
    with pytest.raises(CheckpointError, match="holds a checkpoint already"):
        ckpt.materialize(paths[-1], moved)


def test_materialize_verifies_every_byte_and_commits_nothing_on_a_mismatch(
    tmp_path: Path,
) -> None:
    _, paths = _series(tmp_path, saves=2)
    (file,) = (paths[0] / "data").iterdir()
    data = bytearray(file.read_bytes())
    data[-20] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(ckpt.ChecksumError):
        ckpt.materialize(paths[-1], tmp_path / "copy")
    assert not (tmp_path / "copy" / "shardwise.json").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_chunks_are_hashed_through_the_host(tmp_path: Path) -> None:
    state = {
        "frozen": torch.randn(300, 1000, device="cuda"),
        "adapter": torch.randn(8, 1000, device="cuda"),
    }
    ckpt.save(state, tmp_path / "a", incremental=True)
    state["adapter"].add_(1.0)
    ckpt.save(state, tmp_path / "b", base=tmp_path / "a")
    index = decode_index((tmp_path / "b" / "shardwise.json").read_bytes())
    assert index.tensors["frozen"].chunks[0].file.startswith("../a/")
    assert index.tensors["adapter"].chunks[0].file.startswith("data/")
    out = {key: torch.zeros_like(value) for key, value in state.items()}
    ckpt.load(out, tmp_path / "b")
    assert all(torch.equal(out[key], state[key]) for key in state)


FILE = "rank-00000.0123456789abcdef.safetensors"
_PIECES = ["..", ".", "/", "\\", "a", "step-1", "data", "\x00", "\x1f", "é", FILE]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=9))
@example(["..", "/", "step-1", "/", "data", "/", FILE])  # accepted
@example(["..", "/", "é", "/", "data", "/", FILE])  # accepted
@example(["..", "/", "..", "/", "data", "/", FILE])
@example(["..", "/", ".", "/", "data", "/", FILE])
@example(["..", "/", "a", "/", "a", "/", "data", "/", FILE])
@example(["..", "/", "a", "\\", "/", "data", "/", FILE])
@example(["..", "/", "a", "\x00", "/", "data", "/", FILE])
@example(["/", "step-1", "/", "data", "/", FILE])
def test_an_accepted_reference_stays_one_checkpoint_below_the_root(pieces: list[str]) -> None:
    """Whatever a name is, the decoder refuses it or it names ``<root>/<one component>/data/
    <a data file>``: joined to the checkpoint and normalized, it never leaves the root."""
    name = "".join(pieces)
    document = {
        "format": "shardwise-checkpoint",
        "format_version": 5,
        "save": {"writer": "w", "torch": "t", "world_size": 1, "save_id": "0" * 16,
                 "checkpoint_id": None},
        "checksum": {"algorithm": "xxh3_64", "block_size": 1 << 20, "scope": "file"},
        "files": [[name, 72, 64, "0" * 16]],
        "properties": [["float32", "strided", False, "contiguous_format", False]],
        "tensors": [["t", 0, [2], ["whole", 0, 64]]],
        "objects": [],
        "digests": ["0" * 32],
    }  # fmt: skip
    try:
        index = decode_index(seal(document))
    except CheckpointFormatError:
        return
    (accepted,) = index.files
    parsed = parse_reference(accepted)
    assert parsed is not None, accepted
    resolved = os.path.normpath(os.path.join("/root/ckpt", accepted))
    parts = resolved.split("/")
    assert parts[:2] == ["", "root"] and len(parts) == 5 and parts[3] == "data", resolved
    assert parts[2] not in (".", "..", "") and parts[4] == FILE


# -- a mutation fuzz of incremental indexes --------------------------------------------------

FUZZ_CASES = max(1, int(os.environ.get("SHARDWISE_FUZZ_CASES", "2400")) // 8)


def test_mutated_incremental_indexes_fail_cleanly_inside_the_series_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An incremental checkpoint's index edited and re-sealed (``test_fuzz``'s mutators, and
    its reference names swapped for hostile ones): every reader raises only CheckpointErrors,
    opens nothing outside the series root, and the CLI keeps its contract."""
    from tests import _hostile as h
    from tests.unit.checkpoint.test_fuzz import mutate_document, mutate_semantics, serialize

    root = tmp_path / "series"
    state = h.mixed_state(rows=32)
    ckpt.save(state, root / "step-1", incremental=True)
    state["model"]["weight"].add_(1.0)
    ckpt.save(state, root / "step-2", base=root / "step-1")
    pristine = _document(root / "step-2")
    assert any(row and row[0].startswith("../") for row in pristine["files"])
    del pristine["index_checksum"]
    hostile = [
        "../../outside/data/rank-00000.0123456789abcdef.safetensors",
        "../step-1/data/../../outside/rank-00000.0123456789abcdef.safetensors",
        "../step-2/data/rank-00000.0123456789abcdef.safetensors",
        "../step-9/data/rank-00000.0123456789abcdef.safetensors",
        "../outside-link/data/rank-00000.0123456789abcdef.safetensors",
    ]
    (tmp_path / "outside" / "data").mkdir(parents=True)
    (root / "outside-link").symlink_to(tmp_path / "outside")
    # A referenced file is opened one component at a time, each relative to the descriptor of
    # the directory before it, from the series root (openat): the audit hook sees the bare
    # components, which resolve where they are opened when the root is the working directory.
    monkeypatch.chdir(root)
    rng = random.Random(20261126)
    for _ in range(FUZZ_CASES):
        choice = rng.random()
        if choice < 0.2:
            document = json.loads(json.dumps(pristine))
            row = rng.choice([r for r in document["files"] if r])
            row[0] = rng.choice(hostile)
        elif choice < 0.6:
            document, _ = mutate_semantics(rng, pristine)
        else:
            document, _ = mutate_document(rng, pristine)
        (root / "step-2" / "shardwise.json").write_bytes(serialize(rng, document)[0])
        target = h.blank_like(state)
        with h.confined_opens(root), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module="shardwise")
            h.failure(lambda: ckpt.read_metadata(root / "step-2"))
            h.failure(lambda target=target: ckpt.load(target, root / "step-2"))
            h.failure(lambda: ckpt.load_tensor(root / "step-2", "model.weight"))
            for command in ("inspect", "verify"):
                h.check_cli(h.run_cli(command, str(root / "step-2")))
