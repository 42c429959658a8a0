"""How a state dict is taken apart into checkpoint entries, and put back.

The rules (what is entered; internal keys: dotted, then ``\\x00`` and the positions of int
parts): ``docs/format.md``, *Keys*.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Flat", "display_key", "flatten", "is_stateful", "key_of_path", "restore"]

_MAX_DEPTH = 100
_SEPARATOR = "\x00"
# Exactly these types are plain tensors (a subclass may be anything, e.g. Stateful).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# A path's key, built a part at a time on the way down (O(1) per part, not O(depth) per
# leaf): (dotted key, the positions of int parts, dotted segments so far).
_KeyState = tuple[str, tuple[str, ...], int]
_ROOT: _KeyState = ("", (), 0)


def display_key(key: str) -> str:
    """The dotted key of an internal key (its int-position suffix dropped)."""
    return key.split(_SEPARATOR, 1)[0]


def is_stateful(value: object) -> bool:
    """Whether ``value`` is Stateful (``state_dict`` and ``load_state_dict``); tensors never are."""
    return (
        not isinstance(value, (torch.Tensor, Mapping))
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def _extend(state: _KeyState, part: str | int, first: bool) -> _KeyState:
    """``state`` of a path followed by ``part`` (``first``: the path was empty)."""
    dotted, ints, segments = state
    if isinstance(part, str):
        return (part if first else f"{dotted}.{part}", ints, segments + part.count(".") + 1)
    text = str(part)
    return (text if first else f"{dotted}.{text}", (*ints, str(segments)), segments + 1)


def _key_of(state: _KeyState) -> str:
    """The internal key of a path's state."""
    dotted, ints, _ = state
    return f"{dotted}{_SEPARATOR}{','.join(ints)}" if ints else dotted


def key_of_path(path: Sequence[str | int]) -> str:
    """The internal key of the leaf at ``path`` (its keys from the top, str or int), as
    :func:`flatten` names it.

    Raises:
        TypeError: A part is neither ``str`` nor ``int``, or not valid in a key.
    """
    state = _ROOT
    for number, part in enumerate(path):
        state = _extend(state, _check_part(part, tuple(path[:number])), number == 0)
    return _key_of(state)


@dataclass(slots=True)
class Flat:
    """A state dict taken apart.

    Attributes:
        leaves: Every leaf by internal key, in traversal order.
        statefuls: The Stateful objects met, each with the dict its ``state_dict()`` returned
            (the one :func:`restore` fills), innermost first.
    """

    leaves: dict[str, Any] = field(default_factory=dict)
    statefuls: list[tuple[Any, Any]] = field(default_factory=list)
    _dicts: dict[int, Any] = field(default_factory=dict)

    def state_of(self, value: Any) -> Any:
        """The state dict of Stateful ``value`` (asked once, then remembered)."""
        known = self._dicts.get(id(value))
        if known is None:
            known = self._dicts[id(value)] = value.state_dict()
            if not isinstance(known, Mapping):
                raise TypeError(
                    f"{type(value).__name__}.state_dict() returned a "
                    f"{type(known).__name__}, not a Mapping"
                )
        return known


def _enterable(value: object, depth: int = 0) -> bool:
    """Whether ``value`` is a node to enter; a list or tuple is one when it holds something
    to enter within the depth a state dict may have (deeper, it is a leaf)."""
    if isinstance(value, (torch.Tensor, Mapping)) or is_stateful(value):
        return True
    return (
        isinstance(value, (list, tuple))
        and depth < _MAX_DEPTH
        and any(_enterable(item, depth + 1) for item in value)
    )


def _node(flat: Flat, value: Any) -> Any:
    """What stands at a path: a Stateful object's state dict, or the value itself."""
    return flat.state_of(value) if is_stateful(value) else value


def _children(node: Any) -> Iterator[tuple[str | int, Any]] | None:
    """The children of a node with their path parts, or None for a leaf. An empty Mapping is
    a leaf (an entry ``{}``), so that it round-trips."""
    if isinstance(node, torch.Tensor):
        return None
    if isinstance(node, Mapping):
        return iter(node.items()) if node else None
    if isinstance(node, (list, tuple)) and _enterable(node):
        return iter(enumerate(node))
    return None


def _check_part(part: object, path: tuple[str | int, ...]) -> str | int:
    if type(part) is str and part.isascii() and _SEPARATOR not in part:
        return part  # the common case, without the checks below
    if isinstance(part, bool) or not isinstance(part, (str, int)):
        where = ".".join(str(p) for p in path) or "the state dict"
        raise TypeError(
            f"state_dict keys must be strings or ints, found {part!r} "
            f"({type(part).__name__}) in {where}"
        )
    if isinstance(part, str):
        if _SEPARATOR in part:
            raise TypeError(f"state_dict keys must not contain NUL characters, found {part!r}")
        try:
            part.encode()
        except UnicodeEncodeError:
            # A lone surrogate (e.g. a file name decoded with surrogateescape) has no UTF-8
            # form, so the index could not name the key.
            raise TypeError(
                f"state_dict keys must be valid Unicode text, found {part!r} (a lone surrogate)"
            ) from None
    return part


def flatten(state_dict: Mapping[str, Any]) -> Flat:
    """Take ``state_dict`` apart into leaves by internal key.

    Raises:
        TypeError: ``state_dict`` is not a Mapping, a key is neither ``str`` nor ``int``, or
            the nesting is deeper than 100 (a cycle?).
        ValueError: Two paths give the same key (e.g. ``{"a.b": 1, "a": {"b": 2}}``).
    """
    if not isinstance(state_dict, Mapping):
        hint = " (wrap it: {'model': model})" if is_stateful(state_dict) else ""
        raise TypeError(
            "state_dict must be a Mapping of str or int keys, such as "
            f"{{'model': ..., 'optim': ...}}; got {type(state_dict).__name__}{hint}"
        )
    flat = Flat()
    leaves = flat.leaves

    def visit(value: Any, path: tuple[str | int, ...], state: _KeyState) -> None:
        if len(path) > _MAX_DEPTH:
            raise TypeError(
                f"the state dict is nested deeper than {_MAX_DEPTH} levels at "
                f"{'.'.join(str(p) for p in path[:5])}... (a cycle?)"
            )
        node = _node(flat, value) if path else value
        children = _children(node) if path else iter(value.items())
        if children is None:
            _add_leaf(leaves, _key_of(state), node)
            return
        first = not path
        shallow = len(path) < _MAX_DEPTH
        for part, child in children:
            part = _check_part(part, path)
            if type(child) in _PLAIN_TENSORS and shallow:
                # A plain tensor is a leaf: no visit call (a state dict is mostly these).
                _add_leaf(leaves, _key_of(_extend(state, part, first)), child)
                continue
            visit(child, (*path, part), _extend(state, part, first))
        if path and is_stateful(value):
            flat.statefuls.append((value, flat.state_of(value)))

    visit(state_dict, (), _ROOT)
    return flat


def _add_leaf(leaves: dict[str, Any], key: str, value: Any) -> None:
    if key in leaves:
        raise ValueError(f"state_dict keys [{display_key(key)!r}] appear twice after flattening")
    leaves[key] = value


def restore(state_dict: MutableMapping[str, Any], flat: Flat, values: Mapping[str, Any]) -> None:
    """Put ``values`` (leaves by internal key, from :func:`flatten` of this ``state_dict``)
    into ``state_dict`` in place: Mappings and lists are assigned into, tuples rebuilt (named
    tuples stay named) in their parent, and every Stateful object gets ``load_state_dict``."""

    def rebuild(value: Any, path: tuple[str | int, ...], state: _KeyState) -> Any:
        container = _node(flat, value) if path else value
        children = _children(container) if path else iter(value.items())
        if children is None:
            key = _key_of(state)
            if key not in values:
                return value
            if container is not value:  # an empty state dict of a Stateful object
                container.update(values[key])
                return value
            return values[key]
        items = list(children)
        first = not path
        new_items = [
            (part, rebuild(child, (*path, part), _extend(state, part, first)))
            for part, child in items
        ]
        if isinstance(container, tuple):
            if all(new is old for (_, new), (_, old) in zip(new_items, items, strict=True)):
                return value
            fields = [new for _, new in new_items]
            return type(container)(*fields) if hasattr(container, "_fields") else tuple(fields)
        for (part, new), (_, old) in zip(new_items, items, strict=True):
            if new is not old:
                container[part] = new
        return value

    rebuild(state_dict, (), _ROOT)
    for stateful, state in flat.statefuls:
        stateful.load_state_dict(state)
