"""The tier's directory on one node: names, the job marker, parts, pruning, free space, and
hostile directories (links out, another job's marker, garbage names)."""

from __future__ import annotations

import json
import os
import pathlib
import stat

import pytest

from shardwise.checkpoint.index import data_file_name
from shardwise.checkpoint.local_tier import PartRecord, TierDirectory
from shardwise.checkpoint.local_tier.directory import (
    JOB_FILE,
    PART_FILE,
    SPARE_DIR,
    parse_rank_name,
    parse_step_name,
    rank_name,
    step_name,
)
from shardwise.errors import CheckpointStorageError

SAVE = "0123456789abcdef"


def _tree(path: pathlib.Path) -> dict[str, bytes | None]:
    """Every entry below ``path``: a file's bytes, None for a directory or link (its target)."""
    found: dict[str, bytes | None] = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = pathlib.Path(root, name)
            key = str(full.relative_to(path))
            if full.is_symlink():
                found[key] = os.readlink(full).encode()
            else:
                found[key] = full.read_bytes() if full.is_file() else None
    return found


@pytest.fixture
def tier(tmp_path: pathlib.Path) -> TierDirectory:
    directory = TierDirectory(str(tmp_path / "shm" / "tier"), "job-1")
    assert directory.claim() is None
    return directory


@pytest.fixture
def outside(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory outside the tier that looks like a step, to be left alone."""
    path = tmp_path / "precious"
    (path / "rank_0").mkdir(parents=True)
    (path / "rank_0" / "weights").write_bytes(b"keep me")
    return path


def _save(tier: TierDirectory, step: int, rank: int, world_size: int = 4) -> None:
    path = pathlib.Path(tier.make_part(step, rank))
    (path / "data").mkdir()
    (path / "data" / "part.bin").write_bytes(b"x" * 10)
    tier.commit_part(PartRecord(step=step, rank=rank, world_size=world_size, save_id=SAVE))


# -- names -----------------------------------------------------------------------------------


def test_names_round_trip() -> None:
    for step in (0, 7, 10**19 - 1):
        assert parse_step_name(step_name(step)) == step
    assert step_name(1300) == "step_1300"
    assert rank_name(3) == "rank_3"
    assert parse_rank_name("rank_12") == 12


@pytest.mark.parametrize(
    "name",
    [
        "step_007",
        "step_",
        "step_-1",
        "step_1.old",
        "step_1\n",
        "Step_1",
        "step_\uff11",
        "step_1 ",
        "step_" + "9" * 20,
        "step_10000000000000000000",
        "rank_1",
        "step_0x1",
    ],
)
def test_garbage_step_names(name: str) -> None:
    assert parse_step_name(name) is None


@pytest.mark.parametrize("name", ["rank_01", "rank_", "rank_16777216", "rank_\u0663", "step_1"])
def test_garbage_rank_names(name: str) -> None:
    assert parse_rank_name(name) is None


@pytest.mark.parametrize("value", [-1, True, 1.0, 10**19])
def test_bad_steps_have_no_name(value: object) -> None:
    with pytest.raises(ValueError, match="step"):
        step_name(value)  # type: ignore[arg-type]


# -- the job marker --------------------------------------------------------------------------


def test_claim_makes_and_marks(tier: TierDirectory) -> None:
    path = pathlib.Path(tier.path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    marker = json.loads((path / JOB_FILE).read_bytes())
    assert marker == {"format": "shardwise-local-tier", "version": 1, "job": "job-1"}
    assert tier.claim() is None
    assert _tree(path) == {JOB_FILE: (path / JOB_FILE).read_bytes()}


def test_another_jobs_directory_is_ignored(tier: TierDirectory) -> None:
    _save(tier, 5, 0)
    before = _tree(pathlib.Path(tier.path))
    other = TierDirectory(tier.path, "job-2")
    reason = other.claim()
    assert reason is not None and "another job ('job-1'" in reason
    for use in (other.list_parts, lambda: other.prune(1), lambda: other.make_part(6, 0)):
        with pytest.raises(CheckpointStorageError, match="another job's"):
            use()
    assert _tree(pathlib.Path(tier.path)) == before


def test_a_directory_with_entries_but_no_marker_is_not_taken(tmp_path: pathlib.Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "step_3").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    tier = TierDirectory(str(tmp_path / "home"), "job-1")
    assert "no local tier directory" in (tier.claim() or "")
    with pytest.raises(CheckpointStorageError, match="no marker"):
        tier.prune(1)
    assert _tree(tmp_path) == before


def test_only_temporary_records_count_as_empty(tmp_path: pathlib.Path) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / ".job.json.00112233aabbccdd.tmp").write_text("{")
    assert TierDirectory(str(tmp_path / "t"), "j").claim() is None


def test_a_link_is_refused(tmp_path: pathlib.Path, outside: pathlib.Path) -> None:
    (tmp_path / "link").symlink_to(outside)
    before = _tree(outside)
    tier = TierDirectory(str(tmp_path / "link"), "job-1")
    assert "symbolic link" in (tier.claim() or "")
    with pytest.raises(CheckpointStorageError):
        tier.list_parts()
    assert _tree(outside) == before


def test_a_file_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "file").write_text("x")
    assert "not a directory" in (TierDirectory(str(tmp_path / "file"), "j").claim() or "")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b"[]",
        b'{"format": "shardwise-local-tier", "version": 2, "job": "job-1"}',
        b'{"format": "other", "version": 1, "job": "job-1"}',
        b"\xff" * 10,
        b" " * 5000,
    ],
)
def test_a_marker_that_does_not_read(tmp_path: pathlib.Path, content: bytes) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / JOB_FILE).write_bytes(content)
    assert TierDirectory(str(tmp_path / "t"), "job-1").claim() is not None


def test_a_marker_that_is_a_link_is_refused(tmp_path: pathlib.Path) -> None:
    good = tmp_path / "good.json"
    good.write_text('{"format": "shardwise-local-tier", "version": 1, "job": "job-1"}')
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / JOB_FILE).symlink_to(good)
    tier = TierDirectory(str(tmp_path / "t"), "job-1")
    assert tier.claim() is not None
    with pytest.raises(CheckpointStorageError):
        tier.prune(1)


def test_another_users_directory(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    assert "another user" in (TierDirectory(str(tmp_path), "j").claim() or "")


# -- parts -----------------------------------------------------------------------------------


def test_parts_are_listed_once_committed(tier: TierDirectory) -> None:
    _save(tier, 10, 0)
    _save(tier, 10, 3)
    _save(tier, 20, 1)
    tier.make_part(20, 2)  # a save that did not finish: no record
    parts = tier.list_parts()
    assert sorted(parts) == [10, 20]
    assert sorted(parts[10]) == [0, 3]
    assert parts[20] == {1: PartRecord(step=20, rank=1, world_size=4, save_id=SAVE)}
    assert tier.part_path(20, 2) == os.path.join(tier.path, "step_20", "rank_2")


def test_a_part_directory_is_made_once(tier: TierDirectory) -> None:
    tier.make_part(1, 0)
    with pytest.raises(FileExistsError):
        tier.make_part(1, 0)


def test_records_that_do_not_belong_are_left_out(tier: TierDirectory) -> None:
    for rank in range(4):
        tier.make_part(7, rank)
    path = pathlib.Path(tier.path, "step_7")
    wrong_rank = PartRecord(step=7, rank=2, world_size=4, save_id=SAVE)
    (path / "rank_0" / PART_FILE).write_bytes(wrong_rank.encode("job-1"))
    (path / "rank_1" / PART_FILE).write_bytes(
        PartRecord(step=7, rank=1, world_size=4, save_id=SAVE).encode("job-2")
    )
    (path / "rank_2" / PART_FILE).write_bytes(b'{"format": "shardwise-local-part"}')
    (path / "rank_3" / PART_FILE).mkdir()
    assert tier.list_parts() == {}


def test_links_and_garbage_are_not_listed(tier: TierDirectory, outside: pathlib.Path) -> None:
    _save(tier, 1, 0)
    root = pathlib.Path(tier.path)
    record = PartRecord(step=9, rank=0, world_size=1, save_id=SAVE)
    (outside / "rank_0" / PART_FILE).write_bytes(record.encode("job-1"))
    (root / "step_9").symlink_to(outside)
    (root / "step_1" / "rank_1").symlink_to(outside / "rank_0")
    (root / "step_2").write_text("a file named like a step")
    for name in ("step_01", "step_3.old", "rubbish", ".hidden"):
        (root / name).mkdir()
    assert tier.list_parts() == {1: {0: PartRecord(step=1, rank=0, world_size=4, save_id=SAVE)}}


def test_writing_through_a_link_is_refused(tier: TierDirectory, outside: pathlib.Path) -> None:
    before = _tree(outside)
    pathlib.Path(tier.path, "step_4").symlink_to(outside)
    with pytest.raises(CheckpointStorageError, match="link or not a directory"):
        tier.make_part(4, 1)
    with pytest.raises(CheckpointStorageError, match="link or not a directory"):
        tier.commit_part(PartRecord(step=4, rank=0, world_size=1, save_id=SAVE))
    assert _tree(outside) == before


@pytest.mark.parametrize(
    "fields",
    [
        {"step": -1},
        {"rank": 4},
        {"world_size": 0},
        {"save_id": "ABCDEF0123456789"},
        {"rank": True},
    ],
)
def test_part_record_validation(fields: dict[str, object]) -> None:
    arguments: dict[str, object] = {"step": 1, "rank": 0, "world_size": 4, "save_id": SAVE}
    with pytest.raises(ValueError):
        PartRecord(**{**arguments, **fields})  # type: ignore[arg-type]


def test_part_record_decode_refuses() -> None:
    good = PartRecord(step=1, rank=0, world_size=2, save_id=SAVE)
    assert PartRecord.decode(good.encode("j"), "j") == good
    body = json.loads(good.encode("j"))
    for bad in ({**body, "extra": 1}, {**body, "version": True}, {**body, "step": "1"}):
        with pytest.raises(ValueError):
            PartRecord.decode(json.dumps(bad).encode(), "j")
    with pytest.raises(ValueError, match="job"):
        PartRecord.decode(good.encode("j"), "k")


# -- pruning ---------------------------------------------------------------------------------


def _steps(tier: TierDirectory) -> list[str]:
    return sorted(name for name in os.listdir(tier.path) if name.startswith("step_"))


def test_prune_keeps_the_newest(tier: TierDirectory) -> None:
    for step in (1, 2, 3, 10, 4):
        _save(tier, step, 0)
    assert tier.prune(2) == [1, 2, 3]
    assert _steps(tier) == ["step_10", "step_4"]
    assert tier.prune(2) == []


def test_prune_before_writing(tier: TierDirectory) -> None:
    for step in (1, 2, 3, 5, 6):
        _save(tier, step, 0)
    # Steps 5 and 6 are of a run that the restore to an older step abandoned.
    assert tier.prune(2, writing=5) == [1, 2, 5, 6]
    assert _steps(tier) == ["step_3"]
    assert tier.prune(1, writing=4) == [3]
    assert _steps(tier) == []


def test_prune_follows_no_link(tier: TierDirectory, outside: pathlib.Path) -> None:
    root = pathlib.Path(tier.path)
    target_file = outside / "rank_0" / "weights"
    before = _tree(outside)
    for step in (1, 2):
        _save(tier, step, 0)
    (root / "step_1" / "rank_0" / "data" / "out").symlink_to(outside)
    (root / "step_1" / "rank_0" / "file_link").symlink_to(target_file)
    (root / "step_0").symlink_to(outside)
    for name in ("step_00", "junk", "step_1.bak"):
        (root / name).mkdir()
    assert tier.prune(1) == [1]
    assert _tree(outside) == before
    assert sorted(os.listdir(root)) == sorted(
        [JOB_FILE, "step_2", "step_0", "step_00", "junk", "step_1.bak"]
    )
    assert (root / "step_0").is_symlink()


def test_prune_refuses_bad_arguments(tier: TierDirectory) -> None:
    with pytest.raises(ValueError, match="keep"):
        tier.prune(0)
    with pytest.raises(ValueError, match="step"):
        tier.prune(1, writing=-3)


# -- spares: the data files of pruned steps, written over by the next save -------------------


def _data_name(rank: int) -> str:
    return os.path.basename(data_file_name(rank, SAVE))


def _save_data(tier: TierDirectory, step: int, rank: int, data: bytes) -> pathlib.Path:
    """A part of ``step`` whose data file (of a data file's name) holds ``data``; its path."""
    _save(tier, step, rank)
    path = pathlib.Path(tier.part_path(step, rank), "data", _data_name(rank))
    path.write_bytes(data)
    return path


def _spares(tier: TierDirectory) -> list[str]:
    return sorted(os.listdir(os.path.join(tier.path, SPARE_DIR)))


def _take(tier: TierDirectory, target: pathlib.Path, rank: int, size: int | None) -> int | None:
    target.parent.mkdir(parents=True, exist_ok=True)
    parent = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return tier.take_spare(parent, target.name, rank=rank, size=size)
    finally:
        os.close(parent)


def test_prune_before_writing_keeps_data_files_as_spares(tier: TierDirectory) -> None:
    _save_data(tier, 1, 0, b"a" * 100)
    _save_data(tier, 1, 3, b"b" * 300)
    _save_data(tier, 2, 0, b"c" * 50)
    assert tier.prune(2, writing=3) == [1]
    # Only data files become spares (part.bin is none): by saved rank.
    assert [name.split(".")[0] for name in _spares(tier)] == ["0", "3"]
    assert tier.spare_bytes() >= 400
    free = tier.check_space(0, min_free_bytes=0)
    assert free.free_bytes >= tier.spare_bytes()
    target = pathlib.Path(tier.part_path(3, 0), "data", _data_name(0))
    fd = _take(tier, target, 0, 10)  # rank 0's first, whatever the size
    assert fd is not None
    try:
        assert os.read(fd, 200) == b"a" * 100  # the old bytes, to be written over
        assert os.fstat(fd).st_ino == target.stat().st_ino
    finally:
        os.close(fd)
    assert target.stat().st_nlink == 1
    other = pathlib.Path(tier.part_path(3, 1), "data", _data_name(1))
    fd = _take(tier, other, 1, 10)  # no spare of rank 1's: another
    assert fd is not None
    os.close(fd)
    assert other.read_bytes() == b"b" * 300
    assert _spares(tier) == []
    assert _take(tier, pathlib.Path(tier.path, "x", "y"), 0, None) is None  # none left


def test_the_step_before_the_one_written_is_never_a_spare(tier: TierDirectory) -> None:
    # keep=1 removes the previous save's step, which a rank of the node may still be sending
    # from a mapping: its files are unlinked, never written over (older ones are spares).
    _save_data(tier, 1, 0, b"a" * 100)
    sending = _save_data(tier, 2, 1, b"b" * 100)
    with sending.open("rb") as mapped:  # as the sender's mapping holds it
        assert tier.prune(1, writing=3) == [1, 2]
        assert [name.split(".")[0] for name in _spares(tier)] == ["0"]
        assert os.fstat(mapped.fileno()).st_nlink == 0
        assert mapped.read() == b"b" * 100
    # Steps from the one written on are of an abandoned run: spares too.
    _save_data(tier, 7, 1, b"c" * 100)
    assert tier.prune(1, writing=5) == [7]
    assert [name.split(".")[0] for name in _spares(tier)] == ["1"]


def test_spares_by_size(tier: TierDirectory) -> None:
    for step, length in ((1, 10), (2, 300), (3, 100)):
        _save_data(tier, step, 3, b"z" * length)
    _save(tier, 4, 0)  # the step before the one written: no spare
    tier.prune(1, writing=5)
    targets = [pathlib.Path(tier.path, "t", name) for name in ("a", "b", "c")]
    sizes = []
    for target, want in zip(targets, (50, 500, None), strict=True):
        fd = _take(tier, target, 0, want)
        assert fd is not None
        sizes.append(os.fstat(fd).st_size)
        os.close(fd)
    # The smallest that holds 50; none holds 500: the largest; then what is left.
    assert sizes == [100, 300, 10]


def test_a_prune_removes_the_spares_left_unused(tier: TierDirectory) -> None:
    _save_data(tier, 1, 0, b"a" * 100)
    _save(tier, 2, 0)
    tier.prune(1, writing=3)
    assert len(_spares(tier)) == 1
    tier.prune(1, writing=4)  # no spare made now: the unused one is freed
    assert _spares(tier) == []
    assert tier.spare_bytes() == 0
    _save_data(tier, 4, 0, b"a" * 100)
    tier.prune(1)  # no save follows: nothing set aside
    assert _spares(tier) == []


def test_a_spare_that_exists_at_the_name_is_an_error(tier: TierDirectory) -> None:
    _save_data(tier, 1, 0, b"a" * 100)
    _save(tier, 2, 0)
    tier.prune(1, writing=3)
    target = pathlib.Path(tier.path, "t", "file")
    target.parent.mkdir()
    target.write_bytes(b"mine")
    with pytest.raises(FileExistsError):
        _take(tier, target, 0, None)
    assert target.read_bytes() == b"mine"


def test_hostile_spares_are_never_written(tier: TierDirectory, outside: pathlib.Path) -> None:
    precious = outside / "rank_0" / "weights"
    before = _tree(outside)
    tier.prune(1, writing=1)  # no spare directory yet: none to take
    assert _take(tier, pathlib.Path(tier.path, "t", "a"), 0, None) is None
    spare = pathlib.Path(tier.path, SPARE_DIR)
    spare.mkdir()
    (spare / f"0.{'1' * 16}").symlink_to(precious)
    os.link(precious, spare / f"0.{'2' * 16}")  # a second name of a file outside
    (spare / f"0.{'3' * 16}").mkdir()
    (spare / "garbage").write_bytes(b"not a spare's name")
    assert tier.spare_bytes() == 0  # nothing there is a spare to give back
    assert _take(tier, pathlib.Path(tier.path, "t", "b"), 0, None) is None
    assert _tree(outside) == before
    assert os.stat(precious).st_nlink == 1  # the tier's second name of it is gone
    assert not pathlib.Path(tier.path, "t", "b").exists()
    tier.prune(1, writing=2)
    assert _spares(tier) == []
    assert _tree(outside) == before


def test_a_link_at_the_spare_directory_means_no_spares(
    tier: TierDirectory, outside: pathlib.Path
) -> None:
    before = _tree(outside)
    pathlib.Path(tier.path, SPARE_DIR).symlink_to(outside / "rank_0")
    _save_data(tier, 1, 0, b"a" * 100)
    _save(tier, 2, 0)
    assert tier.prune(1, writing=3) == [1, 2]  # the save goes on: its files are new
    assert _tree(outside) == before
    assert tier.spare_bytes() == 0
    assert _take(tier, pathlib.Path(tier.path, "t", "a"), 0, None) is None


def test_a_spare_removed_while_taken_is_not_had(
    tier: TierDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A prune by another rank of the node empties spare/ between the claim and the link.
    _save_data(tier, 1, 0, b"a" * 100)
    _save(tier, 2, 0)
    tier.prune(1, writing=3)
    link = os.link

    def vanished(source: str, *args: object, **kwargs: object) -> None:
        os.unlink(source, dir_fd=kwargs["src_dir_fd"])  # type: ignore[arg-type]
        link(source, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "link", vanished)
    target = pathlib.Path(tier.path, "t", "a")
    assert _take(tier, target, 0, None) is None
    assert not target.exists()


def test_a_data_file_with_another_name_is_no_spare(
    tier: TierDirectory, outside: pathlib.Path
) -> None:
    data = _save_data(tier, 1, 0, b"a" * 100)
    os.link(data, outside / "second")  # e.g. a restore directory's link, left by a crash
    link = pathlib.Path(tier.part_path(1, 0), "data", _data_name(1))
    link.symlink_to(outside / "rank_0" / "weights")
    _save(tier, 2, 0)
    tier.prune(1, writing=3)
    assert _spares(tier) == []
    assert (outside / "second").read_bytes() == b"a" * 100
    assert (outside / "rank_0" / "weights").read_bytes() == b"keep me"


# -- free space ------------------------------------------------------------------------------


def test_space_simulated(tier: TierDirectory) -> None:
    assert tier.check_space(100, min_free_bytes=50, free_bytes=150).fits
    full = tier.check_space(101, min_free_bytes=50, free_bytes=150)
    assert not full.fits
    assert "needs 101 bytes" in full.describe(tier.path)
    assert not tier.check_space(1, min_free_bytes=0, free_bytes=0).fits


def test_space_of_the_file_system(tier: TierDirectory) -> None:
    space = tier.check_space(0, min_free_bytes=0)
    assert space.free_bytes > 0 and space.fits


def test_a_marker_made_by_another_rank_meanwhile_is_taken(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two ranks of a node claim at once: one finds no marker, and by the time it lists the
    # directory the other's marker is there. That is this job's directory, not a user's.
    path = str(tmp_path / "tier")
    assert TierDirectory(path, "job-1").claim() is None
    from shardwise.checkpoint.local_tier import directory as module

    read = module._read_small
    calls = []

    def late(fd: int, name: str, *args: object) -> bytes:
        calls.append(name)
        if len(calls) == 1:
            raise FileNotFoundError(name)  # not there yet when first read
        return read(fd, name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "_read_small", late)
    assert TierDirectory(path, "job-1").claim() is None
    assert len(calls) == 2
    assert "another job" in str(TierDirectory(path, "job-2").claim())
