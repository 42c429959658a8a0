"""What a state-dict leaf is to a checkpoint on this rank: the global boxes of a tensor with
the local tensors backing them (save writes them, load fills them), or an object's stored form.
"""

from __future__ import annotations

import enum
import functools
import io
import json
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardwise._boxes import Box, origin
from shardwise._json import strict_json
from shardwise.checkpoint.entries.dtensor import local_shape_and_offset
from shardwise.checkpoint.entries.pyjson import (
    MAX_DEPTH,
    form_and_depth,
    json_depth,
    python_form,
    tagged,
)
from shardwise.metadata import TensorProperties

__all__ = [
    "LocalBox",
    "TensorValue",
    "describe_object",
    "describe_tensor",
    "is_tensor_value",
    "storage_key",
    "unstorable",
]

# Exactly these types are plain local tensors (a subclass may be a wrapper of another kind).
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_WHOLE = ("whole",)
# By id, the mesh kept to check identity: (mesh, coordinate, shape).
_MESHES: dict[int, tuple[Any, Any, tuple[int, ...]]] = {}
# The placements met (a few tuples per model; compared by class and fields, so a
# _StridedShard is not a Shard), to :func:`_placement_names` of them.
_PLACEMENTS: dict[Any, Any] = {}
_PARTIAL = ("Partial",)
_TEXT_FORMS = ("json", "pyjson", "pyjson2")  # by python_form


@dataclass(slots=True)
class LocalBox:
    """A global box of a tensor and the local tensor holding exactly that box."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor

    @property
    def box(self) -> Box:
        return self.offsets, self.sizes


@dataclass(slots=True)
class TensorValue:
    """A tensor-like state-dict value as this rank sees it.

    Attributes:
        size: Global size, or ``None`` when only the union of every rank's boxes tells it
            (a standalone LocalShardsWrapper).
        boxes: The boxes this rank holds.
        layout: How the value lies over the ranks when a rule says so: ``("whole",)`` for a
            plain tensor (replicated on every rank that has the key), ``("mesh", device_mesh,
            placements)`` for a DTensor whose placements are all ``"R"``/``"S<dim>"`` and for a
            chunked ShardedTensor (:func:`_chunk_layout`); ``None``: only the boxes tell.
    """

    size: tuple[int, ...] | None
    dtype: torch.dtype
    properties: TensorProperties
    boxes: list[LocalBox]
    layout: tuple[Any, ...] | None = None


def storage_key(value: TensorValue) -> tuple[Any, ...] | None:
    """What identifies the local data of ``value``: equal for two entries that are the same
    tensor on this rank (one object, or views of one storage with the same offset, strides
    and boxes: tied weights), ``None`` when this rank holds none of its elements."""
    parts: list[Any] = [value.size, value.dtype, value.properties.requires_grad]
    for box in value.boxes:
        tensor = box.tensor
        if tensor.numel() == 0:
            continue
        try:
            # The same elements in the same order, read through the same lazy conj/neg.
            where: Any = (
                tensor.data_ptr(),
                tensor.stride(),
                tensor.device,
                tensor.is_conj(),
                tensor.is_neg(),
            )
        except (RuntimeError, NotImplementedError, TypeError):  # no plain storage: by identity
            where = ("object", id(tensor))
        parts.append((box.offsets, box.sizes, tensor.dtype, where))
    return tuple(parts) if len(parts) > 3 else None


def _is_loaded(value: object, module: str, name: str) -> bool:
    """Whether ``value`` is a ``module.name``, asked only if that module is imported (no
    value of it exists before). Importing DTensor takes seconds, plain tensors need no
    sharded-tensor stack, and ``shardwise.local_shards`` imports this package (a cycle)."""
    kind = getattr(sys.modules.get(module), name, None)
    return kind is not None and isinstance(value, kind)


def is_tensor_value(value: object) -> bool:
    """Whether the checkpoint stores ``value`` as a tensor."""
    return isinstance(value, torch.Tensor)


def _wrapper_boxes(wrapper: Any) -> list[LocalBox]:
    return [
        LocalBox(tuple(int(o) for o in offsets), tuple(shard.size()), shard)
        for offsets, shard in zip(wrapper.local_offsets(), wrapper.local_shards(), strict=False)
    ]


def describe_tensor(fqn: str, value: torch.Tensor) -> TensorValue:
    """The boxes of ``value`` this rank holds (no copies; the tensors are the live data).

    Raises:
        ValueError: A DTensor with a ``Partial`` placement (it needs a reduction first).
        TypeError: A quantized, sparse, nested or MKL-DNN tensor (see :func:`unstorable`).
    """
    if type(value) in _PLAIN_TENSOR_TYPES:  # the common case, without the checks below
        return _describe_plain(fqn, value)
    if _is_loaded(value, "shardwise.sharded_tensor.api", "ShardedTensor"):
        return _describe_sharded(value)
    if _is_loaded(value, "torch.distributed.tensor", "DTensor"):
        return _describe_dtensor(fqn, value)
    if _is_loaded(value, "shardwise.local_shards", "LocalShardsWrapper"):
        boxes = _wrapper_boxes(value)
        dtype = boxes[0].tensor.dtype if boxes else torch.get_default_dtype()
        return TensorValue(None, dtype, _properties(dtype, value.requires_grad), boxes)
    return _describe_plain(fqn, value)


def _describe_plain(fqn: str, value: torch.Tensor) -> TensorValue:
    if value.is_quantized or value.layout is not torch.strided or value.is_nested:
        raise _unsaved(fqn, str(unstorable(value)))
    requires_grad = value.requires_grad
    # A detached view costs more than the rest of this description: only where needed.
    tensor = value.detach() if requires_grad or type(value) is not torch.Tensor else value
    size = tuple(tensor.size())
    dtype = tensor.dtype
    full = LocalBox(origin(len(size)), size, tensor)
    return TensorValue(size, dtype, _properties(dtype, requires_grad), [full], _WHOLE)


def unstorable(value: torch.Tensor) -> str | None:
    """What ``value`` is when a checkpoint has no form for it (quantized, sparse...), else None."""
    if value.is_quantized:
        return f"a quantized tensor ({value.dtype})"
    if value.is_nested:
        return "a nested tensor"
    if value.layout is not torch.strided:
        return f"a {str(value.layout).removeprefix('torch.')} tensor"
    return None


def _unsaved(fqn: str, kind: str) -> TypeError:
    if kind.startswith("a quantized"):
        instead = (
            "whose scale and zero point a checkpoint does not store; save value.dequantize() "
            "or its int_repr() and quantization parameters instead"
        )
    elif kind == "a nested tensor":
        instead = (
            "whose components a checkpoint does not store; save value.unbind() (a list of "
            "tensors) or a padded tensor instead"
        )
    else:
        instead = (
            "and a checkpoint stores strided (dense) tensors; save value.to_dense() (or its "
            "indices and values) instead"
        )
    return TypeError(f"cannot checkpoint {fqn!r}: it is {kind}, {instead}")


@functools.cache
def _properties(dtype: torch.dtype, requires_grad: bool) -> TensorProperties:
    """One properties object per distinct value (never written to): a state dict holds thousands
    of tensors of a few kinds, and tables and the index work per distinct object."""
    return TensorProperties(dtype=dtype, requires_grad=bool(requires_grad))


def _describe_sharded(value: Any) -> TensorValue:
    boxes = [
        LocalBox(
            tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes), shard.tensor
        )
        for shard in value.local_shards()
    ]
    properties = value.metadata().tensor_properties
    size = tuple(value.size())
    layout = _chunk_layout(value, len(size))
    # Pinning and memory format describe where the saver kept the data, not the data.
    plain = _properties(properties.dtype, properties.requires_grad)
    return TensorValue(size, properties.dtype, plain, boxes, layout)


def _chunk_layout(value: Any, ndim: int) -> tuple[Any, ...] | None:
    """``("mesh", (shape, global ranks), ("S<dim>",))`` of a ``ChunkShardingSpec``
    ShardedTensor with one chunk per rank (a one-dim mesh), else ``None``."""
    spec = value.sharding_spec()
    if not _is_loaded(spec, "shardwise.sharding_spec.chunk", "ChunkShardingSpec") or not ndim:
        return None
    dim: Any = getattr(spec, "dim", None)
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        return None
    ranks = tuple(shard.placement.rank() for shard in value.metadata().shards_metadata)
    if None in ranks or len(set(ranks)) != len(ranks):
        return None
    return ("mesh", ((len(ranks),), ranks), (f"S{dim % ndim}",))


def _describe_dtensor(fqn: str, value: Any) -> TensorValue:
    placements = value.placements
    try:
        known = _PLACEMENTS.get(placements, _PLACEMENTS)  # the dict itself: not there
    except TypeError:  # a placement type that is not hashable
        known = _placement_names(placements)
    if known is _PLACEMENTS:
        known = _PLACEMENTS[placements] = _placement_names(placements)
    if known is _PARTIAL:
        raise ValueError(
            f"cannot checkpoint {fqn!r}: its DTensor has a Partial placement; reduce it first "
            "(e.g. dtensor.redistribute(placements=[Replicate()]))"
        )
    local = value._local_tensor
    size = tuple(value.size())
    layout = None
    if _is_loaded(local, "shardwise.local_shards", "LocalShardsWrapper"):
        boxes = _wrapper_boxes(local)
        dtype = boxes[0].tensor.dtype if boxes else value.dtype
    else:
        dtype = local.dtype
        mesh = value.device_mesh
        coordinate, mesh_shape = _mesh_facts(mesh)
        if coordinate is None:
            boxes = []
        else:
            found = local_shape_and_offset(size, mesh_shape, coordinate, placements)
            if found is None:
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                found = compute_local_shape_and_global_offset(value.size(), mesh, placements)
            shape, offsets = found
            if local.requires_grad or type(local) is not torch.Tensor:
                local = local.detach()
            boxes = [LocalBox(tuple(offsets), tuple(shape), local)]
        layout = None if known is None else ("mesh", mesh, known)
    return TensorValue(size, dtype, _properties(dtype, value.requires_grad), boxes, layout)


def _mesh_facts(mesh: Any) -> tuple[Any, tuple[int, ...]]:
    """This rank's coordinate in ``mesh`` (None: not in it) and its shape, once per mesh:
    ``mesh.shape`` builds a tuple from a tensor per call, and thousands of DTensors share a few."""
    found = _MESHES.get(id(mesh))
    if found is not None and found[0] is mesh:
        return found[1], found[2]
    if len(_MESHES) >= 64:  # meshes are few and long-lived; never grow without bound
        _MESHES.clear()
    coordinate = mesh.get_coordinate()
    shape = tuple(mesh.shape)
    _MESHES[id(mesh)] = (mesh, coordinate, shape)
    return coordinate, shape


def _placement_names(placements: Any) -> tuple[str, ...] | None:
    """``("S<dim>"/"R", ...)`` of placements that are exactly ``Shard`` (a dim >= 0) and
    ``Replicate``; ``_PARTIAL`` when one is ``Partial``; else ``None``."""
    from torch.distributed.tensor import Partial, Replicate, Shard  # imported: a DTensor exists

    if any(isinstance(placement, Partial) for placement in placements):
        return _PARTIAL
    names = []
    for placement in placements:
        kind = type(placement)
        if kind is Replicate:
            names.append("R")
        elif kind is Shard and placement.dim >= 0:
            names.append(f"S{placement.dim}")
        else:
            return None
    return tuple(names)


@dataclass(slots=True)
class ObjectValue:
    """A non-tensor state-dict value.

    Attributes:
        encoding: ``"json"``, ``"pyjson"`` or ``"pyjson2"`` (text in the index), ``"bytes"``,
            ``"bytesio"`` or ``"pickle"`` (a blob in a data file).
        payload: The JSON text, or the blob's bytes.
    """

    encoding: str
    payload: bytes


def _pickle_hint(value: object) -> str:
    """What to do instead of storing ``value``: pickle only where nothing else fits."""
    name = type(value).__name__
    pickle_it = "pass allow_pickle=True to pickle it (only for checkpoints you will trust)"
    if isinstance(value, (np.ndarray, np.generic)):
        return (
            f"NumPy values of dtype {value.dtype} have no exact JSON form: convert it to a "
            f"tensor (torch.from_numpy) to store it as one, or {pickle_it}"
        )
    if isinstance(value, (set, frozenset)):
        return "store it as a sorted list"
    if isinstance(value, memoryview):  # which pickle cannot take either
        return "store bytes(value) (it comes back as bytes)"
    if isinstance(value, bytearray):
        return f"store bytes(value) (it comes back as bytes), or {pickle_it}"
    if isinstance(value, torch.Generator):
        return "save value.get_state() (a tensor) and restore it with set_state()"
    if isinstance(value, enum.Enum):
        return f"store its value (value.value), or {pickle_it}"
    if callable(getattr(value, "state_dict", None)):
        return (
            f"{name} has state_dict() but no load_state_dict(): save its state_dict() instead, "
            "or give it load_state_dict() so it is Stateful"
        )
    if _too_deep(value):
        return f"it nests deeper than {MAX_DEPTH} levels as JSON; {pickle_it}"
    for base in (int, float, str, bytes, list, tuple, dict):
        if isinstance(value, base) and type(value) is not base:
            return (
                f"{name} is a subclass of {base.__name__}, which would come back as a plain "
                f"{base.__name__}: store {base.__name__}(value), or {pickle_it}"
            )
    return pickle_it


def _too_deep(value: object) -> bool:
    """Whether ``value`` has a JSON form, but one that nests deeper than readers accept."""
    try:
        found = _json_form(value)
    except RecursionError:
        return True
    except (TypeError, ValueError):
        return False
    return found is not None and not found[2]


def _json_form(value: object) -> tuple[int, object, bool] | None:
    """``value``'s :func:`python_form`, its JSON tree, and whether readers accept its depth
    (walked only when it may exceed ``MAX_DEPTH``), or None; ``RecursionError`` when too deep."""
    found = form_and_depth(value)
    if found is None:
        return None
    form, depth = found
    tree = value if form == 0 else tagged(value, extended=form == 2)
    fits = 3 * depth + 3 <= MAX_DEPTH or json_depth(tree) <= MAX_DEPTH
    return form, tree, fits


def _as_json(value: object) -> ObjectValue | None:
    """``value`` as the simplest JSON text that gives it back exactly (``json`` allows NaN and
    Infinity); None when none does, or when it would nest deeper than readers accept."""
    try:
        found = _json_form(value)
        if found is None or not found[2]:
            return None
        return ObjectValue(_TEXT_FORMS[found[0]], json.dumps(found[1]).encode())
    except (TypeError, ValueError, RecursionError):  # an int too long for text, too deep
        return None


def describe_object(fqn: str, value: object, allow_pickle: bool) -> ObjectValue:
    """How a non-tensor value is stored.

    Raises:
        TypeError: The value needs pickle and ``allow_pickle`` is false.
    """
    kind = type(value)
    if kind is bytes:
        return ObjectValue("bytes", value)  # type: ignore[arg-type]
    if kind is io.BytesIO:
        return ObjectValue("bytesio", value.getvalue())  # type: ignore[attr-defined]
    as_json = _as_json(value)
    if as_json is not None:
        return as_json
    if allow_pickle:
        try:
            return ObjectValue("pickle", pickle.dumps(value))
        except TypeError as err:  # its other failures are named by the caller
            raise TypeError(
                f"cannot save state_dict[{fqn!r}] of type {type(value).__name__}: it has no "
                f"stored form without pickle, and pickling it failed: {err}"
            ) from err
    where, part = _culprit(value, "")
    what = f"{where} is a {type(part).__name__}: " if where else ""
    raise TypeError(
        f"cannot save state_dict[{fqn!r}] of type {type(value).__name__}: shardwise stores "
        "tensors, bytes, io.BytesIO, Stateful objects and Python values (None, bool, int, "
        "float, str, and lists, tuples and dicts of them; NumPy numbers and arrays, "
        f"torch.Size and named tuples) without pickle; {what}{_pickle_hint(part)}"
    )


def _culprit(value: object, where: str) -> tuple[str, object]:
    """The path to the first part of ``value`` with no stored form, and that part (or ``value``)."""
    try:
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if python_form(item) is None:
                    return _culprit(item, f"{where}[{i}]")
        elif isinstance(value, dict):
            for key, item in value.items():
                if python_form(key) is None:
                    return f"{where} key {key!r}", key
                if python_form(item) is None:
                    return _culprit(item, f"{where}[{key!r}]")
    except RecursionError:  # too deep to search: the value is named as a whole
        return where, value
    return where, value


def decode_object(encoding: str, payload: bytes, loads: Callable[[bytes], Any]) -> Any:
    """The value a stored object decodes to (``loads`` unpickles)."""
    if encoding == "json":
        return strict_json(payload, "a stored JSON value", constants=True)
    if encoding == "bytes":
        return payload
    if encoding == "bytesio":
        return io.BytesIO(payload)
    if encoding == "pickle":
        return loads(payload)
    raise ValueError(f"unknown object encoding {encoding!r}")
