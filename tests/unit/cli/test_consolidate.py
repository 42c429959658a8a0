"""``shardwise consolidate`` on training checkpoints: ``--prefix``, ``--dtype``, ``--config``,
tied tensors, fsspec outputs (``memory://`` and ``s3://``), what a failure leaves behind, the
safetensors layout of the files and binary units in the progress bar."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import struct
from pathlib import Path
from typing import Any

import fsspec  # type: ignore[import-untyped]
import pytest
import s3fs  # type: ignore[import-untyped]
import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import shardwise.checkpoint as ckpt
from shardwise.checkpoint import tuning as tuning_module
from shardwise.checkpoint.huggingface.files import OutTensor, split_files
from shardwise.checkpoint.index import data_file as data_format
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.cli import main
from tests._s3 import S3Bucket, s3_bucket, s3_server  # noqa: F401 (fixtures)
from tests.unit.cli._helpers import _run


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _training_state(model: torch.nn.Module) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 3}


@pytest.fixture(scope="module")
def training(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A training checkpoint ``{"model", "optim", "step"}`` and the model's state dict."""
    path = tmp_path_factory.mktemp("training") / "ckpt"
    model = _model()
    state = _training_state(model)
    ckpt.save(state, path)
    return path, {key: value.detach().clone() for key, value in model.state_dict().items()}


def _contents(path: Path | str, data: bytes | None = None) -> dict[str, torch.Tensor]:
    raw = Path(path).read_bytes() if data is None else data
    return safetensors.torch.load(raw)


# -- --prefix --------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["model.", "model"])
def test_prefix_selects_and_strips(
    training: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    prefix: str,
) -> None:
    path, expected = training
    code, out, err = _run(capsys, "consolidate", path, tmp_path / "hf", "--prefix", prefix)
    assert (code, err) == (0, "")
    assert out == f"wrote 4 tensors (232 B) to 1 file in {tmp_path / 'hf'}\n"
    contents = _contents(tmp_path / "hf" / "model.safetensors")
    assert sorted(contents) == sorted(expected) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for key, value in expected.items():
        assert torch.equal(contents[key], value), key


def test_prefix_names_the_optimizer_keys_without_their_int_markers(
    training: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(capsys, "consolidate", training[0], tmp_path / "hf", "--prefix", "optim")
    assert code == 0
    contents = _contents(tmp_path / "hf" / "model.safetensors")
    assert sorted(contents) == [
        f"state.{i}.{name}" for i in range(4) for name in ("exp_avg", "exp_avg_sq", "step")
    ]
    assert err.startswith("note: 12 non-tensor entries are not written (safetensors holds "
                          "tensors only): 'param_groups.0.amsgrad', ")  # fmt: skip


def test_a_prefix_that_matches_nothing_lists_the_top_level_parts(
    training: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "consolidate", training[0], tmp_path / "hf", "--prefix", "modle.")
    assert (code, out) == (2, "")
    assert err == (
        "shardwise consolidate: error: no key of the checkpoint starts with 'modle.'; its "
        "top-level parts are 'model.', 'optim.', 'step': give one of them to --prefix\n"
    )
    assert not (tmp_path / "hf").exists()


def test_without_prefix_a_training_checkpoint_gets_a_note(
    training: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "consolidate", training[0], tmp_path / "hf")
    assert code == 0
    assert out.startswith("wrote 16 tensors ")  # everything, as before
    assert err.splitlines()[-1] == (
        "note: the tensors come from 2 top-level parts ('model.', 'optim.'), as in a training "
        "checkpoint; all were written. To export one model for from_pretrained, select its "
        "keys with --prefix, e.g. --prefix model."
    )
    # A model's own state dict has several top-level parts too, but no other values: no note.
    ckpt.save(_model().state_dict(), tmp_path / "plain")
    code, _, err = _run(capsys, "consolidate", tmp_path / "plain", tmp_path / "hf2")
    assert (code, err) == (0, "")


def test_keys_that_collide_as_dotted_names_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt.save({"s": {0: torch.ones(2), "0": torch.zeros(2)}}, tmp_path / "ckpt")
    code, out, err = _run(capsys, "consolidate", tmp_path / "ckpt", tmp_path / "hf")
    assert (code, out) == (3, "")
    assert err.startswith(
        "shardwise consolidate: error: two tensors of the checkpoint would both be written as "
        "'s.0' "
    )
    assert not (tmp_path / "hf").exists()


# -- --dtype ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtype_casts_floating_point_tensors_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: str
) -> None:
    g = torch.Generator().manual_seed(1)
    state = {
        "f32": torch.randn(5, 3, generator=g),
        "f64": torch.randn(4, generator=g, dtype=torch.float64),
        "bf16": torch.randn(6, generator=g).to(torch.bfloat16),
        "ids": torch.arange(7),
        "mask": torch.tensor([True, False]),
        "u8": torch.arange(3, dtype=torch.uint8),
    }
    ckpt.save(state, tmp_path / "ckpt")
    code, out, _ = _run(capsys, "consolidate", tmp_path / "ckpt", tmp_path / "hf", "--dtype", dtype)
    assert code == 0
    target = getattr(torch, dtype)
    contents = _contents(tmp_path / "hf" / "model.safetensors")
    for key, value in state.items():
        wanted = value.to(target) if value.dtype.is_floating_point else value
        assert contents[key].dtype == wanted.dtype, key
        assert torch.equal(contents[key], wanted), key
    total = sum(
        v.numel() * (target.itemsize if v.dtype.is_floating_point else v.element_size())
        for v in state.values()
    )
    assert out == f"wrote 6 tensors ({total} B) to 1 file in {tmp_path / 'hf'}\n"


def test_dtype_cast_of_a_tensor_larger_than_a_piece(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:

    small = dataclasses.replace(tuning_module.TUNING, consolidate_piece_bytes=1000)
    monkeypatch.setattr(tuning_module, "TUNING", small)  # cast and written in many pieces
    big = torch.randn(37, 29, generator=torch.Generator().manual_seed(2))
    ckpt.save({"big": big}, tmp_path / "ckpt")
    for dtype in ("float16", "float32"):
        out = tmp_path / dtype
        assert _run(capsys, "consolidate", tmp_path / "ckpt", out, "--dtype", dtype)[0] == 0
        got = _contents(out / "model.safetensors")["big"]
        assert torch.equal(got, big.to(getattr(torch, dtype)))


# -- --config --------------------------------------------------------------------------------


def test_config_is_copied(
    training: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = '{"model_type": "llama",\n "hidden_size": 8}\n'
    (tmp_path / "config.json").write_text(text)
    out_dir = tmp_path / "hf"
    code, out, _ = _run(capsys, "consolidate", training[0], out_dir, "--prefix", "model.",
                        "--config", tmp_path / "config.json")  # fmt: skip
    assert code == 0
    assert out == f"wrote 4 tensors (232 B) to 1 file and config.json in {out_dir}\n"
    assert (out_dir / "config.json").read_text() == text
    assert sorted(os.listdir(out_dir)) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("[1, 2]", "holds a JSON list; a model config is a JSON object"),
        ("{'a': 1}", "is not valid JSON: Expecting property name enclosed in double quotes"),
        ('{"a": 1, "a": 2}', "repeats the key 'a' in one JSON object"),  # read by strict_json
        ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "is nested too deeply"),  # was a traceback
        (None, "cannot read --config"),
    ],
)
def test_a_bad_config_is_refused_before_anything_is_written(
    training: tuple[Path, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str | None,
    why: str,
) -> None:
    config = tmp_path / "config.json"
    if content is not None:
        config.write_text(content)
    code, out, err = _run(capsys, "consolidate", training[0], tmp_path / "hf", "--config", config)
    assert (code, out) == (2, "")
    assert err.startswith("shardwise consolidate: error: ")
    assert why in err
    assert err.count("\n") == 1
    assert not (tmp_path / "hf").exists()


# -- tied tensors ----------------------------------------------------------------------------


def _tied_state() -> tuple[dict[str, Any], torch.Tensor]:
    shared = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    state = {"enc": {"embed": shared, "norm": torch.ones(3)}, "head": {"weight": shared}}
    return state, shared


def test_tied_tensors_are_written_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state, shared = _tied_state()
    ckpt.save(state, tmp_path / "ckpt")
    with CheckpointReader.open(tmp_path / "ckpt") as reader:
        assert getattr(reader.index, "aliases", None) == {"head.weight": "enc.embed"}, (
            "needs the index's aliases (tied tensors saved once) from shardwise.checkpoint"
        )
    code, out, err = _run(capsys, "consolidate", tmp_path / "ckpt", tmp_path / "hf")
    assert code == 0
    assert out == f"wrote 2 tensors (60 B) to 1 file in {tmp_path / 'hf'}\n"
    assert err == (
        "note: 1 tied tensor not written ('head.weight', tied to 'enc.embed'): save_pretrained "
        "leaves it out too, and from_pretrained ties it again\n"
    )
    contents = _contents(tmp_path / "hf" / "model.safetensors")
    assert sorted(contents) == ["enc.embed", "enc.norm"]
    assert torch.equal(contents["enc.embed"], shared)

    # The tensor it is tied to is not selected: the alias is written, with the data.
    code, out, err = _run(capsys, "consolidate", tmp_path / "ckpt", tmp_path / "head",
                          "--prefix", "head.")  # fmt: skip
    assert (code, err) == (0, "")
    contents = _contents(tmp_path / "head" / "model.safetensors")
    assert list(contents) == ["weight"]
    assert torch.equal(contents["weight"], shared)


# -- where the files go ----------------------------------------------------------------------


def _memory_files(root: str) -> dict[str, bytes]:
    fs = fsspec.filesystem("memory")
    if not fs.exists(root):
        return {}
    return {path.rsplit("/", 1)[-1]: fs.cat_file(path) for path in fs.find(root)}


def test_output_to_an_fsspec_url_never_makes_a_local_directory(
    training: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text('{"a": 1}')
    url = "memory://consolidated/split"
    code, out, _ = _run(capsys, "consolidate", training[0], url, "--prefix", "model.",
                        "--max-shard-size", "200", "--config", "config.json")  # fmt: skip
    try:
        assert code == 0
        assert os.listdir(tmp_path) == ["config.json"]  # no ./memory:/consolidated/...
        files = _memory_files("/consolidated/split")
        names = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
        assert sorted(files) == ["config.json", *names, "model.safetensors.index.json"]
        assert out == f"wrote 4 tensors (232 B) to 2 files and config.json in {url}\n"
        index = json.loads(files["model.safetensors.index.json"])
        contents: dict[str, torch.Tensor] = {}
        for name in names:
            contents.update(_contents("", files[name]))
        assert index["weight_map"] == {
            "0.bias": names[0], "0.weight": names[0], "2.bias": names[0], "2.weight": names[1]
        }  # fmt: skip
        for key, value in training[1].items():
            assert torch.equal(contents[key], value), key
    finally:
        fsspec.filesystem("memory").rm("/consolidated", recursive=True)


def _corrupt_last_tensor(path: Path, fqn: str) -> None:
    metadata = ckpt.read_metadata(path)
    ((_, info),) = [(k, v) for k, v in metadata.storage_data.items() if k.fqn == fqn]
    data_file = path / info["file"]
    data = bytearray(data_file.read_bytes())
    data[info["begin"]] ^= 0xFF
    data_file.write_bytes(bytes(data))


def test_a_failure_removes_what_was_written_to_an_object_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {"a": torch.ones(100), "b": torch.ones(100), "z": torch.ones(100)}
    ckpt.save(state, tmp_path / "ckpt")
    _corrupt_last_tensor(tmp_path / "ckpt", "z")  # read after a.safetensors is written
    url = "memory://failed/out"
    code, out, err = _run(capsys, "consolidate", tmp_path / "ckpt", url, "--max-shard-size", "500")
    assert (code, out) == (3, "")
    assert err.startswith("shardwise consolidate: error: checksum mismatch ")
    assert _memory_files("/failed") == {}


def test_a_failure_leaves_no_local_file_and_no_new_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {"a": torch.ones(100), "z": torch.ones(100)}
    ckpt.save(state, tmp_path / "ckpt")
    _corrupt_last_tensor(tmp_path / "ckpt", "z")
    code, _, _ = _run(capsys, "consolidate", tmp_path / "ckpt", tmp_path / "new" / "out",
                      "--max-shard-size", "500")  # fmt: skip
    assert code == 3
    assert os.listdir(tmp_path / "new") == []  # "out" was made by the run, and removed


def test_consolidate_from_and_to_s3(
    training: tuple[Path, dict[str, torch.Tensor]],
    s3: S3Bucket,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = _training_state(_model())
    ckpt.save(state, s3.url("ckpt"), storage_options=s3.options)
    (tmp_path / "config.json").write_text('{"a": 1}')
    options = json.dumps(s3.options)
    code, _, err = _run(capsys, "consolidate", s3.url("ckpt"), s3.url("hf"), "--prefix",
                          "model.", "--config", tmp_path / "config.json",
                          "--storage-options", options)  # fmt: skip
    assert (code, err) == (0, "")
    fs = s3fs.S3FileSystem(**s3.options)
    assert sorted(fs.ls(f"{s3.name}/hf")) == [
        f"{s3.name}/hf/config.json",
        f"{s3.name}/hf/model.safetensors",
    ]
    contents = _contents("", fs.cat_file(f"{s3.name}/hf/model.safetensors"))
    for key, value in training[1].items():
        assert torch.equal(contents[key], value), key


# -- the files -------------------------------------------------------------------------------


def test_files_are_laid_out_by_the_format_module(
    training: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(capsys, "consolidate", training[0], tmp_path / "hf", "--prefix", "model.")[0] == 0
    data = (tmp_path / "hf" / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0 and (8 + length) % data_format.ALIGNMENT == 0
    header = data_format.parse_header(data, len(data))
    assert header.metadata == {"format": "pt"}
    assert [(e.key, e.dtype, e.shape) for e in header.entries.values()] == [
        ("0.bias", "F32", (8,)),
        ("0.weight", "F32", (8, 4)),
        ("2.bias", "F32", (2,)),
        ("2.weight", "F32", (2, 8)),
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_counts_all_bytes_in_binary_units(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt.save({"w": torch.zeros(3, 1024, 1024, dtype=torch.uint8)}, tmp_path / "ckpt")
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert f"consolidating into {tmp_path / 'hf'}:" in terminal.getvalue()
    assert "/3.0 MiB [" in terminal.getvalue()


# -- consolidate -----------------------------------------------------------------------------


def _safetensors_contents(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as file:
        assert file.metadata() == {"format": "pt"}
        return {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118


def test_consolidate_single_file(
    source: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "hf"
    code, out, err = _run(capsys, "consolidate", source[0], out_dir)
    assert code == 0
    assert out == f"wrote 6 tensors (323 B) to 1 file in {out_dir}\n"
    assert err.splitlines() == [
        "warning: skipping 'cplx': safetensors cannot store dtype complex128",
        "note: 5 non-tensor entries are not written (safetensors holds tensors only): 'blob', "
        "'cfg.lr', 'cfg.name', 'raw', 'step'",
    ]
    assert sorted(os.listdir(out_dir)) == ["model.safetensors"]
    contents = _safetensors_contents(out_dir / "model.safetensors")
    expected = {key: value for key, value in source[1].items() if key != "cplx"}
    assert sorted(contents) == sorted(expected)
    for key, value in expected.items():
        assert contents[key].dtype == value.dtype, key
        assert torch.equal(contents[key], value), key
    loaded = load_file(str(out_dir / "model.safetensors"))
    assert all(torch.equal(loaded[key], value) for key, value in expected.items())


def test_consolidate_split_like_hugging_face(
    source: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "hf"
    code, out, _ = _run(capsys, "consolidate", source[0], out_dir, "--max-shard-size", "100")
    assert code == 0
    assert out == f"wrote 6 tensors (323 B) to 3 files in {out_dir}\n"
    names = [f"model-{i:05d}-of-00003.safetensors" for i in range(1, 4)]
    assert sorted(os.listdir(out_dir)) == [*names, "model.safetensors.index.json"]
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    # In key order, 100 bytes per file, as Hugging Face splits: layer.weight (128 bytes) gets
    # a file of its own at once, the file being filled (ids, layer.bias) stays open.
    assert index == {
        "metadata": {"total_size": 80 + 8 + 128 + 3 + 8 + 96},
        "weight_map": {
            "ids": names[1],
            "layer.bias": names[1],
            "layer.weight": names[0],
            "mask": names[1],
            "scale": names[1],
            "sharded": names[2],
        },
    }
    for name in names:
        contents = _safetensors_contents(out_dir / name)
        assert sorted(contents) == sorted(k for k, v in index["weight_map"].items() if v == name)
        for key, value in contents.items():
            assert torch.equal(value, source[1][key]), key

    # Consolidating again into the same directory replaces the split files and the index.
    assert _run(capsys, "consolidate", source[0], out_dir, "--max-shard-size", "1GB")[0] == 0
    assert os.listdir(out_dir) == ["model.safetensors"]


def test_split_rule_is_hugging_faces() -> None:
    # The example of transformers' docs (limit 10: [6], [6+2], [6+2+2]) plus a tensor above the
    # limit, which gets a file of its own while the file being filled stays open.
    sizes = [6, 6, 2, 6, 2, 2, 12, 1]
    tensors = [OutTensor(f"t{i}", f"t{i}", torch.uint8, (n,), n) for i, n in enumerate(sizes)]
    shards = split_files(tensors, lambda t: t.nbytes, 10)
    assert [[t.nbytes for t in shard] for shard in shards] == [[6], [6, 2], [12], [6, 2, 2], [1]]
    assert split_files([], lambda t: t.nbytes, 10) == [[]]
