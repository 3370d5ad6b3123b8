"""Tables and plots from ``results.jsonl``: ours, with published figures beside them."""

from __future__ import annotations

import collections
import json
import pathlib

import numpy as np

from posenc_jax.functional.registry import encoding_names

__all__ = ["PUBLISHED", "load_results", "plot", "write_report"]

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


def load_results(path) -> list[dict]:
    path = pathlib.Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


_EVAL_ONLY_ROWS = ["rope+pi@eval", "rope+ntk@eval", "rope+yarn@eval"]


def _colour(encoding: str):
    """A colour per encoding that is the same in every plot (registry order, 40 colours)."""
    import matplotlib

    names = encoding_names() + _EVAL_ONLY_ROWS
    index = names.index(encoding) if encoding in names else len(names)
    palette = "tab20" if index % 40 < 20 else "tab20b"
    return matplotlib.colormaps[palette](index % 20)


def _by_cell(rows):
    cells = collections.defaultdict(lambda: collections.defaultdict(dict))
    for row in rows:
        cells[row["task"]][row["encoding"]].setdefault(row["seed"], {})[row["length"]] = row["value"]
    return cells


def _summary(per_seed: dict, keep) -> tuple[float, float, int]:
    means = []
    for lengths in per_seed.values():
        values = [v for n, v in lengths.items() if keep(n)]
        if values:
            means.append(float(np.mean(values)))
    if not means:
        return float("nan"), float("nan"), 0
    return float(np.mean(means)), float(np.std(means)), len(means)


def write_report(
    rows: list[dict], out: pathlib.Path, *, preset: dict | None = None, record: dict | None = None, plots: bool = True
) -> str:
    """Writes ``report.md`` (and returns its text)."""
    out = pathlib.Path(out)
    lines = ["# Length extrapolation", ""]
    if preset:
        lines += [
            f"Preset `{preset['name']}`: {preset['num_layers']} layers x {preset['model_dim']}, "
            f"{preset['num_heads']} heads, {preset['steps']} steps, batch {preset['batch_size']}, "
            f"AdamW lr {preset['learning_rate']} (warmup + cosine), seeds {list(preset['seeds'])}. "
            f"Algorithmic tasks train on lengths 1-{preset['train_length']} and are tested "
            f"at {list(preset['eval_lengths'])}; text trains at {preset['text_context']} characters and is tested at "
            f"{[preset['text_context'] * m for m in preset['text_multiples']]}.",
            "",
        ]
    if record and record.get("text_corpus"):
        lines += [f"Text corpus: {record['text_corpus']}.", ""]
    if record:
        lines += [
            f"Device: {record['device']['kind']} x {record['device']['count']}; jax {record['versions']['jax']}; "
            f"commit {record.get('git_commit')}.",
            "",
        ]
    for task, encodings in _by_cell(rows).items():
        sample = next(r for r in rows if r["task"] == task)
        metric, train_length = sample["metric"], sample["train_length"]
        lower = metric == "bits_per_char"
        lines += [f"## {task} ({metric.replace('_', ' ')}, {'lower' if lower else 'higher'} is better)", ""]
        header = (
            f"| encoding | in distribution (length <= {train_length}) | beyond training (length > {train_length}) |"
        )
        sep = "|---|---|---|"
        published = PUBLISHED.get(task)
        if published:
            header += " published, test 21-40 (different protocol) |"
            sep += "---|"
        lines += [header, sep]
        for encoding, per_seed in encodings.items():
            ind = _summary(per_seed, lambda n, limit=train_length: n <= limit)
            ood = _summary(per_seed, lambda n, limit=train_length: n > limit)
            row = f"| {encoding} | {ind[0]:.3f} ± {ind[1]:.3f} | {ood[0]:.3f} ± {ood[1]:.3f} |"
            if published:
                row += f" {published[encoding]:.3f} |" if encoding in published else " - |"
            lines.append(row)
        lines.append("")
        lines.append(
            "Mean over lengths, then mean ± standard deviation over seeds "
            f"({max(len(p) for p in encodings.values())} seed(s))."
        )
        if published:
            lines.append(
                f"Published column: {PUBLISHED_PROTOCOL}; same task, not the same protocol, so compare the "
                "ordering, not the numbers."
            )
        if task == "text":
            lines.append(f"Reference shape: {TEXT_REFERENCE}")
        if plots:
            lines.append(f"![{task}]({task}.png)")
        lines.append("")
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


def plot(rows: list[dict], out: pathlib.Path) -> list[pathlib.Path]:
    """One PNG per task: metric against evaluation length (log2 axis), mean and spread over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task, encodings in _by_cell(rows).items():
        sample = next(r for r in rows if r["task"] == task)
        fig, ax = plt.subplots(figsize=(6, 4))
        for encoding, per_seed in encodings.items():
            lengths = sorted({n for seed in per_seed.values() for n in seed})
            values = np.array([[seed.get(n, np.nan) for n in lengths] for seed in per_seed.values()])
            mean = np.nanmean(values, axis=0)
            ax.plot(lengths, mean, marker="o", ms=3, color=_colour(encoding), label=encoding)
            if values.shape[0] > 1:
                ax.fill_between(lengths, np.nanmin(values, 0), np.nanmax(values, 0), color=_colour(encoding), alpha=0.2)
        ax.axvline(sample["train_length"], color="k", linestyle="--", linewidth=1, label="training length")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("evaluation length")
        ax.set_ylabel(sample["metric"].replace("_", " "))
        ax.set_title(task)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = pathlib.Path(out) / f"{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
