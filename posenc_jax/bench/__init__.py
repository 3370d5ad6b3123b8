"""Benchmarks: the length-extrapolation runner, its report, and the ``posenc-bench`` command.

From Python::

    from posenc_jax import bench

    out = bench.run("smoke", out="results/smoke")   # what `posenc-bench extrapolate` runs
    table = bench.load_results(out)                 # one row per cell and length
    print(bench.summarize(out))                     # the overview table of the report
    found = bench.cells(out)                        # every cell over all its seeds
    family = bench.compare(out, "counting_copy")    # its pairs, Holm-corrected, with equivalence tests
    probe = bench.run_probe("smoke", out="results/probe")  # what `posenc-bench probe` runs

:func:`holm` and :func:`equivalence` apply the same corrections and tests to numbers of your own.

The submodules import JAX and the models only when these are called, so that importing the
package (and ``posenc-bench --help``) stays quick.
"""

from __future__ import annotations

import dataclasses
import pathlib

__all__ = ["cells", "compare", "equivalence", "holm", "load_results", "run", "run_probe", "summarize"]


def run(
    preset="cpu",
    out=None,
    *,
    corpus: str | None = None,
    progress: bool = False,
    report: bool = True,
    plots: bool = True,
    keep_checkpoints: bool = False,
    log=print,
    host: tuple[int, int] | None = None,
    repair: bool = False,
    **settings,
) -> pathlib.Path:
    """Runs (or resumes) the length-extrapolation benchmark and writes its report; what
    ``posenc-bench extrapolate`` calls.

    Args:
      preset: a preset name (``"smoke"``, ``"cpu"``, ...; see ``posenc-bench extrapolate --help``)
        or a :class:`~posenc_jax.bench.presets.Preset`.
      out: the results folder (default ``results/extrapolation/<preset>``).
      corpus: the text task's corpus: a file or folder of text, or a hub corpus name.
      progress: tqdm progress bars (needs the ``bench`` extra).
      report, plots: write ``report.md`` and the plots (PNG and SVG; plots need matplotlib).
      keep_checkpoints: keep each finished cell's orbax checkpoints (its trained models); by
        default they are deleted once the cell's rows are written (an unfinished cell's stay,
        to resume from).
      log: where each finished cell's line goes (None: nowhere).
      host: ``(i, H)``: run host i's share of the cells (of a run over H hosts) into
        ``<out>/host-i-of-H``, and return that folder; :func:`posenc_jax.bench.hosts.merge`
        joins the hosts' folders (:mod:`posenc_jax.bench.hosts`).
      repair: resume past a missing, unreadable or edited ``run.json``, saying so (``--repair``;
        :class:`~posenc_jax.bench.ledger.Ledger`).
      **settings: preset fields to change, e.g. ``encodings=("rope", "alibi")``, ``seeds=(0, 1)``.

    Returns:
      The results folder, for :func:`load_results` and :func:`summarize`.
    """
    from posenc_jax.bench import extrapolate
    from posenc_jax.bench import report as reporting
    from posenc_jax.bench.ledger import FolderLock, check_writable
    from posenc_jax.bench.presets import PRESETS, Preset
    from posenc_jax.functional.core.registry import encoding_labels

    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    if not isinstance(preset, Preset):
        raise TypeError(f"preset must be a preset name or a Preset, got {type(preset).__name__}")
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(Preset)})
    if unknown:
        raise ValueError(f"unknown preset settings {unknown}; see posenc_jax.bench.presets.Preset for the fields")
    settings = {k: encoding_labels(v) if k == "encodings" else v for k, v in settings.items()}
    preset = dataclasses.replace(preset, **settings)
    out = pathlib.Path(out or f"results/extrapolation/{preset.name}")
    if host is not None:
        from posenc_jax.bench.hosts import host_folder

        out = host_folder(out, host)
    preset.validate()
    check_writable(out)
    with FolderLock(out):  # held until the report and plots are written too
        extrapolate.run(
            preset,
            out,
            corpus=corpus,
            progress=progress,
            keep_checkpoints=keep_checkpoints,
            log=log or (lambda line: None),
            lock=False,
            host=host,
            repair=repair,
        )
        if report:
            reporting.write_report(out, plots=plots)
        if plots:
            reporting.plot(out)
    return out


def run_probe(preset="default", out=None, *, progress: bool = False, plots: bool = True, **settings) -> pathlib.Path:
    """Runs (or resumes) the blind-spot probe and writes its report (``report.md``, the heat map);
    what ``posenc-bench probe`` calls.

    Args:
      preset: a probe preset name (``"smoke"``, ``"default"``).
      out: the results folder (default ``results/<preset name>``).
      progress: tqdm progress bars (needs the ``bench`` extra).
      plots: draw ``probe_heatmap.png`` (needs matplotlib).
      **settings: ``encodings``, ``normalizers``, ``seeds``, ``steps``, ``query_init_scale``.

    Returns:
      The results folder.
    """
    from posenc_jax.bench import extrapolate, results
    from posenc_jax.bench import probe as probing
    from posenc_jax.functional.core.registry import encoding_labels

    unknown = sorted(set(settings) - {"encodings", "normalizers", "seeds", "steps", "query_init_scale"})
    if unknown:
        raise ValueError(
            f"unknown probe settings {unknown}; the probe takes encodings, normalizers, seeds, steps, query_init_scale"
        )
    settings = {k: encoding_labels(v) if k == "encodings" and v is not None else v for k, v in settings.items()}
    chosen = probing.preset_with(preset, **settings)
    chosen.validate()
    out = pathlib.Path(out or f"results/{chosen.name}")
    record = extrapolate.run(chosen, out, progress=progress)
    rows = results.read(out).rows
    probing.write_probe_report(rows, out, preset=record["preset"])
    if plots:
        probing.heat_map(rows, out)
    return out


def load_results(path):
    """One row per task, encoding and length of a results folder: the mean over the cell's learned
    seeds with its 95% interval, the seeds, and whether the cell learned its task (see
    :func:`posenc_jax.bench.results.load_results`). A pandas DataFrame when pandas is installed,
    else a list of dicts."""
    from posenc_jax.bench import results

    return results.load_results(path)


def summarize(results) -> str:
    """The overview table (markdown) of a results folder: every encoding on every task beyond the
    training length, with intervals, or "not learned" (see :func:`posenc_jax.bench.results.summarize`)."""
    from posenc_jax.bench import results as found

    return found.summarize(results)


def cells(path) -> list:
    """Every cell (task × encoding) of a results folder over all its seeds: its score at the training
    length and beyond it with 95% intervals (inside [0, 1] for exact match and accuracy), the best
    seed, "k/n seeds learned" and whether the all-seed mean passed the gate (a list of
    :class:`~posenc_jax.bench.results.CellSummary`)."""
    from posenc_jax.bench import results

    return results.cells(results.read(path))


def compare(path, task: str, encodings=None):
    """The learned cells of ``task`` in a results folder (or those of ``encodings``) compared pair by
    pair over all their common seeds, as one family: paired t-tests Holm-corrected at 0.05 (an
    ordering is resolved only on its corrected p-value) and every pair's equivalence test within the
    task's margin (a :class:`~posenc_jax.bench.stats.Comparison`)."""
    from posenc_jax.bench import results

    return results.comparison(results.read(path), task, encodings)


def holm(p_values, alpha: float = 0.05) -> list[float]:
    """Holm–Bonferroni adjusted p-values of one family of tests (:func:`posenc_jax.bench.stats.holm`)."""
    from posenc_jax.bench import stats

    return stats.holm(p_values, alpha)


def equivalence(a, b, margin: float):
    """The paired equivalence test (two one-sided tests) of two encodings' per-seed scores (seed →
    value) within ``margin`` (:func:`posenc_jax.bench.stats.equivalence`)."""
    from posenc_jax.bench import stats

    return stats.equivalence(a, b, margin)
