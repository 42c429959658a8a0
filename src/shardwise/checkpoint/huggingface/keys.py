"""How the keys of a state dict name the tensors of a Hugging Face directory, in both
directions (``docs/huggingface.md``, *Key mapping*): the state dict's dotted key, under
``prefix`` (stripped), then through the caller's ``key_map``. Pure."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from shardwise.checkpoint.huggingface.files import is_unicode_text, normalized_prefix
from shardwise.errors import CheckpointKeyError

__all__ = ["KeyMap", "Matched", "Names", "match"]

#: A caller's map from a state dict's key (prefix stripped) to the Hugging Face name of its
#: tensor; ``None`` leaves the key out.
KeyMap = Callable[[str], "str | None"]


@dataclass(frozen=True, slots=True)
class Names:
    """The Hugging Face name of each key of a state dict."""

    prefix: str | None = None
    """Only keys under it are mapped, without it (``"model"`` means ``"model."``)."""

    key_map: KeyMap | None = None
    """Applied after the prefix is stripped; ``None``: the name is the key."""

    @classmethod
    def of(cls, prefix: str | None, key_map: KeyMap | None) -> Names:
        """The names of the arguments ``prefix`` and ``key_map``, checked.

        Raises:
            TypeError: ``prefix`` is not a str, or ``key_map`` not callable (``None`` is
                either's default).
        """
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str or None, got {prefix!r}")
        if key_map is not None and not callable(key_map):
            hint = " (for a dict d, pass d.get)" if isinstance(key_map, Mapping) else ""
            raise TypeError(
                f"key_map must be a function (key -> name or None) or None, got "
                f"{type(key_map).__name__}{hint}"
            )
        return cls(None if prefix is None else normalized_prefix(prefix), key_map)

    def name_of(self, key: str) -> str | None:
        """The name of the tensor at dotted ``key``; ``None``: the key is left out.

        Raises:
            CheckpointKeyError: ``key_map`` raised or returned something other than a
                string of Unicode text or ``None`` (naming the key).
        """
        if self.prefix is not None:
            if not key.startswith(self.prefix):
                return None
            key = key[len(self.prefix) :]
        if self.key_map is None:
            return key
        try:
            name = self.key_map(key)
        except Exception as err:  # the caller's code: any failure, named, on every rank
            raise CheckpointKeyError(
                f"key_map raised {type(err).__name__}: {err}", key=key
            ) from err
        if name is not None and not isinstance(name, str):
            raise CheckpointKeyError(
                f"key_map returned {name!r}; it must return a name (str) or None", key=key
            )
        if name is not None and not is_unicode_text(name):
            raise CheckpointKeyError(
                f"key_map returned {name!r}, which is not Unicode text (a lone surrogate): "
                "safetensors names are UTF-8",
                key=key,
            )
        return name


@dataclass(frozen=True, slots=True)
class Matched:
    """A state dict's keys paired with the tensors of a directory.

    Attributes:
        pairs: Key -> the name of the tensor that fills it.
        absent: Keys whose name no weight file holds, in state-dict order.
        unexpected: Names of the files' tensors that no key takes, in file order.
    """

    pairs: dict[str, str]
    absent: list[str]
    unexpected: list[str]


def match(names: Mapping[str, str], stored: Collection[str]) -> Matched:
    """Pair each key of ``names`` (key -> its name) with the tensor of that name in ``stored``;
    two keys may take one tensor (a key map that ties them)."""
    pairs = {key: name for key, name in names.items() if name in stored}
    taken = set(pairs.values())
    return Matched(
        pairs,
        [key for key in names if key not in pairs],
        [name for name in stored if name not in taken],
    )
