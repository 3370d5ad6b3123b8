"""The benchmark's cost model fitted to measured runs.

Every cell of a run records its seconds in the run's ``run.json``: the first training step
(compilation), the other steps, the checks and checkpoints, and evaluation (fine-tuning of the
RoPE text variants included), with the steps each seed trained. :func:`read_cells` pairs them
with :func:`~posenc_jax.bench.cost.cell_cost` of the steps the cell ran, and
:func:`fit_rates` fits the :class:`~posenc_jax.bench.presets.Rates` of one machine by
non-negative least squares, stage by stage:

* training seconds = steps x ``seconds_per_step`` + FLOPs / ``train_flops_per_second``;
* evaluation seconds - fine-tuning FLOPs / the training rate = FLOPs /
  ``eval_flops_per_second`` + programs x ``seconds_per_eval_program``;
* compilation + checks + checkpoints = ``seconds_per_cell`` (their mean).

What the records cannot show, so the fit cannot either: how many evaluation programs were
compiled (the count is the model's rule, one per shape and encoding config) and how evaluation's
seconds split between compiling and computing (one timer holds both); the checks and
checkpoints, which grow with the steps a cell trains, are a cost per cell; fine-tuning is timed
within evaluation and charged at the training rate; time outside the cells (data, n-gram
baselines, the report) is in no record, so a run's measured total here is the sum of its cells.
Machines shared with other work make the same cell's seconds vary between runs (two CPU runs of
the same counting-copy cells differ by up to 2x), which the per-cell spread of :class:`Fit` shows.
Sharing only ever slows a cell, so the fit leaves out the cells that took more than
:data:`CONTENDED` times the seconds a fit of the others gives them, refitting until none is left
out, and names them (:attr:`Fit.left_out`); a cell's ``cpu_seconds``, where its run recorded them,
shows how many cores it had (:attr:`CellRun.cores`), the evidence that it shared the machine.

    python benchmarks/cost_model.py docs/extrapolation-cpu docs/extrapolation-cpu-full
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
from collections.abc import Iterable, Sequence

import numpy as np

from posenc_jax.bench.cost import Cost, Rates, cell_cost
from posenc_jax.bench.presets import Preset

__all__ = ["CONTENDED", "FITTED_FROM", "CellRun", "Fit", "fit_rates", "fit_runs", "read_cells"]

# The committed runs (folders of the repository, not of the installed package) that each set of
# rates in presets.py was fitted to; tests/test_bench.py refits them and checks they agree.
FITTED_FROM = {
    "CPU_ESTIMATE": ("docs/extrapolation-cpu", "docs/extrapolation-cpu-full"),
    "H200_ESTIMATE": ("docs/budget-search", "docs/extrapolation-gpu-text", "docs/extrapolation-colab-tpu-partial"),
    "COLAB_TPU_ON_H200": ("docs/extrapolation-colab-tpu-partial",),
}

# A cell that took more than this many times the seconds the fit gives it ran beside other work:
# the fit leaves it out (see the module's docstring).
CONTENDED = 2.0


@dataclasses.dataclass(frozen=True)
class CellRun:
    """One measured cell: where it ran, its cost (:func:`~posenc_jax.bench.cost.cell_cost` of
    the steps it ran: those of its slowest seed, since learned seeds are computed on, frozen)
    and the seconds its run recorded."""

    folder: str
    device: str
    task: str
    encoding: str
    cost: Cost
    compile_seconds: float
    train_seconds: float
    checkpoint_seconds: float
    eval_seconds: float
    cpu_seconds: float | None = None

    @property
    def cores(self) -> float | None:
        """The cores the cell's process kept busy on average (CPU over wall seconds, every
        thread), where its run recorded its CPU seconds: fewer than a quiet run's when other work
        shared the machine."""
        return None if self.cpu_seconds is None else self.cpu_seconds / self.seconds

    @property
    def fixed_seconds(self) -> float:
        """Compilation of training, checks and checkpoints: what ``seconds_per_cell`` models."""
        return self.compile_seconds + self.checkpoint_seconds

    @property
    def seconds(self) -> float:
        return self.compile_seconds + self.train_seconds + self.checkpoint_seconds + self.eval_seconds


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def _preset(record: dict) -> Preset:
    """The preset a ``run.json`` recorded (settings it predates take their defaults)."""
    known = {field.name for field in dataclasses.fields(Preset)}
    return Preset(**{k: _as_tuples(v) for k, v in record.items() if k in known})


def read_cells(folder) -> list[CellRun]:
    """The measured cells of one results folder (its ``run.json``); cells resumed from a
    checkpoint are left out, their seconds covering only part of their training.

    Example:
      >>> import tempfile
      >>> from posenc_jax.bench.presets import PRESETS
      >>> cell = {"task": "counting_copy", "encoding": "rope", "seeds": [0, 1], "resumed_from_step": 0,
      ...         "steps": {"0": 300, "1": 400}, "compile_seconds": 9.0, "train_seconds": 20.0,
      ...         "checkpoint_seconds": 3.0, "eval_seconds": 2.0}
      >>> run = {"preset": dataclasses.asdict(PRESETS["cpu"]), "device": {"kind": "cpu"}, "cells": [cell]}
      >>> folder = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (folder / "run.json").write_text(json.dumps(run))
      >>> (measured,) = read_cells(folder)
      >>> measured.cost.train_steps, measured.seconds  # the slowest seed's steps, all four timers
      (400, 34.0)
    """
    folder = pathlib.Path(folder)
    run = json.loads((folder / "run.json").read_text())
    preset = _preset(run["preset"])
    device = run["device"]["kind"]
    cells = []
    for cell in run["cells"]:
        if cell["resumed_from_step"] or not cell.get("steps"):
            continue
        encoding, _, normalizer = cell["encoding"].partition("|")
        here = preset.resolve(preset.task(cell["task"])).with_seeds(cell["seeds"])
        steps = max(cell["steps"].values())
        cells.append(
            CellRun(
                folder=str(folder),
                device=device,
                task=cell["task"],
                encoding=cell["encoding"],
                cost=cell_cost(here, encoding, normalizer or "softmax", steps=steps),
                compile_seconds=cell["compile_seconds"],
                train_seconds=cell["train_seconds"],
                checkpoint_seconds=cell["checkpoint_seconds"],
                eval_seconds=cell["eval_seconds"],
                cpu_seconds=cell.get("cpu_seconds"),
            )
        )
    return cells


def _nonnegative_least_squares(columns: Sequence[np.ndarray], target: np.ndarray) -> np.ndarray:
    """Coefficients >= 0 minimising ``|sum_k x_k columns[k] - target|``: the least-squares solution
    over every subset of the columns (the others at 0) whose coefficients are all non-negative,
    the one of smallest residual (exact for the two columns each stage has)."""
    a = np.stack(columns, axis=1)
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(target**2))
    for size in range(1, a.shape[1] + 1):
        for kept in itertools.combinations(range(a.shape[1]), size):
            x, *_ = np.linalg.lstsq(a[:, kept], target, rcond=None)
            if np.all(x >= 0):
                residual = float(np.sum((a[:, kept] @ x - target) ** 2))
                if residual < best_residual:
                    best = np.zeros(a.shape[1])
                    best[list(kept)] = x
                    best_residual = residual
    return best


@dataclasses.dataclass(frozen=True)
class Fit:
    """The rates fitted to one machine's cells, and how well they predict those cells.

    ``cells``: those the rates were fitted to; ``left_out``: those :func:`fit_rates` left out,
    the slowest first, each for taking more than its bound (:data:`CONTENDED` by default) times
    what a fit of the cells still kept gave it. ``spread``: per stage (``"train"``,
    ``"eval"``, ``"fixed"``, ``"cell"`` for the whole cell), the smallest, median and largest
    ratio of a fitted cell's measured seconds to the model's.
    """

    device: str
    cells: tuple[CellRun, ...]
    rates: Rates
    spread: dict[str, tuple[float, float, float]]
    left_out: tuple[CellRun, ...] = ()

    def predicted(self, cell: CellRun) -> float:
        """The seconds the fitted rates give ``cell``."""
        return cell.cost.seconds(self.rates)


def _stage_seconds(cell: CellRun, rates: Rates) -> dict[str, tuple[float, float]]:
    """Measured and modelled seconds of each stage of ``cell``."""
    c = cell.cost
    return {
        "train": (
            cell.train_seconds,
            c.train_steps * rates.seconds_per_step + c.train_flops / rates.train_flops_per_second,
        ),
        "eval": (
            cell.eval_seconds,
            c.finetune_flops / rates.train_flops_per_second
            + c.eval_flops / rates.eval_flops_per_second
            + c.eval_programs * rates.seconds_per_eval_program,
        ),
        "fixed": (cell.fixed_seconds, rates.seconds_per_cell),
        "cell": (cell.seconds, c.seconds(rates)),
    }


def fit_rates(cells: Sequence[CellRun], *, contended: float = CONTENDED) -> Fit:
    """Fits the :class:`~posenc_jax.bench.presets.Rates` of the machine ``cells`` ran on (see the
    module's docstring for the model and what it cannot see), leaving out the cells that took
    more than ``contended`` times the seconds a fit of the others gives them.

    Example:
      >>> from posenc_jax.bench.cost import Cost
      >>> def cell(flops):  # trained at 20 GFLOP/s; 5 s compiling, 5 s checking, 1 s evaluating
      ...     return CellRun("run", "cpu", "copy", "rope", Cost(1, flops, 0.0, 1, train_steps=100),
      ...                    5.0, flops / 2e10, 5.0, 1.0)
      >>> cells = [cell(1e12), cell(2e12)]
      >>> fit = fit_rates(cells)
      >>> r = fit.rates
      >>> round(r.train_flops_per_second / 1e9), round(r.seconds_per_eval_program, 6), r.seconds_per_cell
      (20, 1.0, 10.0)

    Raises:
      ValueError: when ``cells`` is empty or mixes devices, or ``contended`` is not above 1.
    """
    if not contended > 1:  # a bound at or below the model would leave out the cells it fits well
        raise ValueError(f"contended must be a multiple of the modelled seconds above 1, got {contended!r}")
    devices = sorted({cell.device for cell in cells})
    if len(devices) != 1:
        raise ValueError(f"fit_rates fits one device at a time, got cells of {devices or 'none'}; use fit_runs")

    # Each cell against a fit of the others (a slowed cell would pull a fit that includes it
    # towards itself); the slowest past the bound is left out, and again, until none is. A cell
    # without which the others show no FLOP rate is not judged.
    kept = list(cells)

    def against_the_others(i: int) -> float:
        try:
            return kept[i].seconds / kept[i].cost.seconds(_least_squares_rates(kept[:i] + kept[i + 1 :], devices[0]))
        except ValueError:
            return 0.0

    while len(kept) > 2:
        ratios = [against_the_others(i) for i in range(len(kept))]
        slowest = int(np.argmax(ratios))
        if ratios[slowest] <= contended:
            break
        del kept[slowest]
    rates = _least_squares_rates(kept, devices[0])
    ratios = {}
    for cell in kept:
        for stage, (measured, modelled) in _stage_seconds(cell, rates).items():
            ratios.setdefault(stage, []).append(measured / modelled)
    spread = {stage: (min(r), float(np.median(r)), max(r)) for stage, r in ratios.items()}
    fitted = {id(cell) for cell in kept}
    left_out = tuple(cell for cell in cells if id(cell) not in fitted)
    return Fit(device=devices[0], cells=tuple(kept), rates=rates, spread=spread, left_out=left_out)


def _least_squares_rates(cells: Sequence[CellRun], device: str) -> Rates:
    """One non-negative least-squares fit of the rates to ``cells``, stage by stage."""
    per_step, per_flop = _nonnegative_least_squares(
        [np.array([c.cost.train_steps for c in cells], float), np.array([c.cost.train_flops for c in cells])],
        np.array([c.train_seconds for c in cells]),
    )
    if per_flop <= 0:
        raise ValueError(f"the training seconds of {len(cells)} cells on {device} show no FLOP rate")
    # Evaluation's rates from the cells that fine-tune nothing: fine-tuning (charged at the
    # training rate) adds its own compilations and runs one seed at a time, which would
    # otherwise pass for evaluation's cost.
    plain = [c for c in cells if not c.cost.finetune_flops] or list(cells)
    per_eval_flop, per_program = _nonnegative_least_squares(
        [np.array([c.cost.eval_flops for c in plain]), np.array([c.cost.eval_programs for c in plain], float)],
        np.array([c.eval_seconds for c in plain]),
    )
    return Rates(
        train_flops_per_second=float(1 / per_flop),
        seconds_per_step=float(per_step),
        eval_flops_per_second=float(1 / per_eval_flop) if per_eval_flop > 0 else math.inf,
        seconds_per_eval_program=float(per_program),
        seconds_per_cell=float(np.mean([c.fixed_seconds for c in cells])),
    )


def fit_runs(folders: Iterable) -> dict[str, Fit]:
    """:func:`fit_rates` of the cells of ``folders`` (:func:`read_cells`), one fit per device
    they ran on; ``python benchmarks/cost_model.py FOLDER ...`` prints them."""
    by_device: dict[str, list[CellRun]] = {}
    for folder in folders:
        for cell in read_cells(folder):
            by_device.setdefault(cell.device, []).append(cell)
    return {device: fit_rates(cells) for device, cells in by_device.items()}
