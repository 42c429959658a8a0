"""``ShardedOptimizer``: a ``torch.optim`` optimizer over the local shards of ShardedTensor
parameters, whose state dict is keyed by parameter name and holds sharded state as
ShardedTensors.

Gradients. The sharded ops' backward delivers to every shard the gradient of the sum of all
ranks' losses (each rank's output depends on every rank's shards). A plain (replicated)
parameter only gets its own rank's gradient: left alone, the replicas drift apart. Either
``sync_replicated_grads=True`` sums those gradients over the ranks before each step (the same
objective as the sharded parameters: the sum of the ranks' losses), or
``DistributedDataParallel`` told to ignore the sharded parameters averages them.

State. Each local shard is one parameter of the wrapped optimizer, so its state (Adam's
moments, ...) is shaped like the shard. :meth:`ShardedOptimizer.state_dict` joins the state of
a sharded parameter's local shards back into ShardedTensors with the parameter's sharding
(scalar state such as ``step`` stays a plain value), so ``shardwise.checkpoint`` saves it from
any world size and loads it into any other, each rank reading only its own shards.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from shardwise import collectives
from shardwise.metadata import ShardMetadata
from shardwise.sharded_tensor.api import ShardedTensor
from shardwise.sharded_tensor.like import with_local_tensors

__all__ = ["ShardedOptimizer"]


NamedParams = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class _Slot:
    """One tensor the wrapped optimizer steps: a plain parameter, or one local shard of a
    sharded one (``shard`` is then its metadata)."""

    name: str
    tensor: torch.Tensor
    shard: ShardMetadata | None


def _named(named_params: NamedParams) -> dict[str, torch.Tensor]:
    """``named_params`` as a dict, each tensor once (the first name of a tied tensor wins)."""
    pairs = named_params.items() if isinstance(named_params, Mapping) else named_params
    named: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in pairs:
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"ShardedOptimizer needs tensors or ShardedTensors, got {type(value).__name__} "
                f"for {name!r}"
            )
        if name in named:
            raise ValueError(f"parameter name {name!r} is given twice")
        if id(value) not in seen:
            seen.add(id(value))
            named[name] = value
    return named


def _box(full: torch.Tensor, metadata: ShardMetadata) -> torch.Tensor:
    """The part of ``full`` a shard covers (slicing: an empty trailing chunk may start past
    the end)."""
    return full[
        tuple(
            slice(offset, offset + size)
            for offset, size in zip(metadata.shard_offsets, metadata.shard_sizes, strict=True)
        )
    ]


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b


class ShardedOptimizer(torch.optim.Optimizer):
    """Run ``optimizer_class`` over plain parameters and the local shards of sharded ones.

    Upstream's ``torch.distributed._shard.sharded_optim.ShardedOptimizer``, with a working
    :meth:`state_dict` / :meth:`load_state_dict` / :meth:`add_param_group`. ``param_groups``
    and ``state`` are the wrapped optimizer's (LR schedulers work as with any optimizer).

    Args:
        named_params: Parameter name to tensor or ShardedTensor, e.g.
            ``dict(named_params_with_sharded_tensor(model))`` (the pairs themselves also do).
            The names key :meth:`state_dict`.
        optimizer_class: The optimizer to run locally, e.g. ``torch.optim.AdamW``.
        *optimizer_args: Its positional arguments after the parameters.
        sync_replicated_grads: Before each step, sum the gradients of the plain (replicated)
            parameters over the ranks (the process group of the sharded parameters, else the
            default group), so that every rank applies the same update to them and they get
            the gradient of the sum of the ranks' losses, as the sharded parameters do. Every
            rank must call :meth:`step`. Default ``False`` (upstream's behavior: each rank
            uses its own gradient).
        **optimizer_kwargs: Its keyword arguments, e.g. ``lr=1e-3``.

    Raises:
        TypeError: A value is not a tensor.
        ValueError: A name is given twice, or ``sync_replicated_grads`` with sharded
            parameters on different process groups.

    Example:
        >>> shardwise.shard_module(model, plan)
        >>> optim = ShardedOptimizer(
        ...     named_params_with_sharded_tensor(model), torch.optim.AdamW, lr=1e-3,
        ...     sync_replicated_grads=True)
        >>> model(batch).sum().backward()
        >>> optim.step()
    """

    def __init__(
        self,
        named_params: NamedParams,
        optimizer_class: Callable[..., torch.optim.Optimizer],
        *optimizer_args: Any,
        sync_replicated_grads: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        #: Name to parameter (tensor or ShardedTensor), as given.
        self.named_params: dict[str, torch.Tensor] = _named(named_params)
        #: Whether :meth:`step` sums the plain parameters' gradients over the ranks.
        self.sync_replicated_grads = sync_replicated_grads
        self._summed = False  # sync_grads() summed the replicated gradients of this step
        self._slots: list[_Slot] = []
        self._slot_of: dict[int, _Slot] = {}
        tensors = self._add_slots(self.named_params)
        self._check_groups()
        # An empty group rather than no parameters: a rank may hold no shard of anything.
        params: Any = tensors if tensors else [{"params": []}]
        self._optim = optimizer_class(params, *optimizer_args, **optimizer_kwargs)
        self._replicated_checked = False
        self._state_created: set[int] = set()
        # torch.optim.Optimizer's own bookkeeping; its __init__ would build groups of its own.
        self._optimizer_step_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._patch_step_function()

    # -- the wrapped optimizer's groups, state and defaults ---------------------------------

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (of local tensors)."""
        return self._optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optim.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The wrapped optimizer's state, keyed by local tensor."""
        return self._optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optim.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self._optim.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optim.defaults = value

    # -- parameters -------------------------------------------------------------------------

    def _add_slots(self, named: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for name, value in named.items():
            entries: list[tuple[torch.Tensor, ShardMetadata | None]]
            if isinstance(value, ShardedTensor):
                entries = [(shard.tensor, shard.metadata) for shard in value.local_shards()]
            else:
                entries = [(value, None)]
            for tensor, metadata in entries:
                slot = _Slot(name, tensor, metadata)
                self._slots.append(slot)
                self._slot_of[id(tensor)] = slot
                tensors.append(tensor)
        return tensors

    def _sharded(self) -> list[ShardedTensor]:
        return [value for value in self.named_params.values() if isinstance(value, ShardedTensor)]

    def _check_groups(self) -> None:
        groups = {id(st._process_group) for st in self._sharded()}
        if self.sync_replicated_grads and len(groups) > 1:
            raise ValueError(
                "ShardedOptimizer(sync_replicated_grads=True) needs every sharded parameter "
                "on one process group (the replicated parameters' gradients are summed over "
                f"it); these use {len(groups)} different groups"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: ``param_group["params"]`` names its tensors (a Mapping or pairs), the
        other keys are its options, as for any optimizer.

        Raises:
            ValueError: A name is already in use.
        """
        named = _named(param_group["params"])
        taken = sorted(set(named) & set(self.named_params))
        if taken:
            raise ValueError(f"parameter names already in the optimizer: {taken}")
        tensors = self._add_slots(named)
        self.named_params.update(named)
        self._check_groups()
        self._optim.add_param_group({**param_group, "params": tensors})

    # -- stepping ---------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every local tensor (``None`` unless ``set_to_none=False``)."""
        self._summed = False
        self._optim.zero_grad(set_to_none)

    def sync_grads(self) -> None:
        """Sum the plain (replicated) parameters' gradients over the ranks now, as
        ``sync_replicated_grads`` makes :meth:`step` do (collective: every rank calls it), so
        that what runs between backward and the step sees the gradients the step applies:
        ``shardwise.clip_grad_norm_`` then counts each replicated gradient once, the same on
        every rank. The next :meth:`step` does not sum them again."""
        self._sum_replicated_grads()
        self._summed = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One optimization step of the wrapped optimizer; returns the closure's loss.

        With ``sync_replicated_grads`` this is collective: the plain parameters' gradients
        are summed over the ranks first (after the closure, if there is one), unless
        :meth:`sync_grads` summed them since the last step.
        """
        summed, self._summed = self._summed, False
        if not self.sync_replicated_grads:
            return self._optim.step(closure)  # type: ignore[arg-type]
        if closure is None:
            if not summed:
                self._sum_replicated_grads()
            return self._optim.step()

        def synced() -> Any:
            loss = closure()
            self._sum_replicated_grads()
            return loss

        return self._optim.step(synced)

    def _sync_group(self) -> ProcessGroup | None:
        sharded = self._sharded()
        if sharded:
            return sharded[0]._process_group
        return collectives.resolve_group(None) if collectives.is_initialized() else None

    def _sum_replicated_grads(self) -> None:
        group = self._sync_group()
        if (
            group is None
            or not collectives.is_member(group)
            or collectives.group_world_size(group) == 1
        ):
            return
        slots = [slot for slot in self._slots if slot.shard is None and slot.tensor.requires_grad]
        if not self._replicated_checked:
            self._check_replicated(group, slots)
            self._replicated_checked = True
        if not slots:
            return
        # A rank whose loss did not reach a parameter has no gradient for it: it adds zeros,
        # and the parameter gets a gradient if any rank had one.
        had_grad = torch.tensor([slot.tensor.grad is not None for slot in slots], dtype=torch.int64)
        collectives.all_reduce(had_grad, "sum", group)
        buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, slot in enumerate(slots):
            buckets.setdefault((slot.tensor.dtype, slot.tensor.device), []).append(i)
        for indices in buckets.values():
            pieces = []
            for i in indices:
                grad = slots[i].tensor.grad
                pieces.append(
                    torch.zeros_like(slots[i].tensor).reshape(-1)
                    if grad is None
                    else grad.reshape(-1)
                )
            flat = torch.cat(pieces)
            collectives.all_reduce(flat, "sum", group)
            offset = 0
            for i in indices:
                tensor = slots[i].tensor
                summed = flat[offset : offset + tensor.numel()].view_as(tensor)
                offset += tensor.numel()
                if not had_grad[i]:
                    continue
                if tensor.grad is None:
                    tensor.grad = summed.clone()
                else:
                    tensor.grad.copy_(summed)

    def _check_replicated(self, group: ProcessGroup, slots: list[_Slot]) -> None:
        """Every rank has the same replicated parameters (names, sizes, dtypes)."""
        mine = [[slot.name, list(slot.tensor.shape), str(slot.tensor.dtype)] for slot in slots]
        _, everyone = collectives.exchange_or_raise(group, lambda: mine)
        ranks = collectives.global_ranks(group)
        for rank, theirs in zip(ranks, everyone, strict=True):
            if theirs != everyone[0]:
                raise ValueError(
                    "ShardedOptimizer(sync_replicated_grads=True) needs the same replicated "
                    "parameters (names, sizes, dtypes) on every rank: rank "
                    f"{ranks[0]} has {everyone[0]}, rank {rank} has {theirs}"
                )

    # -- state dict -------------------------------------------------------------------------

    def _create_missing_state(self) -> None:
        """Give every trainable local tensor its state, as DCP's ``get_state_dict`` does.

        Optimizers create state at a parameter's first step; until then a checkpoint load
        would have nothing sharded to fill. One step of the wrapped optimizer with zero
        gradients for the tensors that lack state, no gradient for the others, and a zero
        learning rate changes no parameter; the state it creates (e.g. Adam's ``step`` of 1
        and zero moments) is what a save then records and a load overwrites. Tried once per
        tensor (a stateless optimizer such as plain SGD creates none).
        """
        optim = self._optim
        missing = {
            id(slot.tensor)
            for slot in self._slots
            if slot.tensor.requires_grad
            and not optim.state.get(slot.tensor)
            and id(slot.tensor) not in self._state_created
        }
        if not missing:
            return
        self._state_created.update(missing)
        params = [param for group in optim.param_groups for param in group["params"]]
        grads = [param.grad for param in params]
        lrs = [group.get("lr") for group in optim.param_groups]
        try:
            for param in params:
                param.grad = torch.zeros_like(param) if id(param) in missing else None
            for group, lr in zip(optim.param_groups, lrs, strict=True):
                if lr is not None:
                    group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
            optim.step()
        finally:
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
            for group, lr in zip(optim.param_groups, lrs, strict=True):
                if lr is not None:
                    group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """The state, keyed by parameter name; sharded state as ShardedTensors.

        ``{"state": {name: {key: value}}, "param_groups": [{option: value, "params":
        [name, ...]}]}``. A state tensor shaped like a parameter's local shard (Adam's
        moments, ...) becomes a ShardedTensor with the parameter's sharding over the live
        state tensors (no copy); other state (``step``) is the local shards' common value.
        A rank that holds no shard of a parameter has no state for it.

        A parameter that has not stepped yet gets its state first (see
        :meth:`_create_missing_state`): a fresh optimizer's state dict is then a target that
        ``shardwise.checkpoint.load`` fills shard by shard, on any world size.

        Raises:
            RuntimeError: The local shards of one parameter disagree on their state.
        """
        self._create_missing_state()
        live = self._optim.state
        slots_of: dict[str, list[_Slot]] = {}
        for slot in self._slots:
            slots_of.setdefault(slot.name, []).append(slot)
        state: dict[str, dict[str, Any]] = {}
        for name, slots in slots_of.items():
            states = [live.get(slot.tensor) for slot in slots]
            if slots[0].shard is None:
                if states[0]:
                    state[name] = dict(states[0])
            elif any(states):
                state[name] = self._sharded_state(name, states)
        groups = []
        for group in self._optim.param_groups:
            names = [self._slot_of[id(param)].name for param in group["params"]]
            options = {key: value for key, value in group.items() if key != "params"}
            groups.append({**options, "params": list(dict.fromkeys(names))})
        return {"state": state, "param_groups": groups}

    def _sharded_state(self, name: str, states: list[Any]) -> dict[str, Any]:
        st = self.named_params[name]
        assert isinstance(st, ShardedTensor)
        if not all(states) or any(list(s) != list(states[0]) for s in states):
            raise RuntimeError(
                f"the local shards of {name!r} do not have the same optimizer state keys"
            )
        shapes = [shard.tensor.shape for shard in st.local_shards()]
        joined: dict[str, Any] = {}
        for key in states[0]:
            values = [s[key] for s in states]
            if all(
                isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shape
                for value, shape in zip(values, shapes, strict=True)
            ):
                joined[key] = with_local_tensors(st, values)
            elif all(_same(values[0], value) for value in values[1:]):
                joined[key] = values[0]
            else:
                raise RuntimeError(
                    f"optimizer state {key!r} of {name!r} differs between this rank's shards"
                )
        return joined

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of :meth:`state_dict`'s form, from any world size.

        Sharded state may be a ShardedTensor with the parameter's sharding (what
        ``shardwise.checkpoint.load`` fills) or the whole tensor (each rank takes its
        shards' part); the options of every group are restored.

        Raises:
            ValueError: The groups or parameter names do not match this optimizer's, or a
                ShardedTensor value is sharded differently from its parameter.
        """
        saved_groups = list(state_dict["param_groups"])
        saved_state = state_dict["state"]
        groups = self._optim.param_groups
        if len(saved_groups) != len(groups):
            raise ValueError(
                f"the state dict has {len(saved_groups)} parameter groups, this optimizer "
                f"has {len(groups)}"
            )
        unknown = sorted(set(saved_state) - set(self.named_params))
        if unknown:
            raise ValueError(f"the state dict has state for unknown parameters {unknown}")
        inner_groups: list[dict[str, Any]] = []
        slot_at: list[_Slot] = []
        for number, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
            names = list(dict.fromkeys(self._slot_of[id(p)].name for p in group["params"]))
            if sorted(saved["params"]) != sorted(names):
                raise ValueError(
                    f"parameter group {number} of the state dict holds {sorted(saved['params'])}"
                    f", this optimizer's holds {sorted(names)}"
                )
            start = len(slot_at)
            slot_at.extend(self._slot_of[id(p)] for p in group["params"])
            options = {key: value for key, value in saved.items() if key != "params"}
            inner_groups.append({**options, "params": list(range(start, len(slot_at)))})
        inner_state = {
            index: {
                key: self._local_value(slot, key, value)
                for key, value in saved_state[slot.name].items()
            }
            for index, slot in enumerate(slot_at)
            if slot.name in saved_state
        }
        self._optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})

    def _local_value(self, slot: _Slot, key: str, value: Any) -> Any:
        """What local tensor ``slot`` gets of a state value."""
        if slot.shard is None:
            return value
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                if (
                    shard.metadata.shard_offsets == slot.shard.shard_offsets
                    and shard.metadata.shard_sizes == slot.shard.shard_sizes
                ):
                    return shard.tensor
            raise ValueError(
                f"optimizer state {key!r} of {slot.name!r} is a ShardedTensor without a local "
                f"shard at offsets {slot.shard.shard_offsets} (sizes {slot.shard.shard_sizes}): "
                "it must be sharded like the parameter"
            )
        if not isinstance(value, torch.Tensor):
            return value
        full_size = self.named_params[slot.name].size()
        if value.dim() > 0 and value.shape == full_size:
            return _box(value, slot.shard).clone()
        # One copy per local shard: optimizers update their state in place.
        return value.clone()
