"""Tables and plots from ``results.jsonl``: ours, with published figures beside them.

Every summary is the mean over seeds with ± one standard deviation over seeds (of each
seed's mean over the lengths in a table, of each length's value in a plot): the tables
and the plots' shaded bands say the same thing, and a single seed shows no spread.
"""

from __future__ import annotations

import collections
import functools
import json
import pathlib

import numpy as np

from posenc_jax.functional.registry import encoding_names
from posenc_jax.tasks import make_task

__all__ = ["PUBLISHED", "TITLES", "figure", "load_results", "overview", "plot", "write_report"]

# Kazemnejad et al. 2023, mean exact match over test lengths 21-40, 3 seeds (BENCHMARKS.md).
# Their "APE" is the sinusoidal absolute encoding.
PUBLISHED = {
    "counting_copy": {"nope": 0.986, "t5": 0.771, "alibi": 0.289, "rope": 0.000, "sinusoidal": 0.000},
    "copy": {"nope": 0.305, "t5": 0.420, "alibi": 0.331, "rope": 0.011, "sinusoidal": 0.028},
    "duplicate": {"nope": 0.431, "t5": 0.524, "alibi": 0.569, "rope": 0.043, "sinusoidal": 0.040},
    "reverse": {"nope": 0.230, "t5": 0.242, "alibi": 0.171, "rope": 0.077, "sinusoidal": 0.023},
}
PUBLISHED_PROTOCOL = (
    "Kazemnejad et al. 2023: 12 layers x 768, 40K steps, train lengths <= 20, test 21-40, 3 seeds, exact match"
)
TEXT_REFERENCE = (
    "Press et al. 2022 (WikiText-103, 16 x 1024, trained at 512): sinusoidal perplexity explodes past the "
    "training length (20.05 at 512 -> 406 at 15512), rotary degrades slowly (20.07 -> 79.25), T5 holds a while "
    "(19.65 -> 43.08 at 8512), ALiBi stays flat (19.73 -> 18.31)."
)
# Titles a reader can parse: the task, then the model and the metric.
TITLES = {
    "counting_copy": "Counting copy: one symbol repeated n times, copy it (decoder)",
    "copy": "Copy a random string (decoder)",
    "duplicate": "Duplicate a random string, y = x x (decoder)",
    "reverse": "Reverse a random string (decoder)",
    "reverse_string": "Reverse string (encoder)",
    "missing_duplicate": "Missing duplicate: which bit of w w is hidden (encoder)",
    "parity": "Parity of a bit string (encoder)",
    "bucket_sort": "Bucket sort (encoder)",
    "probe": "Probe: index of each of n identical tokens (encoder)",
    "probe_boundary": "Probe with [CLS] ... [SEP] boundary tokens (encoder)",
    "text": "Character-level language modelling (decoder)",
}
_BOUNDED = ("exact_match", "accuracy")  # metrics in [0, 1]
# The order labels take their styles in: the cpu preset's encodings and the RoPE scalings at
# evaluation first (10 distinct colours), then the rest of the registry.
_FIRST = ["nope", "sinusoidal", "learned", "rope", "t5", "alibi", "rope+pi@eval", "rope+ntk@eval", "rope+yarn@eval"]
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h")
_LINESTYLES = ("-", "--", "-.", ":")


def load_results(path) -> list[dict]:
    path = pathlib.Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _style(label: str, others: list[str]) -> dict:
    """Colour, marker and line style of a row label, the same in every plot of every run: the
    labels of ``_FIRST``, then the registry's other names, then labels no name matches (hybrids,
    normalisers) in sorted order. Colours: tab10, then tab20b, then tab20c (50); 11 markers and
    4 line styles, so no two of the first 44 labels share both a marker and a line style."""
    import matplotlib

    names = _FIRST + [n for n in encoding_names() if n not in _FIRST]
    extra = sorted(label for label in others if label not in names)
    index = names.index(label) if label in names else len(names) + extra.index(label)
    if index < 10:
        colour = matplotlib.colormaps["tab10"](index)
    else:
        colour = matplotlib.colormaps["tab20b" if (index - 10) % 40 < 20 else "tab20c"]((index - 10) % 20)
    return {
        "color": colour,
        "marker": _MARKERS[index % len(_MARKERS)],
        "linestyle": _LINESTYLES[(index // len(_MARKERS)) % len(_LINESTYLES)],
    }


def _by_cell(rows):
    cells = collections.defaultdict(lambda: collections.defaultdict(dict))
    for row in rows:
        cells[row["task"]][row["encoding"]].setdefault(row["seed"], {})[row["length"]] = row["value"]
    return cells


def _summary(per_seed: dict, keep) -> tuple[float, float, int]:
    """Mean over seeds of each seed's mean over the kept lengths, the standard deviation over
    seeds of the same, and the number of seeds."""
    means = []
    for lengths in per_seed.values():
        values = [v for n, v in lengths.items() if keep(n)]
        if values:
            means.append(float(np.mean(values)))
    if not means:
        return float("nan"), float("nan"), 0
    return float(np.mean(means)), float(np.std(means)), len(means)


def _cell(summary: tuple[float, float, int]) -> str:
    mean, std, seeds = summary
    if seeds == 0:
        return "-"
    return f"{mean:.3f}" if seeds == 1 else f"{mean:.3f} ± {std:.3f}"


def _protocol(preset: dict) -> list[str]:
    text = "text" in preset["tasks"]
    algorithmic = any(task != "text" for task in preset["tasks"])
    lines = (
        f"Preset `{preset['name']}`: {preset['num_layers']} layers x {preset['model_dim']}, "
        f"{preset['num_heads']} heads, {preset['steps']} steps, batch {preset['batch_size']}, "
        f"AdamW lr {preset['learning_rate']} (warmup + cosine), seeds {list(preset['seeds'])}."
    )
    if algorithmic:
        lines += (
            f" Algorithmic tasks train on lengths 1-{preset['train_length']} and are tested at "
            f"{list(preset['eval_lengths'])}."
        )
    if text:
        lengths = [preset["text_context"] * m for m in preset["text_multiples"]]
        lines += f" Text trains at {preset['text_context']} characters and is tested at {lengths}."
    return [lines, ""]


# Short column heads for the overview, one per task.
_SHORT = {
    "counting_copy": "counting copy",
    "copy": "copy",
    "duplicate": "duplicate",
    "reverse": "reverse",
    "reverse_string": "reverse string (enc)",
    "missing_duplicate": "missing dup. (enc)",
    "parity": "parity (enc)",
    "bucket_sort": "bucket sort (enc)",
    "probe": "probe (enc)",
    "probe_boundary": "probe + [CLS]/[SEP] (enc)",
    "text": "text, bits/char",
}


def overview(rows: list[dict]) -> list[str]:
    """One table of every encoding (rows) on every task (columns): the mean beyond the training
    length, with the in-distribution mean in brackets (both averaged over lengths, then seeds),
    so a reader sees at once whether a task was learned before asking how it extrapolates.
    A cell not yet run is ``·``; an encoding that cannot run a task (no bidirectional form on an
    encoder task) is ``n/a`` when the task has rows for other encodings."""
    cells = _by_cell(rows)
    tasks = list(cells)
    encodings = list(dict.fromkeys(row["encoding"] for row in rows))
    train = {task: next(r["train_length"] for r in rows if r["task"] == task) for task in tasks}
    lines = [
        "| encoding | " + " | ".join(_SHORT.get(task, task) for task in tasks) + " |",
        "|---|" + "---|" * len(tasks),
    ]
    for encoding in encodings:
        parts = []
        for task in tasks:
            per_seed = cells[task].get(encoding)
            if not per_seed:
                parts.append("·" if _can_run(task, encoding) else "n/a")
                continue
            ind = _summary(per_seed, lambda n, limit=train[task]: n <= limit)[0]
            ood = _summary(per_seed, lambda n, limit=train[task]: n > limit)[0]
            parts.append(f"{ood:.2f} ({ind:.2f})")
        lines.append(f"| {encoding} | " + " | ".join(parts) + " |")
    return lines


def _can_run(task_name: str, label: str) -> bool:
    """Whether the encoding of a row label (``enc``, ``enc|normaliser``, ``rope+pi@eval``) can run
    ``task_name`` at all (encoder tasks need a bidirectional form); True when unknown."""
    from posenc_jax.bench.presets import runs_on

    encoding = label.split("|")[0]
    if encoding.endswith("@eval"):
        encoding = encoding.split("+")[0]
    task = _task(task_name)
    try:
        return task is None or runs_on(task, encoding)
    except ValueError:
        return True


def write_report(
    rows: list[dict], out: pathlib.Path, *, preset: dict | None = None, record: dict | None = None, plots: bool = True
) -> str:
    """Writes ``report.md`` (and returns its text)."""
    out = pathlib.Path(out)
    pipeline_check = bool(preset) and preset["name"] == "smoke"
    lines = ["# Length extrapolation", ""]
    if pipeline_check:
        lines += [
            "**A pipeline check, not a result.** The smoke preset trains tiny models for a few steps to "
            "exercise every step of the benchmark in seconds; its numbers say nothing about the encodings. "
            "Run `--preset cpu` (or `cpu-full`) for results.",
            "",
        ]
    if preset:
        lines += _protocol(preset)
    if record and record.get("text_corpus"):
        lines += [f"Text corpus: {record['text_corpus']}.", ""]
    if record:
        version = record["versions"].get("posenc_jax", "(version not recorded)")
        lines += [
            f"Device: {record['device']['kind']} x {record['device']['count']}; posenc_jax {version}, "
            f"jax {record['versions']['jax']}; commit {record.get('git_commit')}.",
            "",
        ]
    if len(_by_cell(rows)) > 1 and not pipeline_check:
        lines += [
            "## Overview",
            "",
            "Beyond the training length, with the in-distribution score in brackets: means over lengths, "
            "then over seeds (the sections below give the spread). Exact match or accuracy, higher is better; "
            "text in bits per character, lower is better. `·`: not run (yet).",
            "",
            *overview(rows),
            "",
        ]
    for task, encodings in _by_cell(rows).items():
        sample = next(r for r in rows if r["task"] == task)
        metric, train_length = sample["metric"], sample["train_length"]
        lower = metric == "bits_per_char"
        seeds = max(len(p) for p in encodings.values())
        title = TITLES.get(task, task)
        direction = "lower" if lower else "higher"
        lines += [f"## {title}", "", f"Task `{task}`; {metric.replace('_', ' ')}, {direction} is better.", ""]
        header = (
            f"| encoding | in distribution (length <= {train_length}) | beyond training (length > {train_length}) |"
        )
        sep = "|---|---|---|"
        published = None if pipeline_check else PUBLISHED.get(task)
        if published:
            header += " published, test 21-40 (different protocol) |"
            sep += "---|"
        lines += [header, sep]
        for encoding, per_seed in encodings.items():
            ind = _summary(per_seed, lambda n, limit=train_length: n <= limit)
            ood = _summary(per_seed, lambda n, limit=train_length: n > limit)
            row = f"| {encoding} | {_cell(ind)} | {_cell(ood)} |"
            if published:
                row += f" {published[encoding]:.3f} |" if encoding in published else " - |"
            lines.append(row)
        lines.append("")
        if seeds == 1:
            lines.append("Mean over lengths; one seed, so no spread is shown.")
        else:
            lines.append(
                f"Mean over lengths, then mean ± standard deviation over seeds ({seeds} seeds; the plot's band "
                "is the same ± 1 standard deviation, per length)."
            )
        if any(label.endswith("@eval") for label in encodings):
            lines.append(
                "Rows `rope+<scaling>@eval` are the trained RoPE model evaluated with that RoPE scaling, "
                "sized at each length (factor = test tokens / training tokens): evaluation only, no training."
            )
        if published:
            lines.append(
                f"Published column: {PUBLISHED_PROTOCOL}; same task, not the same protocol, so compare the "
                "ordering, not the numbers."
            )
        if task == "text" and not pipeline_check:
            lines.append(f"Reference shape: {TEXT_REFERENCE}")
        if plots:
            lines.append(f"![{task}]({task}.png)")
        lines.append("")
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


@functools.cache
def _task(name: str):
    try:
        return make_task(name, max_length=1 << 16)
    except ValueError:  # a task this version does not know: no chance line, default axis
        return None


def figure(task_name: str, rows: list[dict]):
    """The matplotlib figure of one task's rows: the metric against evaluation length, the mean
    over seeds with a band of ± 1 standard deviation; algorithmic tasks on a linear length axis,
    text on a log axis; bounded metrics on [0, 1]; chance (where it exists) and the training
    length marked; the legend outside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = [r for r in rows if r["task"] == task_name]
    encodings = _by_cell(rows)[task_name]
    sample = rows[0]
    task = _task(task_name)
    text = task is not None and task.length_family == "text"
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    seeds = max(len(p) for p in encodings.values())
    all_lengths = sorted({n for per_seed in encodings.values() for seed in per_seed.values() for n in seed})
    # Equal curves stay visible: hollow markers of distinct shapes, each curve shifted along the
    # length axis by its own small offset (together at most a quarter of the narrowest gap).
    where = np.log2(all_lengths) if text else np.asarray(all_lengths, float)
    gap = float(np.min(np.diff(where))) if len(where) > 1 else 1.0
    for rank, (encoding, per_seed) in enumerate(encodings.items()):
        lengths = sorted({n for seed in per_seed.values() for n in seed})
        values = np.array([[seed.get(n, np.nan) for n in lengths] for seed in per_seed.values()])
        mean = np.nanmean(values, axis=0)
        shift = 0.25 * gap * (rank / max(len(encodings) - 1, 1) - 0.5)
        x = np.asarray(lengths, float) * 2**shift if text else np.asarray(lengths, float) + shift
        style = _style(encoding, list(encodings))
        ax.plot(x, mean, ms=5, lw=1.3, label=encoding, markerfacecolor="none", **style)
        if values.shape[0] > 1:
            std = np.nanstd(values, axis=0)
            ax.fill_between(x, mean - std, mean + std, color=style["color"], alpha=0.15, lw=0)
    extra = []
    chance = [task.chance(n) for n in all_lengths] if task is not None else [None]
    if all(c is not None for c in chance):
        ax.plot(all_lengths, chance, color="0.4", lw=1, linestyle=(0, (1, 2)), zorder=0, label="_chance")
        extra.append(Line2D([], [], color="0.4", lw=1, linestyle=(0, (1, 2)), label="chance"))
    ax.axvline(sample["train_length"], color="k", linestyle="--", linewidth=1, zorder=0)
    extra.append(Line2D([], [], color="k", lw=1, linestyle="--", label=f"training length ({sample['train_length']})"))
    if seeds > 1:
        extra.append(Patch(color="0.6", alpha=0.4, label=f"± 1 std over {seeds} seeds"))
    if text:
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_lengths, [str(n) for n in all_lengths])
        ax.minorticks_off()
        ax.set_xlabel("evaluation length (characters, log scale; curves offset slightly to stay visible)")
    else:
        ax.set_xticks(all_lengths)
        ax.set_xlabel("evaluation length (symbols of the input x; curves offset slightly to stay visible)")
    if sample["metric"] in _BOUNDED:
        ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel(sample["metric"].replace("_", " ") + (" (lower is better)" if text else ""))
    ax.set_title(TITLES.get(task_name, task_name), fontsize=10)
    ax.grid(alpha=0.25)
    handles = [h for h in ax.get_lines() if not h.get_label().startswith("_")]
    columns = 1 if len(handles) + len(extra) <= 18 else 2
    ax.legend(
        handles=handles + extra, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, ncol=columns, frameon=False
    )
    return fig


def plot(rows: list[dict], out: pathlib.Path) -> list[pathlib.Path]:
    """One PNG per task (see :func:`figure`); returns their paths."""
    import matplotlib.pyplot as plt

    written = []
    for task_name in _by_cell(rows):
        fig = figure(task_name, rows)
        path = pathlib.Path(out) / f"{task_name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
