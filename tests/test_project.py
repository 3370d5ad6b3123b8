"""The project's promises outside the math: README commands and quickstart, CI, layering (notebooks:
test_notebooks.py)."""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _fenced_blocks(text, language):
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_opens_with_the_two_commands_and_ci_runs_them():
    readme = (ROOT / "README.md").read_text()
    first = _fenced_blocks(readme, "bash")[0].strip().splitlines()
    assert len(first) == 2
    assert "posenc-bench extrapolate --preset cpu" in first[0]
    assert "pytest" in first[1]
    assert readme.index("```bash") < readme.index("## "), "the commands must come before any section"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "README.md" in ci and "python3 -m venv" in ci and "--preset smoke" in ci


def test_readme_quickstart_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = _fenced_blocks(readme, "python")
    assert len(blocks) >= 2
    result = subprocess.run([sys.executable, "-c", "\n".join(blocks)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "(2, 16, 8, 64) bfloat16"
    assert float(lines[1]) == 0.0


def test_functional_layer_imports_no_flax():
    code = (
        "import sys, posenc_jax.functional, posenc_jax.reference; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flax', 'optax', 'orbax')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _import_graph():
    """Each module of the package and the package modules it imports (at any depth of its code)."""
    graph = {}
    for path in (ROOT / "posenc_jax").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("posenc_jax"):
                imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name.startswith("posenc_jax")}
        graph[name] = imported
    return {name: {m for m in imported if m in graph and m != name} for name, imported in graph.items()}


def test_no_import_circle_and_the_core_imports_no_encoding():
    graph = _import_graph()
    state, path, circles = {}, [], []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                circles.append(path[path.index(other) :] + [other])
            elif other not in state:
                visit(other)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert circles == []
    # Core sits below both: it imports neither an encoding nor a kernel (kernels register their forms of
    # core's operations); no kernel imports an encoding.
    for module, imported in graph.items():
        if module.startswith(("posenc_jax.functional.core", "posenc_jax.functional.kernels")):
            assert not any(m.startswith("posenc_jax.functional.encodings") for m in imported), module
            assert "posenc_jax.functional" not in imported, module  # the package imports every encoding
        if module.startswith("posenc_jax.functional.core"):
            assert not any(m.startswith("posenc_jax.functional.kernels") for m in imported), module


def test_core_imports_nothing_from_kernels():
    """Read from the modules' import statements (at any depth of their code, lazy imports included):
    ``functional/core/`` names no module of ``functional/kernels/``, not even through ``importlib``."""
    core = ROOT / "posenc_jax" / "functional" / "core"
    found = []
    for path in sorted(core.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("posenc"):
                names = [node.value]  # a module named as a string, to import_module
            found += [f"{path.name}: {n}" for n in names if n.startswith("posenc_jax.functional.kernels")]
    assert found == []


_HELP = """
import contextlib, io, json, os, runpy, sys, traceback
found = {}
for path in sys.argv[1:]:  # each script run as __main__ with --help, in this one process (one jax import)
    sys.argv, sys.path[0] = [path, "--help"], os.path.dirname(path)  # as `python path --help` would have them
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
        found[path] = "no exit"
    except SystemExit as exit:
        found[path] = (exit.code or 0) if "usage:" in printed.getvalue() else "exited without a usage line"
    except BaseException:
        found[path] = traceback.format_exc()[-2000:]
print(json.dumps(found))
"""


def test_benchmark_scripts_have_a_working_help():
    scripts = sorted(str(p) for p in (ROOT / "benchmarks").glob("*.py"))
    assert len(scripts) >= 9
    result = subprocess.run([sys.executable, "-c", _HELP, *scripts], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found == dict.fromkeys(scripts, 0), {script: why for script, why in found.items() if why != 0}


def test_relative_memory_benchmark_small_run():
    script = ROOT / "benchmarks" / "relative_memory.py"
    result = subprocess.run(
        [sys.executable, str(script), "--length", "256", "--time-length", "64", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.rstrip().endswith(tuple("0123456789")) and "x " in line]
    assert len(rows) == 6, result.stdout
    for row in rows:
        assert float(row.split()[-1]) < 1e-4, row  # fast path agrees with the materialising reference


def test_packaging_metadata_agrees():
    import tomllib

    import posenc_jax

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" in project["dynamic"] and "version" not in project  # defined once, in posenc_jax
    citation = (ROOT / "CITATION.cff").read_text()
    assert f"\nversion: {posenc_jax.__version__}\n" in citation
    assert project["license"] == "Apache-2.0" and "license: Apache-2.0" in citation
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert (ROOT / "posenc_jax" / "py.typed").exists()
    assert f"## {posenc_jax.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_old_vs_new_benchmark_imports_an_old_commit_beside_the_current_one():
    old = "27d360e"
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{old}^{{commit}}"], capture_output=True).returncode:
        pytest.skip(f"commit {old} is not in this clone")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "old_vs_new.py"), "--old", old, "--quick", "--sections", "memory"]
        + ["--encodings", "rope"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert "as posenc_jax_old" in result.stdout and "warning" not in result.stdout, result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| plain |", "| rope |"))]
    assert len(rows) == 2 and all(line.count("MiB") == 2 for line in rows), result.stdout
