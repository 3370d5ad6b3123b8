"""The results the README and the reproductions page show are those of the committed rows.

Each table of scores is recomputed from its folder under `docs/` with the benchmark's own summaries
(mean and 95% interval over all seeds, or "not learned (k/n)"; for text, bits per character by
position), the findings from the orderings corrected over their table, the verdicts from the claims'
corrected tests, and the headline figures are drawn from the same summaries, so a number edited by
hand, or left behind when a run is replaced, fails here.
"""

import functools
import importlib.util
import json
import pathlib
import re

import numpy as np
import pytest

from posenc_jax.bench.results import cells, comparison, read, table_family

ROOT = pathlib.Path(__file__).resolve().parents[1]
LABELS = {
    "NoPE": "nope",
    "T5": "t5",
    "ALiBi": "alibi",
    "RoPE": "rope",
    "CoPE": "cope",
    "sinusoidal": "sinusoidal",
    "RoPE + randomized": "rope+randomized",
    "sinusoidal + randomized": "sinusoidal+randomized",
    "counting copy": "counting_copy",
    "counting replace": "counting_replace",
    "copy": "copy",
    "duplicate": "duplicate",
    "reverse": "reverse",
    "reverse string": "reverse_string",
    "missing duplicate": "missing_duplicate",
    "parity": "parity",
    "bucket sort": "bucket_sort",
}


def _table(page: str, header: str) -> list[dict[str, str]]:
    """The rows of the table on ``page`` whose header line starts with ``header``, as {column: cell}."""
    lines = (ROOT / page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    columns = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(columns, (cell.strip() for cell in line.strip("|").split("|")), strict=True)))
    return rows


@functools.cache
def _results(folder: str):
    return read(ROOT / "docs" / folder)


@functools.cache
def _prose(page: str) -> str:
    """A docs page's text with its lines joined, so a quoted phrase may span a line break."""
    return " ".join((ROOT / "docs" / "site" / page).read_text().split())


@functools.cache
def _summaries(folder: str):
    return {(c.task, c.encoding): c for c in cells(_results(folder))}


def _shown(cell: str) -> str:
    """A table cell without its annotations: bold, a published figure or a note in parentheses."""
    cell = cell.replace("**", "").replace("−", "-")
    if cell.startswith("not learned"):
        return re.match(r"not learned \(\d+/\d+", cell).group(0) + ")"
    return re.sub(r"\s*\([^)]*\)$", "", cell)


def _assert_shows(shown: str, summary, where) -> None:
    want = summary.text("extrapolation")
    assert shown == want, (where, shown, want)
    if summary.extrapolation is not None and summary.bounded:  # no interval leaves [0, 1]
        assert 0 <= summary.extrapolation.low <= summary.extrapolation.high <= 1, where


@pytest.mark.parametrize("page", ["README.md", "docs/site/reproductions.md"])
def test_decoder_tasks_table_is_its_committed_rows(page):
    summaries = _summaries("extrapolation-kazemnejad")
    rows = _table(page, "| task | NoPE | T5 | ALiBi | RoPE | sinusoidal |")
    assert len(rows) == 5
    for row in rows:
        for column in ("NoPE", "T5", "ALiBi", "RoPE", "sinusoidal"):
            summary = summaries[LABELS[row["task"]], LABELS[column]]
            assert summary.learned
            _assert_shows(_shown(row[column]), summary, (page, row["task"], column))


@pytest.mark.parametrize(
    ("header", "folder", "columns"),
    [
        ("| task | RoPE | RoPE + randomized |", "extrapolation-ruoss", 4),
        ("| task | RoPE + randomized | sinusoidal + randomized |", "extrapolation-ruoss-long", 2),
    ],
)
def test_randomized_positions_tables_are_their_committed_rows(header, folder, columns):
    summaries = _summaries(folder)
    rows = _table("docs/site/reproductions.md", header)
    assert len(rows) == 4
    for row in rows:
        for column in list(row)[1 : 1 + columns]:
            _assert_shows(_shown(row[column]), summaries[LABELS[row["task"]], LABELS[column]], (row["task"], column))


@pytest.mark.parametrize(
    ("header", "task"),
    [
        ("| encoding | seeds learned | at 16 pairs |", "flip_flop"),
        ("| encoding | seeds learned | at 16 statements |", "cope_count"),
    ],
)
def test_cope_tasks_tables_are_their_committed_rows(header, task):
    summaries = _summaries("extrapolation-cope-tasks")
    rows = [row for row in _table("docs/site/reproductions.md", header) if row["encoding"] in LABELS]
    assert len(rows) == 4
    for row in rows:
        summary = summaries[task, LABELS[row["encoding"]]]
        at_training, beyond = list(row.values())[2:4]
        assert row["seeds learned"] == f"{len(summary.learned_seeds)}/{summary.seeds}", row
        assert at_training == summary.text("at_training"), (row, summary.text("at_training"))
        _assert_shows(_shown(beyond), summary, (task, row["encoding"]))


def test_headline_figures_are_drawn_from_the_committed_rows(tmp_path):
    spec = importlib.util.spec_from_file_location("headline_figures", ROOT / "benchmarks" / "headline_figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    written = figures.draw(tmp_path)
    assert [p.name for p in written] == ["decoder-tasks.png", "randomized.png"]
    assert all(p.stat().st_size > 10_000 for p in written)
    # What the bars show: the reports' intervals, and no bar where a cell did not learn its task.
    values = figures.bars()
    assert len(values["decoder-tasks"]) == 25 and None not in values["decoder-tasks"].values()
    nope = _summaries("extrapolation-kazemnejad")["copy", "nope"].extrapolation
    assert values["decoder-tasks"]["copy", "nope"] == (nope.mean, nope.low, nope.high)
    randomized = values["randomized"]
    assert round(randomized["bucket_sort", "RoPE"][0], 3) == 0.239  # all 5 seeds
    assert round(randomized["missing_duplicate", "RoPE + randomized"][0], 3) == 0.521
    assert randomized["bucket_sort", "RoPE + randomized"] is None  # not learned in the 4,000-step run
    assert randomized["bucket_sort", "sinusoidal + randomized"] is None


def test_text_table_is_its_committed_rows():
    # README: bits per character at the training length (128) and by position within 4,096-character windows.
    rows = _table("README.md", "| encoding | at 128 | 128–256 | 1k–2k | 2k–4k |")
    labels = {"Kerple (log)": "kerple-log", "FIRE": "fire", "RoPE fine-tuned 100 steps at 512": "rope@ft"}
    results = _results("extrapolation-gpu-text")
    summaries = {c.encoding: c for c in cells(results)}
    assert len(rows) == 7
    for row in rows:
        encoding = labels.get(row["encoding"]) or LABELS[row["encoding"]]
        assert summaries[encoding].learned, encoding
        windows = [r for r in results.rows if r["encoding"] == encoding and r["length"] == 4096]
        assert len(windows) == summaries[encoding].seeds == 5, encoding  # every seed
        want = {
            "at 128": summaries[encoding].at_training.mean,
            "128–256": np.mean([r["buckets"]["1-2x"] for r in windows]),
            "1k–2k": np.mean([r["buckets"]["8-16x"] for r in windows]),
            "2k–4k": np.mean([r["buckets"]["16-32x"] for r in windows]),
        }
        for column, value in want.items():
            assert row[column] == f"{value:.3f}", (encoding, column, row[column], value)


def test_the_cpu_full_parity_figures_are_its_committed_rows():
    """The results page's summary of `cpu-full`'s parity run and the reproductions page's randomized
    cells from it: each figure is the committed rows' summary."""
    summaries = _summaries("extrapolation-cpu-full-parity")
    results_page, reproductions = _prose("results.md"), _prose("reproductions.md")
    shown = lambda encoding: summaries["parity", encoding].text("extrapolation")
    for encoding in ("alibi", "kerple-power", "functional-relative", "rope"):
        assert shown(encoding) in results_page, (encoding, shown(encoding))
    for encoding in ("rope+randomized", "rope"):
        assert shown(encoding) in reproductions, (encoding, shown(encoding))
    assert shown("sinusoidal+randomized") == "not learned (0/5)"
    assert [e for (_, e), c in summaries.items() if not c.learned] == ["sinusoidal+randomized"]
    assert len(summaries["parity", "sandwich"].learned_seeds) == 4
    # ALiBi highest; "no ordering is resolved" over the 276 pairs of the 24 learned rows.
    learned = {e: c.extrapolation for (_, e), c in summaries.items() if c.learned}
    assert len(learned) == 24 and max(learned, key=lambda e: learned[e].mean) == "alibi"
    family = comparison(_results("extrapolation-cpu-full-parity"), "parity")
    assert len(family.orderings) == 276 and not family.resolved


_CPU_FULL_TASKS = ("counting_copy", "missing_duplicate", "reverse_string", "bucket_sort")


def test_the_cpu_full_table_and_its_findings_are_its_committed_rows():
    """The results page's `cpu-full` table, cell by cell, and the paired differences and counts its
    findings quote, corrected over the table's four tasks."""
    summaries = _summaries("extrapolation-cpu-full")
    header = "| encoding | counting copy | missing duplicate | reverse string | bucket sort |"
    rows = _table("docs/site/results.md", header)
    assert len(rows) == 28
    for row in rows:
        for column in list(row)[1:]:
            summary = summaries.get((LABELS[column], row["encoding"]))
            if summary is None:  # no bidirectional form, or NoPE on a task whose answer slots differ
                assert row[column] == "n/a", (row["encoding"], column)
            else:
                _assert_shows(_shown(row[column]), summary, (row["encoding"], column))
    page = _prose("results.md")
    family = table_family(_results("extrapolation-cpu-full"), _CPU_FULL_TASKS)
    assert sum(len(found) for found in family.values()) == 1083 and "Holm over its 1,083 pairs" in page
    for task, (resolved, pairs) in {
        "counting_copy": (23, 378),
        "missing_duplicate": (0, 276),
        "reverse_string": (34, 153),
        "bucket_sort": (45, 276),
    }.items():
        found = family[task]
        assert (sum(o.resolved for o in found), len(found)) == (resolved, pairs), task
    quoted = {
        ("counting_copy", "rope+randomized", "rope"): ("by 0.940 [0.877, 1.003]", True),
        ("counting_copy", "sinusoidal+randomized", "sinusoidal"): ("by 0.816 [0.716, 0.916]", True),
        ("bucket_sort", "sinusoidal+randomized", "sinusoidal"): ("by 0.823 [0.808, 0.838]", True),
        ("bucket_sort", "rope+randomized", "rope"): ("by 0.338 [0.216, 0.460]", False),
        ("bucket_sort", "rope+pi@eval", "rope"): ("by 0.333 [0.228, 0.438]", False),
    }
    for (task, better, worse), (text, resolved) in quoted.items():
        (pair,) = [o for o in family[task] if (o.better, o.worse) == (better, worse)]
        assert pair.resolved == resolved and f"by {pair.difference}" == text, (task, better, worse)
        assert text in page, text
    randomized = ("rope+randomized", "rope", "sinusoidal+randomized", "sinusoidal")
    quoted_cells = [("bucket_sort", e) for e in randomized] + [
        ("missing_duplicate", "rope+randomized"),
        ("missing_duplicate", "rope"),
        ("counting_copy", "rope+randomized"),
        ("counting_copy", "sinusoidal+randomized"),
    ]
    reproductions = _prose("reproductions.md")
    for key in quoted_cells:
        assert summaries[key].text("extrapolation") in reproductions, key


def test_the_cpu_full_findings_in_words_are_its_orderings():
    """What the results page says in words of `cpu-full`'s orderings, read off the committed rows'
    paired differences corrected over the table."""
    family = table_family(_results("extrapolation-cpu-full"), _CPU_FULL_TASKS)

    def resolved(task):
        return {(o.better, o.worse) for o in family[task] if o.resolved}

    copy = resolved("counting_copy")
    assert not any("nope" in pair for pair in copy)  # "no ordering of NoPE survives"
    assert {better for better, _ in copy} == {"rope+randomized", "sinusoidal+randomized", "alibi"}
    assert {worse for better, worse in copy if better == "alibi"} == {"sinusoidal", "learned"}
    reverse = resolved("reverse_string")
    assert not any(set(pair) <= {"kerple-log", "kerple-power", "alibi"} for pair in reverse)
    assert not resolved("missing_duplicate")
    summaries = _summaries("extrapolation-cpu-full")
    seeds = summaries["counting_copy", "nope"].beyond.values()
    assert f"its seeds {min(seeds):.2f}–{max(seeds):.2f}" in _prose("results.md")


def test_the_cpu_and_text_findings_are_their_orderings():
    """The `cpu` preset's counting-copy paragraph and the `gpu-text` runs' orderings, as the results
    page words them (Holm over each table's pairs)."""
    page = _prose("results.md")
    cpu = comparison(_results("extrapolation-cpu-fixed"), "counting_copy")
    resolved = {(o.better, o.worse) for o in cpu.resolved}
    assert len(cpu.orderings) == 15 and len(resolved) == 11
    absolute = ("rope", "sinusoidal", "learned")
    assert resolved == {(a, b) for a in ("t5", "alibi") for b in absolute} | {
        ("nope", b) for b in ("t5", "alibi", *absolute)
    }
    assert not cpu.equivalent()  # sinusoidal and learned are 0 on every seed: 0.5^5 per side is not enough
    assert "15 pairs, 11 orderings are resolved" in page
    summaries = _summaries("extrapolation-cpu-fixed")
    for encoding, shown in (("nope", "NoPE"), ("t5", "T5"), ("alibi", "ALiBi"), ("rope", "RoPE")):
        assert f"| {shown} | 5/5 | 1.000, all 5 seeds | {summaries['counting_copy', encoding].extrapolation} |" in page
    # The README's main-command table: the same cells, in the encodings' order.
    (readme_row,) = _table("README.md", "| NoPE | T5 | ALiBi | RoPE | sinusoidal | learned |")
    order = ("nope", "t5", "alibi", "rope", "sinusoidal", "learned")
    assert [_shown(cell) for cell in readme_row.values()] == [
        str(summaries["counting_copy", e].extrapolation) for e in order
    ]
    text = comparison(_results("extrapolation-gpu-text"), "text")
    resolved = {(o.better, o.worse) for o in text.resolved}
    assert (len(resolved), len(text.orderings)) == (80, 91) and "91 pairs of the report's 14 learned rows, 80" in page
    chain = [("alibi", "t5"), ("kerple-log", "t5"), ("sandwich", "t5"), ("fire", "t5"), ("t5", "rope")]
    chain += [("rope", "sinusoidal"), ("alibi", "sandwich"), ("alibi", "fire")]
    assert set(chain) <= resolved and not text.equivalent()
    for pair in (("alibi", "kerple-log"), ("kerple-log", "sandwich"), ("sandwich", "fire")):
        assert pair not in resolved and pair[::-1] not in resolved
    more = comparison(_results("extrapolation-gpu-text-more"), "text")
    assert [(o.better, o.worse) for o in more.unresolved] == [("alibi", "kerple-power")] and not more.equivalent()


def test_the_cost_model_paragraph_is_the_fit_of_its_folders():
    from posenc_jax.bench.costmodel import FITTED_FROM, fit_runs

    (fit,) = fit_runs(ROOT / folder for folder in FITTED_FROM["CPU_ESTIMATE"]).values()
    page = _prose("results.md")
    assert len(fit.cells) + len(fit.left_out) == 105 and len(fit.left_out) == 18
    assert sum(cell.task == "missing_duplicate" for cell in fit.left_out) == 13
    low, _, high = fit.spread["cell"]
    assert f"took {low:.2f}–{high:.2f} times its modelled time on the CPU" in page
    assert "The CPU fit left out 18 of its 105 cells as contended" in page
    for folder, shown in (
        ("docs/extrapolation-cpu", "(12, 1 left out)"),
        ("docs/extrapolation-cpu-full", "(93, 17 left out)"),
    ):
        kept = [c for c in fit.cells if c.folder.endswith(folder)]
        left = [c for c in fit.left_out if c.folder.endswith(folder)]
        assert f"({len(kept) + len(left)}, {len(left)} left out)" == shown and f"`{folder}/` {shown}" in page


_L2_RUNS = ("q0.03", "q0.1", "q0.1-1200", "q0.3", "q1-1200")


def test_every_committed_run_has_the_baselines_of_its_tasks():
    # Runs of the earlier method have none (they predate the baselines).
    without = {"blockwise/cpu-long-demo", "extrapolation-cpu-long", *(f"probe/l2-query-init/{q}" for q in _L2_RUNS)}
    for run in sorted((ROOT / "docs").glob("**/results.jsonl")):
        baselines = run.parent / "baselines.json"
        if run.parent.relative_to(ROOT / "docs").as_posix() in without:
            assert not baselines.exists(), run.parent
            continue
        tasks = {json.loads(line)["task"] for line in run.read_text().splitlines() if line.strip()}
        assert tasks <= set(json.loads(baselines.read_text())), (run.parent, tasks)


def test_a_run_of_the_earlier_method_is_refused_by_the_report_writer_not_half_read(tmp_path):
    """`extrapolation-cpu-long` predates the gate (its preset has no check_every): the report writer says so
    and writes nothing, instead of failing on a missing key (its committed report stays as written then)."""
    from posenc_jax.bench.report import write_report

    with pytest.raises(ValueError, match="'cpu-long' records no check_every: it predates the gate"):
        write_report(ROOT / "docs" / "extrapolation-cpu-long", tmp_path, plots=False)
    assert not (tmp_path / "report.md").exists()


def test_every_committed_report_is_its_rows_read_now(tmp_path):
    """No committed report is left computed the old way: each is what the report writer makes of
    its rows today (`python tools/reanalyse.py` rewrites them)."""
    from posenc_jax.bench.report import write_report

    spec = importlib.util.spec_from_file_location("reanalyse", ROOT / "tools" / "reanalyse.py")
    reanalyse = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reanalyse)
    folders = reanalyse.folders()
    assert len(folders) >= 12
    for folder in folders:
        out = tmp_path / folder.name
        out.mkdir()
        text = write_report(folder, out, plots=any(folder.glob("*.png")))
        assert (folder / "report.md").read_text() == text, f"{folder}: run `python tools/reanalyse.py`"


def test_the_blind_spot_table_is_the_probes_report():
    """The blind-spot page's table, cell by cell, is the committed probe's report (mean over n, over
    all 5 seeds; seeds that all agree shown as the value alone)."""
    probe = {
        (row["encoding"], row["normaliser"], row["boundary tokens"]): row["mean over n"]
        for row in _table("docs/probe/report.md", "| encoding | normaliser | boundary tokens |")
    }
    names = {"T5": "t5", "ALiBi": "alibi", "RoPE": "rope", "Shaw (R_K + R_V, k = 16)": "shaw"}
    names |= {"sinusoidal": "sinusoidal", "learned": "learned"}
    columns = {"softmax": ("softmax", "no"), "softmax + [CLS]/[SEP]": ("softmax", "yes"), "L2": ("l2", "no")}
    columns |= {"relu²/n": ("relu2", "no"), "URPE": ("urpe", "no")}
    rows = [r for r in _table("docs/site/blind-spot.md", "| encoding | softmax |") if r["encoding"] in names]
    assert len(rows) == 6
    for row in rows:
        for column, (normaliser, boundary) in columns.items():
            want = probe[names[row["encoding"]], normaliser, boundary].replace(", all 5 seeds", "")
            assert row[column] == want, (row["encoding"], column, row[column], want)
