"""The README's headline figures, drawn from committed benchmark rows.

    python benchmarks/headline_figures.py            # writes docs/figures/*.png

* ``decoder-tasks.png``: Kazemnejad et al.'s five decoder tasks (``docs/extrapolation-kazemnejad/``):
  per encoding, the mean exact match beyond the training length over the seeds that learned the
  task, with its 95% interval, and the published figure (another protocol) beside it.
* ``randomized.png``: Ruoss et al.'s encoder tasks, each encoding with and without randomized
  positions (``docs/extrapolation-ruoss/`` without, ``docs/extrapolation-ruoss-long/`` with, at
  16,000 steps); a cell that did not learn its task has no bar, only its label.

Every value comes from :func:`posenc_jax.bench.results.cells`, as the reports' tables do;
:func:`bars` returns them for the tests to check.
"""

from __future__ import annotations

import argparse
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from posenc_jax.bench.report import PUBLISHED
from posenc_jax.bench.results import cells, read

ROOT = pathlib.Path(__file__).resolve().parents[1]
DECODER_TASKS = {
    "counting_copy": "counting copy",
    "counting_replace": "counting replace",
    "copy": "copy",
    "duplicate": "duplicate",
    "reverse": "reverse",
}
DECODER_ENCODINGS = {"nope": "NoPE", "t5": "T5", "alibi": "ALiBi", "rope": "RoPE", "sinusoidal": "sinusoidal"}
ENCODER_TASKS = {
    "reverse_string": "reverse string",
    "missing_duplicate": "missing duplicate",
    "parity": "parity",
    "bucket_sort": "bucket sort",
}
CHANCE = {"missing_duplicate": 0.5, "parity": 0.5}  # two answers, equally likely
RANDOMIZED = {  # label: (encoding, folder)
    "RoPE": ("rope", "extrapolation-ruoss"),
    "RoPE + randomized": ("rope+randomized", "extrapolation-ruoss-long"),
    "sinusoidal": ("sinusoidal", "extrapolation-ruoss"),
    "sinusoidal + randomized": ("sinusoidal+randomized", "extrapolation-ruoss-long"),
}


def _summaries(folder: pathlib.Path) -> dict:
    return {(c.task, c.encoding): c for c in cells(read(folder))}


def bars(docs: pathlib.Path = ROOT / "docs") -> dict[str, dict]:
    """``{figure: {(task, label): (mean, low, high) or None}}``: None where the cell did not learn."""
    out: dict[str, dict] = {"decoder-tasks": {}, "randomized": {}}
    decoder = _summaries(docs / "extrapolation-kazemnejad")
    for task in DECODER_TASKS:
        for encoding in DECODER_ENCODINGS:
            interval = decoder[task, encoding].extrapolation if decoder[task, encoding].learned else None
            out["decoder-tasks"][task, encoding] = interval and (interval.mean, interval.low, interval.high)
    folders = {folder: _summaries(docs / folder) for _, folder in RANDOMIZED.values()}
    for task in ENCODER_TASKS:
        for label, (encoding, folder) in RANDOMIZED.items():
            cell = folders[folder][task, encoding]
            interval = cell.extrapolation if cell.learned else None
            out["randomized"][task, label] = interval and (interval.mean, interval.low, interval.high)
    return out


def _panel(ax, values, labels, published=None, chance=None):
    x = np.arange(len(labels))
    for i, value in enumerate(values):
        if value is None:
            ax.text(i, 0.02, "not\nlearned", ha="center", va="bottom", fontsize=7, color="0.4")
            continue
        mean, low, high = value
        ax.bar(i, mean, 0.6, color="tab:blue", yerr=[[mean - low], [high - mean]], capsize=3)
    if published is not None:
        ax.scatter(x, published, marker="D", s=28, facecolors="none", edgecolors="tab:red", zorder=3)
    if chance is not None:
        ax.axhline(chance, color="0.5", lw=0.8, ls=":")
    ax.set_xticks(x, labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)


def _row(path: pathlib.Path, titles: dict, panels: dict, ylabel: str, title: str) -> pathlib.Path:
    """One figure of panels side by side, one per task (``panels[task]``: ``_panel``'s arguments)."""
    fig, axes = plt.subplots(1, len(titles), figsize=(3 * len(titles), 3.4), sharey=True)
    for ax, (task, name) in zip(axes, titles.items(), strict=True):
        _panel(ax, **panels[task])
        ax.set_title(name, fontsize=10)
    axes[0].set_ylabel(ylabel)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw(out: pathlib.Path, docs: pathlib.Path = ROOT / "docs") -> list[pathlib.Path]:
    """Writes the figures into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    values = bars(docs)
    decoder = {
        task: dict(
            values=[values["decoder-tasks"][task, e] for e in DECODER_ENCODINGS],
            labels=list(DECODER_ENCODINGS.values()),
            published=[PUBLISHED[task][e] for e in DECODER_ENCODINGS],
        )
        for task in DECODER_TASKS
    }
    randomized = {
        task: dict(
            values=[values["randomized"][task, label] for label in RANDOMIZED],
            labels=list(RANDOMIZED),
            chance=CHANCE.get(task),
        )
        for task in ENCODER_TASKS
    }
    return [
        _row(
            out / "decoder-tasks.png",
            DECODER_TASKS,
            decoder,
            "exact match beyond training",
            "Decoder tasks, trained on lengths ≤ 10, tested at 12–20: mean over 5 seeds with its 95% interval; "
            "◇ Kazemnejad et al. 2023 (12 x 768, tested at 21–40)",
        ),
        _row(
            out / "randomized.png",
            ENCODER_TASKS,
            randomized,
            "accuracy beyond training",
            "Encoder tasks, trained on lengths ≤ 10, tested to 100: mean over the seeds that learned (of 5) "
            "with its 95% interval (dotted: chance); randomized cells trained 16,000 steps, the others 4,000",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "figures")
    for path in draw(parser.parse_args().out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
