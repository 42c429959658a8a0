"""What a state dict holds, rank by rank: tensor boxes with their local data, and objects.

Shared by save (which writes the boxes it holds) and load (which fills the boxes it holds).
Every supported value kind is described by the global box(es) this rank holds and the local
tensors backing them.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.checkpoint.planner import Box
from shardwise.metadata import TensorProperties

__all__ = [
    "LocalBox",
    "TensorValue",
    "byte_view",
    "describe_object",
    "describe_tensor",
    "is_tensor_value",
    "narrow_to",
    "storage_key",
]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def narrow_to(tensor: torch.Tensor, origin: tuple[int, ...], box: Box) -> torch.Tensor:
    """The part of ``tensor`` (holding the global box that starts at ``origin``) that holds
    the global ``box``."""
    view = tensor
    for dim, (start, offset, size) in enumerate(zip(origin, box[0], box[1], strict=True)):
        view = view.narrow(dim, offset - start, size)
    return view


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
        dtype: Element type.
        properties: Tensor properties to record.
        boxes: The boxes this rank holds.
    """

    size: tuple[int, ...] | None
    dtype: torch.dtype
    properties: TensorProperties
    boxes: list[LocalBox]


def storage_key(value: TensorValue) -> tuple[Any, ...] | None:
    """What identifies the local data of ``value``: equal for two state-dict entries that are
    the same tensor on this rank (the same object, or views of one storage with the same
    offset, strides and boxes, as ``model.state_dict()`` gives for tied weights), ``None``
    when this rank holds none of its elements (it cannot tell)."""
    parts: list[Any] = [value.size, value.dtype, value.properties.requires_grad]
    for box in value.boxes:
        tensor = box.tensor
        if tensor.numel() == 0:
            continue
        try:
            where: Any = (
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.stride()),
                str(tensor.device),
            )
        except (RuntimeError, NotImplementedError, TypeError):  # no plain storage: by identity
            where = ("object", id(tensor))
        parts.append((box.offsets, box.sizes, tensor.dtype, where))
    return tuple(parts) if len(parts) > 3 else None


def _dtensor_type() -> type | None:
    # No DTensor can exist before its module is imported, and importing it takes seconds:
    # a process that never touched DTensor does not pay for it here.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor: type | None = getattr(module, "DTensor", None)
    return dtensor


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
        TypeError: A quantized tensor (its scale and zero point have no place in a
            checkpoint).
    """
    if type(value) in _PLAIN_TENSOR_TYPES:  # the common case, without the checks below
        return _describe_plain(fqn, value)
    from shardwise.local_shards import LocalShardsWrapper
    from shardwise.sharded_tensor.api import ShardedTensor

    if isinstance(value, ShardedTensor):
        boxes = [
            LocalBox(
                tuple(shard.metadata.shard_offsets),
                tuple(shard.metadata.shard_sizes),
                shard.tensor,
            )
            for shard in value.local_shards()
        ]
        properties = value.metadata().tensor_properties
        return TensorValue(tuple(value.size()), properties.dtype, _plain(properties), boxes)
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        return _describe_dtensor(fqn, value)
    if isinstance(value, LocalShardsWrapper):
        boxes = _wrapper_boxes(value)
        dtype = boxes[0].tensor.dtype if boxes else torch.get_default_dtype()
        properties = TensorProperties(dtype=dtype, requires_grad=value.requires_grad)
        return TensorValue(None, dtype, properties, boxes)
    return _describe_plain(fqn, value)


# Exactly these types are plain local tensors (a subclass may be a wrapper of another kind).
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _describe_plain(fqn: str, value: torch.Tensor) -> TensorValue:
    if value.is_quantized:
        raise TypeError(
            f"cannot checkpoint {fqn!r}: it is a quantized tensor ({value.dtype}), whose scale "
            "and zero point a checkpoint does not store; save value.dequantize() or its "
            "int_repr() and quantization parameters instead"
        )
    tensor = value.detach()
    properties = TensorProperties(dtype=tensor.dtype, requires_grad=value.requires_grad)
    full = LocalBox((0,) * tensor.dim(), tuple(tensor.size()), tensor)
    return TensorValue(tuple(tensor.size()), tensor.dtype, properties, [full])


def _plain(properties: TensorProperties) -> TensorProperties:
    # Pinning and memory format describe where the saver kept the data, not the data.
    return TensorProperties(dtype=properties.dtype, requires_grad=properties.requires_grad)


def _describe_dtensor(fqn: str, value: Any) -> TensorValue:
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from shardwise.local_shards import LocalShardsWrapper

    if any(isinstance(placement, Partial) for placement in value.placements):
        raise ValueError(
            f"cannot checkpoint {fqn!r}: its DTensor has a Partial placement; reduce it first "
            "(e.g. dtensor.redistribute(placements=[Replicate()]))"
        )
    local = value._local_tensor
    size = tuple(value.size())
    if isinstance(local, LocalShardsWrapper):
        boxes = _wrapper_boxes(local)
        dtype = boxes[0].tensor.dtype if boxes else value.dtype
    else:
        dtype = local.dtype
        if value.device_mesh.get_coordinate() is None:
            boxes = []
        else:
            shape, offsets = compute_local_shape_and_global_offset(
                value.size(), value.device_mesh, value.placements
            )
            boxes = [LocalBox(tuple(offsets), tuple(shape), local.detach())]
    properties = TensorProperties(dtype=dtype, requires_grad=value.requires_grad)
    return TensorValue(size, dtype, properties, boxes)


def _is_json_value(value: object) -> bool:
    """Whether JSON gives ``value`` back as it is (no tuples, string keys only)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_is_json_value(item) for item in value)
    if isinstance(value, dict):
        return not (_TAGS & value.keys()) and all(
            isinstance(key, str) and _is_json_value(item) for key, item in value.items()
        )
    return False


# The tagged JSON of "pyjson" values: a tuple is {"__tuple__": [...]}, a dict whose keys are
# not all strings (or that holds a tag as a key) is {"__dict__": [[key, value], ...]}.
_TAGS = frozenset({"__tuple__", "__dict__"})


def _tagged(value: object) -> object:
    """``value`` as tagged JSON; TypeError when it holds something else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_tagged(item) for item in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_tagged(item) for item in value]}
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and not (_TAGS & value.keys()):
            return {key: _tagged(item) for key, item in value.items()}
        return {"__dict__": [[_tagged(key), _tagged(item)] for key, item in value.items()]}
    raise TypeError(type(value).__name__)


def _untagged(value: object) -> Any:
    if isinstance(value, list):
        return [_untagged(item) for item in value]
    if isinstance(value, dict):
        if len(value) == 1 and "__tuple__" in value and isinstance(value["__tuple__"], list):
            return tuple(_untagged(item) for item in value["__tuple__"])
        if len(value) == 1 and "__dict__" in value and isinstance(value["__dict__"], list):
            pairs = value["__dict__"]
            if not all(isinstance(pair, list) and len(pair) == 2 for pair in pairs):
                raise ValueError("malformed __dict__ pairs")
            return {_hashable(_untagged(k)): _untagged(v) for k, v in pairs}
        return {key: _untagged(item) for key, item in value.items()}
    return value


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict)):
        raise ValueError(f"a dict key cannot be a {type(key).__name__}")
    return key


@dataclass(slots=True)
class ObjectValue:
    """A non-tensor state-dict value.

    Attributes:
        encoding: ``"json"`` (stored in the index), ``"pyjson"`` (JSON with tuples and
            non-string keys tagged, in the index), ``"bytes"``, ``"bytesio"`` or
            ``"pickle"`` (stored as a blob in a data file).
        payload: JSON text for ``json``/``pyjson``; the blob bytes otherwise.
    """

    encoding: str
    payload: bytes


def _pickle_hint(value: object) -> str:
    """What to do instead of storing ``value``: pickle only where nothing else fits."""
    name = type(value).__name__
    if type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        return "convert it to a tensor (torch.from_numpy) to store it as one"
    if isinstance(value, (set, frozenset)):
        return "store it as a sorted list"
    if callable(getattr(value, "state_dict", None)):
        return (
            f"{name} has state_dict() but no load_state_dict(): save its state_dict() instead, "
            "or give it load_state_dict() so it is Stateful"
        )
    return "pass allow_pickle=True to pickle it (only for checkpoints you will trust)"


def _as_json(value: object) -> ObjectValue | None:
    """``value`` as ``json`` (plain JSON; NaN and Infinity allowed, so ``float("inf")``
    round-trips) or ``pyjson`` (tagged) text, or None when it is neither."""
    try:
        if _is_json_value(value):
            return ObjectValue("json", json.dumps(value).encode())
        return ObjectValue("pyjson", json.dumps(_tagged(value)).encode())
    except (TypeError, ValueError, RecursionError):  # not JSON-able, circular, too deep
        return None


def describe_object(fqn: str, value: object, allow_pickle: bool) -> ObjectValue:
    """How a non-tensor value is stored.

    Raises:
        TypeError: The value needs pickle and ``allow_pickle`` is false.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ObjectValue("bytes", bytes(value))
    if isinstance(value, io.BytesIO):
        return ObjectValue("bytesio", value.getvalue())
    as_json = _as_json(value)
    if as_json is not None:
        return as_json
    if allow_pickle:
        return ObjectValue("pickle", pickle.dumps(value))
    raise TypeError(
        f"cannot save state_dict[{fqn!r}] of type {type(value).__name__}: shardwise stores "
        "tensors, bytes, io.BytesIO, Stateful objects and Python values (None, bool, int, "
        "float, str, and lists, tuples and dicts of them) without pickle; "
        f"{_pickle_hint(value)}"
    )


def decode_object(encoding: str, payload: bytes, loads: Callable[[bytes], Any]) -> Any:
    """The value a stored object decodes to (``loads`` unpickles)."""
    if encoding == "json":
        return json.loads(payload)
    if encoding == "pyjson":
        return _untagged(json.loads(payload))
    if encoding == "bytes":
        return payload
    if encoding == "bytesio":
        return io.BytesIO(payload)
    if encoding == "pickle":
        return loads(payload)
    raise ValueError(f"unknown object encoding {encoding!r}")


def untag(value: object) -> Any:
    """A decoded ``pyjson`` value with its tuples and dicts rebuilt.

    Raises:
        ValueError: Malformed tags.
    """
    return _untagged(value)


def nbytes_of(sizes: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a box of ``sizes`` elements of ``dtype``."""
    return math.prod(sizes) * dtype.itemsize
