"""The README's headline figures, drawn from committed benchmark rows.

    python benchmarks/headline_figures.py            # writes docs/figures/*.png

* ``decoder-tasks.png``: Kazemnejad et al.'s five decoder tasks (``docs/extrapolation-kazemnejad/``):
  per encoding, the mean exact match beyond the training length over all seeds, with its 95%
  interval, and the published figure (another protocol) beside it, read with its source from
  ``posenc_jax/bench/published.json``.
* ``randomized.png``: Ruoss et al.'s encoder tasks, each encoding with and without randomized
  positions, in two rows. Top: one run (``docs/extrapolation-cpu-full/``; parity in
  ``-cpu-full-parity/``), both encodings on the same seeds, drawn paired: a line joins each
  seed's two scores and the paired difference is printed. Bottom: Ruoss et al.'s lengths (to
  10x), again one run (``docs/extrapolation-ruoss/``, every cell 4,000 steps at most), drawn the
  same way. The randomized cells' longer run (``docs/extrapolation-ruoss-long/``, 16,000 steps)
  is not drawn: set beside 4,000-step cells it would compare two budgets. A cell that did not
  learn its task has no bar, only its label; cells of two run folders are never drawn paired.

Every value comes from :func:`posenc_jax.bench.results.cells`, as the reports' tables do;
:func:`bars` returns them and :func:`pairs` the seeds each drawn pair shares (none unless both
ran in one run folder), for the tests to check.
"""

from __future__ import annotations

import argparse
import pathlib
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from posenc_jax.bench import published
from posenc_jax.bench.report import PUBLISHED_GROUP
from posenc_jax.bench.results import cells, read
from posenc_jax.bench.stats import paired_difference

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
# Each encoding without and with randomized positions, as (label, encoding) pairs.
PAIRS = (
    (("RoPE", "rope"), ("RoPE + randomized", "rope+randomized")),
    (("sinusoidal", "sinusoidal"), ("sinusoidal + randomized", "sinusoidal+randomized")),
)
COLOURS = {"RoPE": "tab:orange", "sinusoidal": "tab:blue"}  # the per-run plots' family colours
# Top row: one run, both encodings of a pair on the same seeds (tested to 2x the training length).
ONE_RUN = {task: "extrapolation-cpu-full" for task in ENCODER_TASKS} | {"parity": "extrapolation-cpu-full-parity"}
# Bottom row, Ruoss et al.'s lengths (to 10x): label: (encoding, folder), all of one run and one
# budget (the randomized cells' 16,000-step rerun has no partner at that budget, so it is left out).
RANDOMIZED = {
    "RoPE": ("rope", "extrapolation-ruoss"),
    "RoPE + randomized": ("rope+randomized", "extrapolation-ruoss"),
    "sinusoidal": ("sinusoidal", "extrapolation-ruoss"),
    "sinusoidal + randomized": ("sinusoidal+randomized", "extrapolation-ruoss"),
}
ROWS = ("to 2x", "to 10x")


def _summaries(folder: pathlib.Path) -> dict:
    return {(c.task, c.encoding): c for c in cells(read(folder))}


def _randomized_cells(docs: pathlib.Path) -> dict:
    """``{(row, task, label): (folder, cell summary)}`` of both rows of the randomized figure."""
    folders: dict[str, dict] = {}
    out = {}
    for row in ROWS:
        for task in ENCODER_TASKS:
            for pair in PAIRS:
                for label, encoding in pair:
                    folder = ONE_RUN[task] if row == ROWS[0] else RANDOMIZED[label][1]
                    if folder not in folders:
                        folders[folder] = _summaries(docs / folder)
                    out[row, task, label] = folder, folders[folder][task, encoding]
    return out


def paired_seeds(first: tuple[str, object], second: tuple[str, object]) -> tuple[int, ...]:
    """The seeds two cells ``(folder, summary)`` share, if they ran in the same run folder: a pair is
    drawn paired only then (the same seeds of different runs are different models and data)."""
    (folder_a, a), (folder_b, b) = first, second
    if folder_a != folder_b:
        return ()
    return tuple(sorted(set(a.in_distribution) & set(b.in_distribution)))


def pairs(docs: pathlib.Path = ROOT / "docs") -> dict[tuple[str, str, str], tuple[int, ...]]:
    """``{(row, task, encoding label): seeds}`` of each pair the randomized figure draws: the seeds
    its two cells share in one run folder (drawn paired), or ``()`` (drawn apart)."""
    found = _randomized_cells(docs)
    return {
        (row, task, base[0]): paired_seeds(found[row, task, base[0]], found[row, task, randomized[0]])
        for row in ROWS
        for task in ENCODER_TASKS
        for base, randomized in PAIRS
    }


def _value(cell):
    interval = cell.extrapolation if cell.learned else None
    return interval and (interval.mean, interval.low, interval.high)


def bars(docs: pathlib.Path = ROOT / "docs") -> dict[str, dict]:
    """``{figure: {(task, label): (mean, low, high) or None}}``: None where the cell did not learn.
    ``"randomized"`` is the row tested to 10x, ``"randomized-paired"`` the row tested to 2x (both one run each)."""
    out: dict[str, dict] = {"decoder-tasks": {}, "randomized": {}, "randomized-paired": {}}
    decoder = _summaries(docs / "extrapolation-kazemnejad")
    for task in DECODER_TASKS:
        for encoding in DECODER_ENCODINGS:
            out["decoder-tasks"][task, encoding] = _value(decoder[task, encoding])
    for (row, task, label), (_, cell) in _randomized_cells(docs).items():
        out["randomized-paired" if row == ROWS[0] else "randomized"][task, label] = _value(cell)
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
    fig.suptitle("\n".join(textwrap.wrap(title, 160)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _pair_bars(ax, row: str, task: str, found: dict, shared: dict) -> None:
    """One task's bars of one row: each pair side by side, joined seed by seed only if paired."""
    ticks, names = [], []
    for p, (base, randomized) in enumerate(PAIRS):
        colour = COLOURS[base[0]]
        seeds = shared[row, task, base[0]]
        drawn = []
        for k, (label, _) in enumerate((base, randomized)):
            # Paired bars touch; bars of separate runs stand apart, each named by its run.
            x = 2.9 * p + k * (1.1 if seeds else 1.35)
            folder, cell = found[row, task, label]
            drawn.append((x, cell))
            ticks.append(x)
            name = label.replace(" + randomized", "\n+ randomized")
            names.append(name if seeds else f"{name}\n({folder.removeprefix('extrapolation-')})")
            if not cell.learned:
                ax.text(x, 0.02, "not\nlearned", ha="center", va="bottom", fontsize=7, color="0.4")
                continue
            mean, low, high = cell.extrapolation.mean, cell.extrapolation.low, cell.extrapolation.high
            ax.bar(
                x,
                mean,
                0.9 if seeds else 0.7,
                color=colour,
                alpha=0.85 if k == 0 else 0.45,
                hatch="//" if k else None,
                edgecolor=colour,
                yerr=[[mean - low], [high - mean]],
                capsize=3,
            )
        (xa, a), (xb, b) = drawn
        if seeds and a.learned and b.learned:
            for seed in seeds:
                ax.plot([xa, xb], [a.beyond[seed], b.beyond[seed]], color="0.25", lw=0.7, marker="o", ms=2.5)
            diff = paired_difference(b.beyond, a.beyond)
            ax.text(
                (xa + xb) / 2,
                1.07,
                f"Δ {diff.mean:+.2f}\n[{diff.low:+.2f}, {diff.high:+.2f}]",
                ha="center",
                fontsize=6.5,
            )
    ax.set_xticks(ticks, names, fontsize=6.5)
    ax.set_ylim(0, 1.25)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])


def _randomized(path: pathlib.Path, docs: pathlib.Path) -> pathlib.Path:
    found, shared = _randomized_cells(docs), pairs(docs)
    fig, axes = plt.subplots(2, len(ENCODER_TASKS), figsize=(3.3 * len(ENCODER_TASKS), 7.6), sharey=True)
    for r, row in enumerate(ROWS):
        for ax, (task, name) in zip(axes[r], ENCODER_TASKS.items(), strict=True):
            _pair_bars(ax, row, task, found, shared)
            if task in CHANCE:
                ax.axhline(CHANCE[task], color="0.5", lw=0.8, ls=":")
            ax.set_title(name, fontsize=10)
    axes[0][0].set_ylabel("one run, paired by seed\naccuracy beyond training (to 2x)", fontsize=9)
    axes[1][0].set_ylabel("one run, paired by seed\naccuracy beyond training (to 10x)", fontsize=9)
    seeds = {len(cell.in_distribution) for _, cell in found.values()}
    title = (
        f"Randomized positions (Ruoss et al. 2023) on encoder tasks trained on lengths ≤ 10: mean over all "
        f"{'/'.join(map(str, sorted(seeds)))} seeds with its 95% interval; hatched: randomized; dotted: chance. "
        "Each row is one run, both encodings on the same seeds, at most 4,000 steps; a line joins a seed's two "
        "scores, Δ is the paired difference (randomized less not). Top: tested to 20 (cpu-full). Bottom: tested "
        "to 100 (ruoss)."
    )
    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=8.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def draw(out: pathlib.Path, docs: pathlib.Path = ROOT / "docs") -> list[pathlib.Path]:
    """Writes the figures into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    values = bars(docs)
    figures = published.by_task(PUBLISHED_GROUP)
    source = published.record(PUBLISHED_GROUP, "copy", "nope").source
    decoder = {
        task: dict(
            values=[values["decoder-tasks"][task, e] for e in DECODER_ENCODINGS],
            labels=list(DECODER_ENCODINGS.values()),
            published=[figures[task][e] for e in DECODER_ENCODINGS],
        )
        for task in DECODER_TASKS
    }
    seeds = {len(c.in_distribution) for c in _summaries(docs / "extrapolation-kazemnejad").values()}
    return [
        _row(
            out / "decoder-tasks.png",
            DECODER_TASKS,
            decoder,
            "exact match beyond training",
            f"Decoder tasks, trained on lengths ≤ 10, tested at 12–20: mean over all {max(seeds)} seeds with its 95% "
            f"interval; ◇ {source.paper} (arXiv:{source.arxiv}; 12 x 768, tested at 21–40), mean over their 3 seeds "
            f"from the authors' result rows ({source.repository} {source.file} at {source.commit[:7]})",
        ),
        _randomized(out / "randomized.png", docs),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "figures")
    for path in draw(parser.parse_args().out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
