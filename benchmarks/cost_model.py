"""The cost model's rates fitted to measured runs, and how well they predict each run.

For each set of rates in ``posenc_jax/bench/presets.py`` (``CPU_ESTIMATE``, ``H200_ESTIMATE``,
``TPU_ESTIMATE``), or for the results folders named on the command line (one fit per device
they ran on): the fitted rates, the spread of each stage's measured / modelled seconds cell by
cell, and per folder the measured seconds of its cells against the model's for the steps they
trained. ``posenc_jax/bench/costmodel.py`` says what the fit can and cannot see.

    python benchmarks/cost_model.py                          # the fits behind presets.py
    python benchmarks/cost_model.py results/extrapolation/cpu docs/extrapolation-cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib

from posenc_jax.bench import presets
from posenc_jax.bench.costmodel import CONTENDED, FITTED_FROM, Fit, fit_runs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rate(flops_per_second: float) -> str:
    if math.isinf(flops_per_second):
        return "no growth with FLOPs"
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops_per_second >= scale:
            return f"{flops_per_second / scale:.3g} {unit}"
    return f"{flops_per_second:.3g} FLOP/s"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _shown(folder: str) -> str:
    """``folder`` relative to the repository when it is in it."""
    path = pathlib.Path(folder).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else folder


def _cores(cells) -> str:
    cores = sorted(cell.cores for cell in cells if cell.cores is not None)
    if not cores:
        return "no CPU seconds recorded"
    return f"cores busy {cores[0]:.2f}-{cores[-1]:.2f} (median {cores[len(cores) // 2]:.2f}, {len(cores)} recorded)"


def describe(fit: Fit, title: str) -> str:
    """The fitted rates, their spread cell by cell, the cells left out as contended, and each
    folder's measured time against the model's."""
    r, spread = fit.rates, fit.spread
    folders = list(dict.fromkeys(cell.folder for cell in fit.cells + fit.left_out))

    def ratio(stage):
        low, median, high = spread[stage]
        return f"{low:.2f}-{high:.2f} (median {median:.2f})"

    lines = [
        f"{title}: {fit.device}, {len(fit.cells)} cells of {', '.join(map(_shown, folders))}",
        "  stage        rates                                       measured / model, cell by cell",
        f"  training     {_rate(r.train_flops_per_second)} + {r.seconds_per_step * 1e3:.3g} ms a step".ljust(59)
        + ratio("train"),
        f"  evaluation   {_rate(r.eval_flops_per_second)} + {r.seconds_per_eval_program:.3g} s a program".ljust(59)
        + ratio("eval"),
        f"  per cell     {r.seconds_per_cell:.3g} s (compilation, checks, checkpoints)".ljust(59) + ratio("fixed"),
        "  whole cells".ljust(59) + ratio("cell"),
        f"  fitted cells: {_cores(fit.cells)}",
    ]
    if fit.left_out:
        over = sorted(cell.seconds / fit.predicted(cell) for cell in fit.left_out)
        lines.append(
            f"  left out as contended (over {CONTENDED:g}x the model): {len(fit.left_out)} cells, "
            f"{over[0]:.2f}-{over[-1]:.2f}x; {_cores(fit.left_out)}"
        )
    lines.append(
        f"  {'folder':46s} {'cells':>5s} {'left out':>8s} {'measured':>10s} {'model':>10s} {'measured / model':>17s}"
    )
    for folder in folders:
        cells = [cell for cell in fit.cells if cell.folder == folder]
        left_out = sum(cell.folder == folder for cell in fit.left_out)
        measured = sum(cell.seconds for cell in cells)
        modelled = sum(fit.predicted(cell) for cell in cells)
        lines.append(
            f"  {_shown(folder):46s} {len(cells):5d} {left_out:8d} {_minutes(measured):>10s} {_minutes(modelled):>10s} "
            f"{measured / modelled if cells else math.nan:17.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", help="results folders (with run.json); default: those behind presets.py")
    args = parser.parse_args(argv)
    if args.folders:
        for device, fit in fit_runs(args.folders).items():
            print(describe(fit, device), end="\n\n")
        return
    for name, folders in FITTED_FROM.items():
        (fit,) = fit_runs([ROOT / folder for folder in folders]).values()
        print(describe(fit, name))
        written = getattr(presets, name)
        agree = all(
            math.isclose(getattr(written, field.name), getattr(fit.rates, field.name), rel_tol=0.01, abs_tol=1e-3)
            for field in dataclasses.fields(presets.Rates)
        )
        print(f"  presets.{name} {'agrees with this fit' if agree else f'differs from this fit: {written}'}\n")


if __name__ == "__main__":
    main()
