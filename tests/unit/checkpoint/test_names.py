"""The names a reader takes from a file and turns into a path (``docs/format.md``,
*Incremental checkpoints*, *Names*): a sibling checkpoint of a reference, data files and their
temporary names, step directories, Hugging Face weight-map files and DCP storage paths. Each
rule is checked against an oracle written here apart (character by character, no regular
expression), over arbitrary text; then references that break the rule are refused by every
reader, and a base so named by ``save`` before anything is written."""

from __future__ import annotations

import json
import os
import string
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.dcp_import._plan import _relative_path_problem
from shardwise.checkpoint.huggingface.files import is_weight_file_name, parse_index_json
from shardwise.checkpoint.index import decode_index, is_data_file_name, is_temporary_name
from shardwise.checkpoint.index.names import (
    MAX_NAME,
    is_checkpoint_name,
    is_portable_name,
    parse_reference,
)
from shardwise.checkpoint.manager.series import MAX_STEP, parse_step_name, step_name
from shardwise.errors import CheckpointFormatError
from tests import _hostile as h

PORTABLE = frozenset(string.ascii_letters + string.digits + "._-")
ASCII_DIGITS = frozenset("0123456789")
HEX_DIGITS = frozenset("0123456789abcdef")
FILE = "rank-00000.0123456789abcdef.safetensors"
ARABIC_ZEROS = "\u0660" * 5  # ARABIC-INDIC DIGIT ZERO: a digit to \d, not to [0-9]

# Characters no name may hold, each a trap for some way of checking: separators, NUL, C0, DEL,
# C1 (U+0085 is a line break to str.splitlines, U+009B a terminal's CSI), line and paragraph
# separators, spaces, non-ASCII letters and digits that \w, \d or str.isdigit accept, the
# Kelvin sign and long s that [a-z] matches under re.IGNORECASE, a lone surrogate.
HOSTILE = [
    "/", "\\", "\x00", "\x01", "\t", "\n", "\r", "\x1f", "\x7f", "\x80", "\x85", "\x9b", "\x9f",
    " ", "\xa0", "\u2028", "\u2029", "\ufeff", "é", "ß", "Ω", "²", "\u0663", "\u0966", "\uff10",
    "\u212a", "\u017f", "\ud800", ":", "*", "?", "%", "+", "=", "~",
]  # fmt: skip
# Text of mostly name characters, with any character at all mixed in.
NAME_TEXT = st.text(
    st.one_of(
        st.sampled_from(sorted(PORTABLE)),
        st.sampled_from(HOSTILE),
        st.characters(),
    ),
    max_size=300,
)
VALID = st.text(st.sampled_from(sorted(PORTABLE)), min_size=1, max_size=MAX_NAME).filter(
    lambda name: name[0] not in ".-"
)


def portable(name: str) -> bool:
    """The rule of docs/format.md, *Names*, spelled out."""
    return (
        1 <= len(name) <= MAX_NAME
        and all(character in PORTABLE for character in name)
        and name[0] not in ".-"
    )


# -- the portable rule ------------------------------------------------------------------------


@settings(max_examples=500, deadline=None)
@given(NAME_TEXT)
@example("step-00000100")
@example("run-7.epoch_3")
@example("_x")
@example("a" * MAX_NAME)
@example("a" * (MAX_NAME + 1))
@example("")
@example(".")
@example("..")
@example(".hidden")
@example("-rf")
@example("step\x7f1")
@example("step\x851")
@example("a\n")
def test_a_portable_name_is_exactly_the_documented_rule(name: str) -> None:
    assert is_portable_name(name) == portable(name)
    assert is_checkpoint_name(name) == portable(name)
    if is_portable_name(name):
        assert name.isascii() and name.isprintable() and name not in (".", "..")
        assert "/" not in name and os.path.basename(name) == name


@settings(max_examples=300, deadline=None)
@given(VALID, st.sampled_from(HOSTILE), st.data())
def test_one_character_outside_the_rule_anywhere_refuses_a_name(
    name: str, bad: str, data: st.DataObject
) -> None:
    assert is_portable_name(name)
    at = data.draw(st.integers(0, len(name)))
    spoiled = name[:at] + bad + name[at:]
    assert not is_portable_name(spoiled)
    assert parse_reference(f"../{spoiled}/data/{FILE}") is None
    assert not is_weight_file_name(f"{spoiled}.safetensors")
    if bad != "/":  # the separator of a DCP storage path's components
        assert _relative_path_problem(f"{spoiled}.distcp") is not None


# -- references -------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(NAME_TEXT)
@example("step-00000100")
@example("step\x7f1")
@example("step\x851")
@example("é")
@example("..")
def test_a_reference_names_a_checkpoint_exactly_when_its_name_follows_the_rule(name: str) -> None:
    parsed = parse_reference(f"../{name}/data/{FILE}")
    assert (parsed is not None) == portable(name), repr(name)
    if parsed is not None:
        assert parsed == (name, f"data/{FILE}")
        resolved = os.path.normpath(os.path.join("/root/ckpt", f"../{name}/data/{FILE}"))
        assert resolved == f"/root/{name}/data/{FILE}"


@pytest.mark.parametrize(
    "name",
    [
        f"../a/data/{FILE}\n",
        f"../a/data/{FILE}\x00",
        f"\n../a/data/{FILE}",
        f"../a/data/{FILE}/",
        f"../a/data//{FILE}",
        f"..//a/data/{FILE}",
        "../a/data/" + FILE.replace("00000", ARABIC_ZEROS),
    ],
)
def test_a_reference_is_matched_whole(name: str) -> None:
    assert parse_reference(name) is None
    assert parse_reference(f"../a/data/{FILE}") is not None  # the control


def test_the_refusal_of_an_index_names_the_reference_and_the_rule() -> None:
    document: dict[str, Any] = {
        "format": "shardwise-checkpoint",
        "format_version": 5,
        "save": {"writer": "w", "torch": "t", "world_size": 1, "save_id": "0" * 16,
                 "checkpoint_id": None},
        "checksum": {"algorithm": "xxh3_64", "block_size": 1 << 20, "scope": "file"},
        "files": [[f"../step\x7f1/data/{FILE}", 72, 64, "0" * 16]],
        "properties": [["float32", "strided", False, "contiguous_format", False]],
        "tensors": [["t", 0, [2], ["whole", 0, 64]]],
        "objects": [],
        "digests": ["0" * 32],
    }  # fmt: skip
    with pytest.raises(CheckpointFormatError) as info:
        decode_index(h.resealed(document))
    message = str(info.value)
    assert repr(f"../step\x7f1/data/{FILE}") in message
    assert "is not a data file name" in message and "A-Z a-z 0-9 . _ -" in message
    document["files"][0][0] = f"../step-1/data/{FILE}"  # the control: accepted
    assert decode_index(h.resealed(document)).references == [f"../step-1/data/{FILE}"]


# -- data files and steps ---------------------------------------------------------------------

DIGITS = st.text(
    st.sampled_from(
        "0123456789\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669\uff10\uff11\u0968"
    ),
    min_size=1,
    max_size=20,
)
SUFFIXES = [".safetensors", ".safetensors\n", ".safetensorsx", ".Safetensors", ""]


@settings(max_examples=400, deadline=None)
@given(
    DIGITS,
    st.text(st.sampled_from("0123456789abcdefA\u0663"), min_size=15, max_size=17),
    st.sampled_from(SUFFIXES),
    st.booleans(),
)
@example("00000", "0123456789abcdef", ".safetensors", False)
@example(ARABIC_ZEROS, "0123456789abcdef", ".safetensors", False)
@example("00000", "0123456789abcdef", ".safetensors\n", False)
def test_data_file_names_are_ascii_and_whole(
    rank: str, save_id: str, suffix: str, temporary: bool
) -> None:
    name = f"rank-{rank}.{save_id}{suffix}"
    expected = (
        set(rank) <= ASCII_DIGITS
        and 5 <= len(rank) <= 9
        and set(save_id) <= HEX_DIGITS
        and len(save_id) == 16
        and suffix == ".safetensors"
    )
    assert is_data_file_name(name) == expected
    assert is_temporary_name(f"{name}.tmp") == expected
    assert not is_temporary_name(name) and not is_data_file_name(f"{name}.tmp")
    assert not is_temporary_name(f"{name}.tmp\n")


def _a_step_name(name: str) -> bool:
    """Whether ``name`` is ``step_name`` of a step: ``step-``, 8 to 19 ASCII digits, no
    leading zero beyond the 8 digits."""
    digits = name.removeprefix("step-")
    return (
        name.startswith("step-")
        and set(digits) <= ASCII_DIGITS
        and 8 <= len(digits) <= 19
        and (len(digits) == 8 or digits[0] != "0")
    )


@settings(max_examples=400, deadline=None)
@given(st.one_of(DIGITS.map(lambda d: f"step-{d}"), NAME_TEXT))
@example("step-00000100")
@example("step-\u0660\u0660\u0660\u0660\u0660\u0661\u0660\u0660")
@example("step-\uff10\uff10\uff10\uff10\uff10\uff11\uff10\uff10")
@example("step-00000100\n")
@example("step-00000100 ")
@example("step-0000010")
@example("step-000000100")
@example(f"step-{MAX_STEP}")
def test_a_step_directory_is_exactly_a_name_the_manager_writes(name: str) -> None:
    step = parse_step_name(name)
    assert (step is not None) == _a_step_name(name), repr(name)
    if step is not None:
        assert step_name(step) == name and is_checkpoint_name(name)


# -- Hugging Face weight maps and DCP storage paths -------------------------------------------


@settings(max_examples=300, deadline=None)
@given(NAME_TEXT)
@example("model-00001-of-00004.safetensors")
@example("diffusion_pytorch_model.fp16.safetensors")
@example(".safetensors")
@example("../model.safetensors")
@example("model\x7f.safetensors")
@example("mod\u00e8le.safetensors")
@example("model.safetensors\n")
def test_a_weight_map_names_a_portable_safetensors_file(name: str) -> None:
    expected = portable(name) and name.endswith(".safetensors")
    assert is_weight_file_name(name) == expected
    index = json.dumps({"weight_map": {"w": name}}).encode()
    if expected:
        assert parse_index_json(index, "i") == {"w": name}
    else:
        with pytest.raises(CheckpointFormatError, match="not a plain"):
            parse_index_json(index, "i")


@settings(max_examples=300, deadline=None)
@given(st.lists(NAME_TEXT, min_size=1, max_size=3))
@example(["__0_0.distcp"])
@example(["sub", "__0_0.distcp"])
@example(["__0_0\x7f.distcp"])
@example(["sub\x85", "__0_0.distcp"])
@example(["__\u0660_0.distcp"])
def test_a_dcp_storage_path_is_made_of_portable_components(parts: list[str]) -> None:
    path = "/".join(parts)
    components = path.split("/")
    problem = _relative_path_problem(path)
    assert (problem is None) == all(portable(part) for part in components), (path, problem)


def test_a_dcp_component_outside_the_rule_is_named() -> None:
    assert _relative_path_problem("__0_0\x7f.distcp") == (
        "its component '__0_0\\x7f.distcp' is not a portable file name (1 to 255 of the "
        "characters A-Z a-z 0-9 . _ - (POSIX's portable file name characters), not starting "
        "with . or -)"
    )
    assert _relative_path_problem("__0_0.distcp") is None


# -- end to end: load and save ----------------------------------------------------------------


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(3)
    return {
        "base": torch.randn(64, 16, generator=generator),
        "adapter": torch.randn(4, 16, generator=generator),
        "step": 1,
    }


def _blank() -> dict[str, Any]:
    return {"base": torch.zeros(64, 16), "adapter": torch.zeros(4, 16), "step": 0}


def renamed_series(tmp_path: Path, sibling: str) -> Path:
    """An incremental checkpoint ``b`` built on ``a``, then ``a`` renamed ``sibling`` and
    ``b``'s index rewritten (and sealed again) to reference it there."""
    state = _state()
    ckpt.save(state, tmp_path / "a", incremental=True)
    state["adapter"].add_(1.0)
    ckpt.save(state, tmp_path / "b", base=tmp_path / "a")
    (tmp_path / "a").rename(tmp_path / sibling)
    document = h.read_document(tmp_path / "b")
    for row in document["files"]:
        if row is not None and row[0].startswith("../a/"):
            row[0] = f"../{sibling}/" + row[0].removeprefix("../a/")
    h.write_resealed(tmp_path / "b", document)
    return tmp_path / "b"


def test_a_sibling_renamed_within_the_rule_still_loads(tmp_path: Path) -> None:
    """The control of the test below: only the name's characters make it fail."""
    path = renamed_series(tmp_path, "a.renamed-1")
    loaded = _blank()
    ckpt.load(loaded, path)
    assert torch.equal(loaded["base"], _state()["base"])
    assert torch.equal(loaded["adapter"], _state()["adapter"] + 1.0)


@pytest.mark.parametrize("character", ["\x7f", "\x85", "\x9b", "\u2028", "é"])
def test_a_reference_to_a_sibling_named_outside_the_rule_is_refused(
    tmp_path: Path, character: str
) -> None:
    sibling = f"a{character}1"
    path = renamed_series(tmp_path, sibling)
    (reference,) = decode_index_references(tmp_path / sibling, path)
    state = _blank()
    before = h.snapshot(state)
    for call in (
        lambda: ckpt.load(state, path),
        lambda: ckpt.load_tensor(path, "base"),
        lambda: ckpt.read_metadata(path),
    ):
        with pytest.raises(CheckpointFormatError) as info:
            call()
        assert repr(reference) in str(info.value)
        assert "is not a data file name" in str(info.value)
    h.assert_unchanged(state, before)


def decode_index_references(sibling: Path, path: Path) -> list[str]:
    """The references of ``path``'s index (read as JSON: the decoder refuses them), each a
    file that exists below ``sibling``: the load would have read it."""
    names = [row[0] for row in h.read_document(path)["files"] if row and row[0].startswith("../")]
    for name in names:
        assert (path.parent / name.removeprefix("../")).is_file()
        assert name.startswith(f"../{sibling.name}/")
    return names


@pytest.mark.parametrize("name", ["a\x7f1", "a\x851", "é", "a b", "-a", ".a"])
def test_save_refuses_a_base_named_outside_the_rule_before_writing(
    tmp_path: Path, name: str
) -> None:
    state = _state()
    ckpt.save(state, tmp_path / name, incremental=True)  # any name saves and loads on its own
    loaded = _blank()
    ckpt.load(loaded, tmp_path / name)
    assert torch.equal(loaded["base"], state["base"])
    with pytest.raises(ValueError, match="cannot be referenced") as info:
        ckpt.save(state, tmp_path / "b", base=tmp_path / name)
    assert repr(name) in str(info.value) and "A-Z a-z 0-9 . _ -" in str(info.value)
    assert not (tmp_path / "b").exists()
    (tmp_path / name).rename(tmp_path / "ok")  # the control: the same base, renamed, builds
    ckpt.save(state, tmp_path / "b", base=tmp_path / "ok")
    assert decode_index_references(tmp_path / "ok", tmp_path / "b")


def test_a_data_file_swapped_for_one_of_the_same_size_fails_its_checksums(
    tmp_path: Path,
) -> None:
    """``docs/format.md``, *Validation*: the load returns the saved bytes or raises
    ChecksumError; nothing of the swapped file's header is used."""
    ckpt.save(_state(), tmp_path / "a")
    other = _state()
    other["base"].add_(1.0)
    ckpt.save(other, tmp_path / "b")
    (mine,), (theirs,) = h.data_files(tmp_path / "a"), h.data_files(tmp_path / "b")
    assert mine.stat().st_size == theirs.stat().st_size
    theirs.rename(mine)
    state = _blank()
    with pytest.raises(ckpt.ChecksumError) as info:
        ckpt.load(state, tmp_path / "a")
    message = str(info.value)
    assert message.startswith("checksum mismatch for a chunk of this tensor in block 0 of the file")
    assert "the data file is corrupt; the tensors this load was filling are undefined" in message
    assert state["step"] == 0  # no Python value replaced
