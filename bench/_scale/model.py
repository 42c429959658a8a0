"""What the ranks of a large FSDP job hold: a GPT-like training state and its dim-0 shards.

The tensors are those ``get_state_dict`` gives for a GPT-2-medium-like model (d_model 1024,
MLP 4096, vocabulary 50,304) trained with AdamW under FSDP2: every parameter and its two Adam
moments sharded along dim 0 over every rank (``Shard(0)``, torch's ceil rule: ranks past the
end hold an empty shard), and one 0-d ``step`` counter per parameter, replicated on every rank.
Blocks are repeated until the state has the number of sharded tensors asked for, so a large
count means a deep model, not different shapes.

Nothing here touches a process group: the shards are computed with the rule torch uses, and
:func:`check_against_torch` compares them with torch's own function on a sample.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.checkpoint.entries.items import LocalBox, TensorValue
from shardwise.checkpoint.planning.planner import Box
from shardwise.metadata import TensorProperties

# The module (the package exports its function of the same name).
snapshot_module = importlib.import_module("shardwise.checkpoint.saving.snapshot")

D_MODEL = 1024
D_MLP = 4 * D_MODEL
VOCAB = 50_304
CONTEXT = 1024
ITEMSIZE = 4  # float32 parameters and moments

# (name under the block, shape) of one transformer block, nanoGPT's names and nn.Linear's
# (out, in) weight layout.
_BLOCK = (
    ("ln_1.weight", (D_MODEL,)),
    ("ln_1.bias", (D_MODEL,)),
    ("attn.c_attn.weight", (3 * D_MODEL, D_MODEL)),
    ("attn.c_attn.bias", (3 * D_MODEL,)),
    ("attn.c_proj.weight", (D_MODEL, D_MODEL)),
    ("attn.c_proj.bias", (D_MODEL,)),
    ("ln_2.weight", (D_MODEL,)),
    ("ln_2.bias", (D_MODEL,)),
    ("mlp.c_fc.weight", (D_MLP, D_MODEL)),
    ("mlp.c_fc.bias", (D_MLP,)),
    ("mlp.c_proj.weight", (D_MODEL, D_MLP)),
    ("mlp.c_proj.bias", (D_MODEL,)),
)
_OUTSIDE = (
    ("transformer.wte.weight", (VOCAB, D_MODEL)),
    ("transformer.wpe.weight", (CONTEXT, D_MODEL)),
    ("transformer.ln_f.weight", (D_MODEL,)),
    ("transformer.ln_f.bias", (D_MODEL,)),
)


@dataclass(frozen=True, slots=True)
class Tensor:
    """One state-dict tensor of the job.

    Attributes:
        fqn: Its state-dict key (as ``save`` flattens ``{"model": ..., "optim": ...}``).
        shape: Its global shape.
        requires_grad: True for parameters.
        replicated: A 0-d ``step`` counter held whole by every rank; otherwise sharded
            along dim 0 over every rank.
    """

    fqn: str
    shape: tuple[int, ...]
    requires_grad: bool
    replicated: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE


def _parameters() -> Iterator[tuple[str, tuple[int, ...]]]:
    yield from _OUTSIDE[:2]
    layer = 0
    while True:
        for name, shape in _BLOCK:
            yield f"transformer.h.{layer}.{name}", shape
        layer += 1


def gpt_state(sharded: int, steps: bool = True) -> list[Tensor]:
    """The tensors of the training state, in state-dict order (model, then optimizer state),
    with about ``sharded`` sharded tensors: ``round(sharded / 3)`` parameters, each with its
    ``exp_avg`` and ``exp_avg_sq`` (and its replicated ``step`` with ``steps``)."""
    count = max(1, round(sharded / 3))
    names = []
    source = _parameters()
    for _ in range(count - 2 if count > 4 else count):
        names.append(next(source))
    if count > 4:  # end like a real model: the final layer norm
        names.extend(_OUTSIDE[2:])
    model = [Tensor(f"model.{name}", shape, True, False) for name, shape in names]
    optim = []
    for name, shape in names:
        prefix = f"optim.state.{name}"
        if steps:
            optim.append(Tensor(f"{prefix}.step", (), False, True))
        optim.append(Tensor(f"{prefix}.exp_avg", shape, False, False))
        optim.append(Tensor(f"{prefix}.exp_avg_sq", shape, False, False))
    return model + optim


def fsdp_box(shape: Sequence[int], ranks: int, rank: int) -> Box:
    """The global box rank ``rank`` of ``ranks`` holds of a tensor of ``shape`` under
    ``Shard(0)``: rows ``[rank * c, (rank + 1) * c)`` with ``c = ceil(rows / ranks)``, cut at
    the end; a rank past the end holds zero rows at offset ``rows`` (as torch places it)."""
    rows = shape[0]
    per = -(-rows // ranks)
    start = rank * per
    rest = tuple(shape[1:])
    zeros = (0,) * len(rest)
    if start >= rows:
        return (rows, *zeros), (0, *rest)
    return (start, *zeros), (min(per, rows - start), *rest)


def box_of(tensor: Tensor, ranks: int, rank: int) -> Box:
    """The box ``rank`` holds of ``tensor`` (all of it when it is replicated)."""
    if tensor.replicated:
        return (0,) * len(tensor.shape), tensor.shape
    return fsdp_box(tensor.shape, ranks, rank)


_PROPERTIES = {
    flag: TensorProperties(dtype=torch.float32, requires_grad=flag).to_dict()
    for flag in (False, True)
}


def plan_entries(tensors: Sequence[Tensor], ranks: int, rank: int) -> list[dict[str, Any]]:
    """Rank ``rank``'s tensor entries of the all-gather save exchange that ``save`` used until
    it planned from tables on the coordinator (session 4): equal, when it was removed, to what
    the former ``save._plan_entries`` gave for the rank's snapshot (checked at every run then).
    The "today's path" steps simulate that protocol as the baseline of
    docs/design/archive/scale.md."""
    entries = []
    for tensor in tensors:
        offsets, sizes = box_of(tensor, ranks, rank)
        entries.append(
            {
                "fqn": tensor.fqn,
                "dtype": "float32",
                "size": list(tensor.shape),
                "properties": _PROPERTIES[tensor.requires_grad],
                "itemsize": ITEMSIZE,
                "chunks": [[list(offsets), list(sizes)]],
            }
        )
    return entries


def snapshot_of(tensors: Sequence[Tensor], ranks: int, rank: int) -> Any:
    """Rank ``rank``'s ``_snapshot.Snapshot`` (boxes without data: nothing here reads them)."""
    empty = torch.empty(0)
    values = {}
    for tensor in tensors:
        offsets, sizes = box_of(tensor, ranks, rank)
        properties = TensorProperties(dtype=torch.float32, requires_grad=tensor.requires_grad)
        values[tensor.fqn] = TensorValue(
            tensor.shape, torch.float32, properties, [LocalBox(offsets, sizes, empty)]
        )
    return snapshot_module.Snapshot(values, {})


def check_against_torch(tensors: Sequence[Tensor], ranks: int) -> None:
    """Check :func:`fsdp_box` against torch's DTensor rule for a sample of tensors and ranks.

    Raises:
        AssertionError: They differ.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    sample = [t for t in tensors if not t.replicated][:40]
    for rank in sorted({0, 1, ranks // 2, ranks - 2, ranks - 1} & set(range(ranks))):
        for tensor in sample:
            shape, offsets = _compute_local_shape_and_global_offset(
                tensor.shape, (ranks,), [rank], [Shard(0)]
            )
            expected = (tuple(offsets), tuple(shape))
            assert fsdp_box(tensor.shape, ranks, rank) == expected, (tensor, rank, expected)
