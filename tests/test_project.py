"""The project's promises outside the math: README commands and quickstart, CI, layering (notebooks:
test_notebooks.py)."""

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


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_benchmark_scripts_have_a_working_help(script):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


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
