"""Public seams (issue 54): the model and its layers call functional/ and each other through public names.

A call ``obj._name(...)`` on anything but ``self``/``cls`` reaches into another class's private
piece, and ``from posenc_jax.functional... import _name`` into a module's; both tie the model to
details functional/ is free to change. NamedTuple's own ``_replace`` (public API, underscored so as
not to clash with field names) is the one exception.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "posenc_jax"
# The model side: the Flax layers and models, their adapters, and what drives them.
MODEL_SIDE = ("nn", "hf", "linen.py", "generation.py", "training.py", "checkpoint.py")
NAMEDTUPLE_API = {"_replace", "_asdict", "_make", "_fields"}


def _private_reaches(source: str, filename: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("posenc_jax.functional"):
            found += [f"{filename}:{node.lineno} imports {a.name}" for a in node.names if a.name.startswith("_")]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, owner = node.func.attr, node.func.value
            if not name.startswith("_") or name.startswith("__") or name in NAMEDTUPLE_API:
                continue
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            found.append(f"{filename}:{node.lineno} calls {ast.unparse(node.func)}")
    return found


def _model_side_sources():
    for entry in MODEL_SIDE:
        path = PACKAGE / entry
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def test_the_model_reaches_no_private_piece_of_another_class_or_of_functional():
    sources = list(_model_side_sources())
    assert len(sources) > 8, f"the model's modules were not found under {PACKAGE}"
    found = [hit for path in sources for hit in _private_reaches(path.read_text(), path.name)]
    assert not found, f"private pieces reached across a seam (make them public, or move the call): {found}"


def test_the_walk_finds_a_private_call_and_a_private_import():
    source = (
        "from posenc_jax.functional.core.attention import _attend, attend\n"
        "class Block:\n"
        "    def __call__(self, x):\n"
        "        self._own(x)\n"
        "        super()._own(x)\n"
        "        cache._replace(length=1)\n"
        "        return self.attention._forward_terms(x)\n"
    )
    assert _private_reaches(source, "m.py") == ["m.py:1 imports _attend", "m.py:7 calls self.attention._forward_terms"]
