"""``state_dict.flatten``'s internal keys follow the documented rule for any nesting (the walk
builds them a part at a time), and ``restore`` puts every value back where it came from."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.checkpoint.entries.state_dict import display_key, flatten, restore


def _documented_key(path: tuple[str | int, ...]) -> str:
    """docs/format.md, *Keys*: the parts joined by ``.``; with int parts, NUL and the
    positions of the int parts in the ``.``-split key, comma separated."""
    dotted = ".".join(str(part) for part in path)
    positions, segments = [], 0
    for part in path:
        if isinstance(part, int):
            positions.append(str(segments))
            segments += 1
        else:
            segments += part.count(".") + 1
    return f"{dotted}\x00{','.join(positions)}" if positions else dotted


_parts = st.one_of(st.text(alphabet="ab.0_", max_size=4), st.integers(min_value=-3, max_value=20))


@st.composite
def _trees(draw: st.DrawFn, depth: int = 0) -> tuple[Any, list[tuple[tuple[Any, ...], int]]]:
    """A nested state dict of dicts and lists with tensor leaves, and each leaf's path with
    the number it holds."""
    counter = draw(st.integers(0, 1000))
    leaves: list[tuple[tuple[Any, ...], int]] = []

    def build(level: int, path: tuple[Any, ...]) -> Any:
        nonlocal counter
        kind = draw(st.sampled_from(["leaf", "dict", "list"] if level < 4 else ["leaf"]))
        if kind == "leaf" and path:
            counter += 1
            leaves.append((path, counter))
            return torch.tensor(float(counter))
        if kind == "list" and path:
            size = draw(st.integers(1, 3))
            return [build(level + 1, (*path, i)) for i in range(size)]
        keys = draw(st.lists(_parts, min_size=1, max_size=3, unique=True))
        return {key: build(level + 1, (*path, key)) for key in keys}

    return build(0, ()), leaves


@settings(max_examples=200, deadline=None)
@given(tree=_trees())
def test_keys_follow_the_documented_rule_and_restore_puts_values_back(tree) -> None:
    state_dict, leaves = tree
    try:
        flat = flatten(state_dict)
    except ValueError:  # two paths give one key (e.g. "a.b" and "a" -> "b"): refused
        keys = [_documented_key(path) for path, _ in leaves]
        assert len(set(keys)) < len(keys)
        return
    assert list(flat.leaves) == [_documented_key(path) for path, _ in leaves]
    for (path, number), key in zip(leaves, flat.leaves, strict=True):
        assert display_key(key) == ".".join(str(part) for part in path)
        assert flat.leaves[key].item() == number
    restore(state_dict, flat, {key: torch.tensor(-1.0) for key in flat.leaves})
    assert all(value.item() == -1.0 for value in flatten(state_dict).leaves.values())
