"""Writes every committed run's report anew from its rows, with the benchmark's current statistics.

    python tools/reanalyse.py          # docs/extrapolation-*/report.md and docs/probe/report.md

A run's rows are what it measured; its report is a reading of them. When the reading changes
(every seed counted, bounded intervals, corrected comparisons), this rewrites each report from
the same rows, so no committed report is left computed the old way. Runs of the first method
(no ``check_every`` in their preset: fixed steps, no gate, random text windows) have no gate to
read and keep the report they were written with; the results page says what they are.
"""

from __future__ import annotations

import json
import pathlib

from posenc_jax.bench import probe, report
from posenc_jax.bench.results import read

ROOT = pathlib.Path(__file__).resolve().parents[1]


def folders(docs: pathlib.Path = ROOT / "docs") -> list[pathlib.Path]:
    """The committed run folders of the current reading (a ``run.json`` whose preset has a gate)."""
    found = []
    for run in sorted(docs.glob("extrapolation-*/**/run.json")):
        preset = json.loads(run.read_text())["preset"]
        if "check_every" in preset:
            found.append(run.parent)
    return found


def main() -> None:
    for folder in folders():
        report.write_report(folder, plots=any(folder.glob("*.png")))
        print(f"{folder.relative_to(ROOT)}/report.md")
    results = read(ROOT / "docs" / "probe")
    probe.write_probe_report(results.rows, ROOT / "docs" / "probe", preset=results.preset)
    print("docs/probe/report.md")


if __name__ == "__main__":
    main()
