"""A training state as torchtitan checkpoints it, on one rank: the model under FSDP2, AdamW
after real steps, ``{"model": ..., "optim": ...}`` from ``get_state_dict`` — and the known
values the benchmark writes into it, clears and checks.

Every tensor of the state holds a pattern that depends on its key and on each element's global
(row-major) position (:func:`model.pattern`), so a load into any world size can be checked
exactly, and a load that leaves a value alone, or puts one tensor's bytes into another, fails.
``step`` tensors (plain, replicated) hold a number derived from their key.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from _training.model import Decoder, ModelShape, key_salt, pattern

# Values of the first param group that a load must bring back (the target gets others).
SAVED_LR = 3e-4
CLEARED_LR = -1.0


@dataclass(slots=True)
class Leaf:
    """One tensor of the state: its dotted key, the tensor in the state dict, the local
    tensor this rank holds, and where that local tensor starts in the flat global tensor."""

    key: str
    value: torch.Tensor
    local: torch.Tensor
    first: int


def build(shape: ModelShape, mesh: DeviceMesh, per_layer: bool, steps: int) -> TrainingState:
    """The model of ``shape`` sharded with FSDP2 over ``mesh`` (each block its own FSDP unit
    when ``per_layer``, as torchtitan does; else one unit), AdamW after ``steps`` real steps
    (``steps=0``: the state ``get_state_dict`` initializes, as a job about to load has)."""
    torch.manual_seed(0)
    model = Decoder(shape)
    if per_layer:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=SAVED_LR, weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, shape.vocab, (1, 16), generator=generator)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, shape.vocab), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    model_state, optim_state = get_state_dict(model, optim)
    return TrainingState(model, optim, {"model": model_state, "optim": optim_state})


def _walk(node: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(node, torch.Tensor):
        yield path, node
    elif isinstance(node, dict):
        for key, child in node.items():
            yield from _walk(child, f"{path}.{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for index, child in enumerate(node):
            yield from _walk(child, f"{path}.{index}")


def _leaf(key: str, value: torch.Tensor) -> Leaf:
    if isinstance(value, DTensor):
        local = value.to_local()
        _, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        # FSDP2 shards dim 0 only, so a rank's part is a contiguous run of the flat tensor.
        assert all(offset == 0 for offset in offsets[1:]), (key, offsets)
        assert local.is_contiguous(), key
        first = offsets[0] * math.prod(value.shape[1:]) if local.numel() else 0
        return Leaf(key, value, local, first)
    return Leaf(key, value, value, 0)


class TrainingState:
    """The model, its optimizer and their state dict, with the benchmark's known values."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer, state: Any) -> None:
        self.model = model
        self.optim = optim
        self.state: dict[str, Any] = state
        self.leaves = [_leaf(key, value) for key, value in _walk(state, "")]
        # Tied weights (two keys, one tensor) hold the pattern of the first key.
        first_key: dict[tuple[int, int, tuple[int, ...]], str] = {}
        self._pattern_key = {}
        for leaf in self.leaves:
            where = (leaf.local.data_ptr(), leaf.local.numel(), tuple(leaf.local.shape))
            self._pattern_key[leaf.key] = (
                first_key.setdefault(where, leaf.key) if leaf.local.numel() else leaf.key
            )

    @property
    def local_tensors(self) -> list[torch.Tensor]:
        """This rank's local tensors, in state order."""
        return [leaf.local for leaf in self.leaves]

    @property
    def local_bytes(self) -> int:
        """Bytes of this rank's local tensors."""
        return sum(t.numel() * t.element_size() for t in self.local_tensors)

    @property
    def global_bytes(self) -> int:
        """Bytes of the whole state's tensors (each counted once)."""
        return sum(leaf.value.numel() * leaf.value.element_size() for leaf in self.leaves)

    def _expected(self, leaf: Leaf) -> torch.Tensor:
        salt = key_salt(self._pattern_key[leaf.key])
        if isinstance(leaf.value, DTensor):
            return pattern(leaf.first, leaf.local.numel(), salt).view(leaf.local.shape)
        # A step counter (or any plain tensor): one number derived from the key.
        return torch.full_like(leaf.local, float(salt % 100 + 1))

    def fill(self) -> None:
        """Write the known values into every tensor (and the first param group's lr)."""
        with torch.no_grad():
            for leaf in self.leaves:
                leaf.local.copy_(self._expected(leaf))
        self._param_group()["lr"] = SAVED_LR

    def clear(self, objects: bool = True) -> None:
        """Overwrite every value a load must restore with something else: -1 in every
        tensor, and (with ``objects``) the first param group's lr."""
        with torch.no_grad():
            for leaf in self.leaves:
                leaf.local.fill_(-1.0)
        if objects:
            self._param_group()["lr"] = CLEARED_LR

    def check(self, what: str, objects: bool = True) -> None:
        """Raise unless every tensor holds its known values and (with ``objects``) lr was
        restored."""
        with torch.no_grad():
            for leaf in self.leaves:
                if not torch.equal(leaf.local, self._expected(leaf)):
                    raise AssertionError(f"{what}: {leaf.key} differs from what was saved")
        lr = self._param_group()["lr"]
        if objects and lr != SAVED_LR:
            raise AssertionError(f"{what}: optim.param_groups.0.lr is {lr!r}, not {SAVED_LR}")

    def _param_group(self) -> dict[str, Any]:
        group: dict[str, Any] = self.state["optim"]["param_groups"][0]
        return group
