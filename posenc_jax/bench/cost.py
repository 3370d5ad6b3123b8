"""What a run costs: cells, floating-point operations and compiled programs, and their time on a machine.

:func:`cost` counts a preset's cells and FLOPs (:func:`cell_cost` one cell's, from its task's
resolved settings), :class:`Rates` turn them into seconds on one machine (fitted to measured
runs by :mod:`posenc_jax.bench.costmodel`), and :func:`estimate` is the expected time
``posenc-bench extrapolate --help`` states for each preset.
"""

from __future__ import annotations

import dataclasses
import math

from posenc_jax.bench.settings import TaskSettings, runs_on
from posenc_jax.functional.core.registry import encoding_info

__all__ = [
    "COLAB_TPU_ON_H200",
    "CPU_ESTIMATE",
    "H200_ESTIMATE",
    "TPU_ESTIMATE",
    "Cost",
    "Rates",
    "cell_cost",
    "cost",
    "duration",
    "estimate",
    "expected_seconds",
    "step_flops",
]


@dataclasses.dataclass(frozen=True)
class Cost:
    """What a preset (or one cell) asks for: trained cells (task x encoding x normaliser, all
    seeds together), floating-point operations of training, of fine-tuning RoPE's scaled
    variants (text only; the runner times it with evaluation) and of evaluation (all seeds), and
    the evaluation programs to compile (one per shape and encoding config: every length of the
    text task or of a length-dependent encoding, every length of a variant, whose scaling
    changes with the length)."""

    cells: int
    train_flops: float
    eval_flops: float
    eval_programs: int
    finetune_flops: float = 0.0
    train_steps: int = 0  # summed over cells; one step of a cell trains all its seeds

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))

    def seconds(self, rates: Rates) -> float:
        """The wall time this cost takes at ``rates``: training and fine-tuning at the training
        rate plus a host cost per step, evaluation at its rate plus a compilation per program,
        and a fixed cost per cell (training's compilation, checks and checkpoints).

        Example:
          >>> Cost(cells=2, train_flops=4e12, eval_flops=1e11, eval_programs=3, train_steps=100).seconds(
          ...     Rates(train_flops_per_second=2e10, seconds_per_step=0.01, eval_flops_per_second=1e10,
          ...           seconds_per_eval_program=1.0, seconds_per_cell=10.0))
          234.0
        """
        return (
            (self.train_flops + self.finetune_flops) / rates.train_flops_per_second
            + self.train_steps * rates.seconds_per_step
            + self.eval_flops / rates.eval_flops_per_second
            + self.eval_programs * rates.seconds_per_eval_program
            + self.cells * rates.seconds_per_cell
        )


def _forward_flops_per_token(preset, context: int, vocab: int) -> float:
    """Multiply-adds x 2 of one token's forward pass: projections and MLP, attention over
    ``context`` keys (scores and weighted sum, all heads), the output head."""
    d = preset.model_dim
    per_layer = 2 * (4 * d * d + 2 * d * preset.mlp_dim) + 4 * context * d
    return preset.num_layers * per_layer + 2 * d * vocab


def step_flops(preset, *, tokens: int, vocab: int, batch: int) -> float:
    """FLOPs of one optimisation step of one seed on ``batch`` sequences of ``tokens`` tokens:
    3 x the forward pass (the backward pass costs about twice the forward). ``preset``: a
    :class:`~posenc_jax.bench.presets.Preset` or a task's :class:`~posenc_jax.bench.settings.TaskSettings`
    (the model's sizes).

    Example:
      >>> from posenc_jax.bench.presets import PRESETS
      >>> round(step_flops(PRESETS["cpu"], tokens=64, vocab=128, batch=32) / 1e9, 2)  # GFLOP
      1.51
    """
    return 3 * batch * tokens * _forward_flops_per_token(preset, tokens, vocab)


def cell_cost(settings: TaskSettings, encoding: str, normalizer: str = "softmax", *, steps: int | None = None) -> Cost:
    """The FLOPs and evaluation programs of one cell (all the seeds of ``settings``, a task's
    resolved settings: :meth:`Preset.resolve <posenc_jax.bench.presets.Preset.resolve>`), trained
    for ``steps`` steps (default: the task's whole budget). Seeds that have learned their task keep
    being computed, frozen, while the others train on, so a cell's training costs its seeds times
    the steps of the slowest seed.

    Example:
      >>> from posenc_jax.bench.presets import PRESETS
      >>> cpu = PRESETS["cpu"]
      >>> c = cell_cost(cpu.resolve(cpu.task("counting_copy")), "rope", steps=700)
      >>> c.cells, round(c.train_flops / 1e12, 2), c.eval_programs  # 5 seeds x 700 steps
      (1, 1.48, 1)
    """
    task, lengths = settings.task, settings.lengths
    steps = settings.steps if steps is None else steps
    train_tokens = task.max_tokens(lengths.train)
    longest = task.max_tokens(max(lengths.eval))
    one_shape = task.fixed_eval_shape and not any(encoding_info(p).length_dependent for p in encoding.split("+"))
    per_model = 0.0
    for n in lengths.eval:
        tokens = longest if one_shape else task.max_tokens(n)
        per_model += lengths.examples_at(n) * tokens * _forward_flops_per_token(settings, tokens, task.vocab_size)
    found = settings.variants(encoding, normalizer)
    seeds = len(settings.seeds)
    train = seeds * steps * step_flops(settings, tokens=train_tokens, vocab=task.vocab_size, batch=settings.batch_size)
    tuned = sum(v.protocol == "finetune" for v in found)
    tuned_step = step_flops(
        settings,
        tokens=train_tokens * settings.finetune_multiple,
        vocab=task.vocab_size,
        batch=settings.finetune_batch,
    )
    finetune = seeds * tuned * settings.finetune_steps * tuned_step
    programs = (1 if one_shape else len(lengths.eval)) + len(found) * len(lengths.eval)
    return Cost(
        cells=1,
        train_flops=train,
        eval_flops=seeds * (1 + len(found)) * per_model,
        eval_programs=programs,
        finetune_flops=finetune,
        train_steps=steps,
    )


def cost(preset) -> Cost:
    """The cells, FLOPs and evaluation programs of ``preset`` (a
    :class:`~posenc_jax.bench.presets.Preset`): :func:`cell_cost` of every cell that runs, each
    trained for its whole budget of steps (what a ``fixed-budget`` run trains; an upper bound for
    a ``to-criterion`` one, whose cells stop once learned), its tasks made and resolved as the
    runner makes and resolves them.

    Example:
      >>> from posenc_jax.bench.presets import PRESETS
      >>> c = cost(PRESETS["cpu"])
      >>> c.cells, round(c.train_flops / 1e12, 1), round(c.finetune_flops / 1e12, 1), c.eval_programs
      (6, 15.2, 0.0, 6)
    """
    total = Cost(cells=0, train_flops=0.0, eval_flops=0.0, eval_programs=0)
    for name in preset.tasks:
        task = preset.task(name)
        settings = preset.resolve(task)
        for encoding in preset.encodings:
            if runs_on(task, encoding):
                for normalizer in preset.normalizers:
                    total += cell_cost(settings, encoding, normalizer)
    return total


@dataclasses.dataclass(frozen=True)
class Rates:
    """How fast one machine runs the benchmark: the rates :meth:`Cost.seconds` turns a cost into
    seconds with. :func:`posenc_jax.bench.costmodel.fit_rates` fits them to measured runs.

    Attributes:
      train_flops_per_second: training (all seeds of a cell together), fine-tuning too.
      seconds_per_step: host work of one training step of a cell, whatever its FLOPs (making
        each seed's batch, dispatching the step); what bounds small models on an accelerator.
      eval_flops_per_second: evaluation.
      seconds_per_eval_program: compiling one evaluation program.
      seconds_per_cell: training's compilation, the checks and the checkpoints of one cell.
    """

    train_flops_per_second: float
    seconds_per_step: float
    eval_flops_per_second: float
    seconds_per_eval_program: float
    seconds_per_cell: float


# Fitted (posenc_jax.bench.costmodel.fit_rates; `python benchmarks/cost_model.py` prints each fit
# and how well it predicts its runs) to the cells of docs/extrapolation-cpu/ (the cpu preset's 12,
# commit 2d47bf5) and docs/extrapolation-cpu-full/ (93 of cpu-full, commits 47ebb12 to 402a460),
# both on this project's 2-core CPU, shared with other work; tests/test_bench.py refits them. The
# fit leaves out 18 cells that took over twice what the others' fit gives them (contended, by their
# time alone: 13 of them are missing-duplicate cells at 0.08-1.8 s a step, the 9 others 0.04-0.08).
# Measured over modelled time, for the cells fitted: 1.45 for the first run, 0.93 for the second.
# No per-step host cost shows on a CPU.
CPU_ESTIMATE = Rates(
    train_flops_per_second=29.7e9,
    seconds_per_step=0.0,
    eval_flops_per_second=18.0e9,
    seconds_per_eval_program=0.408,
    seconds_per_cell=17.9,
)
# Fitted the same way to the 36 cells of docs/budget-search/, docs/extrapolation-gpu-text/ and
# docs/extrapolation-colab-tpu-partial/ (the files of commit cf1ad04; their rows say bc093da,
# dirty), run on one NVIDIA H200, the only accelerator the benchmark has been timed on; the
# gpu-text run was three processes sharing it. Small models there are bound by the 13 ms of host
# work a step, not by FLOPs. Measured over modelled time: 0.86, 0.94 and 1.66 for the three runs.
H200_ESTIMATE = Rates(
    train_flops_per_second=38.2e12,
    seconds_per_step=0.0130,
    eval_flops_per_second=1.90e12,
    seconds_per_eval_program=1.05,
    seconds_per_cell=51.0,
)
# Fitted the same way to the colab-tpu preset's own 9 cells on that H200
# (docs/extrapolation-colab-tpu-partial/), which took 1.66 times what H200_ESTIMATE gives them:
# about 45 ms a step for 5 seeds at 4 x 256 (some 6 TFLOP/s, about 1% of the H200's TF32 peak)
# and 17-75 s of compilation a cell. Their evaluation did not take longer with more FLOPs (one
# program a cell), so the fit puts it all in the per-program term.
COLAB_TPU_ON_H200 = Rates(
    train_flops_per_second=23.6e12,
    seconds_per_step=0.0328,
    eval_flops_per_second=math.inf,
    seconds_per_eval_program=16.0,
    seconds_per_cell=83.0,
)
# Assumed, not measured (nothing has run on a TPU): a Colab TPU v2-8 with all 8 cores
# data-parallel runs the colab-tpu preset as fast as the H200 ran its cells. Peaks do not settle
# it either way: the v2-8's (about 180 TFLOP/s of bfloat16) is below the H200's (about 990), but
# these cells ran at about 1% of the H200's, bound by host work per step and by compilation,
# which a TPU host does too. A v5e chip has a peak like the v2-8's.
TPU_ESTIMATE = COLAB_TPU_ON_H200


def expected_seconds(preset, rates: Rates) -> float:
    """An estimate of a whole run's wall time: :func:`cost` (every cell to its whole budget, as a
    ``fixed-budget`` run trains) at the ``rates`` of a machine (:data:`CPU_ESTIMATE`, :data:`H200_ESTIMATE`,
    :data:`TPU_ESTIMATE`).

    Example:
      >>> from posenc_jax.bench.presets import PRESETS
      >>> round(expected_seconds(PRESETS["smoke"], CPU_ESTIMATE) / 60) <= 5  # minutes
      True
    """
    return cost(preset).seconds(rates)


def duration(seconds: float) -> str:
    """A time as runs print it: ``42s``, ``3m05s``, ``2h10m``.

    Example:
      >>> duration(185), duration(7800)
      ('3m05s', '2h10m')
    """
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def estimate(preset) -> str:
    """The time ``preset`` is expected to take, every cell to its whole budget, on the machine it is
    sized for (``about 48 min on a 2-core CPU``): what ``extrapolate --help`` and the README's table say.

    Example:
      >>> from posenc_jax.bench.presets import PRESETS
      >>> estimate(PRESETS["ruoss"])
      'about 3.9 h on a 2-core CPU'
    """
    c = cost(preset)
    if preset.target == "cpu":
        return f"about {_minutes(c.seconds(CPU_ESTIMATE))} on a 2-core CPU"
    if preset.target == "colab-tpu":
        return f"about {_minutes(c.seconds(TPU_ESTIMATE))} on a Colab TPU v2-8"
    return f"about {_minutes(c.seconds(H200_ESTIMATE))} on an H200"
