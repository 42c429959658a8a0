"""Retention reads an incremental checkpoint's references through the one validated index
reader: an index in any encoding a reader accepts (indented, other separators, ``\\/`` and
``\\u`` escapes in names) keeps what it reads, an index that does not decode keeps every name it
holds, and a real ``kill -9`` at any removal of those deletions leaves every kept checkpoint
loadable (``docs/manager.md``, *Retention by reference*)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.index import decode_index
from shardwise.checkpoint.manager import deletion, list_series
from shardwise.checkpoint.manager.series import references_of
from shardwise.checkpoint.storage import LocalStorage
from shardwise.cli import main

NUM_STEPS = 4
_SEAL_KEY = '"index_checksum":"'


def _state(step: int) -> dict[str, Any]:
    """A state whose saves reference earlier ones: ``base`` never changes (step 1's bytes),
    ``slow`` changes at odd steps (step 4 reads step 3's), ``adapter`` at every step."""
    return {
        "base": torch.full((64, 32), 1.0),
        "slow": torch.full((16, 32), float((step + 1) // 2)),
        "adapter": torch.full((4, 32), float(step)),
        "step": step,
    }


def _blank() -> dict[str, Any]:
    return {key: torch.zeros_like(value) for key, value in _state(0).items() if key != "step"} | {
        "step": -1
    }


def _loads_as(path: Path, step: int) -> None:
    state, expected = _blank(), _state(step)
    ckpt.load(state, path)
    for key, value in expected.items():
        assert torch.equal(state[key], value) if key != "step" else state[key] == value, key


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _dirs(root: Path) -> list[str]:
    return sorted(entry.name for entry in root.iterdir() if entry.name.startswith("step-"))


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An incremental series of NUM_STEPS steps, all kept."""
    root = tmp_path_factory.mktemp("template") / "run"
    retention = ckpt.RetentionPolicy(keep_last=None)
    with ckpt.CheckpointManager(
        root, retention=retention, incremental=True, async_save=False
    ) as manager:
        for step in range(1, NUM_STEPS + 1):
            manager.save(step, _state(step))
    return root


@contextlib.contextmanager
def _copied(template: Path) -> Iterator[Path]:
    """A copy of the series ``template``, removed afterwards."""
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory) / "run"
        shutil.copytree(template, root)
        yield root


def _referenced(root: Path, step: int) -> set[Path]:
    document = json.loads((_step_dir(root, step) / "shardwise.json").read_bytes())
    names = [row[0] for row in document["files"] if row is not None]
    return {(_step_dir(root, step) / name).resolve() for name in names if name.startswith("../")}


# -- re-encodings a reader accepts ----------------------------------------------------------


def _escape(name: str, chosen: set[str], slash: bool) -> str:
    """``name`` as the body of a JSON string, with the characters of ``chosen`` as ``\\u``
    escapes and, with ``slash``, each ``/`` as ``\\/``."""
    out = []
    for char in name:
        if char in chosen:
            out.append(f"\\u{ord(char):04x}")
        elif char == "/" and slash:
            out.append("\\/")
        else:
            out.append(json.dumps(char)[1:-1])
    return "".join(out)


def reencoded(
    data: bytes,
    *,
    indent: int | str | None,
    separators: tuple[str, str],
    escaped: set[str],
    slash: bool,
    shuffle: random.Random | None = None,
) -> bytes:
    """The sealed index ``data`` as another JSON text of the same document, sealed again:
    ``indent`` and ``separators`` as ``json.dumps`` takes them, the characters ``escaped`` of
    every reference name written as ``\\u`` escapes, ``slash`` writing ``/`` in them as ``\\/``,
    and ``shuffle`` reordering the keys of every object (which a reader refuses)."""
    document = json.loads(data)
    del document["index_checksum"]

    def reorder(value: Any) -> Any:
        if isinstance(value, dict):
            items = [(key, reorder(item)) for key, item in value.items()]
            assert shuffle is not None
            shuffle.shuffle(items)
            return dict(items)
        if isinstance(value, list):
            return [reorder(item) for item in value]
        return value

    if shuffle is not None:
        document = reorder(document)
    text = json.dumps(document, indent=indent, separators=separators)
    text = re.sub(r'"(\.\./[^"]*)"', lambda found: f'"{_escape(found[1], escaped, slash)}"', text)
    prefix = text.rstrip()[:-1].rstrip() + ","  # the object, open: the seal closes it
    digest = xxhash.xxh3_64_hexdigest(prefix.encode())
    return f'{prefix}{_SEAL_KEY}{digest}"}}'.encode()


def test_the_issues_example_an_indented_index_keeps_its_files(template: Path) -> None:
    with _copied(template) as root:
        index = _step_dir(root, 4) / "shardwise.json"
        index.write_bytes(
            reencoded(
                index.read_bytes(), indent=1, separators=(", ", ": "), escaped=set(), slash=False
            )
        )
        _loads_as(_step_dir(root, 4), 4)  # a reader accepts it
        retention = ckpt.RetentionPolicy(keep_last=2)
        with ckpt.CheckpointManager(
            root, retention=retention, incremental=True, async_save=False
        ) as manager:
            manager.save(5, _state(5))
        _loads_as(_step_dir(root, 4), 4)
        _loads_as(_step_dir(root, 5), 5)
        assert not (_step_dir(root, 2)).exists()  # nothing kept reads step 2
        assert not (_step_dir(root, 1) / "shardwise.json").exists()  # retired: base bytes kept


_ENCODINGS = st.fixed_dictionaries(
    {
        "indent": st.sampled_from([None, 0, 1, 2, "\t"]),
        "separators": st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : "), (",\n", ":\t")]),
        "escaped": st.sets(st.sampled_from("./-steprankdafy0123456789")),
        "slash": st.booleans(),
    }
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    encodings=st.dictionaries(st.integers(1, NUM_STEPS), _ENCODINGS),
    shuffled=st.sets(st.integers(1, NUM_STEPS)),
    deleting=st.sets(st.integers(1, NUM_STEPS - 1)),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_reencoding_keeps_what_the_kept_checkpoints_read(
    template: Path,
    encodings: dict[int, dict[str, Any]],
    shuffled: set[int],
    deleting: set[int],
    seed: int,
) -> None:
    with _copied(template) as root:
        readable = set(range(1, NUM_STEPS + 1)) - shuffled
        expected_files = {step: _referenced(root, step) for step in range(1, NUM_STEPS + 1)}
        for step in set(encodings) | shuffled:
            index = _step_dir(root, step) / "shardwise.json"
            options = encodings.get(step) or {
                "indent": None,
                "separators": (",", ":"),
                "escaped": set(),
                "slash": False,
            }
            shuffle = random.Random(seed + step) if step in shuffled else None
            index.write_bytes(reencoded(index.read_bytes(), **options, shuffle=shuffle))
        for step in readable:  # a reader takes every re-encoding that keeps the key order
            decode_index((_step_dir(root, step) / "shardwise.json").read_bytes())
        storage = LocalStorage(str(root))
        listing = list_series(storage)
        protected = deletion.protected_files(storage, listing, deleting)

        def open_step(step: int, root: Path = root) -> LocalStorage:
            return LocalStorage(str(_step_dir(root, step)))

        for step in sorted(deleting):
            assert deletion.delete_checkpoint(storage, step, open_step, protected)
        for step in set(range(1, NUM_STEPS + 1)) - deleting:
            for file in expected_files[step]:
                assert file.is_file(), (step, file)  # what it references, whatever its encoding
            if step in readable:
                _loads_as(_step_dir(root, step), step)
        for step in deleting:
            assert not (_step_dir(root, step) / "shardwise.json").exists()
            kept = {
                file for other in set(expected_files) - deleting for file in expected_files[other]
            }
            data = _step_dir(root, step) / "data"
            left = set(data.iterdir()) if data.exists() else set()
            assert {path.resolve() for path in left} <= kept  # only what others read stays


def test_a_protected_file_is_kept_whatever_the_case_of_its_reference(template: Path) -> None:
    with _copied(template) as root:
        storage = LocalStorage(str(root))
        (kept,) = (_step_dir(root, 1) / "data").iterdir()
        upper = {("STEP-00000001", f"data/{kept.name}")}  # read there on a case-blind system
        deletion.delete_checkpoint(
            storage, 1, lambda s: LocalStorage(str(_step_dir(root, s))), frozenset(upper)
        )
        assert [path.name for path in (_step_dir(root, 1) / "data").iterdir()] == [kept.name]
        assert not (_step_dir(root, 1) / "shardwise.json").exists()


# -- indexes that do not decode --------------------------------------------------------------


def test_an_index_of_an_unknown_version_keeps_every_name_it_holds_and_says_so(
    template: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with _copied(template) as root:
        index = _step_dir(root, 4) / "shardwise.json"
        referenced = _referenced(root, 4)
        document = json.loads(index.read_bytes())
        document["format_version"] = 99  # a later shardwise's: this one does not read it
        index.write_bytes(
            reencoded(
                json.dumps(document).encode(),
                indent=2,
                separators=(",", ": "),
                escaped=set("step"),
                slash=True,
            )
        )
        storage = LocalStorage(str(root))
        with caplog.at_level(logging.WARNING, "shardwise.checkpoint.manager"):
            found = references_of(storage, 4)
        assert found.undecoded is not None and "version 99" in found.undecoded
        assert {
            (_step_dir(root, 4) / f"../{owner}/{file}").resolve() for owner, file in found.files
        } == referenced
        assert any("step-00000004" in record.getMessage() for record in caplog.records)
        retention = ckpt.RetentionPolicy(keep_last=1, keep_every=4)  # keeps 4, drops 1 to 3
        with ckpt.CheckpointManager(root, retention=retention, async_save=False) as manager:
            manager.save(5, _state(5))
        for file in referenced:
            assert file.is_file()
        assert main(["ls", str(root), "--json"]) == 0


def test_ls_counts_shared_bytes_of_an_index_it_cannot_decode_as_unknown(
    template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with _copied(template) as root:
        index = _step_dir(root, 3) / "shardwise.json"
        data = index.read_bytes()
        index.write_bytes(data.replace(b'"format_version":5', b'"format_version":6'))  # seal broken
        assert main(["ls", str(root), "--json"]) == 0
        rows = {row["step"]: row for row in json.loads(capsys.readouterr().out)["checkpoints"]}
        assert rows[3]["shared_bytes"] is None and rows[4]["shared_bytes"] > 0
        assert main(["ls", str(root)]) == 0
        line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("3 "))
        assert re.search(r"\s\?\s", line), line


# -- kill -9 in the deletions ---------------------------------------------------------------


def _delete_in_child(root: Path, deleting: list[int], kill_at: int) -> int:
    """Run retention's deletions of ``deleting`` in a forked child that SIGKILLs itself at
    its ``kill_at``-th removal; returns its wait status (0: it finished first)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            removals = 0
            removing = LocalStorage.remove
            removing_dir = LocalStorage.remove_directory

            def count() -> None:
                nonlocal removals
                removals += 1
                if removals == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            def remove(self: LocalStorage, path: str) -> None:
                count()
                removing(self, path)

            def remove_directory(self: LocalStorage, path: str) -> None:
                count()
                removing_dir(self, path)

            LocalStorage.remove = remove  # type: ignore[method-assign]
            LocalStorage.remove_directory = remove_directory  # type: ignore[method-assign]
            storage = LocalStorage(str(root))
            listing = list_series(storage)
            protected = deletion.protected_files(storage, listing, deleting)
            for step in deleting:
                deletion.delete_checkpoint(
                    storage, step, lambda s: LocalStorage(str(_step_dir(root, s))), protected
                )
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def test_kill_9_at_any_removal_of_deletions_with_reencoded_indexes(template: Path) -> None:
    kill_at = 1
    while True:
        with _copied(template) as root:
            for step, options in ((4, {"indent": 1}), (3, {"escaped": set("sp"), "slash": True})):
                index = _step_dir(root, step) / "shardwise.json"
                settings_ = {
                    "indent": None,
                    "separators": (",", ":"),
                    "escaped": set(),
                    "slash": False,
                }
                index.write_bytes(reencoded(index.read_bytes(), **(settings_ | options)))
            status = _delete_in_child(root, [1, 2], kill_at)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            assert killed or status == 0
            for step in (3, 4):
                _loads_as(_step_dir(root, step), step)
            # The next run finishes what the kill left; 3 and 4 still load.
            retention = ckpt.RetentionPolicy(keep_last=2)
            with ckpt.CheckpointManager(
                root, retention=retention, incremental=True, async_save=False
            ) as manager:
                assert manager.steps()[-2:] == [3, 4]
                manager.save(5, _state(5))
            for step in (4, 5):
                _loads_as(_step_dir(root, step), step)
        if not killed:
            break
        kill_at += 1
    assert kill_at > 4  # every removal of the two deletions was a kill point
