"""Size caps (issue 54): in posenc_jax/functional and posenc_jax/bench (the benchmark) no function over 100
lines and no file over 600; in the whole package no file over 600.

A function's lines run from its ``def`` to its last line, docstring included; nested functions count
inside the function that holds them and on their own. Files are counted in lines of text.
"""

from __future__ import annotations

import ast
import pathlib

FUNCTIONAL = pathlib.Path(__file__).resolve().parents[1] / "posenc_jax" / "functional"
BENCH = FUNCTIONAL.parent / "bench"
MAX_FUNCTION_LINES = 100
MAX_FILE_LINES = 600

# Files over the cap that another change is splitting: path (relative to functional/) -> why. None today;
# an entry names its file and the change that brings it under the cap, and goes when that lands.
FILE_EXCEPTIONS: dict[str, str] = {}


def _sources():
    return sorted(FUNCTIONAL.rglob("*.py"))


def _long_functions(root: pathlib.Path) -> list[str]:
    long = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return long


def test_no_function_in_functional_is_over_100_lines():
    long = _long_functions(FUNCTIONAL)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_function_in_the_benchmark_is_over_100_lines():
    long = _long_functions(BENCH)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_file_in_functional_is_over_600_lines():
    assert _sources(), f"no sources found under {FUNCTIONAL}"
    long = {}
    for path in _sources():
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            long[path.relative_to(FUNCTIONAL).as_posix()] = lines
    unexpected = {name: lines for name, lines in long.items() if name not in FILE_EXCEPTIONS}
    assert not unexpected, f"files over {MAX_FILE_LINES} lines: {unexpected}"


def test_no_file_in_the_benchmark_is_over_600_lines():
    sources = sorted(BENCH.rglob("*.py"))
    assert len(sources) > 20, f"the benchmark's modules and tasks were not found under {BENCH}"
    long = {
        p.relative_to(BENCH).as_posix(): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_file_in_the_package_is_over_600_lines():
    package = FUNCTIONAL.parent
    long = {
        p.relative_to(package).as_posix(): n
        for p in sorted(package.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_the_package_defines_at_most_8_protocols():
    """The contract is closed (issue 54): capabilities are declared forms, not Protocols found by isinstance."""
    protocols = []
    for path in sorted(FUNCTIONAL.parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and any(
                (base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)) == "Protocol"
                for base in node.bases
            ):
                protocols.append(f"{path.relative_to(FUNCTIONAL.parent).as_posix()}:{node.name}")
    assert protocols, "no Protocol found: the walk is broken"
    assert len(protocols) <= 8, f"{len(protocols)} Protocols: {protocols}"
