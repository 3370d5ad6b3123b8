"""benchmarks/materialized.py end to end at a tiny size: its three tables have a row per encoding, composition
and baseline, and every ratio in them is a positive finite number."""

import math
import pathlib

import pytest
from scripts import benchmark_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENCODINGS = ("rope", "alibi", "cope")


@pytest.fixture(scope="module")
def materialized():
    with benchmark_script("materialized.py", "materialized_benchmark") as module:
        yield module


def _tables(page: str) -> list[list[list[str]]]:
    """The page's markdown tables, each a list of rows of cells, header first (the rule left out)."""
    tables, current = [], None
    for line in page.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if current is None:
            current = []
            tables.append(current)
        if not set("".join(cells)) <= set("-:"):
            current.append(cells)
    return tables


def _ratio(cell: str) -> float:
    assert cell.endswith("×"), cell
    value = float(cell[:-1])
    assert math.isfinite(value) and value > 0, cell
    return value


def test_materialized_benchmark_writes_its_three_tables(materialized, tmp_path):
    out = tmp_path / "materialized.md"
    argv = ["--length", "64", "--heads", "2", "--rounds", "1", "--compile-rounds", "1", "--encodings", *ENCODINGS]
    results = materialized.main([*argv, "--composition", "rope", "alibi", "--out", str(out)])
    page = out.read_text()
    assert page.startswith("# Materialised attention: T = 64, 2 heads")
    assert f"`python benchmarks/materialized.py {' '.join(argv)} --composition rope alibi --out {out}`" in page
    assert "jax 0." in page and "cpu" in page and "B=1, N=2, H=64, T=64, float32" in page
    encodings, plain, compile_times = _tables(page)

    header, *rows = encodings
    assert header[:5] == ["encoding", "temp fwd", "temp fwd+bwd", "time fwd", "time fwd+bwd"]
    assert [row[0] for row in rows] == list(ENCODINGS)
    for row in rows:
        assert len(row) == len(header) == 10
        for cell in row[1:5]:
            _ratio(cell)
        for cell in row[5:8]:  # XLA's flops, the floors and the budgets: two ratios each
            for part in cell.split(", "):
                _ratio(part)
        assert row[8] in ("yes", "no")
    assert _ratio(rows[2][6].split(", ")[0]) > 1  # CoPE's floor: its position logits add arithmetic

    header, *rows = plain
    assert len(rows) == 1 and rows[0][0] == "nope (materialize)" and len(rows[0]) == len(header) == 9
    for cell in rows[0][1:5] + rows[0][5].split(", "):
        _ratio(cell)
    assert rows[0][6] == "1.10×" and rows[0][7] in ("yes", "no")
    assert results["plain"]["difference"] < 1e-5  # the two compute the same attention

    header, *rows = compile_times
    assert header[:3] == ["forward and backward", "compile s", "ratio to jax.nn"]
    labels = [row[0] for row in rows]
    assert labels == [
        "rope + alibi, materialize",
        "rope + alibi, auto (goes materialize)",
        "nope, materialize",
        *(f"{name}, materialize" for name in ENCODINGS),
    ]
    for row in rows:
        assert float(row[1]) > 0 and float(row[5]) > 0
        _ratio(row[2])
    assert [row[3] for row in rows[:2]] == ["3.00×", "3.00×"] and all(row[4] in ("yes", "no") for row in rows[:2])
    assert all(row[3:5] == ["–", "–"] for row in rows[2:])
