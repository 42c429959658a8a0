"""The options of save, async_save and load: one dataclass each, and the public signatures
SPEC.md fixes list exactly its fields, with its defaults."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.options import LoadOptions, SaveOptions


@pytest.mark.parametrize("function", [ckpt.save, ckpt.async_save])
def test_save_signatures_list_the_fields_of_save_options(function: object) -> None:
    parameters = inspect.signature(function).parameters  # type: ignore[arg-type]
    assert list(parameters)[:2] == ["state_dict", "path"]
    keywords = {
        name: parameter.default
        for name, parameter in parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    fields = {field.name: field.default for field in dataclasses.fields(SaveOptions)}
    assert keywords == fields
    assert list(keywords) == [
        "process_group",
        "coordinator_rank",
        "sync_files",
        "allow_pickle",
        "storage_options",
        "progress",
        "incremental",
        "base",
    ]


def test_load_options_are_the_keywords_of_load_it_carries() -> None:
    parameters = inspect.signature(ckpt.load).parameters
    for field in dataclasses.fields(LoadOptions):
        assert parameters[field.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters[field.name].default == field.default


def test_options_are_keyword_only_frozen_values() -> None:
    with pytest.raises(TypeError):
        SaveOptions(None, 1)  # type: ignore[misc]
    options = SaveOptions(coordinator_rank=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.progress = True  # type: ignore[misc]
    assert not hasattr(options, "__dict__")  # slots
    assert SaveOptions.of_call(
        {"state_dict": {}, "path": "p", **dataclasses.asdict(options)}
    ) == SaveOptions(coordinator_rank=1)


def test_an_unknown_keyword_is_refused_by_python(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'checkpoint_id'"):
        ckpt.save({"w": torch.ones(1)}, tmp_path, checkpoint_id="x")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'checkpoint_id'"):
        ckpt.async_save({"w": torch.ones(1)}, tmp_path, checkpoint_id="x")  # type: ignore[call-arg]
    assert not (tmp_path / "shardwise.json").exists()


def test_every_save_option_reaches_the_save(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="coordinator_rank=1 is not a rank"):
        ckpt.save({"w": torch.ones(1)}, tmp_path / "a", coordinator_rank=1)
    with pytest.raises(TypeError, match="without pickle"):
        ckpt.save({"s": {1, 2}}, tmp_path / "b")
    ckpt.save({"s": {1, 2}}, tmp_path / "b", allow_pickle=True, sync_files=False)
    future = ckpt.async_save({"s": {3}}, tmp_path / "c", allow_pickle=True)
    future.result(timeout=60)
    target = {"s": None}
    ckpt.load(target, tmp_path / "c", allow_pickle=True)
    assert target["s"] == {3}
