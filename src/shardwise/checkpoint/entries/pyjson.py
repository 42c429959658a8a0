"""Python values as tagged JSON (``pyjson``, ``pyjson2``) that keeps tuples, non-string dict
keys, NumPy values, ``torch.Size`` and named tuples, decoded strictly (the tags and their
rules: ``docs/format.md``, *Python values*). Pure (NumPy is the only library it knows;
``torch.Size`` is recognized by name), so that every layer storing JSON values shares one rule.
"""

from __future__ import annotations

import base64
import binascii
import collections
import functools
import keyword
import math
import unicodedata
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import orjson

__all__ = [
    "MAX_DEPTH",
    "TAGS",
    "TAGS2",
    "check_plain",
    "compact",
    "form_and_depth",
    "json_depth",
    "python_form",
    "tagged",
    "untag",
]

#: A stored JSON value may nest lists and objects this deep (readers refuse deeper ones).
MAX_DEPTH = 64
#: Named tuples of more fields are not stored as such (nor made on load).
MAX_FIELDS = 1024

# The tags of "pyjson", in a fixed order so that a message naming one of several is stable.
_TAG_ORDER = ("__tuple__", "__dict__")
TAGS = frozenset(_TAG_ORDER)
# "pyjson2" adds these.
_NUMPY, _ARRAY, _SIZE, _NAMED = "__numpy__", "__ndarray__", "__size__", "__namedtuple__"
_TAG_ORDER2 = (*_TAG_ORDER, _NUMPY, _ARRAY, _SIZE, _NAMED)
TAGS2 = frozenset(_TAG_ORDER2)
# The NumPy dtypes whose values JSON holds exactly (a complex value as [real, imag]).
_NUMPY_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
    | {"float16", "float32", "float64", "complex64", "complex128"}
)
# The types that are JSON scalars as they are.
_SCALARS = frozenset({bool, int, float, str, type(None)})
# The one NaN a reader's JSON parser gives back for every NaN of a document.
_NAN = float("nan")
_CONTAINERS = frozenset({list, dict})
_JSON_TYPES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}
_MAX_ARRAY_DIMS = 64
# NumPy refuses an array whose nonzero dims times the item size exceed its index type.
_MAX_ARRAY_BYTES = int(np.iinfo(np.intp).max)
_INT64 = (-(2**63), 2**63 - 1)


def compact(value: object, *, sort_keys: bool = False) -> bytes:
    """``value`` as compact UTF-8 JSON, as ``json.dumps(value, separators=(",", ":"),
    ensure_ascii=False).encode()`` writes it, for documents built from validated parts.

    orjson is 10-30x faster than ``json`` (measured: a 10,000-entry safetensors header in
    0.7 ms instead of 21 ms, a per-tensor cost of every save). It raises ``TypeError`` on what
    JSON cannot hold, but would write a NaN as ``null``: not for user values.
    """
    option = orjson.OPT_NON_STR_KEYS | (orjson.OPT_SORT_KEYS if sort_keys else 0)
    return orjson.dumps(value, option=option)


def python_form(value: object) -> int | None:
    """The simplest stored form that gives ``value`` back exactly, types included: 0 plain
    JSON, 1 ``pyjson``, 2 ``pyjson2``; None when none does (a set, an enum, a subclass of
    ``int``, an object array...). Recurses (``RecursionError`` past the interpreter's limit)."""
    found = form_and_depth(value)
    return None if found is None else found[0]


def form_and_depth(value: object) -> tuple[int, int] | None:
    """:func:`python_form` of ``value`` and how deep its containers nest (0 for a scalar). Its
    tagged JSON nests at most ``3 * depth + 3`` levels (a tag takes at most three)."""
    kind = type(value)
    if kind in _SCALARS:
        return 0, 0
    if kind is list or kind is tuple or _is_named(kind):
        form, depth = (0 if kind is list else 1 if kind is tuple else 2), 0
        for item in value:  # type: ignore[attr-defined]
            if type(item) in _SCALARS:  # most items: no call
                continue
            inner = form_and_depth(item)
            if inner is None:
                return None
            form, depth = max(form, inner[0]), max(depth, inner[1])
        return form, depth + 1
    if kind is dict:
        assert isinstance(value, dict)
        plain = all(type(key) is str for key in value) and not TAGS & value.keys()
        if not plain and len({_as_read(key) for key in value}) != len(value):
            return None  # two keys a reader gets back as one (a reader refuses such pairs)
        form, depth = (0 if plain else 1), 0
        for key, item in value.items():
            inner, key_inner = form_and_depth(item), form_and_depth(key)
            if inner is None or key_inner is None:
                return None
            form = max(form, inner[0], key_inner[0])
            depth = max(depth, inner[1], key_inner[1])
        return form, depth + 1
    if kind is np.ndarray or isinstance(value, np.generic):
        return (2, 0) if value.dtype.name in _NUMPY_DTYPES else None  # type: ignore[attr-defined]
    if kind.__module__ == "torch" and kind.__name__ == "Size":
        return 2, 0
    return None


def _as_read(key: object) -> object:
    """``key`` as a reader gets it back: every NaN is then one object, so keys that differ only
    in which NaN they hold become equal (Python compares by identity first)."""
    if type(key) is float:
        return _NAN if math.isnan(key) else key
    if isinstance(key, tuple):
        return tuple(_as_read(part) for part in key)
    return key


def _is_named(kind: type) -> bool:
    """Whether ``kind`` is a named tuple class a reader can remake (:func:`_named_problem`; not
    one made with ``rename=True``, a field ``_1``: a save refuses what no load could read)."""
    fields = getattr(kind, "_fields", None)
    return (
        issubclass(kind, tuple)
        and type(fields) is tuple
        and callable(getattr(kind, "_make", None))
        and _named_problem(kind.__name__, fields) is None
    )


def _named_problem(name: object, fields: tuple[object, ...]) -> str | None:
    """Why a named tuple class of ``name`` and ``fields`` cannot be made on load (the rules of
    ``collections.namedtuple``, and at most :data:`MAX_FIELDS` fields), or None."""
    if len(fields) > MAX_FIELDS:
        return f"more than {MAX_FIELDS} fields"
    for word in (name, *fields):
        if type(word) is not str or not word.isidentifier() or keyword.iskeyword(word):
            return f"{word!r} is not a valid named tuple name"
    for field in fields:
        if str(field).startswith("_"):
            return f"field {field!r} starts with an underscore"
    # Python compares identifiers NFKC-normalized: "\ufb01" (the "fi" ligature) is "fi", and
    # collections.namedtuple fails with a SyntaxError on two fields that normalize alike.
    if len({unicodedata.normalize("NFKC", field) for field in fields}) != len(fields):  # type: ignore[arg-type]
        return "a field is named twice"
    return None


def tagged(value: object, extended: bool = False) -> object:
    """``value`` as tagged JSON: ``pyjson``, or ``pyjson2`` with ``extended``.

    Raises:
        TypeError: ``value`` holds what the encoding has no form for (the message: its type).
    """
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list or kind is tuple or (extended and _is_named(kind)):
        items = [
            item if type(item) in _SCALARS else tagged(item, extended)
            for item in value  # type: ignore[attr-defined]
        ]
        if kind is list or kind is tuple:
            return items if kind is list else {"__tuple__": items}
        return {_NAMED: [kind.__name__, list(kind._fields), items]}  # type: ignore[attr-defined]
    if kind is dict:
        assert isinstance(value, dict)
        reserved = TAGS2 if extended else TAGS
        if all(type(key) is str for key in value) and not (reserved & value.keys()):
            return {key: tagged(item, extended) for key, item in value.items()}
        pairs = [[tagged(key, extended), tagged(item, extended)] for key, item in value.items()]
        return {"__dict__": pairs}
    if extended:
        if kind is np.ndarray:
            return {_ARRAY: _array_json(value)}  # type: ignore[arg-type]
        if isinstance(value, np.generic) and value.dtype.name in _NUMPY_DTYPES:
            item = value.item()
            if type(item) is complex:
                item = [item.real, item.imag]
            return {_NUMPY: [value.dtype.name, item]}
        if kind.__module__ == "torch" and kind.__name__ == "Size":
            return {_SIZE: [int(size) for size in value]}  # type: ignore[attr-defined]
    raise TypeError(kind.__name__)


def _array_json(array: np.ndarray) -> list[Any]:
    name = array.dtype.name
    if name not in _NUMPY_DTYPES:
        raise TypeError(f"numpy array of {name}")
    data = np.ascontiguousarray(array, dtype=np.dtype(name).newbyteorder("<")).tobytes()
    stored = [name, list(array.shape), base64.b64encode(data).decode("ascii")]
    # An array of the other byte order than this machine's comes back in that order.
    return [*stored, ">"] if array.dtype.byteorder == ">" else stored


def untag(value: object, extended: bool = False, like: object = None) -> Any:
    """A decoded ``pyjson`` (``pyjson2`` with ``extended``) value with its tagged values
    rebuilt. A named tuple takes the class of the value at its place in ``like`` (the value it
    replaces) when that class has the stored name and fields, else a class made for them.

    Strict: an object with a tag as a key must be exactly what :func:`tagged` writes, so
    whatever decodes is a value the writer gives the same JSON for.

    Raises:
        ValueError: A malformed tag (the message names the tag and what is wrong with it).
    """
    if isinstance(value, list):
        return _untag_items(value, extended, like)
    if isinstance(value, dict):
        for tag in _TAG_ORDER2 if extended else _TAG_ORDER:  # 2 or 6 lookups: cheap
            if tag in value:
                if len(value) != 1:
                    others = sorted(key for key in value if key != tag)
                    raise _malformed(
                        tag, f"a tag is the only key of its object; this one also has {others[:3]}"
                    )
                return _DECODERS[tag](value[tag], extended, like)
        if _CONTAINERS.isdisjoint(map(type, value.values())):
            return value  # scalars only: kept as decoded, as a list of them is
        return {key: untag(item, extended, _entry(like, key)) for key, item in value.items()}
    return value


def check_plain(value: object) -> None:
    """Check a decoded ``json`` value: the writer stores a dict with a tag of :data:`TAGS` as a
    key as ``pyjson``, so a ``json`` value holding one was not written by it.

    Raises:
        ValueError: An object of ``value`` has a tag as a key.
    """
    stack: list[Any] = [value] if type(value) in _CONTAINERS else []
    while stack:
        item = stack.pop()
        items: Iterable[Any] = item.values() if isinstance(item, dict) else item
        if isinstance(item, dict) and not TAGS.isdisjoint(item):
            tag = min(TAGS.intersection(item))
            raise ValueError(
                f"malformed json value: an object has the key {tag!r}, a pyjson tag (the writer "
                "stores such a dict as pyjson)"
            )
        if not _CONTAINERS.isdisjoint(map(type, items)):  # scanned in C
            stack.extend(part for part in items if type(part) in _CONTAINERS)


def _malformed(tag: str, why: str) -> ValueError:
    return ValueError(f"malformed {tag} value: {why}")


def _what(value: object) -> str:
    """The JSON type of ``value``, for a message."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _untag_items(items: list[Any], extended: bool, like: object) -> list[Any]:
    """:func:`untag` of each of ``items`` (a scalar, most items, as it is)."""
    if _CONTAINERS.isdisjoint(map(type, items)):  # in C: 11 ms for 1M floats, 45 with any()
        return items
    return [
        item if type(item) in _SCALARS else untag(item, extended, _part(like, i))
        for i, item in enumerate(items)
    ]


def _part(like: object, index: int) -> object:
    """What stands at ``index`` of ``like`` (a list or tuple), else None."""
    return like[index] if isinstance(like, (list, tuple)) and index < len(like) else None


def _entry(like: object, key: object) -> object:
    """What stands at ``key`` of ``like`` (a dict), else None."""
    return like.get(key) if isinstance(like, dict) and _is_hashable(key) else None


def _is_hashable(key: object) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def _untag_tuple(inner: object, extended: bool, like: object) -> tuple[Any, ...]:
    if type(inner) is not list:
        raise _malformed("__tuple__", f"the payload must be a list, got {_what(inner)}")
    return tuple(_untag_items(inner, extended, like))


def _untag_dict(inner: object, extended: bool, like: object) -> dict[Any, Any]:
    if type(inner) is not list or not inner:
        got = "[] (an empty dict is written {})" if inner == [] else _what(inner)
        raise _malformed(
            "__dict__", f"the payload must be a non-empty list of [key, value] pairs, got {got}"
        )
    result: dict[Any, Any] = {}
    for pair in inner:
        if type(pair) is not list or len(pair) != 2:
            raise ValueError(
                f"malformed __dict__ pairs: each is a [key, value] list, not {pair!r:.80}"
            )
        key = untag(pair[0], extended)
        if not _is_hashable(key):
            name = type(key).__name__
            holds = "" if type(key) in (list, dict, np.ndarray) else " that holds a list or array"
            raise _malformed("__dict__", f"a dict key cannot be a {name}{holds}")
        if key in result:  # 1, 1.0 and True are one key
            raise _malformed("__dict__", f"the key {key!r:.80} appears twice")
        result[key] = untag(pair[1], extended, _entry(like, key))
    if all(type(key) is str for key in result) and (TAGS2 if extended else TAGS).isdisjoint(result):
        raise _malformed("__dict__", "its keys are strings, none a tag: it is a JSON object")
    return result


def _untag_numpy(inner: object, extended: bool, like: object) -> Any:
    if not (
        type(inner) is list
        and len(inner) == 2
        and type(inner[0]) is str
        and inner[0] in _NUMPY_DTYPES
    ):
        raise _malformed(
            _NUMPY, f"the payload must be [dtype, value], dtype one of {sorted(_NUMPY_DTYPES)}"
        )
    # A bool, an int in the dtype's range, a float (never an int) that is exactly a value of
    # the dtype, or a [real, imag] pair of such floats: what tagged writes.
    dtype, item = np.dtype(inner[0]), inner[1]
    kind = dtype.kind
    if kind == "b":
        if type(item) is not bool:
            raise _malformed(_NUMPY, f"a bool is true or false, not {item!r}")
        return np.bool_(item)
    if kind in "iu":
        info = np.iinfo(dtype)
        if type(item) is not int or not info.min <= item <= info.max:
            raise _malformed(
                _NUMPY, f"a {dtype.name} is an integer in [{info.min}, {info.max}], not {item!r}"
            )
        return dtype.type(item)
    parts = [item] if kind == "f" else item
    if not (
        type(parts) is list
        and len(parts) == (1 if kind == "f" else 2)
        and all(type(part) is float for part in parts)
    ):
        form = "a number with a fraction or exponent" if kind == "f" else "[real, imag] numbers"
        raise _malformed(_NUMPY, f"a {dtype.name} is written as {form}, not {item!r}")
    with np.errstate(over="ignore"):
        value = dtype.type(item if kind == "f" else complex(parts[0], parts[1]))
    back = [value] if kind == "f" else [value.real, value.imag]
    if not all(
        float(got) == part or (math.isnan(part) and np.isnan(got))
        for got, part in zip(back, parts, strict=True)
    ):
        # Not what a writer stores: every value of the dtype has an exact float form.
        raise _malformed(_NUMPY, f"{item!r} is not a {dtype.name} value")
    return value


def _untag_array(inner: object, extended: bool, like: object) -> np.ndarray:
    if not (
        type(inner) is list
        and (len(inner) == 3 or (len(inner) == 4 and inner[3] == ">"))
        and type(inner[0]) is str
        and inner[0] in _NUMPY_DTYPES
        and type(inner[1]) is list
        and len(inner[1]) <= _MAX_ARRAY_DIMS
        and all(type(size) is int and size >= 0 for size in inner[1])
        and type(inner[2]) is str
    ):
        raise _malformed(
            _ARRAY,
            f'the payload must be [dtype, shape, base64 data] (and ">" for big-endian), dtype '
            f"one of {sorted(_NUMPY_DTYPES)}, shape at most {_MAX_ARRAY_DIMS} integers >= 0",
        )
    dtype = np.dtype(inner[0])
    if len(inner) == 4 and dtype.itemsize == 1:
        raise _malformed(_ARRAY, f"{dtype.name} has no byte order")
    shape, text = tuple(inner[1]), inner[2]
    nbytes = dtype.itemsize
    for size in shape:
        nbytes *= size or 1
        if nbytes > _MAX_ARRAY_BYTES:
            raise _malformed(_ARRAY, f"shape {list(shape)} is too large for an array")
    # The element count is checked against the text before anything is decoded or allocated.
    count = math.prod(shape)
    short = ValueError(f"__ndarray__ data does not hold {count} values of {dtype.name}")
    if (count * dtype.itemsize + 2) // 3 * 4 != len(text):
        raise short
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:  # ValueError: a non-ASCII character
        raise _malformed(_ARRAY, f"the data is not base64: {err}") from err
    if len(data) != count * dtype.itemsize:
        raise short
    # A last group with padding has spare bits; the writer leaves them zero.
    if data and base64.b64encode(data[-(len(data) % 3 or 3) :]).decode() != text[-4:]:
        raise _malformed(_ARRAY, "the data is not the standard base64 of its bytes")
    if dtype.kind == "b" and data.translate(None, b"\x00\x01"):
        raise _malformed(_ARRAY, "a bool array holds bytes other than 0 and 1")
    if len(inner) == 4:
        dtype = dtype.newbyteorder(">")
    return np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)


def _untag_size(inner: object, extended: bool, like: object) -> Any:
    if not (
        type(inner) is list
        and all(type(size) is int and _INT64[0] <= size <= _INT64[1] for size in inner)
    ):
        raise _malformed(_SIZE, "the payload must be a list of integers in [-2**63, 2**63)")
    import torch  # only a checkpoint that holds a torch.Size needs it here

    return torch.Size(inner)


def _untag_named(inner: object, extended: bool, like: object) -> Any:
    if not (
        type(inner) is list
        and len(inner) == 3
        and type(inner[0]) is str
        and type(inner[1]) is list
        and all(type(field) is str for field in inner[1])
        and type(inner[2]) is list
        and len(inner[2]) == len(inner[1])
    ):
        raise _malformed(
            _NAMED, "the payload must be [type name, [field names], [values]], one value per field"
        )
    name, fields, items = inner[0], tuple(inner[1]), inner[2]
    problem = _named_problem(name, fields)
    if problem is not None:
        raise _malformed(_NAMED, problem)
    kind = type(like)
    if not (_is_named(kind) and kind.__name__ == name and kind._fields == fields):  # type: ignore[attr-defined]
        kind = _named_class(name, fields)
    return kind._make(untag(item, True, _part(like, i)) for i, item in enumerate(items))  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=256)
def _named_class(name: str, fields: tuple[str, ...]) -> type:
    """A named tuple class of ``name`` and ``fields`` (checked by :func:`_named_problem`)."""
    return collections.namedtuple(name, fields)  # type: ignore[misc]


# What each tag decodes to, from its payload (``extended`` and ``like`` as for untag).
_DECODERS: dict[str, Callable[[object, bool, object], Any]] = {
    "__tuple__": _untag_tuple,
    "__dict__": _untag_dict,
    _NUMPY: _untag_numpy,
    _ARRAY: _untag_array,
    _SIZE: _untag_size,
    _NAMED: _untag_named,
}


def json_depth(value: object) -> int:
    """How deep lists and objects nest in the decoded JSON ``value`` (0 for a scalar)."""
    if not isinstance(value, (list, dict)):
        return 0
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if type(child) in (list, dict))
    return deepest
