"""The seed-004 probe: can a model say where it is among n identical tokens?

Trains small encoders to output each position's index on n identical tokens, for each
encoding x normaliser, without and with boundary tokens ([CLS] ... [SEP]), and reports
per-token accuracy in distribution and at longer n beside the outcome the mathematics
predicts (``../shared/BENCHMARKS.md``, ``tests/test_theorem.py``). Same outputs as the
extrapolation benchmark (results.jsonl, run.json, report.md) plus a heat map.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib

import numpy as np

from posenc_jax.bench.extrapolate import Preset
from posenc_jax.functional.registry import encoding_info

__all__ = ["PROBE_PRESETS", "expected_outcome", "heat_map", "write_probe_report"]

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
        eval_lengths=(3, 6, 9),
        eval_examples=8,
        checkpoint_every=10,
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
        eval_lengths=(4, 8, 12, 16, 24, 32),
        eval_examples=32,
        checkpoint_every=300,
    ),
}


def expected_outcome(encoding: str, normalizer: str, boundary: bool) -> str:
    """What the mathematics says for this setting (seed 004; Luo et al. 2022)."""
    info = encoding_info(encoding)
    if info.acts_on == "embeddings":
        return "solvable (absolute positions)"
    if "values" in info.hooks:
        return "edges within k distinct (R_V)" if normalizer == "softmax" and not boundary else "solvable"
    positional_logits = bool(info.hooks)
    if normalizer == "urpe":
        return "solvable (URPE)"
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


def _table(rows):
    cells = collections.defaultdict(lambda: collections.defaultdict(list))
    for row in rows:
        key = (row["encoding"], row["task"])
        cells[key]["in" if row["in_distribution"] else "out"].append(row["value"])
    return cells


def write_probe_report(rows, out: pathlib.Path, *, preset: dict | None = None) -> str:
    """``report.md``: measured accuracy beside the expected outcome, one row per setting."""
    lines = ["# Seed 004 probe: n identical tokens, output each position's index", ""]
    if preset:
        lines += [
            f"Preset `{preset['name']}`: encoders of {preset['num_layers']} layers x {preset['model_dim']}, "
            f"{preset['steps']} steps, trained on n <= {preset['train_length']}, tested at "
            f"{list(preset['eval_lengths'])}; per-token accuracy (chance 1/n); seeds {list(preset['seeds'])}.",
            "",
        ]
    lines += [
        "| encoding | normaliser | boundary tokens | in distribution | longer n | expected |",
        "|---|---|---|---|---|---|",
    ]
    for (label, task), values in sorted(_table(rows).items()):
        encoding, normalizer = _split(label)
        boundary = task == "probe_boundary"
        lines.append(
            f"| {encoding} | {normalizer} | {'yes' if boundary else 'no'} | {np.mean(values['in']):.3f} | "
            f"{np.mean(values['out']) if values['out'] else float('nan'):.3f} | "
            f"{expected_outcome(encoding, normalizer, boundary)} |"
        )
    lines += ["", "![accuracy heat map](probe_heatmap.png)", ""]
    text = "\n".join(lines)
    (pathlib.Path(out) / "report.md").write_text(text)
    return text


def heat_map(rows, out: pathlib.Path) -> pathlib.Path:
    """A PNG: encodings x (normaliser, boundary), in-distribution accuracy in each cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = _table(rows)
    encodings = sorted({_split(label)[0] for label, _ in cells})
    columns = sorted({(_split(label)[1], task) for label, task in cells})
    grid = np.full((len(encodings), len(columns)), np.nan)
    for (label, task), values in cells.items():
        encoding, normalizer = _split(label)
        grid[encodings.index(encoding), columns.index((normalizer, task))] = np.mean(values["in"])
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(columns), 0.8 + 0.5 * len(encodings)))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(
        range(len(columns)),
        [f"{n}\n{'[CLS]..[SEP]' if t == 'probe_boundary' else 'plain'}" for n, t in columns],
        fontsize=7,
    )
    ax.set_yticks(range(len(encodings)), encodings, fontsize=8)
    for i in range(len(encodings)):
        for j in range(len(columns)):
            if not np.isnan(grid[i, j]):
                ax.text(
                    j,
                    i,
                    f"{grid[i, j]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if grid[i, j] < 0.5 else "black",
                )
    ax.set_title("probe accuracy, in distribution")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    path = pathlib.Path(out) / "probe_heatmap.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def preset_with(name: str, **overrides) -> Preset:
    if name not in PROBE_PRESETS:
        raise ValueError(f"unknown probe preset {name!r}; presets: {', '.join(PROBE_PRESETS)}")
    return dataclasses.replace(PROBE_PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
