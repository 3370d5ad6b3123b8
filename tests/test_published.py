"""Every published number we print comes from posenc_jax/bench/published.json, with its source.

The data file is read here both through the loader and as plain JSON, so a loader that invented or
dropped a number fails as well as a page or a report that prints one the file does not hold.
"""

import json
import pathlib
import re
import tomllib

import pytest

from posenc_jax.bench import published, report

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "site").glob("*.md"))]
# The pages' names for the published tables' rows and columns.
NAMES = {
    "NoPE": "nope",
    "T5": "t5",
    "ALiBi": "alibi",
    "RoPE": "rope",
    "sinusoidal": "sinusoidal",
    "APE": "sinusoidal",
    "counting copy": "counting_copy",
    "counting replace": "counting_replace",
    "copy": "copy",
    "duplicate": "duplicate",
    "reverse": "reverse",
}
SOURCE = {
    "paper": "Someone et al. 2020",
    "title": "A paper",
    "arxiv": "2001.00001",
    "protocol": "a model",
    "verified": True,
    "repository": "owner/name",
    "file": "results.jsonl",
    "commit": "0" * 40,
}
RECORD = {
    "group": "g",
    "source": "someone2020",
    "task": "copy",
    "encoding": "nope",
    "value": 0.5,
    "statistic": "mean exact match",
    "lengths": [21, 40],
    "filter": "all rows",
    "aggregation": "paper's",
}


def _raw() -> dict:
    return json.loads(published.DATA.read_text())


def _write(tmp_path, sources, records) -> pathlib.Path:
    path = tmp_path / "published.json"
    path.write_text(json.dumps({"sources": sources, "records": records}))
    return path


def test_a_record_without_a_source_is_refused(tmp_path):
    (good,) = published.load(_write(tmp_path, {"someone2020": SOURCE}, [RECORD]))
    assert good.value == 0.5 and good.source.where == "owner/name results.jsonl at 0000000"
    without = {k: v for k, v in RECORD.items() if k != "source"}
    with pytest.raises(ValueError, match=r"record 0 \(copy, nope\) has no source"):
        published.load(_write(tmp_path, {"someone2020": SOURCE}, [without]))
    with pytest.raises(ValueError, match="has no source: source='other'"):
        published.load(_write(tmp_path, {"someone2020": SOURCE}, [{**RECORD, "source": "other"}]))
    # A source must say where: a repository's file at a commit, or a table or figure of the paper.
    nowhere = {k: v for k, v in SOURCE.items() if k not in ("repository", "file", "commit")}
    with pytest.raises(ValueError, match="says neither where in a repository"):
        published.load(_write(tmp_path, {"someone2020": nowhere}, [RECORD]))
    with pytest.raises(ValueError, match="says neither where in a repository"):
        published.load(_write(tmp_path, {"someone2020": {**SOURCE, "commit": None}}, [RECORD]))
    with pytest.raises(ValueError, match="commit must be 40 hex digits, got 'main'"):
        published.load(_write(tmp_path, {"someone2020": {**SOURCE, "commit": "main"}}, [RECORD]))
    (table,) = published.load(_write(tmp_path, {"someone2020": {**nowhere, "table": "Table 2"}}, [RECORD]))
    assert table.source.where == "Someone et al. 2020, Table 2"
    with pytest.raises(ValueError, match="needs its paper and arXiv id"):
        published.load(_write(tmp_path, {"someone2020": {**SOURCE, "arxiv": ""}}, [RECORD]))
    with pytest.raises(ValueError, match="aggregation must be one of"):
        published.load(_write(tmp_path, {"someone2020": SOURCE}, [{**RECORD, "aggregation": "mine"}]))
    with pytest.raises(ValueError, match="value must be a finite number"):
        published.load(_write(tmp_path, {"someone2020": SOURCE}, [{**RECORD, "value": None}]))
    with pytest.raises(ValueError, match="mixes sources, statistics or aggregations"):
        published.load(_write(tmp_path, {"someone2020": SOURCE}, [RECORD, {**RECORD, "statistic": "another"}]))


def test_the_shipped_file_is_complete_and_packaged():
    records = published.load()
    assert len(records) == len(_raw()["records"])
    kazemnejad = [r for r in records if r.source.arxiv == "2305.19466"]
    assert {r.source.commit for r in kazemnejad} == {"d06170ec6b7722ff97de3663fa99c8ac88340409"}
    assert {r.source.file for r in kazemnejad} == {"results/sanity_check.jsonl"}
    assert all('job_type == "best_run_seed_exp"' in r.filter for r in kazemnejad)
    assert all(r.aggregation == "ours" and r.source.verified for r in kazemnejad)
    # Press et al.'s appendix numbers are held, marked as not re-verified.
    press = [r for r in records if r.source.arxiv == "2108.12409"]
    assert (
        press
        and not any(r.source.verified for r in press)
        and "not re-verified" in published.source_line(press[0].group)
    )
    # The wheel ships the data file (setuptools' package-data).
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["posenc_jax"]
    assert published.DATA.relative_to(ROOT / "posenc_jax").as_posix() in shipped


def test_every_number_in_report_published_comes_from_the_file():
    raw = [r for r in _raw()["records"] if r["group"] == report.PUBLISHED_GROUP]
    want: dict[str, dict[str, float]] = {}
    for r in raw:
        want.setdefault(r["task"], {})[r["encoding"]] = r["value"]
    assert want == report.PUBLISHED
    assert len(raw) == 25 and set(want) == {"counting_copy", "counting_replace", "copy", "duplicate", "reverse"}
    # The reports' one line on the published column names the source: paper, arXiv id, file at its commit.
    line = report.PUBLISHED_PROTOCOL
    assert "\n" not in line
    for part in ("Kazemnejad et al. 2023", "arXiv:2305.19466", "McGill-NLP/length-generalization", "d06170e"):
        assert part in line, (part, line)
    assert "our aggregation of the authors' rows" in line and "mean over the 3 seeds" in line


def test_the_text_reference_prints_the_shape_and_no_unverified_number():
    # Press et al.'s appendix perplexities are in the file, marked not re-verified: the report cites
    # their shape and the paper's arXiv id, and prints none of them.
    press = [r for r in published.load() if r.source.arxiv == "2108.12409"]
    assert press and not any(r.source.verified for r in press)
    printed = [float(n) for n in re.findall(r"(?<![\d.])\d+\.\d+(?![\d.])", report.TEXT_REFERENCE)]
    assert not any(n in {r.value for r in press} for n in printed), printed
    assert "not re-verified" in report.TEXT_REFERENCE and "2108.12409" in report.TEXT_REFERENCE


def _tables(text: str):
    """Each markdown table as (header cells, rows of cells)."""
    block: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            if len(block) > 2:
                yield block[0], block[2:]
            block = []


def _printed_figures():
    """``(page, row, column, value)`` of every published figure the pages print: in the pages' form, a
    number without its leading zero in parentheses after ours (``0.882 [0.742, 1.021] (.986)``), or a
    cell of a column headed "published"."""
    for page in PAGES:
        for header, rows in _tables(page.read_text()):
            for row in rows:
                for column, cell in zip(header, row, strict=False):
                    shown = re.search(r"\((\.\d+)\)$", cell)
                    if "published" in column.lower() and re.fullmatch(r"\d*\.\d+", cell):
                        yield page.name, row[0], column, float(cell)
                    elif shown and re.search(r"\d", cell[: shown.start()]):
                        yield page.name, row[0], column, float(shown.group(1))


def test_every_published_figure_the_pages_print_is_in_the_file():
    records = published.load()
    found = list(_printed_figures())
    assert found, "no published figure found in the pages: has their form changed?"
    untraced = []
    for page, row, column, value in found:
        # A row or column names the task and the other the encoding (or only the encoding).
        task = NAMES.get(row) if NAMES.get(row) in report.PUBLISHED else None
        encoding = NAMES.get(column) or NAMES.get(row)
        matches = [
            r
            for r in records
            if r.value == value
            and (encoding is None or r.encoding == encoding)
            and (task is None or r.task == task)
            and r.lengths == (21, 40)
        ]
        if not matches:
            untraced.append((page, row, column, value))
    assert not untraced, f"published figures printed without a record in {published.DATA.name}: {untraced}"
