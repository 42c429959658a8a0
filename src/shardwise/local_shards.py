""":class:`LocalShardsWrapper`: the several shards one rank holds of one tensor, as one tensor.

Typically the local tensor of a DTensor whose shards are uneven or several per rank (e.g.
row-wise or column-wise sharded embedding tables), so that DCP and shardwise checkpoints can
save and load it: the wrapper knows the global offsets of its shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from shardwise.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorStorageMetadata,
    properties_to_dcp,
)
from shardwise.metadata import TensorProperties

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as DCPChunk
    from torch.distributed.checkpoint.metadata import MetadataIndex as DCPMetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

__all__ = ["LocalShardsWrapper"]

aten = torch.ops.aten

_Handler = Callable[[tuple[Any, ...], dict[str, Any]], Any]


def _logical_size(shards: Sequence[torch.Tensor]) -> torch.Size:
    """The size the wrapper reports: the shards side by side along their sharded dim.

    Several 2-D shards are column blocks (dim 1 adds up), several 1-D shards are row blocks
    (dim 0 adds up); otherwise the first shard's size stands for the whole.
    """
    first = list(shards[0].size())
    if len(shards) > 1 and len(first) == 2:
        first[1] = sum(shard.size(1) for shard in shards)
    elif len(shards) > 1 and len(first) == 1:
        first[0] = sum(shard.size(0) for shard in shards)
    return torch.Size(first)


class LocalShardsWrapper(torch.Tensor):
    """A tensor made of the local shards of one rank, each with its offsets in the global tensor.

    Args:
        local_shards: This rank's shards, all on one device (else a bare ``AssertionError``).
        local_offsets: The global offsets of each shard, in the same order. Extra entries on
            either side are ignored.

    The wrapper's size is the shards put together: several 2-D shards side by side (dim 1
    adds up), several 1-D shards one after the other (dim 0 adds up), otherwise the first
    shard's size; no shards gives size ``[0, 0]`` on the ``meta`` device. Its dtype is the
    default dtype, as upstream (the shards keep theirs: see :meth:`storage_metadata`).

    Only a few ops are supported (conversions, views, ``equal``, ``detach``, ``clone``,
    ``new_empty``, constant padding and the functional all-gather that DTensor uses); any other
    raises ``NotImplementedError``.

    Example::

        w = LocalShardsWrapper([torch.ones(4, 2), torch.zeros(4, 3)], [(0, 0), (0, 2)])
        w.size()            # torch.Size([4, 5])
        w.local_offsets()   # [torch.Size([0, 0]), torch.Size([0, 2])]
    """

    __slots__ = ("_local_shards", "_storage_meta")

    _local_shards: list[torch.Tensor]
    _storage_meta: TensorStorageMetadata

    _HANDLERS: ClassVar[dict[Any, _Handler]]

    def __new__(
        cls, local_shards: list[torch.Tensor], local_offsets: Sequence[Sequence[int]]
    ) -> LocalShardsWrapper:
        if any(shard.device != local_shards[0].device for shard in local_shards[1:]):
            raise AssertionError
        if local_shards:
            size = _logical_size(local_shards)
            device = local_shards[0].device
            properties = TensorProperties.create_from_tensor(local_shards[0])
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(offset), sizes=shard.size())
                for shard, offset in zip(local_shards, local_offsets, strict=False)
            ]
        else:
            size = torch.Size([0, 0])
            device = torch.device("meta")
            properties = TensorProperties()
            chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([0, 0]))]
        # No dtype: the wrapper reports the default dtype whatever its shards hold (upstream).
        wrapper: LocalShardsWrapper = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, size, device=device
        )
        wrapper._local_shards = list(local_shards)
        wrapper._storage_meta = TensorStorageMetadata(
            properties=properties, size=size, chunks=chunks
        )
        return wrapper

    # -- dispatch ---------------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        handler = cls._HANDLERS.get(func)
        if handler is None:
            raise NotImplementedError(f"{func} is not supported for LocalShardsWrapper!")
        return handler(args, kwargs or {})

    # -- tensor-like properties -----------------------------------------------------------------

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """The shards' device; ``meta`` when there are none."""
        return self._local_shards[0].device if self._local_shards else torch.device("meta")

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        """Whether the shards are meta tensors (True when there are none)."""
        return self._local_shards[0].is_meta if self._local_shards else True

    def is_pinned(self, device: Any = None) -> bool:  # type: ignore[override]
        """Whether the first shard was pinned when the wrapper was made."""
        return self._storage_meta.properties.pin_memory

    def requires_grad_(self, requires_grad: bool = True) -> LocalShardsWrapper:
        """Set ``requires_grad`` on every shard and in the storage metadata; returns self."""
        self._storage_meta.properties.requires_grad = requires_grad
        for shard in self._local_shards:
            shard.requires_grad_(requires_grad)
        return self

    # -- shards and their metadata -----------------------------------------------------------

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's shards (empty if it holds none)."""
        return self._local_shards

    def local_sizes(self) -> list[torch.Size]:
        """The size of each shard, from the storage metadata."""
        return [chunk.sizes for chunk in self._storage_meta.chunks]

    def local_offsets(self) -> list[torch.Size]:
        """The global offsets of each shard, from the storage metadata."""
        return [chunk.offsets for chunk in self._storage_meta.chunks]

    @property
    def local_chunks(self) -> list[ChunkStorageMetadata]:
        """Offsets and sizes of each shard."""
        return self._storage_meta.chunks

    def storage_metadata(self) -> TensorStorageMetadata:
        """Properties (of the shards), logical size and chunks of this rank's part."""
        return self._storage_meta

    def is_empty_shard(self) -> bool:
        """Whether this rank holds nothing (logical size ``[0, 0]``)."""
        size = self._storage_meta.size
        return size[0] == 0 and size[1] == 0

    def _get_tensor_size_bytes(self) -> int:
        """Bytes held by the shards."""
        return sum(shard.numel() * shard.element_size() for shard in self._local_shards)

    # -- DCP's checkpoint protocol -----------------------------------------------------------

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        """One DCP ``WriteItem`` per shard; ``object`` (this wrapper or the DTensor around it)
        gives the global size."""
        from torch.distributed.checkpoint.metadata import MetadataIndex as DCPIndex
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        dcp_properties = properties_to_dcp(self._storage_meta.properties)
        return [
            WriteItem(
                index=DCPIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk.to_dcp(), properties=dcp_properties, size=object.size()
                ),
            )
            for _, chunk in zip(self._local_shards, self._storage_meta.chunks, strict=False)
        ]

    def __create_chunk_list__(self) -> list[DCPChunk]:
        """The shards' chunks, as DCP ``ChunkStorageMetadata``."""
        return [chunk.to_dcp() for chunk in self._storage_meta.chunks]

    def __get_tensor_shard__(self, index: DCPMetadataIndex) -> torch.Tensor:
        """The shard that starts at ``index.offset`` (``index.index`` is tried first)."""
        chunks = self._storage_meta.chunks
        hint = index.index
        if (
            hint is not None
            and 0 <= hint < len(self._local_shards)
            and chunks[hint].offsets == index.offset
        ):
            return self._local_shards[hint]
        if index.offset is not None:
            for shard, chunk in zip(self._local_shards, chunks, strict=False):
                if chunk.offsets == index.offset:
                    return shard
        if not self._local_shards and chunks[0].sizes == torch.Size([0, 0]):
            return torch.empty(0)
        raise ValueError(f"Could not find shard at '{index.offset}' for FQN: '{index.fqn}'")

    # -- identity and printing -----------------------------------------------------------------

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"LocalShardsWrapper:{self._local_shards} {self._storage_meta}"

    def __str__(self) -> str:
        return repr(self)


# -------------------------------------------------------------------------------------------
# Op handlers: ``args``/``kwargs`` as the dispatcher passes them, the wrapper first.
# -------------------------------------------------------------------------------------------


def _all_gather_into_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # The shards put together along their last dim, which is the wrapper's logical tensor for
    # both layouts (1-D row blocks, 2-D column blocks): what DTensor expects to gather.
    wrapper: LocalShardsWrapper = args[0]
    local = torch.cat(wrapper.local_shards(), dim=-1)
    return torch.ops._c10d_functional.all_gather_into_tensor.default(local, *args[1:], **kwargs)


def _wait_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    wrapper: LocalShardsWrapper = args[0]
    for shard in wrapper.local_shards():
        torch.ops._c10d_functional.wait_tensor.default(shard)
    return wrapper


def _to_copy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> LocalShardsWrapper:
    wrapper: LocalShardsWrapper = args[0]
    shards = [aten._to_copy.default(shard, *args[1:], **kwargs) for shard in wrapper.local_shards()]
    return LocalShardsWrapper(shards, wrapper.local_offsets())


def _view(args: tuple[Any, ...], kwargs: dict[str, Any]) -> LocalShardsWrapper:
    wrapper: LocalShardsWrapper = args[0]
    shape = list(args[1])
    shards = wrapper.local_shards()
    if len(shards) <= 1:
        viewed = [aten.view.default(shard, shape, **kwargs) for shard in shards]
        return LocalShardsWrapper(viewed, wrapper.local_offsets())
    # Several shards cannot all take the requested shape; DTensor only ever asks for the
    # wrapper's own shape (``view_as(self)``), which leaves every shard as it is.
    ndim = shards[0].ndim
    size = list(wrapper.storage_metadata().size)
    if ndim == 2:
        if shape != size:
            raise AssertionError
    elif ndim == 1:
        if shape[0] != size[0]:
            raise AssertionError
    else:
        raise NotImplementedError("No support for view on tensors ndim > 2")
    viewed = [aten.view.default(shard, list(shard.shape), **kwargs) for shard in shards]
    return LocalShardsWrapper(viewed, wrapper.local_offsets())


def _equal(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    first, second = args[0], args[1]
    if not isinstance(first, LocalShardsWrapper) or not isinstance(second, LocalShardsWrapper):
        return False
    if len(first.local_shards()) != len(second.local_shards()):
        return False
    pairs = zip(first.local_shards(), second.local_shards(), strict=True)
    if not all(aten.equal.default(a, b) for a, b in pairs):
        return False
    return first.storage_metadata() == second.storage_metadata()


def _detach(args: tuple[Any, ...], kwargs: dict[str, Any]) -> LocalShardsWrapper:
    # Upstream detaches in place and returns the same wrapper; callers rely on the identity.
    wrapper: LocalShardsWrapper = args[0]
    wrapper._local_shards = [aten.detach.default(shard) for shard in wrapper.local_shards()]
    wrapper._storage_meta.properties.requires_grad = False
    return wrapper


def _clone(args: tuple[Any, ...], kwargs: dict[str, Any]) -> LocalShardsWrapper:
    wrapper: LocalShardsWrapper = args[0]
    memory_format = kwargs.get("memory_format")
    if memory_format is not None and memory_format != torch.preserve_format:
        raise NotImplementedError(f"{memory_format} is not supported for LocalShardsWrapper!")
    shards = [shard.clone() for shard in wrapper.local_shards()]
    return LocalShardsWrapper(shards, wrapper.local_offsets())


def _new_empty(args: tuple[Any, ...], kwargs: dict[str, Any]) -> LocalShardsWrapper:
    # The requested size is ignored (upstream): the result mirrors the shards.
    wrapper: LocalShardsWrapper = args[0]
    shards = [torch.empty_like(shard) for shard in wrapper.local_shards()]
    return LocalShardsWrapper(shards, wrapper.local_offsets())


def _constant_pad_nd(args: tuple[Any, ...], kwargs: dict[str, Any]) -> LocalShardsWrapper:
    wrapper: LocalShardsWrapper = args[0]
    pad = [int(p) for p in args[1]]
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    shards = wrapper.local_shards()
    offsets = [list(offset) for offset in wrapper.local_offsets()]
    if not shards:
        raise NotImplementedError("Padding empty LocalShardsWrapper is not supported.")
    if len(shards) == 1:
        padded = [aten.constant_pad_nd.default(shards[0], pad, value)]
    else:
        ndim = shards[0].ndim
        last = len(shards) - 1
        if ndim == 2:
            # Column blocks: rows pad every block, columns pad the outer blocks only.
            if len(pad) == 2:
                pad = [*pad, 0, 0]
            if len(pad) != 4:
                raise ValueError(f"Padding spec must be of length 4 for 2D tensors, got {len(pad)}")
            left, right, top, bottom = pad
            padded = [
                aten.constant_pad_nd.default(
                    shard, [left if i == 0 else 0, right if i == last else 0, top, bottom], value
                )
                for i, shard in enumerate(shards)
            ]
            for offset in offsets[1:]:
                offset[1] += left
        elif ndim == 1:
            # Row blocks: the top pads the first block, the bottom the last.
            if len(pad) != 2:
                raise ValueError(f"Padding spec must be of length 2 for 1D tensors, got {len(pad)}")
            top, bottom = pad
            padded = [
                aten.constant_pad_nd.default(
                    shard, [top if i == 0 else 0, bottom if i == last else 0], value
                )
                for i, shard in enumerate(shards)
            ]
            for offset in offsets[1:]:
                offset[0] += top
        else:
            raise NotImplementedError(
                f"Padding for {ndim}D tensors is not supported. "
                "Only 1D and 2D tensors are currently supported."
            )
    result = LocalShardsWrapper(padded, offsets)
    result._storage_meta.properties = dataclasses.replace(wrapper.storage_metadata().properties)
    return result


def _handlers() -> dict[Any, _Handler]:
    table: dict[Any, _Handler] = {
        aten._to_copy.default: _to_copy,
        aten.view.default: _view,
        aten.equal.default: _equal,
        aten.detach.default: _detach,
        aten.clone.default: _clone,
        aten.new_empty.default: _new_empty,
        aten.constant_pad_nd.default: _constant_pad_nd,
    }
    if torch.distributed.is_available():
        # The functional collectives DTensor uses to replicate a sharded local tensor.
        functional = torch.ops._c10d_functional
        table[functional.all_gather_into_tensor.default] = _all_gather_into_tensor
        table[functional.wait_tensor.default] = _wait_tensor
    return table


LocalShardsWrapper._HANDLERS = _handlers()
