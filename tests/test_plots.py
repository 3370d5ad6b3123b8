"""The plots: what each panel holds, that its lines can be told apart, that the y-range shows the
differences the text claims, and that only runs paired by seed are drawn as paired."""

import importlib.util
import itertools
import json
import pathlib

import matplotlib
import numpy as np

from posenc_jax.bench import report, results

matplotlib.use("Agg")
import matplotlib.colors
import matplotlib.pyplot as plt

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROPE = report.FAMILIES[1]


def _write(folder, task, metric, curves, *, train_length, lengths, baselines=None):
    """A hand-made results folder: ``curves[encoding][seed]`` is the seed's value at each length."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "task": task,
            "encoding": encoding,
            "seed": seed,
            "length": n,
            "metric": metric,
            "value": float(value),
            "train_length": train_length,
            "in_distribution": n <= train_length,
            "steps": 100,
        }
        for encoding, per_seed in curves.items()
        for seed, values in per_seed.items()
        for n, value in zip(lengths, values, strict=True)
    ]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "run.json").write_text(json.dumps({"preset": {"tasks": [task]}}))
    (folder / "baselines.json").write_text(json.dumps(baselines or {}))
    return results.read(folder)


def _copy_task(folder, encodings):
    """The copy task, every encoding learned (1.0 at the training length), scores beyond it apart."""
    curves = {
        e: {s: [1.0, 1.0, 0.7 - 0.05 * i + 0.01 * s, 0.6 - 0.05 * i + 0.01 * s] for s in range(3)}
        for i, e in enumerate(encodings)
    }
    return _write(folder, "copy", "exact_match", curves, train_length=8, lengths=[4, 8, 12, 16])


def _encoding_lines(ax):
    """The panel's lines of encodings (not baselines, the training length or markers above a range)."""
    skip = ("baseline", "training length", "n-gram", "_")
    return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith(skip)}


MANY = ["nope", "sinusoidal", "rope", "rope+pi@eval", "rope+ntk@eval", "rope+yarn@eval", "rope@ft", "rope+yarn@ft"]
MANY += ["alibi", "t5", "kerple-log", "cope"]


def test_fine_tuned_rope_rows_go_to_the_rope_panel(tmp_path):
    for label in ("rope@ft", "rope+yarn@ft", "rope+pi@eval", "rope"):
        assert report.family(label) == ROPE, label
    fig = report.figure("copy", _copy_task(tmp_path, MANY))
    panel = {ax.get_title(): set(_encoding_lines(ax)) for ax in fig.axes}
    assert panel[ROPE] == {e for e in MANY if e.startswith("rope")}
    assert panel[report.FAMILIES[3]] == {"cope"}  # where rope@ft used to land
    plt.close(fig)


def test_lines_within_a_panel_are_told_apart_and_keep_their_familys_colour(tmp_path):
    fig = report.figure("copy", _copy_task(tmp_path, MANY))
    hues = {}
    for ax in fig.axes:
        lines = _encoding_lines(ax)
        assert len(lines) >= 3 or ax.get_title() != ROPE
        for a, b in itertools.combinations(lines.values(), 2):
            ca, cb = (np.array(matplotlib.colors.to_rgb(line.get_color())) for line in (a, b))
            assert np.abs(ca - cb).max() > 0.04, (a.get_label(), b.get_label(), ca, cb)  # its own shade
            assert (a.get_linestyle(), a.get_marker()) != (b.get_linestyle(), b.get_marker())
        hues[ax.get_title()] = [
            matplotlib.colors.rgb_to_hsv(matplotlib.colors.to_rgb(x.get_color()))[0] for x in lines.values()
        ]
    # One colour family per panel: its hues close together, apart from another family's.
    for title, found in hues.items():
        assert max(found) - min(found) < 0.1, (title, found)
    for a, b in itertools.combinations(hues, 2):
        apart = abs(np.mean(hues[a]) - np.mean(hues[b]))
        assert min(apart, 1 - apart) > 0.12, (a, b, hues[a], hues[b])
    plt.close(fig)


def test_a_task_with_few_encodings_is_one_panel_comparing_them(tmp_path):
    few = ["cope", "rope", "nope", "alibi"]  # one of each family
    fig = report.figure("copy", _copy_task(tmp_path, few))
    (ax,) = fig.axes
    lines = _encoding_lines(ax)
    assert set(lines) == set(few)
    colours = [matplotlib.colors.to_hex(line.get_color()) for line in lines.values()]
    assert len(set(colours)) == 4
    plt.close(fig)
    fig = report.figure("copy", _copy_task(tmp_path / "many", MANY))
    assert len(fig.axes) == 4  # more than a few: by family
    plt.close(fig)


def test_the_text_plot_zooms_to_the_learned_lines_and_marks_the_others(tmp_path):
    lengths = [64, 128, 256, 512, 1024]
    flat = {  # learned (below the 2.0 n-gram less its 0.2 margin at 64), apart by about 0.05-0.2 beyond
        "alibi": [1.60, 1.52, 1.47, 1.45, 1.44],
        "kerple-log": [1.62, 1.58, 1.56, 1.57, 1.59],
        "fire": [1.61, 1.60, 1.66, 1.72, 1.80],
    }
    exploding = {"sinusoidal": [1.65, 3.5, 5.0, 5.8, 6.0], "rope": [1.63, 2.5, 4.2, 5.5, 5.9]}
    curves = {e: {s: [v + 0.01 * s for v in values] for s in range(3)} for e, values in {**flat, **exploding}.items()}
    curves |= {f"t5|{i}": {s: [2.4] * 5 for s in range(3)} for i in range(2)}  # not learned, off any zoom
    ngram = {"text": {"ngram": [{"order": 5, "bits_per_char": 2.0}]}}
    found = _write(tmp_path, "text", "bits_per_char", curves, train_length=64, lengths=lengths, baselines=ngram)
    assert {c.encoding for c in results.cells(found) if c.learned} == {*flat, *exploding}
    fig = report.figure("text", found)
    zoomed = [ax for ax in fig.axes if "zoomed" in ax.get_title()]
    assert zoomed and len(zoomed) == len(fig.axes) // 2
    low, high = zoomed[0].get_ylim()
    values = np.concatenate([np.array(v) for e in flat for v in curves[e].values()])
    assert low <= values.min() and values.max() <= high  # every learned line that held is in range ...
    assert high - low < 1.5 * (max(values.max(), 2.0) - values.min())  # ... and the range is fitted to them
    # The exploded lines leave the zoomed range, marked where they do; the full row shows them.
    above = [line for ax in zoomed for line in ax.get_lines() if line.get_label() == "_above" and len(line.get_xdata())]
    assert len(above) >= 2
    full = [ax for ax in fig.axes if "full range" in ax.get_title()]
    assert max(ax.get_ylim()[1] for ax in full) > 6.0
    plt.close(fig)
    # Where every learned line held, there is no second row.
    only_flat = {e: v for e, v in curves.items() if e in flat}
    fig = report.figure(
        "text",
        _write(
            tmp_path / "flat", "text", "bits_per_char", only_flat, train_length=64, lengths=lengths, baselines=ngram
        ),
    )
    assert not any("zoomed" in ax.get_title() for ax in fig.axes)
    plt.close(fig)


def _headline_figures():
    spec = importlib.util.spec_from_file_location("headline_figures", ROOT / "benchmarks" / "headline_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_are_drawn_paired_only_when_one_run_holds_both_on_the_same_seeds():
    figures = _headline_figures()
    cell = results.cells(results.read(ROOT / "docs" / "extrapolation-ruoss"))[0]
    # The same seeds in two run folders are not a pair; in one folder they are.
    assert figures.paired_seeds(("extrapolation-ruoss", cell), ("extrapolation-ruoss-long", cell)) == ()
    assert figures.paired_seeds(("extrapolation-ruoss", cell), ("extrapolation-ruoss", cell)) == (0, 1, 2, 3, 4)
    found = figures.pairs()
    assert set(found) == {
        (row, task, name) for row in figures.ROWS for task in figures.ENCODER_TASKS for name in ("RoPE", "sinusoidal")
    }
    for (row, task, name), seeds in found.items():
        # Each row is one run (cpu-full to 2x, ruoss to 10x), one budget: every pair shares its seeds.
        assert seeds == (0, 1, 2, 3, 4), (row, task, name, seeds)
    assert {folder for folder, _ in figures._randomized_cells(ROOT / "docs").values()} == {
        "extrapolation-cpu-full",
        "extrapolation-cpu-full-parity",
        "extrapolation-ruoss",
    }  # the 16,000-step ruoss-long has no partner at its budget, so it is not drawn
    # Drawn: a line joins a seed's two scores where both cells of a pair learned.
    cells = figures._randomized_cells(ROOT / "docs")
    for row, task, joined in (("to 2x", "bucket_sort", 10), ("to 10x", "missing_duplicate", 5)):  # 5 seeds a pair
        fig, ax = plt.subplots()
        figures._pair_bars(ax, row, task, cells, found)
        assert sum(len(line.get_xdata()) == 2 for line in ax.get_lines()) == joined, row
        plt.close(fig)
