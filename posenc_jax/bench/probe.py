"""The blind-spot probe (Su 2022; Luo et al. 2022): can a model say where it is among n identical tokens?

Trains small encoders to output each position's index on n identical tokens, for each
encoding x normaliser, without and with boundary tokens ([CLS] ... [SEP]), and reports
per-token accuracy beside the outcome the mathematics predicts (``../shared/BENCHMARKS.md``,
``tests/test_theorem.py``). The probe asks whether a setting *can* tell positions apart, so
it is tested only at lengths it trained on: longer n would ask for position classes no
example ever taught. Same outputs as the extrapolation benchmark (results.jsonl, run.json,
report.md) plus a heat map.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib

import numpy as np

from posenc_jax.bench.presets import Preset
from posenc_jax.bench.stats import bounded_interval
from posenc_jax.functional.core.normalizers import NORMALIZERS
from posenc_jax.functional.core.registry import encoding_info

__all__ = ["MIRROR_SYMMETRIC", "PROBE_PRESETS", "expected_outcome", "heat_map", "write_probe_report"]

# Bidirectional biases that depend on |i - j| alone (ALiBi's -m|i-j|, Kerple's log and power
# kernels of |i - j|, Sandwich's sum of cos(ω(i - j))): on n identical tokens the sequence and
# its mirror image are the same input, so positions i and n-1-i get the same output under any
# normaliser, and at most ceil(n/2) of n positions can be told apart. tests/test_theorem.py
# checks each one's symmetry, and the lack of it in the others, on random models.
MIRROR_SYMMETRIC = ("alibi", "kerple-log", "kerple-power", "sandwich")

PROBE_PRESETS = {
    "smoke": Preset(
        name="probe-smoke",
        encodings=("nope", "sinusoidal", "alibi"),
        tasks=("probe", "probe_boundary"),
        seeds=(0,),
        normalizers=("softmax", "urpe"),
        model_dim=32,
        num_layers=1,
        num_heads=2,
        mlp_dim=64,
        steps=20,
        batch_size=8,
        train_length=6,
        eval_lengths=(3, 6),
        eval_examples=8,
        checkpoint_every=10,
        check_every=10,
        check_examples=8,
        extrapolates=False,
    ),
    "default": Preset(
        name="probe",
        encodings=("nope", "sinusoidal", "learned", "alibi", "t5", "rope", "shaw"),
        tasks=("probe", "probe_boundary"),
        seeds=(0,),
        normalizers=("softmax", "l2", "relu2", "urpe"),
        model_dim=64,
        num_layers=2,
        num_heads=4,
        mlp_dim=128,
        steps=300,
        batch_size=16,
        learning_rate=3e-3,
        train_length=16,
        eval_lengths=(4, 8, 12, 16),
        eval_examples=32,
        checkpoint_every=300,
        check_every=50,
        extrapolates=False,
    ),
}


def expected_outcome(encoding: str, normalizer: str, boundary: bool) -> str:
    """What the mathematics says for this setting (Su 2022; Luo et al. 2022)."""
    info = encoding_info(encoding)
    if info.acts_on == "embeddings":
        return "solvable (absolute positions)"
    if "values" in info.hooks:
        return "edges within k distinct (R_V)" if normalizer == "softmax" and not boundary else "solvable"
    positional_logits = bool(info.hooks)
    if normalizer == "urpe":
        return "solvable (URPE)"
    if encoding in MIRROR_SYMMETRIC and not boundary and normalizer in ("l2", "relu2"):
        return "mirror-blind: at most ceil(n/2)/n (i and n-1-i alike)"
    if normalizer == "l2":
        return "solvable (row sums vary)" if positional_logits else "blind: chance 1/n (equal rows)"
    if normalizer == "relu2":
        return "solvable (row sums vary)" if positional_logits else "blind: chance 1/n (relu²/n sums equal)"
    if boundary and positional_logits:
        return "solvable within distance resolution (boundaries)"
    return "blind: chance 1/n (rows sum to 1)"


def _split(label: str):
    encoding, _, normalizer = label.partition("|")
    return encoding, normalizer or "softmax"


def _short(expected: str) -> str:
    """The expected outcome in a word or two, for the heat map."""
    if expected.startswith("blind"):
        return "blind (≤ 1/n)"
    if expected.startswith("edges"):
        return "edges only"
    if expected.startswith("mirror"):
        return "mirror (≤ ½)"
    return "solvable"


def _order(rows):
    """Encodings in the order they were run; normalisers softmax first (the registry's order);
    plain before boundary tokens."""
    encodings = list(dict.fromkeys(_split(row["encoding"])[0] for row in rows))
    normalizers = sorted({_split(row["encoding"])[1] for row in rows}, key=lambda n: list(NORMALIZERS).index(n))
    columns = [(n, task) for n in normalizers for task in ("probe", "probe_boundary")]
    present = {(_split(row["encoding"])[1], row["task"]) for row in rows}
    return encodings, [c for c in columns if c in present]


def _table(rows):
    """(label, task) -> {"all": every value, "longest": the values at the longest n,
    "seeds": {seed: every value of that seed}, "seeds_longest": {seed: its values at the longest n}}."""
    longest = max(row["length"] for row in rows)
    cells = collections.defaultdict(lambda: collections.defaultdict(list))
    for row in rows:
        key = (row["encoding"], row["task"])
        cell = cells[key]
        cell["all"].append(row["value"])
        cell.setdefault("seeds", collections.defaultdict(list))[row.get("seed", 0)].append(row["value"])
        if row["length"] == longest:
            cell["longest"].append(row["value"])
            cell.setdefault("seeds_longest", collections.defaultdict(list))[row.get("seed", 0)].append(row["value"])
    return cells


def _over_seeds(per_seed) -> str:
    """The mean over seeds of each seed's mean, with its 95% interval when there are several seeds."""
    if not per_seed:
        return "nan"
    interval = bounded_interval([float(np.mean(values)) for values in per_seed.values()])
    return str(interval) if interval.n > 1 else f"{interval.mean:.3f}"


def write_probe_report(rows, out: pathlib.Path, *, preset: dict | None = None) -> str:
    """``report.md``: measured accuracy beside the expected outcome, one row per setting."""
    lines = ["# Blind-spot probe: n identical tokens, output each position's index", ""]
    if preset:
        lines += [
            f"Preset `{preset['name']}`: encoders of {preset['num_layers']} layers x {preset['model_dim']}, "
            f"up to {preset['steps']} steps, trained on n <= {preset['train_length']}, tested at "
            f"{list(preset['eval_lengths'])} (only lengths it trained on: longer n would ask for position classes "
            f"never taught); per-token accuracy (chance 1/n); seeds {list(preset['seeds'])}; with several seeds, "
            "the mean over seeds with its 95% interval (inside [0, 1]).",
            "",
        ]
        if preset.get("query_init_scale", 1.0) != 1.0:
            lines += [
                f"Every layer's initial query projection is scaled by {preset['query_init_scale']:g} "
                "(`--query-init-scale`), shrinking the initial scores by the same factor.",
                "",
            ]
        if preset["name"] == "probe-smoke" and preset["steps"] <= PROBE_PRESETS["smoke"].steps:
            lines += ["**A pipeline check, not a result**: tiny models, a few steps; the numbers mean nothing.", ""]
        elif preset["name"] == "probe-smoke":
            lines += [
                f"**A small run**: the smoke preset's tiny models trained {preset['steps']} steps, one seed; "
                "indicative only (the full probe is `--preset default`).",
                "",
            ]
    lines += [
        "| encoding | normaliser | boundary tokens | mean over n | at the longest n | expected |",
        "|---|---|---|---|---|---|",
    ]
    cells = _table(rows)
    encodings, columns = _order(rows)
    for encoding in encodings:
        for normalizer, task in columns:
            label = encoding if normalizer == "softmax" else f"{encoding}|{normalizer}"
            if (label, task) not in cells:
                continue
            values = cells[(label, task)]
            boundary = task == "probe_boundary"
            lines.append(
                f"| {encoding} | {normalizer} | {'yes' if boundary else 'no'} | {_over_seeds(values['seeds'])} | "
                f"{_over_seeds(values.get('seeds_longest'))} | {expected_outcome(encoding, normalizer, boundary)} |"
            )
    lines += ["", "![accuracy heat map](probe_heatmap.png)", ""]
    text = "\n".join(lines)
    (pathlib.Path(out) / "report.md").write_text(text)
    return text


def heat_map(rows, out: pathlib.Path) -> pathlib.Path:
    """A PNG of two panels, the mean over n and the longest n: encodings x (normaliser, boundary),
    softmax first, each cell's measured accuracy above the outcome the mathematics expects."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = _table(rows)
    encodings, columns = _order(rows)
    width = 1.6 + 0.95 * len(columns)
    fig, axes = plt.subplots(1, 2, figsize=(2 * width + 1.2, 1.2 + 0.62 * len(encodings)), squeeze=False)
    for ax, (part, title) in zip(axes[0], (("all", "mean over n"), ("longest", "at the longest n")), strict=True):
        grid = np.full((len(encodings), len(columns)), np.nan)
        for i, encoding in enumerate(encodings):
            for j, (normalizer, task) in enumerate(columns):
                label = encoding if normalizer == "softmax" else f"{encoding}|{normalizer}"
                values = cells.get((label, task), {}).get(part)
                if values:
                    grid[i, j] = np.mean(values)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(
            range(len(columns)),
            [f"{n}\n{'[CLS]..[SEP]' if t == 'probe_boundary' else 'plain'}" for n, t in columns],
            fontsize=7,
        )
        ax.set_yticks(range(len(encodings)), encodings, fontsize=8)
        for i, encoding in enumerate(encodings):
            for j, (normalizer, task) in enumerate(columns):
                if np.isnan(grid[i, j]):
                    continue
                expected = _short(expected_outcome(encoding, normalizer, task == "probe_boundary"))
                ax.text(
                    j,
                    i,
                    f"{grid[i, j]:.2f}\nexp. {expected}",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white" if grid[i, j] < 0.5 else "black",
                )
        ax.set_title(f"probe accuracy, {title}", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), fraction=0.025, label="per-token accuracy")
    path = pathlib.Path(out) / "probe_heatmap.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def preset_with(name: str, **overrides) -> Preset:
    if name not in PROBE_PRESETS:
        raise ValueError(f"unknown probe preset {name!r}; presets: {', '.join(PROBE_PRESETS)}")
    return dataclasses.replace(PROBE_PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
