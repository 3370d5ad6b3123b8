"""Griffe extension for the API pages: this project's ``Example:`` sections are doctests.

Google-style parsing reads ``Examples:`` (plural) as doctest blocks but ``Example:`` as
an admonition of plain text; the docstrings use the singular throughout, so the plural
is what the parser is shown.
"""

from __future__ import annotations

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class DoctestExamples(griffe.Extension):
    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
