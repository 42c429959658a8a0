"""Hugging Face safetensors in and out of real ranks (issue 27): ``load_safetensors`` fills
row-, column- and 2-D-sharded DTensors, ShardedTensors and plain tensors on 1, 2 and 4 ranks
from a directory written by the ``safetensors`` library (the reference is its ``load_file``),
and from the moto S3 server; ``save_safetensors`` writes from sharded tensors (FSDP2 among
them) files that ``load_file`` and ``from_pretrained`` read back exactly; a hostile header is
refused with the same error on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

import shardwise as sw
import shardwise.checkpoint as ckpt
from tests._llama import check_from_pretrained, tiny_llama
from tests._s3 import S3Bucket, s3_bucket, s3_server  # noqa: F401 (fixtures)
from tests.harness import distributed, run_on_ranks

#: The reference tensors: uneven sizes (9 rows over 2 or 4 ranks), several dtypes, a 0-d one.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.embed.weight": ((9, 12), torch.float32),
    "model.proj.weight": ((10, 7), torch.bfloat16),
    "model.norm.weight": ((12,), torch.float16),
    "model.ids": ((5, 6), torch.int64),
    "model.scale": ((), torch.float64),
}
#: The files of the reference directory (two, with an index, as save_pretrained splits).
FILES = {
    "model-00001-of-00002.safetensors": ["model.embed.weight", "model.norm.weight"],
    "model-00002-of-00002.safetensors": ["model.proj.weight", "model.ids", "model.scale"],
}


def _reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(27)
    return {
        name: torch.randint(-100, 100, shape, generator=g).to(dtype)
        for name, (shape, dtype) in SHAPES.items()
    }


def _write_directory(path: Path) -> None:
    """A split model directory, written by the safetensors library alone."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = _reference()
    weight_map = {}
    for file, names in FILES.items():
        save_file({n: tensors[n] for n in names}, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _loaded_reference(path: Path) -> dict[str, torch.Tensor]:
    """What ``safetensors.torch.load_file`` reads from every file of ``path``."""
    return {k: v for file in FILES for k, v in load_file(str(path / file)).items()}


def _zeros(name: str) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    return torch.zeros(shape, dtype=dtype)


def _layouts(world: int) -> dict[str, tuple[DeviceMesh, list[Placement]] | str]:
    """The target layouts on ``world`` ranks: DTensor placements on a mesh, or a kind."""
    mesh = init_device_mesh("cpu", (world,))
    layouts: dict[str, tuple[DeviceMesh, list[Placement]] | str] = {
        "rows": (mesh, [Shard(0)]),
        "cols": (mesh, [Shard(1)]),
        "replicated": (mesh, [Replicate()]),
        "st_rows": "st0",
        "st_cols": "st1",
        "plain": "plain",
    }
    if world == 4:
        mesh_2d = init_device_mesh("cpu", (2, 2))
        layouts["2d"] = (mesh_2d, [Shard(0), Shard(1)])
        layouts["2d_cols_rows"] = (mesh_2d, [Shard(1), Shard(0)])
    return layouts


def _target(name: str, layout: tuple[DeviceMesh, list[Placement]] | str, world: int) -> Any:
    """A zero tensor for ``name`` in ``layout`` (a 1-D tensor is sharded on dim 0 only, a
    0-d one stays plain)."""
    zeros = _zeros(name)
    if layout == "plain" or zeros.dim() == 0:
        return zeros
    if isinstance(layout, str):
        dim = min(int(layout[-1]), zeros.dim() - 1)
        spec = sw.ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in range(world)])
        return sw.zeros(spec, *zeros.shape, dtype=zeros.dtype)
    mesh, placements = layout
    fitted = [Shard(min(p.dim, zeros.dim() - 1)) if isinstance(p, Shard) else p for p in placements]
    return distribute_tensor(zeros, mesh, fitted)


def _check(value: Any, expected: torch.Tensor, what: str) -> None:
    """``value`` (any kind) holds ``expected``: its local data compared box by box."""
    if isinstance(value, DTensor):
        assert torch.equal(value.full_tensor(), expected), what
        return
    if isinstance(value, sw.ShardedTensor):
        for shard in value.local_shards():
            if shard.tensor.numel() == 0:  # an empty trailing shard may start past the end
                continue
            view = expected
            for dim, (o, n) in enumerate(
                zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True)
            ):
                view = view.narrow(dim, o, n)
            assert torch.equal(shard.tensor, view), what
        return
    assert torch.equal(value, expected), what


def _load_every_layout(path: Path) -> None:
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        _write_directory(path)
    dist.barrier()
    reference = _loaded_reference(path)
    for layout_name, layout in _layouts(world).items():
        state = {"model": {n.removeprefix("model."): _target(n, layout, world) for n in SHAPES}}
        result = ckpt.load_safetensors(state, path)
        assert result == ([], []), layout_name
        for name, expected in reference.items():
            _check(state["model"][name.removeprefix("model.")], expected, f"{layout_name} {name}")


@distributed(world_size=1)
def test_load_into_every_layout_on_one_rank(tmp_path: Path) -> None:
    _load_every_layout(tmp_path / "hf")


@distributed(world_size=2)
def test_load_into_every_layout_on_two_ranks(tmp_path: Path) -> None:
    _load_every_layout(tmp_path / "hf")


@distributed(world_size=4)
def test_load_into_every_layout_on_four_ranks(tmp_path: Path) -> None:
    _load_every_layout(tmp_path / "hf")


@distributed(world_size=2)
def test_prefix_key_map_cast_and_tied_keys_on_two_ranks(tmp_path: Path) -> None:
    path = tmp_path / "hf"
    if dist.get_rank() == 0:
        _write_directory(path)
    dist.barrier()
    reference = _loaded_reference(path)
    mesh = init_device_mesh("cpu", (2,))
    embed = distribute_tensor(torch.zeros(9, 12), mesh, [Shard(1)])
    state: dict[str, Any] = {
        "net": {
            "embedding": embed,
            "head": embed,  # tied: the same DTensor under two keys, absent from the files
            "proj": distribute_tensor(torch.zeros(10, 7), mesh, [Shard(0)]),  # bf16 -> f32
        },
        "step": 5,
    }
    names = {
        "embedding": "model.embed.weight",
        "head": "lm_head.weight",  # no file holds it
        "proj": "model.proj.weight",
    }
    with pytest.raises(ckpt.CheckpointMismatchError, match="allow_dtype_cast=True"):
        ckpt.load_safetensors(state, path, prefix="net", key_map=names.get)
    assert not embed.full_tensor().any()  # refused before anything was read
    with pytest.warns(UserWarning, match="3 keys in the safetensors files but not in the state"):
        result = ckpt.load_safetensors(
            state, path, prefix="net", key_map=names.get, allow_dtype_cast=True, strict=False
        )
    assert result.missing_keys == []  # "net.head" is tied to a loaded key
    assert sorted(result.unexpected_keys) == ["model.ids", "model.norm.weight", "model.scale"]
    assert torch.equal(state["net"]["head"].full_tensor(), reference["model.embed.weight"])
    expected = reference["model.proj.weight"].float()
    assert torch.equal(state["net"]["proj"].full_tensor(), expected)
    assert state["step"] == 5
    # An untied key whose name the files lack is missing, on every rank.
    state["net"]["head"] = distribute_tensor(torch.zeros(9, 12), mesh, [Shard(0)])
    with pytest.raises(ckpt.CheckpointKeyError, match="missing from the safetensors files"):
        ckpt.load_safetensors(state, path, prefix="net", key_map=names.get, allow_dtype_cast=True)


@distributed(world_size=2)
def test_a_hostile_header_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "hf"
    if dist.get_rank() == 0:
        _write_directory(path)
        file = path / "model-00002-of-00002.safetensors"
        data = bytearray(file.read_bytes())
        # A shape whose bytes are not what data_offsets spans (the header keeps its length).
        text = data[8 : 8 + int.from_bytes(data[:8], "little")].decode()
        new = text.replace('"shape":[5,6]', '"shape":[5,7]').encode()
        assert len(new) == len(text) and new != text.encode()
        data[8 : 8 + len(new)] = new
        file.write_bytes(bytes(data))
    dist.barrier()
    target = {"model.ids": _zeros("model.ids")}
    with pytest.raises(ckpt.CheckpointFormatError) as caught:
        ckpt.load_safetensors(target, path, strict=False)
    assert "model-00002-of-00002.safetensors" in str(caught.value)
    assert "data_offsets" in str(caught.value)
    assert not target["model.ids"].any()


@distributed(world_size=2, timeout=120)
def test_hostile_names_raise_the_same_error_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "hf"
    if dist.get_rank() == 0:
        _write_directory(tmp_path / "valid")
        _write_directory(path)
        # An index that repeats a key: which file holds it would be the parser's choice.
        (path / "model.safetensors.index.json").write_text(
            '{"weight_map": {"model.ids": "model-00002-of-00002.safetensors", '
            '"model.ids": "model-00001-of-00002.safetensors"}}'
        )
    dist.barrier()
    target = {"model.ids": _zeros("model.ids")}
    with pytest.raises(ckpt.CheckpointFormatError, match=r"repeats the key 'model\.ids'"):
        ckpt.load_safetensors(target, path)
    assert not target["model.ids"].any()

    # A key map giving a name that is not Unicode text on one rank only: that rank's error,
    # on every rank (was: a bare TypeError of the JSON encoder).
    def key_map(key: str) -> str:
        return "\udcff" if dist.get_rank() == 1 else key

    with pytest.raises(ckpt.CheckpointKeyError, match="not Unicode text"):
        ckpt.save_safetensors({"w": torch.ones(2)}, tmp_path / "out", key_map=key_map)
    with pytest.raises(ckpt.CheckpointKeyError, match="not Unicode text"):
        ckpt.load_safetensors(target, tmp_path / "valid", key_map=key_map)
    assert not (tmp_path / "out").exists() and not target["model.ids"].any()


# -- save ----------------------------------------------------------------------------------------


def _sharded_state(world: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A state dict of every layout (and a tied key) on ``world`` ranks, and its full tensors."""
    fulls = {f"layer{i}.weight": torch.arange(90.0).reshape(9, 10) * (i + 1) for i in range(5)}
    fulls["bias"] = torch.arange(7, dtype=torch.float64)
    mesh = init_device_mesh("cpu", (world,))
    placements: list[list[Placement]] = [[Shard(0)], [Shard(1)], [Replicate()]]
    state: dict[str, Any] = {
        f"layer{i}.weight": distribute_tensor(fulls[f"layer{i}.weight"], mesh, placements[i])
        for i in range(3)
    }
    spec = sw.ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in reversed(range(world))])
    state["layer3.weight"] = sw.shard_tensor(fulls["layer3.weight"], spec)
    if world == 4:
        mesh_2d = init_device_mesh("cpu", (2, 2))
        state["layer4.weight"] = distribute_tensor(
            fulls["layer4.weight"], mesh_2d, [Shard(1), Shard(0)]
        )
    else:
        state["layer4.weight"] = distribute_tensor(fulls["layer4.weight"], mesh, [Shard(0)])
    state["bias"] = fulls["bias"].clone()
    state["head.weight"] = state["layer0.weight"]  # tied: written once, as save_pretrained does
    return {"model": state, "step": 3}, fulls


def _save_every_layout(path: Path) -> None:
    world = dist.get_world_size()
    state, fulls = _sharded_state(world)
    # Small files: split in key order, one file per tensor above 400 bytes.
    written = ckpt.save_safetensors(state, path, prefix="model.", max_shard_size=400)
    if dist.get_rank() == 0:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert sorted(written) == sorted(
            {*index["weight_map"].values(), "model.safetensors.index.json"}
        )
        assert sorted(index["weight_map"]) == sorted(fulls)  # head.weight: tied, left out
        got = {
            k: v
            for f in set(index["weight_map"].values())
            for k, v in load_file(str(path / f)).items()
        }
        assert sorted(got) == sorted(fulls)
        for key, value in fulls.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    dist.barrier()
    # ... and loads back into another layout.
    mesh = init_device_mesh("cpu", (world,))
    again = {
        k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)])
        for k, v in fulls.items()
        if v.dim() == 2
    }
    again["bias"] = torch.zeros(7, dtype=torch.float64)
    assert ckpt.load_safetensors(again, path) == ([], [])
    for key, value in fulls.items():
        _check(again[key], value, key)


@distributed(world_size=2)
def test_save_from_every_layout_on_two_ranks(tmp_path: Path) -> None:
    _save_every_layout(tmp_path / "out")


@distributed(world_size=4)
def test_save_from_every_layout_on_four_ranks(tmp_path: Path) -> None:
    _save_every_layout(tmp_path / "out")


@distributed(world_size=2, timeout=120)
def test_a_bad_max_shard_size_is_refused_alike_on_every_rank_before_any_collective(
    tmp_path: Path,
) -> None:
    state, fulls = _sharded_state(2)
    for size, error in (("5XB", ValueError), ("0GB", ValueError), (1.5, TypeError)):
        with pytest.raises(error, match="max_shard_size") as caught:
            ckpt.save_safetensors(state, tmp_path / "out", max_shard_size=size)  # type: ignore[arg-type]
        messages: list[object] = [None, None]
        dist.all_gather_object(messages, f"{type(caught.value).__name__}: {caught.value}")
        assert messages[0] == messages[1], messages
    assert not (tmp_path / "out").exists()
    # No rank was left waiting in a collective: the same save, with the size as transformers
    # takes it ("1KB": 1000 bytes, two of the 360-byte tensors per file), runs on both.
    written = ckpt.save_safetensors(state, tmp_path / "out", prefix="model.", max_shard_size="1KB")
    assert written[-1] == "model.safetensors.index.json" and len(written) == 3 + 1
    if dist.get_rank() == 0:
        got = {k: v for f in written[:-1] for k, v in load_file(str(tmp_path / "out" / f)).items()}
        assert sorted(got) == sorted(fulls)


def _save_fsdp2_llama(path: str, tie: bool) -> dict[str, torch.Tensor] | None:
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama(tie)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert isinstance(model.model.embed_tokens.weight, DTensor)
    ckpt.save_safetensors(model.state_dict(), path)
    if dist.get_rank() == 0:
        model.config.save_pretrained(path)
    # And an FSDP2 model loads it back: every parameter's shard, its tied head included.
    fresh = tiny_llama(tie)
    with torch.no_grad():
        for parameter in fresh.parameters():
            parameter.zero_()
    for layer in fresh.model.layers:
        fully_shard(layer)
    fully_shard(fresh)
    assert ckpt.load_safetensors(fresh.state_dict(), path) == ([], [])
    for key, value in fresh.state_dict().items():
        assert torch.equal(value.full_tensor(), expected[key]), key
    return expected if dist.get_rank() == 0 else None


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_an_fsdp2_model_saved_on_two_ranks_loads_with_from_pretrained(
    tmp_path: Path, tie: bool
) -> None:
    out = tmp_path / "hf"
    expected = run_on_ranks(_save_fsdp2_llama, 2, args=(str(out), tie), timeout=120)[0]
    assert expected is not None
    check_from_pretrained(out, expected, tie)


# -- S3 ------------------------------------------------------------------------------------------


def _load_from_s3(s3: S3Bucket, local: str) -> None:
    reference = _loaded_reference(Path(local))
    mesh = init_device_mesh("cpu", (2,))
    state = {
        "embed": distribute_tensor(_zeros("model.embed.weight"), mesh, [Shard(1)]),
        "proj": sw.zeros(
            sw.ChunkShardingSpec(0, ["rank:1/cpu", "rank:0/cpu"]), 10, 7, dtype=torch.bfloat16
        ),
        "ids": _zeros("model.ids"),
    }
    names = {"embed": "model.embed.weight", "proj": "model.proj.weight", "ids": "model.ids"}
    with pytest.warns(UserWarning, match="2 keys in the safetensors files but not in the state"):
        result = ckpt.load_safetensors(
            state, s3.url("hf"), key_map=names.get, storage_options=s3.options, strict=False
        )
    assert result.missing_keys == []
    assert sorted(result.unexpected_keys) == ["model.norm.weight", "model.scale"]
    for key, name in names.items():
        _check(state[key], reference[name], key)


def test_load_from_s3_on_two_ranks(s3: S3Bucket, tmp_path: Path) -> None:
    _write_directory(tmp_path / "hf")
    fs = s3.filesystem()
    for file in (tmp_path / "hf").iterdir():
        fs.put_file(str(file), f"{s3.name}/hf/{file.name}")
    fs.invalidate_cache()
    run_on_ranks(_load_from_s3, 2, args=(s3, str(tmp_path / "hf")), timeout=90)
