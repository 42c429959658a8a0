"""Export to Hugging Face: a training checkpoint ``{"model", "optim", "step"}`` saved with
shardwise, consolidated with ``--prefix model. --config config.json``, loads with
``from_pretrained`` exactly: every weight equal, the same logits, no missing or unexpected
key, and tied weights tied (written once, as ``save_pretrained`` writes them).

The model is a tiny Llama built from a config (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.cli import main
from tests._llama import check_from_pretrained, tiny_llama


def _trained(tie: bool) -> tuple[Any, torch.optim.Optimizer, torch.Tensor]:
    """A tiny Llama after one AdamW step, its optimizer, and a batch of token ids."""
    model = tiny_llama(tie)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer, ids


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as file:
        assert file.metadata() == {"format": "pt"}
        return sorted(file.keys())


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_consolidated_training_checkpoint_loads_with_from_pretrained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tie: bool
) -> None:
    model, optimizer, ids = _trained(tie)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    ckpt.save(
        {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 1},
        tmp_path / "ckpt",
    )
    if tie:
        with CheckpointReader.open(tmp_path / "ckpt") as reader:
            aliases = getattr(reader.index, "aliases", None)
        assert aliases == {"model.lm_head.weight": "model.model.embed_tokens.weight"}, (
            "needs the index's aliases (tied tensors saved once) from shardwise.checkpoint"
        )
    model.config.to_json_file(str(tmp_path / "config.json"))

    out = tmp_path / "hf"
    code = main(
        ["consolidate", str(tmp_path / "ckpt"), str(out), "--prefix", "model.",
         "--config", str(tmp_path / "config.json")]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    # The same tensors under the same names as save_pretrained writes: the tied head left out.
    model.save_pretrained(str(tmp_path / "reference"))
    assert _keys(out / "model.safetensors") == _keys(tmp_path / "reference" / "model.safetensors")
    if tie:
        assert "lm_head.weight" not in _keys(out / "model.safetensors")
        assert captured.err == (
            "note: 1 tied tensor not written ('lm_head.weight', tied to "
            "'model.embed_tokens.weight'): save_pretrained leaves it out too, and "
            "from_pretrained ties it again\n"
        )
    else:
        assert captured.err == ""

    loaded = check_from_pretrained(out, model.state_dict(), tie)
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_bfloat16_export_loads_as_bfloat16(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, optimizer, _ = _trained(tie=True)
    ckpt.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 1},
              tmp_path / "ckpt")  # fmt: skip
    model.config.to_json_file(str(tmp_path / "config.json"))
    code = main(
        ["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--prefix", "model.",
         "--config", str(tmp_path / "config.json"), "--dtype", "bfloat16"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    loaded = transformers.LlamaForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.bfloat16
    )
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.to(torch.bfloat16)), key
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
