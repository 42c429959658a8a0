"""``ShardedTensorBase`` and ``ShardedTensor``: a tensor whose shards live on several ranks.

Both are wrapper subclasses of ``torch.Tensor``: the wrapper carries the global size, dtype,
layout and requires_grad but no storage; the data lives in this rank's :class:`Shard` list.

The work behind the methods lives in the modules beside this one (``gather``, ``reshard``,
``moves``, ``serialization``, ``remote``, ``dcp_protocol``, ``guards``), which take the tensor
as an argument and so never import this module at run time. The torch functions called on a
ShardedTensor go to the op registry of :mod:`shardwise.ops`, a layer above this one: it is
installed here (:func:`install_torch_function_handler`) when :mod:`shardwise.sharded_tensor`
is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ProcessGroup

from shardwise import collectives
from shardwise.metadata import ShardedTensorMetadata, TensorProperties, keeps_requires_grad
from shardwise.sharded_tensor import dcp_protocol, gather, guards, moves, remote, reshard
from shardwise.sharded_tensor.remote import (  # noqa: F401 - upstream's names live here
    _sharded_tensor_lock,
    _sharded_tensor_map,
)
from shardwise.sharded_tensor.serialization import ProcessGroupState, get_state, set_state
from shardwise.sharded_tensor.shard import Shard
from shardwise.sharded_tensor.utils import (
    build_global_metadata,
    build_metadata_from_local_shards,
    check_local_shard,
    flatten_tensor_size,
    parse_and_validate_remote_device,
    recalc_global_sharded_tensor_metadata,
    recalculated_entry,
    size_dims,
)
from shardwise.sharding_spec import ShardingSpec
from shardwise.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)
from shardwise.sharding_spec.inference import _infer_sharding_spec_from_shards_metadata

__all__ = ["ShardedTensor", "ShardedTensorBase", "install_torch_function_handler"]

#: ``handler(func, types, args, kwargs)``: what ``ShardedTensor.__torch_function__`` runs.
TorchFunctionHandler = Callable[
    [Callable[..., Any], tuple[type, ...], tuple[Any, ...], dict[str, Any] | None], Any
]

_torch_function_handler: TorchFunctionHandler | None = None


def install_torch_function_handler(handler: TorchFunctionHandler) -> None:
    """Route every torch function called on a ShardedTensor to ``handler``.

    :mod:`shardwise.sharded_tensor` installs ``shardwise.ops.registry.dispatch`` when it is
    imported (dependency inversion: the ops are built on this module).
    """
    global _torch_function_handler
    _torch_function_handler = handler


def _require_pinnable(pin_memory: bool) -> None:
    if pin_memory and not torch.accelerator.is_available():
        raise RuntimeError(
            "pin_memory=True cannot be honored: pinned (page-locked) memory needs a CUDA or "
            "other accelerator runtime, and this host has none. Pass pin_memory=False."
        )


class ShardedTensorBase(torch.Tensor):
    """The data of a sharded tensor with no process group attached.

    Built by :meth:`_init_from_local_shards_and_global_metadata` (no communication, usable
    without ``init_process_group``); :class:`ShardedTensor` adds the process group.
    """

    _sharding_spec: ShardingSpec
    _metadata: ShardedTensorMetadata
    _local_shards: list[Shard]

    @staticmethod
    def __new__(cls, sharding_spec: ShardingSpec, *size: Any, **kwargs: Any) -> Any:
        if not isinstance(sharding_spec, ShardingSpec):
            raise ValueError(f"Expecting ShardingSpec but got: {type(sharding_spec)}")
        sizes = flatten_tensor_size(size)
        dtype = kwargs.get("dtype")
        properties = TensorProperties(
            dtype=torch.get_default_dtype() if dtype is None else dtype,
            layout=kwargs.get("layout", torch.strided),
            requires_grad=kwargs.get("requires_grad", False),
            pin_memory=kwargs.get("pin_memory", False),
        )
        metadata = sharding_spec.build_metadata(sizes, tensor_properties=properties)
        return cls._new_wrapper(sharding_spec, metadata)

    @classmethod
    def _new_wrapper(cls, sharding_spec: ShardingSpec, metadata: ShardedTensorMetadata) -> Any:
        properties = metadata.tensor_properties
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            metadata.size,
            dtype=properties.dtype,
            layout=properties.layout,
            pin_memory=properties.pin_memory,
            requires_grad=properties.requires_grad,
        )
        wrapper._sharding_spec = sharding_spec
        wrapper._metadata = metadata
        wrapper._local_shards = []
        return wrapper

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        raise guards.dispatch_error(cls.__name__, func, ShardedTensor)

    # -- accessors -------------------------------------------------------------------------

    def metadata(self) -> ShardedTensorMetadata:
        """The global metadata (the live object, not a copy)."""
        return self._metadata

    def local_shards(self) -> list[Shard]:
        """This rank's shards (the live list; may be empty)."""
        return self._local_shards

    def sharding_spec(self) -> ShardingSpec:
        """The sharding spec this tensor was created with or inferred to have."""
        return self._sharding_spec

    def is_pinned(self) -> bool:  # type: ignore[override]
        """Whether the shards were created in pinned memory."""
        return self._metadata.tensor_properties.pin_memory

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardedTensor({self._metadata})"

    def __hash__(self) -> int:
        return id(self)

    @classmethod
    def _init_from_local_shards_and_global_metadata(  # type: ignore[override]
        cls,
        local_shards: list[Shard],
        sharded_tensor_metadata: ShardedTensorMetadata,
        sharding_spec: ShardingSpec | None = None,
    ) -> ShardedTensorBase:
        """Wrap ``local_shards`` with ``sharded_tensor_metadata``; no process group involved.

        Every shard given is stored as is; the metadata is checked for overlap and coverage.
        """
        shards_metadata = sharded_tensor_metadata.shards_metadata
        if len(shards_metadata) == 0:
            raise ValueError("shards_metadata must not be empty!")
        if sharded_tensor_metadata.tensor_properties.layout != torch.strided:
            raise ValueError("Only torch.strided layout is currently supported")
        spec = sharding_spec or _infer_sharding_spec_from_shards_metadata(shards_metadata)
        result = ShardedTensor._new_wrapper(spec, sharded_tensor_metadata)
        validate_non_overlapping_shards_metadata(shards_metadata)
        check_tensor(shards_metadata, list(sharded_tensor_metadata.size))
        result._local_shards = local_shards
        return result  # type: ignore[no-any-return]


class ShardedTensor(ShardedTensorBase):
    """A tensor split into shards placed on the ranks of a process group.

    Creating one is SPMD: call the same constructor on every rank. Placements name *global*
    ranks; a rank owns the shards whose placement names it (possibly several, possibly none).

    Args:
        sharding_spec: How the tensor is split (e.g. :class:`ChunkShardingSpec`).
        *size: The global size, as varargs or one sequence.
        dtype: Element type (default: the default dtype).
        layout: Only ``torch.strided``.
        requires_grad: Whether autograd records operations on the shards.
        pin_memory: Allocate shards in pinned memory (needs an accelerator runtime).
        memory_format: Only ``torch.contiguous_format``.
        process_group: The group the shards live on (default: the default group).
        init_rrefs: Exchange RPC references to every shard (needs ``rpc.init_rpc``).

    Example:
        >>> spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
        >>> st = ShardedTensor(spec, 10, 4)  # rank 0 owns rows 0-4, rank 1 rows 5-9
    """

    #: Where a pickled tensor was saved (upstream spells it ``ShardedTensor.ProcessGroupState``).
    ProcessGroupState = ProcessGroupState

    _process_group: ProcessGroup
    _init_rrefs: bool
    _sharded_tensor_id: int | None
    _remote_shards: dict[int, list[Any]]

    @staticmethod
    def __new__(cls, sharding_spec: ShardingSpec, *size: Any, **kwargs: Any) -> Any:
        return ShardedTensorBase.__new__(cls, sharding_spec, *size, **kwargs)

    def __init__(
        self,
        sharding_spec: ShardingSpec,
        *size: Any,
        dtype: torch.dtype | None = None,
        layout: torch.layout = torch.strided,
        requires_grad: bool = False,
        pin_memory: bool = False,
        memory_format: torch.memory_format = torch.contiguous_format,
        process_group: ProcessGroup | None = None,
        init_rrefs: bool = False,
    ) -> None:
        self._prepare_init(process_group=process_group, init_rrefs=init_rrefs)
        if layout != torch.strided:
            raise ValueError("Only torch.strided layout is currently supported")
        if memory_format != torch.contiguous_format:
            raise ValueError("Only torch.contiguous_format memory_format is currently supported")
        _require_pinnable(pin_memory)
        current_rank = collectives.global_rank()
        properties = self._metadata.tensor_properties
        for shard_metadata in self._metadata.shards_metadata:
            rank, device = parse_and_validate_remote_device(
                self._process_group, shard_metadata.placement
            )
            if rank == current_rank:
                tensor = torch.empty(
                    shard_metadata.shard_sizes,
                    dtype=properties.dtype,
                    layout=properties.layout,
                    device=device,
                    requires_grad=properties.requires_grad,
                    memory_format=memory_format,
                    pin_memory=properties.pin_memory,
                )
                self._local_shards.append(Shard(tensor, shard_metadata))
        self._post_init()

    def _prepare_init(self, process_group: ProcessGroup | None, init_rrefs: bool) -> None:
        self._init_rrefs = init_rrefs
        self._sharded_tensor_id = None
        self._process_group = collectives.resolve_group(process_group)
        self._remote_shards = {}

    def _post_init(self) -> None:
        if self._init_rrefs:
            remote.init_rrefs(self)

    # -- torch.distributed.checkpoint (DCP) object protocol ---------------------------------

    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        """DCP protocol: one write item per local shard (DCP's own classes)."""
        return dcp_protocol.write_items(fqn, self)

    def __create_chunk_list__(self) -> list[Any]:
        """DCP protocol: the boxes of this rank's shards (DCP ``ChunkStorageMetadata``)."""
        return dcp_protocol.chunk_list(self)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        """DCP protocol: the local shard tensor at ``index.offset``."""
        return dcp_protocol.tensor_shard(self, index)

    # -- resharding and pickling ------------------------------------------------------------

    def reshard(self, resharding_spec: ShardingSpec) -> ShardedTensor:
        """Move the data to the layout of ``resharding_spec``, in place; returns ``self``.

        Collective. Any layout to any layout: chunk or enumerable specs, any dims, several
        shards per rank, uneven chunks. Only bytes that change owner cross the network. A
        chunk spec with the same dim and placements is a no-op; a chunk target keeps its shard
        metadata ordered by placement rank.
        """
        return reshard.reshard(self, resharding_spec)

    def __getstate__(self) -> tuple[Any, ...]:
        return get_state(self)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        set_state(self, state)

    # -- torch function dispatch -----------------------------------------------------------

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        handler = _torch_function_handler
        assert handler is not None, "importing shardwise.sharded_tensor installs the op dispatch"
        return handler(func, types, args, kwargs)

    # -- accessors -------------------------------------------------------------------------

    def local_tensor(self) -> torch.Tensor:
        """The tensor of this rank's only shard.

        Raises:
            NotImplementedError: This rank does not own exactly one shard.
        """
        if len(self._local_shards) != 1:
            raise NotImplementedError(
                f"Only single local shard is supported. Number of shards: {len(self._local_shards)}"
            )
        return self._local_shards[0].tensor

    def remote_shards(self) -> dict[int, list[Any]]:
        """RRefs to other ranks' shards, keyed by RPC rank (needs ``init_rrefs=True``)."""
        if not self._init_rrefs:
            raise RuntimeError(
                "ShardedTensor created with init_rrefs=False, no RRefs to remote shards available"
            )
        return self._remote_shards

    def _current_device(self) -> torch.device:
        if self._local_shards:
            return self._local_shards[0].tensor.device
        group = getattr(self, "_process_group", None)
        if group is not None and not collectives.is_member(group):
            # A rank outside the group has no handle on its backend; answer for the default
            # group's instead (upstream failed there).
            group = collectives.resolve_group(None)
        if group is None or collectives.comm_device(group).type == "cpu":
            return torch.device("cpu")
        return collectives.comm_device(group)  # pragma: no cover - needs a GPU

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def _init_from_local_shards(
        cls,
        local_shards: list[Shard],
        *global_size: Any,
        process_group: ProcessGroup | None = None,
        init_rrefs: bool = False,
    ) -> ShardedTensor:
        """See :func:`shardwise.init_from_local_shards`."""
        group = collectives.resolve_group(process_group)
        sizes = size_dims(global_size)
        recalc = any(dim is None for dim in sizes)
        current_rank = collectives.global_rank()

        def local_view() -> ShardedTensorMetadata | None:
            # The size is validated here, inside the exchange, so that a bad size on one rank
            # makes every rank raise instead of leaving the others waiting.
            size = flatten_tensor_size([0 if dim is None else dim for dim in sizes])
            if not local_shards:
                return None
            return build_metadata_from_local_shards(local_shards, size, current_rank, group)

        _, views = collectives.exchange_or_raise(
            group, local_view, lambda view: None if view is None else view.to_dict()
        )
        # Pure functions of the gathered views from here on: every rank reaches the same verdict.
        global_metadata = build_global_metadata(
            [None if view is None else ShardedTensorMetadata.from_dict(view) for view in views]
        )
        if recalc:
            recalc_global_sharded_tensor_metadata(global_metadata)
        shards_metadata = global_metadata.shards_metadata
        validate_non_overlapping_shards_metadata(shards_metadata)
        check_tensor(shards_metadata, list(global_metadata.size))
        if recalc:
            # This rank's own verdict first (its own numbers in the message), then every other
            # member's, computed from the gathered views, so that all ranks raise together.
            mine = recalculated_entry(global_metadata, len(local_shards), current_rank)
            for view, rank in zip(views, collectives.global_ranks(group), strict=True):
                num_shards = 0 if view is None else len(view["shards"])
                recalculated_entry(global_metadata, num_shards, rank)
            local_shards[0].metadata = mine
        spec = _infer_sharding_spec_from_shards_metadata(shards_metadata)
        result: ShardedTensor = cls._new_wrapper(spec, global_metadata)
        result._prepare_init(process_group=group, init_rrefs=init_rrefs)
        result._local_shards = local_shards
        result._post_init()
        return result

    @classmethod
    def _init_from_local_shards_and_global_metadata(  # type: ignore[override]
        cls,
        local_shards: list[Shard],
        sharded_tensor_metadata: ShardedTensorMetadata,
        process_group: ProcessGroup | None = None,
        init_rrefs: bool = False,
        sharding_spec: ShardingSpec | None = None,
    ) -> ShardedTensor:
        """Wrap this rank's shards given the global metadata; no communication.

        Only this rank's shards are checked against the metadata; other ranks' entries are
        trusted (each rank checks its own).
        """
        group = collectives.resolve_group(process_group)
        current_rank = collectives.global_rank()
        shards_metadata = sharded_tensor_metadata.shards_metadata
        owned = [
            md
            for md in shards_metadata
            if parse_and_validate_remote_device(group, md.placement)[0] == current_rank
        ]
        if len(local_shards) != len(owned):
            raise RuntimeError(
                f"Number of local shards ({len(local_shards)}) does not match number of local "
                f"shards metadata in sharded_tensor_metadata ({len(owned)}) on rank "
                f"({current_rank}) "
            )
        if len(shards_metadata) == 0:
            raise ValueError("shards_metadata must not be empty!")
        properties = sharded_tensor_metadata.tensor_properties
        if properties.layout != torch.strided:
            raise ValueError("Only torch.strided layout is currently supported")
        spec = sharding_spec or _infer_sharding_spec_from_shards_metadata(shards_metadata)
        result: ShardedTensor = cls._new_wrapper(spec, sharded_tensor_metadata)
        result._prepare_init(process_group=group, init_rrefs=init_rrefs)
        for shard in local_shards:
            check_local_shard(shard, properties)
        validate_non_overlapping_shards_metadata(shards_metadata)
        check_tensor(shards_metadata, list(sharded_tensor_metadata.size))
        result._local_shards = local_shards
        result._post_init()
        return result

    @classmethod
    def _init_from_local_tensor(
        cls,
        local_tensor: torch.Tensor,
        sharding_spec: ShardingSpec,
        *global_size: Any,
        process_group: ProcessGroup | None = None,
        init_rrefs: bool = False,
    ) -> ShardedTensor:
        """See :func:`shardwise.init_from_local_tensor`."""
        if not local_tensor.is_contiguous():
            raise ValueError("local_tensor is not a contiguous Tensor.")
        group = collectives.resolve_group(process_group)
        size = flatten_tensor_size(global_size)
        metadata = sharding_spec.build_metadata(
            size, TensorProperties.create_from_tensor(local_tensor)
        )
        current_rank = collectives.global_rank()
        local_shards = [
            Shard(local_tensor, md)
            for md in metadata.shards_metadata
            if parse_and_validate_remote_device(group, md.placement)[0] == current_rank
        ]
        return cls._init_from_local_shards_and_global_metadata(
            local_shards,
            metadata,
            process_group=group,
            init_rrefs=init_rrefs,
            sharding_spec=sharding_spec,
        )

    # -- collectives -----------------------------------------------------------------------

    def gather(  # type: ignore[override]
        self,
        dst: int = 0,
        out: torch.Tensor | None = None,
        enforce_dtype: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Assemble the full tensor into ``out`` on group rank ``dst`` (collective).

        Args:
            dst: Group rank that receives the tensor.
            out: The full-size destination tensor on ``dst``; ``None`` on every other rank.
            enforce_dtype: Receive in ``out.dtype`` (kept for compatibility; ``dtype`` is the
                modern spelling).
            dtype: Element type of the transfer; default: this tensor's own dtype.

        Raises:
            ValueError: ``out`` is missing on ``dst``, has the wrong size, or is given on
                another rank. Every rank raises, so nobody is left waiting.
        """
        gather.gather(self, dst=dst, out=out, enforce_dtype=enforce_dtype, dtype=dtype)

    # -- device and dtype moves --------------------------------------------------------------

    def cpu(  # type: ignore[override]
        self,
        memory_format: torch.memory_format = torch.preserve_format,
        process_group: ProcessGroup | None = None,
    ) -> ShardedTensor:
        """A copy with every shard on the CPU (``self`` when all placements already are)."""
        moves.check_memory_format(memory_format)
        if all(
            md.placement is not None and md.placement.device().type == "cpu"
            for md in self._metadata.shards_metadata
        ):
            return self
        cpu = torch.device("cpu")
        shards = moves.moved_shards(
            self._local_shards, lambda tensor: tensor.cpu(memory_format=memory_format), cpu
        )
        metadata = moves.metadata_on_device(self._metadata, lambda device: cpu)
        metadata.tensor_properties.requires_grad = keeps_requires_grad(
            self.requires_grad, self.dtype
        )
        return self._moved(shards, metadata, process_group)

    def cuda(  # type: ignore[override]  # pragma: no cover - needs a GPU
        self,
        device: torch.device | str | int | None = None,
        non_blocking: bool = False,
        memory_format: torch.memory_format = torch.preserve_format,
        process_group: ProcessGroup | None = None,
    ) -> ShardedTensor:
        """A copy with every local shard on the current CUDA device."""
        moves.check_memory_format(memory_format)
        current = torch.device("cuda", torch.cuda.current_device())
        if device is not None:
            requested = torch.device("cuda", device) if isinstance(device, int) else device
            if torch.device(requested).index != current.index:
                raise AssertionError(
                    'Only device without device id (e.g. "cpu" or "cuda") is expected for '
                    "ShardedTensor!"
                )
        shards = moves.moved_shards(
            self._local_shards,
            lambda tensor: tensor.cuda(
                device=current, non_blocking=non_blocking, memory_format=memory_format
            ),
            current,
        )
        metadata = moves.metadata_on_device(
            self._metadata, lambda old: old if old.type == "cuda" else current
        )
        return self._moved(shards, metadata, process_group)

    def to(self, *args: Any, **kwargs: Any) -> ShardedTensor:  # type: ignore[override]
        """Move or convert the shards, like ``Tensor.to``.

        Accepts ``to(dtype)``, ``to(device)``, ``to(tensor)``, ``to(device, dtype)``, the
        ``(device, dtype, non_blocking)`` form that ``nn.Module.to`` uses, and the keywords
        ``device``, ``dtype``, ``non_blocking``, ``copy``, ``memory_format``, ``process_group``.
        Returns ``self`` when nothing changes and ``copy`` is false.
        """
        current_device = self._current_device()
        to = moves.parse_to_args(current_device, self.dtype, args, kwargs)
        device, dtype = to.device, to.dtype
        if device.type != "cpu":
            device = moves.force_current_accelerator_index(device)  # pragma: no cover - GPU
        if not to.copy and dtype == self.dtype and device == current_device:
            return self
        shards = moves.moved_shards(
            self._local_shards,
            lambda tensor: tensor.to(
                device=device,
                dtype=dtype,
                non_blocking=to.non_blocking,
                copy=to.copy,
                memory_format=to.memory_format,
            ),
            device,
        )
        metadata = moves.metadata_on_device(self._metadata, lambda old: device)
        metadata.tensor_properties.dtype = dtype
        metadata.tensor_properties.requires_grad = keeps_requires_grad(self.requires_grad, dtype)
        return self._moved(shards, metadata, to.process_group)

    def _moved(
        self,
        shards: list[Shard],
        metadata: ShardedTensorMetadata,
        process_group: ProcessGroup | None,
    ) -> ShardedTensor:
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards,
            metadata,
            process_group=process_group or self._process_group,
            init_rrefs=self._init_rrefs,
        )
