"""Step 1 of a save: what a rank will write, described locally (no copies) and checked, with
its tied keys (``async_save`` then copies it to its staging area, :mod:`.staging`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardwise.checkpoint.entries.items import (
    ObjectValue,
    TensorValue,
    describe_object,
    describe_tensor,
    is_tensor_value,
    storage_key,
)
from shardwise.checkpoint.entries.state_dict import display_key, flatten
from shardwise.errors import CheckpointError

__all__ = ["Snapshot", "describe_or_error"]


@dataclass(slots=True)
class Snapshot:
    """Everything a rank will write, described locally."""

    tensors: dict[str, TensorValue]
    objects: dict[str, ObjectValue]
    # Keys whose local data is that of an earlier key (tied weights): key -> that key.
    aliases: dict[str, str] = field(default_factory=dict)


def _describe_state(state_dict: Mapping[str, Any], allow_pickle: bool) -> Snapshot:
    tensors: dict[str, TensorValue] = {}
    objects: dict[str, ObjectValue] = {}
    try:
        leaves = flatten(state_dict).leaves
    except (TypeError, ValueError):
        raise
    except Exception as err:  # a Stateful object's state_dict() failed
        raise CheckpointError(
            f"cannot save: taking the state dict apart failed with {type(err).__name__}: {err}"
        ) from err
    for key, value in leaves.items():
        fqn = display_key(key)
        try:
            if is_tensor_value(value):
                described = tensors[key] = describe_tensor(fqn, value)
                if _on_meta(described):
                    raise ValueError(
                        f"cannot checkpoint {fqn!r}: it is on the meta device, which holds no "
                        "data; materialize it first (e.g. module.to_empty(device=...) and "
                        "initialize it)"
                    )
            else:
                objects[key] = describe_object(fqn, value, allow_pickle)
        except (TypeError, ValueError):
            raise
        # Anything else is named and shared with every rank too, so no rank is left waiting.
        except Exception as err:
            raise CheckpointError(f"cannot save it: {type(err).__name__}: {err}", key=fqn) from err
    return Snapshot(tensors, objects, _local_aliases(tensors))


def _on_meta(value: TensorValue) -> bool:
    for box in value.boxes:  # noqa: SIM110 (a generator costs more than the check)
        if box.tensor.is_meta:
            return True
    return False


def _local_aliases(tensors: Mapping[str, TensorValue]) -> dict[str, str]:
    """Each key whose local data is that of an earlier key, mapped to the first such key; only
    keys whose first element shares its address with another's are compared in full
    (``storage_key``): in a state dict of thousands of tensors, few share memory."""
    addresses = {key: _first_address(value) for key, value in tensors.items()}
    shared = Counter(address for address in addresses.values() if address is not None)
    first: dict[tuple[Any, ...], str] = {}
    aliases = {}
    for key, address in addresses.items():
        if address is None or shared[address] < 2:
            continue
        identity = storage_key(tensors[key])
        if identity is not None:
            target = first.setdefault(identity, key)
            if target != key:
                aliases[key] = target
    return aliases


def _first_address(value: TensorValue) -> int | None:
    """The address of the first element this rank holds of ``value`` (``None``: none; -1: a
    tensor without plain storage, compared by ``storage_key``)."""
    for box in value.boxes:
        if box.tensor.numel():
            try:
                return box.tensor.data_ptr()
            except (RuntimeError, NotImplementedError, TypeError):
                return -1
    return None


def describe_or_error(
    state_dict: Mapping[str, Any], allow_pickle: bool
) -> tuple[Snapshot, BaseException | None]:
    """The local description, or the error that stops it, raised once every rank has shared
    its verdict."""
    try:
        return _describe_state(state_dict, allow_pickle), None
    except Exception as err:
        return Snapshot({}, {}), err
