"""Tests for :class:`shardwise.RemoteDevice`, the upstream ``_remote_device`` placement grammar.

The accepted forms, the accessors, the string form and every error (type and text) are part of
the API contract (reference §2 and error table rows 1-3).
"""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch

from shardwise import RemoteDevice


def parse_error(text: str) -> str:
    """The exact ValueError text for an unparsable placement string."""
    return (
        f"Could not parse remote_device: {text}. The valid format is "
        "'<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'"
    )


# (input, worker_name, rank, device, str form)
VALID = [
    pytest.param("rank:0/cuda:0", None, 0, "cuda:0", "rank:0/cuda:0", id="rank-cuda"),
    pytest.param("rank:3/cpu", None, 3, "cpu", "rank:3/cpu", id="rank-cpu"),
    pytest.param("rank:2/cpu:0", None, 2, "cpu:0", "rank:2/cpu:0", id="rank-cpu-index"),
    pytest.param("rank:0", None, 0, "cpu", "rank:0/cpu", id="rank-alone"),
    pytest.param("rank:12", None, 12, "cpu", "rank:12/cpu", id="rank-two-digits"),
    pytest.param("rank:01/cpu", None, 1, "cpu", "rank:1/cpu", id="rank-leading-zero"),
    pytest.param("rank:1/meta", None, 1, "meta", "rank:1/meta", id="rank-meta"),
    pytest.param("worker0/cpu", "worker0", None, "cpu", "worker0/cpu", id="worker-cpu"),
    pytest.param("ps0/cuda:0", "ps0", None, "cuda:0", "ps0/cuda:0", id="worker-cuda"),
    pytest.param("worker0", "worker0", None, "cpu", "worker0/cpu", id="worker-alone"),
    pytest.param("cpu2", "cpu2", None, "cpu", "cpu2/cpu", id="cpu2-is-a-worker"),
    pytest.param("rank0/cpu", "rank0", None, "cpu", "rank0/cpu", id="worker-named-rank0"),
    pytest.param("cpu", None, None, "cpu", "cpu", id="device-cpu"),
    pytest.param("cuda", None, None, "cuda", "cuda", id="device-cuda"),
    pytest.param("cuda:1", None, None, "cuda:1", "cuda:1", id="device-cuda-1"),
    pytest.param("meta", None, None, "meta", "meta", id="device-meta"),
    pytest.param(torch.device("cpu"), None, None, "cpu", "cpu", id="torch-device-cpu"),
    pytest.param(torch.device("cuda", 1), None, None, "cuda:1", "cuda:1", id="torch-device-cuda"),
    pytest.param(torch.device("meta"), None, None, "meta", "meta", id="torch-device-meta"),
]


@pytest.mark.parametrize(("spec", "worker", "rank", "device", "text"), VALID)
def test_valid_forms(
    spec: str | torch.device, worker: str | None, rank: int | None, device: str, text: str
) -> None:
    remote = RemoteDevice(spec)
    assert remote.worker_name() == worker
    assert remote.rank() == rank
    assert type(remote.rank()) is type(rank)
    assert isinstance(remote.device(), torch.device)
    assert remote.device() == torch.device(device)
    assert str(remote) == text
    assert repr(remote) == text


def test_non_ascii_decimal_rank_is_accepted_like_upstream() -> None:
    # str.isdecimal accepts other scripts' decimal digits and int() reads them: rank 3.
    assert RemoteDevice("rank:\u0663/cpu").rank() == 3


@pytest.mark.parametrize(
    "value",
    [0, 1.5, None, b"cpu", ["rank:0/cpu"], RemoteDevice("cpu")],
    ids=["int", "float", "none", "bytes", "list", "remote-device"],
)
def test_rejects_other_types(value: object) -> None:
    with pytest.raises(TypeError) as info:
        RemoteDevice(value)  # type: ignore[arg-type]
    assert str(info.value) == f"Invalid type for remote_device: {type(value)}"


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("a/b/c", id="three-fields"),
        pytest.param("worker0/cpu/", id="trailing-slash-three-fields"),
        pytest.param("/cuda:0", id="empty-worker"),
        pytest.param("/", id="slash-only"),
        pytest.param("", id="empty-string"),
        pytest.param("foo:0/cpu", id="not-rank-prefix"),
        pytest.param("RANK:0/cpu", id="uppercase-rank"),
        pytest.param("rank:foo/cpu", id="rank-not-digits"),
        pytest.param("rank:-1/cpu", id="negative-rank"),
        pytest.param("rank:/cpu", id="empty-rank"),
        pytest.param("rank: 1/cpu", id="space-in-rank"),
        pytest.param("rank:1.0/cpu", id="float-rank"),
        pytest.param("rank:\u00b2/cpu", id="superscript-digit-rank"),
        pytest.param("a:b:c/cpu", id="three-colon-fields"),
        pytest.param("rank:0:1/cpu", id="rank-with-extra-field"),
        pytest.param("cuda:foo", id="bad-cuda-alone-falls-to-worker"),
        pytest.param("random:0", id="unknown-device-alone-falls-to-worker"),
        pytest.param("foo:0", id="colon-worker-alone"),
        pytest.param("rank:foo", id="rank-not-digits-alone"),
        pytest.param("rank:-1", id="negative-rank-alone"),
    ],
)
def test_parse_errors(text: str) -> None:
    with pytest.raises(ValueError) as info:
        RemoteDevice(text)
    assert type(info.value) is ValueError
    assert str(info.value) == parse_error(text)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param("rank:0/cpu2", "Invalid device string: 'cpu2'", id="cpu2"),
        pytest.param("rank:0/cuda:foo", "Invalid device string: 'cuda:foo'", id="cuda-foo"),
        pytest.param("rank:0/foo", "Expected one of cpu, cuda", id="unknown-type"),
        pytest.param("rank:0/random:0", "Expected one of cpu, cuda", id="unknown-type-index"),
        pytest.param("worker0/", "Device string must not be empty", id="empty-device"),
        pytest.param("worker0/cuda:-1", "Invalid device string: 'cuda:-1'", id="negative-index"),
    ],
)
def test_device_errors_propagate_from_torch(text: str, fragment: str) -> None:
    with pytest.raises(RuntimeError, match=re.escape(fragment)):
        RemoteDevice(text)


# Evaluation order (reference §2): split on "/", then the empty-worker check, then the device
# part through torch.device, and only then the worker part.
@pytest.mark.parametrize(
    ("text", "error", "fragment"),
    [
        pytest.param("a/b/cpu2", ValueError, parse_error("a/b/cpu2"), id="split-before-device"),
        pytest.param("/cpu2", ValueError, parse_error("/cpu2"), id="empty-worker-before-device"),
        pytest.param(
            "foo:0/cpu2", RuntimeError, "Invalid device string: 'cpu2'", id="device-before-worker"
        ),
        pytest.param(
            "a:b:c/foo", RuntimeError, "Expected one of cpu, cuda", id="device-before-3-fields"
        ),
        pytest.param(
            "rank:-1/", RuntimeError, "Device string must not be empty", id="device-before-rank"
        ),
        pytest.param("cuda:foo", ValueError, parse_error("cuda:foo"), id="bare-field-is-worker"),
    ],
)
def test_evaluation_order(text: str, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=re.escape(fragment)) as info:
        RemoteDevice(text)
    assert type(info.value) is error


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ("rank:0/cpu", "rank:00/cpu"),
        ("rank:0", "rank:0/cpu"),
        ("worker0", "worker0/cpu"),
        ("cpu", torch.device("cpu")),
        ("cuda:1", torch.device("cuda", 1)),
        ("ps0/cuda:0", "ps0/cuda:0"),
    ],
)
def test_equal_placements_hash_equal(left: str | torch.device, right: str | torch.device) -> None:
    a, b = RemoteDevice(left), RemoteDevice(right)
    assert a == b
    assert not a != b  # noqa: SIM202 - exercises __ne__ as well
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert {a: "x"}[b] == "x"


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ("rank:0/cpu", "rank:1/cpu"),
        ("rank:0/cpu", "cpu"),
        ("rank:0/cpu", "rank:0/cpu:0"),
        ("rank:0/cpu", "rank0/cpu"),
        ("worker0/cpu", "worker1/cpu"),
        ("worker0/cpu", "worker0/cuda:0"),
        ("worker0/cpu", "cpu"),
        ("cpu", "cpu:0"),
        ("cuda:0", "cuda:1"),
    ],
)
def test_different_placements_are_not_equal(left: str, right: str) -> None:
    assert RemoteDevice(left) != RemoteDevice(right)
    assert not RemoteDevice(left) == RemoteDevice(right)  # noqa: SIM201 - exercises __eq__


def test_not_equal_to_its_own_string_form() -> None:
    remote = RemoteDevice("rank:0/cpu")
    assert str(remote) == "rank:0/cpu"
    assert (remote == "rank:0/cpu") is False
    assert (remote != "rank:0/cpu") is True


@pytest.mark.parametrize(
    "other", [torch.device("cpu"), None, 0], ids=["torch-device", "none", "int"]
)
def test_never_equal_to_other_types(other: object) -> None:
    remote = RemoteDevice("cpu")
    assert (remote == other) is False
    assert (remote != other) is True


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize(
    "spec", ["rank:0/cuda:0", "rank:5", "worker0/cpu", "cpu2", "cuda:1", torch.device("meta")]
)
def test_pickle_round_trip(spec: str | torch.device, protocol: int) -> None:
    remote = RemoteDevice(spec)
    loaded = pickle.loads(pickle.dumps(remote, protocol=protocol))
    assert loaded == remote
    assert hash(loaded) == hash(remote)
    assert (loaded.worker_name(), loaded.rank(), loaded.device()) == (
        remote.worker_name(),
        remote.rank(),
        remote.device(),
    )
    assert str(loaded) == str(remote)


def test_copy_and_deepcopy() -> None:
    remote = RemoteDevice("rank:2/cuda:2")
    assert copy.copy(remote) == remote
    assert copy.deepcopy(remote) == remote
    assert copy.deepcopy(remote) is not remote


def test_device_attribute_can_be_reassigned() -> None:
    # ShardedTensor.cpu/cuda/to move placements by assigning ``_device`` (reference §2).
    remote = RemoteDevice("rank:1/cuda:1")
    remote._device = torch.device("cpu")
    assert remote.device() == torch.device("cpu")
    assert str(remote) == "rank:1/cpu"
    assert remote == RemoteDevice("rank:1/cpu")
    assert hash(remote) == hash(RemoteDevice("rank:1/cpu"))
