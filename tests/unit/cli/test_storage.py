"""Every command on object storage: ``--storage-options``, ``s3://`` checkpoints on a local
S3-compatible server (moto), and storage failures (no credentials, an endpoint nobody listens
on, a bad option) as one line on stderr with exit code 4, never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import aiohttp
import botocore.exceptions
import pytest
import s3fs  # type: ignore[import-untyped]
import torch

import shardwise.checkpoint as ckpt
from shardwise.cli import _app, main
from tests._s3 import S3Bucket, s3_bucket, s3_server  # noqa: F401 (fixtures)
from tests.unit.cli._helpers import _run

# fsspec options that make a dead endpoint fail at once: one attempt, a 1 s connect timeout.
_FAST = {"config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}


def _dead_endpoint() -> str:
    """An http URL of a port on 127.0.0.1 that nothing listens on (bound, never listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _argv(command: str, url: str, local: Path) -> list[str]:
    """``command`` with its storage argument(s) at ``url``, local ones under ``local``."""
    return {
        "inspect": ["inspect", url],
        "verify": ["verify", url],
        "diff": ["diff", url, url],
        "consolidate": ["consolidate", url, str(local / "out")],
        "consolidate-out": ["consolidate", str(local / "ckpt"), url],
        "convert-dcp": ["convert-dcp", str(local / "dcp"), url],
    }[command]


def _dcp_save(state_dict: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # DCP warns that it assumes a single process; that is the point here.
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state_dict, checkpoint_id=str(path), no_dist=True)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local checkpoint (``ckpt``) and DCP checkpoint (``dcp``), for the commands that
    write to storage."""
    path = tmp_path_factory.mktemp("local")
    ckpt.save({"w": torch.arange(6.0)}, path / "ckpt")
    _dcp_save({"w": torch.arange(6.0), "step": 3}, path / "dcp")
    return path


COMMANDS = ["inspect", "verify", "diff", "consolidate", "consolidate-out", "convert-dcp"]


# -- failures of the storage: one line, exit 4 -------------------------------------------------


def _run_isolated(
    argv: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m shardwise argv`` with no AWS settings from this machine."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    clean.update(
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
        AWS_CONFIG_FILE="/nonexistent",
        # No credentials also means no asking the cloud's metadata service for some.
        AWS_EC2_METADATA_DISABLED="true",
        **(env or {}),
    )
    return subprocess.run(
        [sys.executable, "-m", "shardwise", *argv],
        capture_output=True,
        text=True,
        env=clean,
        timeout=120,
    )


def _run_clean(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    in_process: bool,
) -> tuple[int, str, str]:
    """``shardwise argv`` with no AWS settings from this machine: as ``python -m shardwise``
    (``in_process=False``: what a user's shell runs, start-up included) or through
    ``cli.main`` in this process under the same environment (the same code from the
    argument parser on, without the second of start-up a process costs)."""
    if not in_process:
        result = _run_isolated(argv)
        return result.returncode, result.stdout, result.stderr
    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return _run(capsys, *argv)


# One command of each test runs as its own process (start-up, logging and exit as a shell
# sees them); the others run the same code in this process, a second faster each.
@pytest.mark.parametrize(
    ("command", "in_process"), [(command, command != "inspect") for command in COMMANDS]
)
def test_an_unreachable_endpoint_is_one_line(
    command: str,
    in_process: bool,
    local: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    options = {"endpoint_url": _dead_endpoint(), "key": "a", "secret": "b", **_FAST}
    argv = [*_argv(command, "s3://bucket/x", local), "--storage-options", json.dumps(options)]
    code, out, err = _run_clean(capsys, monkeypatch, argv, in_process)
    name = command.split("-out")[0]
    assert (code, out) == (4, ""), err
    assert err.count("\n") == 1, err
    assert err.startswith(f"shardwise {name}: error: ")
    assert "Could not connect to the endpoint URL" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("command", "in_process"), [("inspect", False), ("consolidate-out", True)])
def test_no_credentials_is_one_line(
    command: str,
    in_process: bool,
    local: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    options = {"endpoint_url": _dead_endpoint(), **_FAST}
    argv = [*_argv(command, "s3://bucket/x", local), "--storage-options", json.dumps(options)]
    code, out, err = _run_clean(capsys, monkeypatch, argv, in_process)
    assert (code, out) == (4, ""), err
    assert err.count("\n") == 1, err
    assert err.startswith(f"shardwise {command.split('-out')[0]}: error: ")
    assert "Unable to locate credentials" in err
    assert not (local / "s3:").exists()


def test_an_option_the_storage_library_refuses_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # s3fs hands unknown options on to aiobotocore, which raises a TypeError.
    options = json.dumps({"endpoint_url": _dead_endpoint(), "no_such_option": 1})
    code, out, err = _run(capsys, "inspect", "s3://bucket/x", "--storage-options", options)
    assert (code, out) == (4, "")
    assert err.startswith("shardwise inspect: error: ")
    assert "no_such_option" in err and "TypeError" in err
    assert err.count("\n") == 1


def test_a_protocol_without_a_backend_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = _run(capsys, "inspect", "nosuchprotocol://bucket/x")
    assert (code, out) == (4, "")
    assert err == (
        "shardwise inspect: error: cannot open nosuchprotocol://bucket/x: Protocol not known: "
        "nosuchprotocol\n"
    )
    ckpt.save({"w": torch.zeros(2)}, tmp_path / "ckpt")
    code, _, err = _run(capsys, "consolidate", tmp_path / "ckpt", "nosuchprotocol://out")
    assert code == 4 and err.count("\n") == 1
    assert not (tmp_path / "nosuchprotocol:").exists()


def test_errors_of_storage_libraries_are_one_line_and_bugs_keep_their_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardwise.cli import inspect

    def no_credentials(args: object) -> int:
        raise botocore.exceptions.NoCredentialsError()

    monkeypatch.setattr(inspect, "run", no_credentials)
    assert _run(capsys, "inspect", "s3://b/x") == (
        4,
        "",
        "shardwise inspect: error: Unable to locate credentials (NoCredentialsError)\n",
    )

    def bug(args: object) -> int:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(inspect, "run", bug)
    with pytest.raises(ZeroDivisionError, match="a bug"):
        main(["inspect", "s3://b/x"])


def test_storage_library_detection() -> None:
    assert _app._from_storage_library(aiohttp.ClientError("x"))  # by its type's package
    assert not _app._from_storage_library(ValueError("ours"))
    with pytest.raises(TypeError) as raised:  # a built-in error, raised inside s3fs
        s3fs.S3FileSystem(no_such_option=1, skip_instance_cache=True).connect()
    assert _app._from_storage_library(raised.value)
    with pytest.raises(KeyError) as ours:  # a built-in error raised here: a bug
        {}["missing"]
    assert not _app._from_storage_library(ours.value)


# -- --storage-options -----------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "invalid JSON '{not json': "),
        ("[" * 100_000 + "]" * 100_000, "invalid JSON '[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["),
        ("[1, 2]", "'[1, 2]' is a JSON list, not an object"),
        ("null", "'null' is a JSON NoneType, not an object"),
        # read as strictly as every other JSON document (shardwise._json.strict_json)
        (
            '{"anon": true, "anon": false}',
            """invalid JSON '{"anon": true, "anon": false}': --storage-options repeats the key""",
        ),
        (
            '{"timeout": NaN}',
            """invalid JSON '{"timeout": NaN}': --storage-options contains NaN, which is not""",
        ),
    ],
)
def test_storage_options_must_be_a_json_object(
    capsys: pytest.CaptureFixture[str], local: Path, command: str, text: str, why: str
) -> None:
    argv = [*_argv(command, "memory://x", local), "--storage-options", text]
    code, out, err = _run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith("usage: shardwise ")
    assert f"error: argument --storage-options: {why}" in err


def test_every_command_works_on_s3_with_storage_options(
    s3: S3Bucket, local: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = json.dumps(s3.options)
    state = {"w": torch.arange(6.0), "step": 3}
    ckpt.save(state, s3.url("a"), storage_options=s3.options)
    ckpt.save(state, s3.url("b"), storage_options=s3.options)

    code, out, err = _run(capsys, "inspect", s3.url("a"), "--json", "--storage-options", options)
    assert (code, err) == (0, "")
    assert json.loads(out)["num_tensors"] == 1
    code, out, _ = _run(capsys, "verify", s3.url("a"), "--storage-options", options)
    assert (code, out) == (0, f"{s3.url('a')}: OK, 2 entries, 1 chunks and blobs, 24 B checked\n")
    code, out, _ = _run(capsys, "diff", s3.url("a"), s3.url("b"), "--storage-options", options)
    assert (code, out) == (0, "no differences (2 keys)\n")
    code, _, _ = _run(capsys, "consolidate", s3.url("a"), tmp_path / "hf",
                      "--storage-options", options)  # fmt: skip
    assert code == 0 and (tmp_path / "hf" / "model.safetensors").exists()
    code, _, err = _run(capsys, "convert-dcp", local / "dcp", s3.url("converted"),
                        "--storage-options", options)  # fmt: skip
    assert (code, err) == (0, "")
    target = {"w": torch.zeros(6), "step": 0}
    ckpt.load(target, s3.url("converted"), storage_options=s3.options)
    assert torch.equal(target["w"], torch.arange(6.0)) and target["step"] == 3

    # Without the options the same URLs are another endpoint's: they fail, in one line.
    fs = s3fs.S3FileSystem(**s3.options)
    assert fs.exists(f"{s3.name}/a/shardwise.json")
    dead = json.dumps({"endpoint_url": _dead_endpoint(), "key": "a", "secret": "b", **_FAST})
    code, out, err = _run(capsys, "inspect", s3.url("a"), "--storage-options", dead)
    assert (code, out) == (4, "") and err.count("\n") == 1
