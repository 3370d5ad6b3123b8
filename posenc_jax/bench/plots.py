"""The plots of a results folder: each task's score against evaluation length, by encoding family.

Learned cells are drawn as the mean over all seeds with a 95% interval band, unlearned cells
hollow, grey and dotted, and the baselines (chance, position-only, content-only; the best n-gram
model for text) and the training length as lines (:func:`figure`, :func:`plot`).
"""

from __future__ import annotations

import pathlib

import numpy as np

from posenc_jax.bench.results import BOUNDED, Results, cells, read
from posenc_jax.bench.stats import interval
from posenc_jax.bench.tasks import TASKS, task, title
from posenc_jax.functional.core.registry import encoding_info

__all__ = ["FAMILIES", "family", "figure", "plot"]

# Families for the plots' small multiples, in panel order.
FAMILIES = ("absolute and none", "RoPE and its scalings", "additive biases", "relative, content-dependent")
# One colour family per encoding family (a sequential palette: each encoding of a family its own
# shade), and within a panel each line its own style and marker. Dotted is kept for the unlearned
# cells and the baselines.
_PALETTES = ("Blues", "Oranges", "Greens", "Purples")
_LINESTYLES = ("-", "--", "-.", (0, (6, 1.5)), (0, (3, 1, 1, 1, 1, 1)), (0, (8, 2, 2, 2)))
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")
# Tasks with at most this many encodings are drawn in one panel, so that they are compared.
_ONE_PANEL = 6
# On text, a learned line that rises above this multiple of its bits per character at the
# training length has exploded; the zoomed row's y-range is fitted to the lines that did not.
_EXPLODED = 1.5


def family(label: str) -> str:
    """The family of a row label (``enc``, ``enc|normaliser``, ``a+b``, ``rope+pi@eval``,
    ``rope@ft``): by where its first part acts, from the registry."""
    base = label.split("|")[0].split("@")[0].split("+")[0]  # rope+pi@eval, rope@ft -> rope
    try:
        info = encoding_info(base)
    except ValueError:
        return FAMILIES[-1]
    if info.acts_on == "embeddings" or not info.hooks:
        return FAMILIES[0]
    if "rotate" in info.hooks:
        return FAMILIES[1]
    if info.acts_on == "shared_bias":
        return FAMILIES[2]
    return FAMILIES[3]


def _text(name: str, format: str) -> bool:
    """Whether task ``name`` is scored on text (False for a task this version does not know)."""
    try:
        return task(name, format).length_family == "text"
    except ValueError:  # a task this version does not know: no chance line, default axis
        return False


def _unit(name: str, text: bool) -> str:
    """What one unit of task ``name``'s length counts, for the x axis."""
    unit = TASKS[name].unit if name in TASKS else ""
    return unit or ("characters" if text else "symbols of x")


def _panels(encodings: list[str]) -> list[tuple[str, list[str]]]:
    """``[(title, encodings)]``: one panel per family, or one for all when there are few to compare."""
    by_family = [(f, [e for e in encodings if family(e) == f]) for f in FAMILIES]
    by_family = [(f, members) for f, members in by_family if members]
    if len(encodings) <= _ONE_PANEL:
        return [("every encoding (colour: family)", [e for _, members in by_family for e in members])]
    return by_family


def _styles(panels: list[tuple[str, list[str]]]) -> dict[str, dict]:
    """Each encoding's colour (its family's palette, one shade per encoding of that family in the
    panel), line style and marker (one per encoding of the panel)."""
    import matplotlib

    styles = {}
    for _, members in panels:
        for name in FAMILIES:
            kin = [e for e in members if family(e) == name]
            palette = matplotlib.colormaps[_PALETTES[FAMILIES.index(name)]]
            shades = np.linspace(0.9, 0.4, len(kin)) if len(kin) > 1 else [0.75] * len(kin)
            for encoding, shade in zip(kin, shades, strict=True):
                styles[encoding] = {"color": palette(float(shade))}
        for index, encoding in enumerate(members):
            styles[encoding] |= {
                "linestyle": _LINESTYLES[index % len(_LINESTYLES)],
                "marker": _MARKERS[index % len(_MARKERS)],
            }
    return styles


def _curve(rows: list[dict], encoding: str, lengths: list[int], bounded: bool):
    """Mean over all seeds at each length, and its 95% interval (NaN where one seed)."""
    by_seed: dict[int, dict[int, float]] = {}
    for r in rows:
        if r["encoding"] == encoding:
            by_seed.setdefault(r["seed"], {})[r["length"]] = r["value"]
    mean, low, high = [], [], []
    for n in lengths:
        values = [v[n] for v in by_seed.values() if n in v]
        if len(values) > 1:
            found = interval(values, bounded=bounded)
            mean.append(found.mean), low.append(found.low), high.append(found.high)
        else:
            mean.append(values[0] if values else np.nan), low.append(np.nan), high.append(np.nan)
    return np.array(mean), np.array(low), np.array(high)


def _zoom(curves: dict, summaries: dict, train_length: int, lengths: list[int], ngram: float | None):
    """The y-range fitted to the learned lines that did not explode (each below ``_EXPLODED`` times its
    score at the training length), with the n-gram line; None when that range would hide nothing."""
    at = lengths.index(train_length) if train_length in lengths else 0
    learned = [e for e in curves if summaries[e].learned]
    kept = [e for e in learned if np.nanmax(curves[e][0]) <= _EXPLODED * curves[e][0][at]]
    if not kept or len(kept) == len(learned):
        return None
    values = np.concatenate([np.concatenate(curves[e]) for e in kept] + [[ngram] if ngram else []])
    low, high = np.nanmin(values), np.nanmax(values)
    pad = 0.06 * (high - low)
    return low - pad, high + pad


def figure(task_name: str, results: Results):
    """The matplotlib figure of one task: the metric against evaluation length, in small multiples by
    family (absolute and none, RoPE and its scalings, additive biases, relative), or in one panel
    when a task has few encodings to compare. One colour family per encoding family, a shade, line
    style and marker per encoding; learned cells as the mean over all seeds with a 95% interval
    band, unlearned cells hollow, grey and dotted (labelled "not learned"); baselines and the
    training length as lines. On text, a second row zooms to the learned lines that did not explode
    (the y-range of the differences the claims rest on), marking with ▲ where a line is above it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = {c.encoding: c for c in cells(results) if c.task == task_name}
    rows = [r for r in results.rows if r["task"] == task_name]
    text = _text(task_name, (results.preset or {}).get("task_format", "ours"))
    sample = rows[0]
    bounded = sample["metric"] in BOUNDED
    lengths = sorted({r["length"] for r in rows})
    known = results.baselines.get(task_name, {})
    best = min(known["ngram"], key=lambda b: b["bits_per_char"]) if known.get("ngram") else None
    panels = _panels(list(summaries))
    styles = _styles(panels)
    curves = {e: _curve(rows, e, lengths, bounded) for e in summaries}
    zoom = (
        _zoom(curves, summaries, sample["train_length"], lengths, best and best["bits_per_char"])
        if text and not bounded
        else None
    )
    shape = (2 if zoom else 1, len(panels))
    fig, axes = plt.subplots(*shape, figsize=(4.4 * shape[1], 3.4 * shape[0] + 0.6), sharey="row", squeeze=False)
    # Legends go below the bottom row (outside the axes; the PNG's tight bounding box takes them in).
    fig.subplots_adjust(left=0.07, right=0.98, top=1 - 0.7 / fig.get_figheight(), wspace=0.12, hspace=0.32)
    for row, line_axes in enumerate(axes):
        for ax, (panel, members) in zip(line_axes, panels, strict=True):
            _encoding_lines(ax, members, curves, styles, summaries, lengths, zoom[1] if row == 1 else None)
            _reference_lines(ax, known, best, lengths, sample["train_length"])
            if text:
                ax.set_xscale("log", base=2)
                ax.set_xticks(lengths, [str(n) for n in lengths], rotation=45)
                ax.minorticks_off()
            if bounded:
                ax.set_ylim(-0.02, 1.02)
            if row == 1:
                ax.set_ylim(*zoom)
                ax.set_title(f"{panel}: zoomed (▲ above the range)", fontsize=9)
            else:
                ax.set_title(panel + (": full range" if zoom else ""), fontsize=9)
            if row == shape[0] - 1:
                ax.set_xlabel(f"evaluation length ({_unit(task_name, text)})", fontsize=8)
            ax.grid(alpha=0.25)
        line_axes[0].set_ylabel(sample["metric"].replace("_", " ") + (" (lower is better)" if text else ""))
    _legends_below(fig, axes)
    fig.suptitle(f"{title(task_name)}: mean over all seeds, band = 95% interval", fontsize=10)
    return fig


def _encoding_lines(ax, members, curves, styles, summaries, lengths, top) -> None:
    """Each encoding's line in one panel: learned cells as the mean with a 95% band, unlearned ones hollow,
    grey and dotted; ``top``: the zoomed row's upper limit, past which a point is marked with ▲ (or None)."""
    for encoding in members:
        mean, low, high = curves[encoding]
        style = styles[encoding]
        if not summaries[encoding].learned:
            ax.plot(
                lengths,
                mean,
                color="0.6",
                lw=1,
                ms=4,
                markerfacecolor="none",
                linestyle=":",
                marker=style["marker"],
                label=f"{encoding} (not learned)",
            )
        else:
            ax.plot(lengths, mean, lw=1.4, ms=4, label=encoding, **style)
            ax.fill_between(lengths, low, high, color=style["color"], alpha=0.15, lw=0)
        if top is not None:  # the zoomed row: mark the points above its range
            above = [n for n, v in zip(lengths, mean, strict=True) if v > top]
            ax.plot(
                above,
                [top] * len(above),
                linestyle="none",
                marker="^",
                ms=6,
                color=style["color"] if summaries[encoding].learned else "0.6",
                clip_on=False,
                label="_above",
            )


def _reference_lines(ax, known: dict, best, lengths, train_length: int) -> None:
    """The baselines (position-only, content-only, chance; the best n-gram on text) and the training length."""
    if "lengths" in known:
        for name, line in (("position-only", (0, (1, 1))), ("content-only", (0, (4, 2))), ("chance", "-")):
            values = [known["lengths"].get(str(n), {}).get(name) for n in lengths]
            if all(v is not None for v in values):
                ax.plot(lengths, values, color="k", lw=0.8, linestyle=line, alpha=0.6, label=f"{name} baseline")
    if best:
        ax.axhline(
            best["bits_per_char"],
            color="k",
            lw=0.8,
            linestyle=(0, (1, 1)),
            alpha=0.6,
            label=f"best n-gram ({best['order']}-gram)",
        )
    ax.axvline(
        train_length,
        color="0.35",
        linestyle="-.",
        linewidth=0.8,
        alpha=0.7,
        label=f"training length ({train_length})",
    )


def _legends_below(fig, axes) -> None:
    """Each column's legend under its bottom axes, below the tick labels and the axis label."""
    renderer = fig.canvas.get_renderer()
    bottom = min(ax.xaxis.get_tightbbox(renderer).y0 for ax in axes[-1])
    for ax in axes[-1]:
        shown = [(h, lab) for h, lab in zip(*ax.get_legend_handles_labels(), strict=True) if lab != "_above"]
        below = ax.transAxes.inverted().transform((0, bottom))[1]
        ax.legend(
            *zip(*shown, strict=True),
            fontsize=6.5,
            frameon=False,
            loc="upper center",
            bbox_to_anchor=(0.5, below - 0.02),
            ncol=2,
        )


def plot(results: Results | str | pathlib.Path, out: pathlib.Path | None = None) -> list[pathlib.Path]:
    """One PNG (150 dpi) and one SVG per task (see :func:`figure`); returns the PNGs' paths."""
    import matplotlib.pyplot as plt

    if not isinstance(results, Results):
        out = pathlib.Path(results) if out is None else out
        results = read(results)
    written = []
    for task_name in dict.fromkeys(r["task"] for r in results.rows):
        fig = figure(task_name, results)
        path = pathlib.Path(out) / f"{task_name}.png"
        fig.savefig(path, dpi=150, bbox_inches="tight")
        fig.savefig(path.with_suffix(".svg"), bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
