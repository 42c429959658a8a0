"""A griffe extension: shardwise's docstrings, written for ``help()`` and Sphinx, as Markdown.

The docstrings use Google-style sections (``Args:``, ``Returns:``, ``Raises:``) with reST
inline markup. Two things of that markup mkdocstrings would show wrongly, and this rewrites
before the docstring is parsed:

* ``Example:`` (singular) is an admonition for griffe, so its ``>>>`` lines would be read as
  Markdown text (``[[3, 2], [2, 2]]`` as a link); ``Examples:`` is the code section.
* Sphinx roles (``:class:`~shardwise.ShardedTensor```) become code spans of the name.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|ref):`~?([^`]+)`")


class RestDocstrings(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(r"`\1`", text)
