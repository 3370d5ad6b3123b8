"""Griffe extensions for the API pages.

``DoctestExamples``: this project's ``Example:`` sections are doctests. Google-style parsing
reads ``Examples:`` (plural) as doctest blocks but ``Example:`` as an admonition of plain
text; the docstrings use the singular throughout, so the plural is what the parser is shown.

``TupleAssignments``: a module-level ``A, B = 1, 2`` (or ``= range(2)``) binds names that Griffe's
static analysis does not record; each becomes a module attribute whose value is its part of the
right-hand side, so a name a package exports from such a line has its API entry.

``SphinxRoles``: the docstrings cross-reference with Sphinx roles (``:func:`name```,
``:class:`~posenc_jax.nn.Transformer```, ``:meth:`RoPE.rotate```), which Markdown would show
literally. Each becomes an optional mkdocs-autorefs reference to the target's canonical path
(see ``canonical_target``): a link where the site renders the target, under any of its paths,
and the name as inline code where it does not. A target outside the loaded packages is inline
code. ``~`` shows only the last part of the name. The encodings page (``encodings_page.py``)
applies the same rewrite to the encoding modules' docstrings.
"""

from __future__ import annotations

import ast
import contextlib
import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)

ROLES = "func|class|meth|mod|attr|data|obj|exc|const|type"
# ``:role:`name``` and ``:role:`~name```, ``:py:role:`` too; explicit titles (``title <name>``) are not used here.
ROLE = re.compile(rf":(?:py:)?(?:{ROLES}):`(~?)([A-Za-z_][\w.]*)`")


class DoctestExamples(griffe.Extension):
    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)


class TupleAssignments(griffe.Extension):
    def on_module_members(self, *, node, mod, **kwargs) -> None:
        if not isinstance(node, ast.Module):  # a module inspected at run time has its names already
            return
        for statement in node.body:
            if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
                continue
            target = statement.targets[0]
            if not (isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts)):
                continue
            value = statement.value
            parts = value.elts if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts) else None
            for i, name in enumerate(target.elts):
                if name.id in mod.members:
                    continue
                shown = ast.unparse(parts[i]) if parts else f"{ast.unparse(value)}[{i}]"
                attribute = griffe.Attribute(
                    name.id, lineno=statement.lineno, endlineno=statement.end_lineno, value=shown
                )
                attribute.labels.add("module-attribute")
                mod.set_member(name.id, attribute)


def canonical_target(scope: griffe.Object, name: str) -> str | None:
    """The canonical path of the object ``name`` refers to in ``scope``'s docstring, None if not found.

    ``name`` is looked up from the scope, then as an absolute path, then as the unique object of the
    scope's package whose path ends with it (``Transformer.decode`` where ``Transformer`` is not imported).
    """
    head, _, rest = name.partition(".")
    paths = []
    with contextlib.suppress(griffe.NameResolutionError):
        paths.append(scope.resolve(head) + (f".{rest}" if rest else ""))
    paths.append(name)
    for path in paths:
        try:
            return scope.modules_collection[path].canonical_path
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
    matches = {obj.path for obj in _objects(scope.package) if obj.path.endswith(f".{name}")}
    return matches.pop() if len(matches) == 1 else None


def rewrite_roles(text: str, scope: griffe.Object) -> str:
    """``text`` with each Sphinx role an optional autoref (a link if rendered, else code) or inline code."""

    def replace(match: re.Match) -> str:
        tilde, name = match.groups()
        shown = name.rpartition(".")[2] if tilde else name
        path = canonical_target(scope, name)
        if path is None:
            return f"`{shown}`"
        return f'<autoref identifier="{path}" optional><code>{shown}</code></autoref>'

    return ROLE.sub(replace, text)


def _objects(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        # Once the whole package is loaded, so that names imported from its other modules resolve.
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rewrite_roles(obj.docstring.value, obj)
