"""``shardwise.checkpoint.consolidate``, the Python form of ``shardwise consolidate``: a training
checkpoint exported with ``prefix``, ``config``, ``dtype`` and ``max_shard_size`` (an int or a
size as transformers takes it) loads with ``from_pretrained`` exactly; its refusals are
argument errors raised before the output is touched. The command's own tests:
``tests/unit/cli/test_consolidate.py`` and ``test_hugging_face.py``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import shardwise.checkpoint as ckpt
from tests._llama import check_from_pretrained, tiny_llama


def _saved(tmp_path: Path, tie: bool) -> tuple[Any, Path, Path]:
    """A tiny Llama, its training checkpoint ``{"model", "optim", "step"}`` and its config."""
    model = tiny_llama(tie)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    path = tmp_path / "ckpt"
    ckpt.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 1}, path)
    model.config.to_json_file(str(tmp_path / "config.json"))
    return model, path, tmp_path / "config.json"


@pytest.mark.parametrize(
    ("tie", "max_shard_size"), [(True, "5GB"), (False, 40_000), (True, "40KB")]
)
def test_a_training_checkpoint_loads_with_from_pretrained(
    tmp_path: Path, tie: bool, max_shard_size: int | str, caplog: pytest.LogCaptureFixture
) -> None:
    model, path, config = _saved(tmp_path, tie)
    out = tmp_path / "hf"
    with caplog.at_level(logging.INFO, logger="shardwise"):
        result = ckpt.consolidate(
            path, out, prefix="model", config=config, max_shard_size=max_shard_size
        )
    split = max_shard_size != "5GB"
    assert (len(result.files) > 1) == split
    index = ["model.safetensors.index.json"] if split else []
    assert sorted(p.name for p in out.iterdir()) == sorted([*result.files, *index, "config.json"])
    assert result.config == "config.json"
    assert (out / "config.json").read_bytes() == config.read_bytes()
    expected = model.state_dict()
    assert result.num_tensors == len(expected) - tie  # the tied head is written once
    assert result.nbytes == sum(
        v.numel() * v.element_size()
        for k, v in expected.items()
        if not (tie and k == "lm_head.weight")
    )
    if split:
        weight_map = json.loads((out / index[0]).read_text())["weight_map"]
        assert sorted(set(weight_map.values())) == result.files
    if tie:
        assert result.notes == [
            "note: 1 tied tensor not written ('lm_head.weight', tied to "
            "'model.embed_tokens.weight'): save_pretrained leaves it out too, and "
            "from_pretrained ties it again"
        ]
        assert result.notes[0] in caplog.messages
    else:
        assert result.notes == []

    check_from_pretrained(out, expected, tie)


def test_bfloat16_and_a_second_write_that_replaces_the_first(tmp_path: Path) -> None:
    model, path, config = _saved(tmp_path, tie=True)
    out = tmp_path / "hf"
    ckpt.consolidate(path, out, prefix="model.", max_shard_size=1)  # a file per tensor
    result = ckpt.consolidate(path, out, prefix="model.", config=config, dtype=torch.bfloat16)
    assert result.files == ["model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.to(torch.bfloat16)), key


@pytest.mark.parametrize(
    ("options", "error", "says"),
    [
        ({"prefix": "modle."}, ValueError, "starts with 'modle.'.*give one of them to prefix"),
        ({"config": "missing.json"}, ValueError, "cannot read config"),
        ({"config": "list.json"}, ValueError, "holds a JSON list"),
        ({"max_shard_size": "5XB"}, ValueError, "invalid max_shard_size '5XB'"),
        ({"max_shard_size": 0}, ValueError, "max_shard_size"),
        ({"max_shard_size": 1.5}, TypeError, "max_shard_size"),
        ({"dtype": torch.int8}, ValueError, "not a floating-point dtype"),
        ({"dtype": "bfloat16"}, TypeError, r"dtype must be a torch\.dtype"),
        ({"prefix": 3}, TypeError, "prefix must be a str"),
    ],
)
def test_refusals_are_argument_errors_raised_before_the_output_is_touched(
    tmp_path: Path, options: dict[str, Any], error: type[Exception], says: str
) -> None:
    path = tmp_path / "ckpt"
    ckpt.save({"model": {"w": torch.ones(2)}, "step": 1}, path)
    (tmp_path / "list.json").write_text("[1, 2]")
    if "config" in options:
        options = {**options, "config": tmp_path / options["config"]}
    with pytest.raises(error, match=says) as caught:
        ckpt.consolidate(path, tmp_path / "hf", **options)
    assert not isinstance(caught.value, ckpt.CheckpointError)
    assert not (tmp_path / "hf").exists()


def test_a_corrupt_block_leaves_no_output(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    ckpt.save({"a": torch.ones(100), "z": torch.ones(100)}, path)
    metadata = ckpt.read_metadata(path)
    ((_, info),) = [(k, v) for k, v in metadata.storage_data.items() if k.fqn == "z"]
    data = bytearray((path / info["file"]).read_bytes())
    data[info["begin"]] ^= 0xFF
    (path / info["file"]).write_bytes(bytes(data))
    with pytest.raises(ckpt.ChecksumError):
        ckpt.consolidate(path, tmp_path / "new" / "hf", max_shard_size=500)
    assert not (tmp_path / "new" / "hf").exists()
