"""One cell of the extrapolation benchmark: a task and an encoding, trained and evaluated.

A cell's seeds train together: their models and optimiser states are stacked along a
leading seed axis and one ``jax.vmap``-ed, jitted step updates them all, so a cell
compiles once and each step serves every seed (:class:`~posenc_jax.bench.seeds.SeedGroup`).
Each seed keeps its own data (the batch of step k depends only on (seed, k)), its own
checkpoints and its own rows; ``benchmarks/seed_vmap.py`` measures the speed-up.

A cell receives its task's settings resolved once by the runner (a
:class:`~posenc_jax.bench.settings.TaskSettings`: the preset with the task's overrides, its
lengths and its variants) and reads nothing else of the preset. What it measures (test batches,
scores, held-out checks, fine-tuning) is :mod:`~posenc_jax.bench.evaluation`.

Batches are made on the host, one jitted step a call (``Preset.batches="host"``), or inside
the jitted program (``"device"``, :mod:`posenc_jax.bench.device_batches`), where one call runs
``Preset.steps_per_dispatch`` steps (:meth:`SeedGroup.train <posenc_jax.bench.seeds.SeedGroup.train>`,
a ``lax.scan`` over steps): an accelerator then no longer waits on the host between steps.
``benchmarks/train_dispatch.py`` measures the three side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posenc_jax.bench.device_batches import DeviceBatches, seed_key
from posenc_jax.bench.evaluation import (
    SUPPORTED_IMPLEMENTATIONS,
    Criterion,
    check_batch,
    check_score,
    eval_batches,
    evaluate,
    finetuned,
    held,
    measure_seed,
    position_buckets,
    predict,
    sequence_mesh,
)
from posenc_jax.bench.ledger import checkpoint_dir, write_text
from posenc_jax.bench.seeds import SeedGroup
from posenc_jax.bench.settings import TaskLengths, TaskSettings
from posenc_jax.checkpoint import Checkpointer, CheckpointError
from posenc_jax.functional.core.normalizers import normalizer_config
from posenc_jax.functional.core.registry import encoding_config, encoding_info
from posenc_jax.nn import Transformer
from posenc_jax.training import fit, make_optimizer, warmup_cosine_adamw

__all__ = [
    "SUPPORTED_IMPLEMENTATIONS",
    "Cell",
    "Criterion",
    "DivergedError",
    "SeedGroup",
    "build",
    "build_model",
    "check_batch",
    "check_score",
    "encodings_for",
    "eval_batches",
    "evaluate",
    "finetuned",
    "held",
    "position_buckets",
    "predict",
    "row_label",
    "sequence_mesh",
    "train_and_evaluate",
    "train_batch",
]


def row_label(encoding: str, normalizer: str) -> str:
    """The ``encoding`` field of a result row: the encoding, with ``|normaliser`` unless softmax."""
    return encoding if normalizer == "softmax" else f"{encoding}|{normalizer}"


@dataclasses.dataclass(frozen=True)
class Cell:
    """A task x encoding x normaliser: the unit that is built, trained (all seeds together) and
    evaluated, with its task's resolved ``settings``."""

    settings: TaskSettings
    encoding: str
    normalizer: str = "softmax"

    @property
    def task_name(self) -> str:
        return self.settings.name

    @property
    def task(self):
        return self.settings.task

    @property
    def lengths(self) -> TaskLengths:
        return self.settings.lengths

    @property
    def label(self) -> str:
        return row_label(self.encoding, self.normalizer)

    @property
    def train_tokens(self) -> int:
        return self.task.max_tokens(self.lengths.train)

    @property
    def max_tokens(self) -> int:
        return self.task.max_tokens(max(self.lengths.eval))

    @property
    def length_dependent(self) -> bool:
        """Frequencies that follow the sequence length (max position + 1) must see each length unpadded."""
        return any(encoding_info(part).length_dependent for part in self.encoding.split("+"))

    def eval_tokens(self, length: int) -> int:
        """The padded model input length of one evaluation length."""
        if self.task.fixed_eval_shape and not self.length_dependent:
            return self.max_tokens  # one shape for every length: one compilation
        return self.task.max_tokens(length)


def encodings_for(name: str, head_dim: int, train_tokens: int, max_tokens: int) -> list:
    """The configs of ``name`` (``a+b`` for a hybrid) sized by each config's ``for_lengths``: tables
    long enough for the longest evaluation, RoPE scalings from the training to the longest length.
    A position sampler (randomized positions) is sized first; the others then cover its range.
    Settings an encoding cannot do without (a scaling's factor) start from its small settings
    and are then set by ``for_lengths``."""
    configs = []
    for part in name.split("+"):
        info = encoding_info(part)
        configs.append(encoding_config(part, **{k: info.small_settings[k] for k in info.required}))
    reach = max_tokens
    for i, config in enumerate(configs):
        if config.acts_on == "positions":
            configs[i] = config.for_lengths(train_length=train_tokens, max_length=max_tokens, head_dim=head_dim)
            reach = max(reach, configs[i].max_length)
    return [
        c if c.acts_on == "positions" else c.for_lengths(train_length=train_tokens, max_length=reach, head_dim=head_dim)
        for c in configs
    ]


def build_model(task, settings: TaskSettings, configs, seed: int, normalizer: str = "softmax") -> Transformer:
    """The benchmark's Transformer for ``task`` with the encoding ``configs``, sized by ``settings``
    (a task's resolved settings, or a preset: its model fields), initialised from ``seed`` (every
    layer's query projection scaled by ``settings.query_init_scale``)."""
    model = Transformer(
        vocab_size=task.vocab_size,
        model_dim=settings.model_dim,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        mlp_dim=settings.mlp_dim,
        encoding=configs,
        causal=task.kind == "decoder",
        normalizer=normalizer_config(normalizer),
        dropout_rate=settings.dropout_rate,
        rngs=nnx.Rngs(params=seed, dropout=seed + 1),
    )
    if settings.query_init_scale != 1.0:
        for block in model.blocks:
            query = block.attention.query
            query.kernel[...] = query.kernel[...] * settings.query_init_scale
    return model


def train_batch(settings: TaskSettings, seed: int, step: int) -> dict:
    """The training batch of ``step`` for ``seed`` of the task of ``settings``: it depends on
    (seed, step) alone, so a resumed run sees the data an uninterrupted one would."""
    task, lengths = settings.task, settings.lengths
    rng = np.random.default_rng([seed, step])
    return task.batch(
        rng,
        task.train_lengths(rng, lengths.train, settings.batch_size, minimum=lengths.train_min),
        pad_to=task.max_tokens(lengths.train),
    )


@functools.cache
def optimizer_transform(settings: TaskSettings):
    """The task's AdamW with warm-up and cosine decay: one object per task's settings, so that
    optimisers built from it share their (static) graph and a jitted step compiles once for all seeds."""
    return warmup_cosine_adamw(
        learning_rate=settings.learning_rate,
        total_steps=settings.steps,
        warmup_steps=max(0, int(settings.warmup_fraction * settings.steps)),
        weight_decay=settings.weight_decay,
    )


def build(cell: Cell, configs, seed: int):
    """``(model, optimizer)`` of one seed of ``cell``, freshly initialised."""
    model = build_model(cell.task, cell.settings, configs, seed, cell.normalizer)
    return model, make_optimizer(model, optimizer_transform(cell.settings))


def _restore(cell, checkpointers, models, optimizers, recorded) -> dict:
    """Each seed's newest intact checkpoint; seeds left at different steps (a run killed while saving
    them) go back to the newest step they all have, so they train on together."""
    start = {}
    for seed, ckpt in checkpointers.items():
        has = ckpt.latest_step() is not None
        start[seed] = ckpt.restore(models[seed], optimizers[seed], config=recorded[seed]) if has else 0
    if len(set(start.values())) > 1:
        common = set.intersection(*(set(ckpt.all_steps()) for ckpt in checkpointers.values()))
        if common:
            step = max(common)
            try:
                for seed in start:
                    if start[seed] != step:
                        checkpointers[seed].restore(models[seed], optimizers[seed], step, config=recorded[seed])
                        start[seed] = step
            except CheckpointError:
                pass  # a damaged common step: the seeds differ in step, and train_and_evaluate restarts them all
    return start


def _checks_path(out: pathlib.Path, fingerprint: str, cell: Cell, seed: int) -> pathlib.Path:
    """Where one seed keeps its held-out checks, ``[[step, score], ...]``, beside its checkpoints."""
    return checkpoint_dir(out, fingerprint, cell.task_name, cell.label, seed).with_suffix(".checks.json")


def _write_checks(path: pathlib.Path, checks: list) -> None:
    """Writes a seed's checks whole or not at all (a kill mid-write leaves the previous file; a
    full disk is one error naming the file)."""
    write_text(path, json.dumps(checks))


def _read_checks(path: pathlib.Path, up_to: int) -> list:
    """The checks recorded up to step ``up_to`` (those after it belong to steps a resumed run repeats)."""
    if not path.exists():
        return []
    return [check for check in json.loads(path.read_text()) if check[0] <= up_to]


def train_and_evaluate(
    cell: Cell,
    seeds: list[int],
    todo: dict,
    *,
    out: pathlib.Path,
    fingerprint: str,
    write,
    criterion: Criterion,
    stamp: dict | None = None,
    mesh=None,
    bar=None,
) -> list[dict]:
    """Trains the seeds of ``cell`` together (resuming from their checkpoints) for their task's
    budget of steps (``fixed-budget``) or to criterion (``to-criterion``), then evaluates each.

    Args:
      cell: the task's resolved settings, the encoding and the normaliser.
      seeds: the seeds to train (those with rows left to measure).
      todo: per seed, the rows left: ``(variant, length)`` pairs, ``variant`` None for the
        trained encoding or an :class:`~posenc_jax.bench.settings.EvalVariant`.
      out, fingerprint: the output folder and the run's settings fingerprint (where checkpoints go).
      write: called with each result row as soon as it is measured.
      criterion: when a seed has learned the task (checked on held-out examples every
        ``check_every`` steps; the first step at which it held at two checks in a row is
        each row's ``criterion_step``). Under ``to-criterion`` a seed stops there, and the cell
        when every seed has, or at ``settings.steps``; under ``fixed-budget`` every seed trains
        ``settings.steps`` steps.
      stamp: fields every row carries (the commit that made it).
      mesh: a data-parallel mesh, or None.
      bar: ``bar(total, initial, description)`` makes a progress bar (tqdm's interface); it is
        made after the first step, so its rate does not count compilation.

    Returns:
      One timing record per group of seeds trained together: normally one; more only when a
      kill left seeds at steps they do not share.
    """
    settings = cell.settings
    configs = encodings_for(cell.encoding, settings.head_dim, cell.train_tokens, cell.max_tokens)
    models, optimizers = _build_seeds(cell, configs, seeds)
    with contextlib.ExitStack() as stack:
        checkpointers = _open_checkpointers(stack, out, fingerprint, cell, seeds)
        # Each checkpoint records what it is a checkpoint of.
        recorded = {
            seed: {
                "settings": fingerprint,
                "task": cell.task_name,
                "encoding": cell.label,
                "seed": seed,
                "encoding_configs": [repr(c) for c in configs],
            }
            for seed in seeds
        }
        start = _restore(cell, checkpointers, models, optimizers, recorded)
        if len(set(start.values())) > 1:
            # No step every seed has (a kill in the middle of the first saves): they start again from
            # their initialisation, together, as an uninterrupted run trains them.
            models, optimizers = _build_seeds(cell, configs, seeds)
            start = dict.fromkeys(seeds, 0)
        checks = {seed: _read_checks(_checks_path(out, fingerprint, cell, seed), start[seed]) for seed in seeds}
        groups = {}
        for seed in seeds:
            groups.setdefault(start[seed], []).append(seed)
        records = []
        for first_step, group in sorted(groups.items()):
            cpu_began = time.process_time()  # this process's CPU time, every thread's
            record = _train_group(
                cell,
                group,
                first_step,
                models,
                optimizers,
                checkpointers,
                recorded,
                checks=checks,
                criterion=criterion,
                save_checks=lambda seed: _write_checks(_checks_path(out, fingerprint, cell, seed), checks[seed]),
                mesh=mesh,
                bar=bar,
            )
            began = time.perf_counter()
            for seed in group:
                training = {
                    "steps": record["steps"][seed],
                    "criterion_step": held(checks[seed], criterion),
                    "check_score": checks[seed][-1][1] if checks[seed] else None,
                    "protocol": settings.protocol,
                }
                measure_seed(cell, seed, models[seed], todo[seed], write, {**training, **(stamp or {})})
            record["eval_seconds"] = time.perf_counter() - began
            # Beside the wall seconds, the CPU seconds this process used for the group: a cell that ran
            # beside other work on a shared machine used fewer cores per second of its wall time.
            record["cpu_seconds"] = time.process_time() - cpu_began
            records.append(record)
        return records


def _build_seeds(cell: Cell, configs, seeds: list[int]) -> tuple[dict, dict]:
    """Each seed's model and optimizer state, freshly initialised: ``(models, optimizers)`` by seed."""
    built = {seed: build(cell, configs, seed) for seed in seeds}
    return {seed: m for seed, (m, _) in built.items()}, {seed: o for seed, (_, o) in built.items()}


def _open_checkpointers(stack: contextlib.ExitStack, out: pathlib.Path, fingerprint: str, cell: Cell, seeds) -> dict:
    """Each seed's checkpointer, closed with ``stack``. Two steps kept, so a damaged newest one falls back to
    the one before (same results: the data of step k depends only on (seed, k))."""
    return {
        seed: stack.enter_context(
            contextlib.closing(
                Checkpointer(
                    checkpoint_dir(out, fingerprint, cell.task_name, cell.label, seed),
                    max_to_keep=2,
                    process_local=jax.process_count() > 1,  # each host of a several-host run its own
                )
            )
        )
        for seed in seeds
    }


class DivergedError(ValueError):
    """A training loss that is not finite (NaN or infinite): the cell stops there, and so does the run.

    Decision: the whole run stops (``posenc-bench extrapolate`` exits with this one line) rather
    than recording the cell as failed and going on. A diverged cell has no score to report;
    skipping it would leave a report with a silently missing cell, and its usual cause (a
    learning rate too high for the model) would make every later cell diverge too. Nothing of
    the cell is written (no rows, no checkpoint of the diverged state); the rows and
    checkpoints of earlier cells are kept, so the same command resumes once the setting is
    fixed, or the encoding is left out.
    """

    def __init__(self, cell, seeds: list[int], step: int, loss: float):
        settings = cell.settings
        self.seeds, self.step, self.loss = list(seeds), step, loss
        super().__init__(
            f"training diverged: {cell.task_name} / {cell.label}, seed{'s' if len(seeds) > 1 else ''} "
            f"{','.join(map(str, seeds))}: the loss is {loss} at step {step} of {settings.steps} (learning rate "
            f"{settings.learning_rate}); no rows were written for this cell. Lower --learning-rate, or leave this "
            "encoding out with --encodings; the rows of earlier cells are kept and the same command resumes"
        )


def _train_group(
    cell,
    group,
    first_step,
    models,
    optimizers,
    checkpointers,
    recorded,
    *,
    checks,
    criterion,
    save_checks,
    mesh,
    bar,
):
    """Trains the seeds of ``group`` (all at ``first_step``), each until it has met ``criterion`` at
    two checks in a row (it then keeps that state while the others train on) and all of them at
    most to ``settings.steps``; afterwards ``models[seed]`` and ``optimizers[seed]`` hold each
    seed's trained state and ``checks[seed]`` its checks. So a seed's result depends on its own
    seed alone, not on which seeds it trained beside.

    Under the ``fixed-budget`` protocol (``settings.protocol``) no seed stops: every seed trains
    exactly ``settings.steps`` steps, and the checks only record when each met the criterion
    (its steps to criterion, a measurement).

    With ``settings.batches == "device"`` each call runs ``settings.steps_per_dispatch`` steps, their
    batches made on the device (:meth:`SeedGroup.train`); :func:`fit` then counts dispatches,
    and the checks, checkpoints and steps it reports are converted back to steps."""
    settings = cell.settings
    stops = settings.protocol == "to-criterion"
    record = {
        "task": cell.task_name,
        "encoding": cell.label,
        "seeds": list(group),
        "resumed_from_step": first_step,
        "compile_seconds": 0.0,
        "train_seconds": 0.0,
        "final_loss": None,  # unknown when a resumed cell has no steps left
        "steps": {seed: (held(checks[seed], criterion) if stops else None) or first_step for seed in group},
    }
    if first_step >= settings.steps or (stops and all(held(checks[seed], criterion) is not None for seed in group)):
        return record
    if first_step % settings.steps_per_dispatch:
        raise ValueError(
            f"{cell.task_name} / {cell.label}: resuming at step {first_step}, which is not a multiple of "
            f"steps_per_dispatch={settings.steps_per_dispatch}; checkpoints of these settings are saved between "
            "dispatches"
        )
    seeds = SeedGroup([models[s] for s in group], [optimizers[s] for s in group], mesh=mesh)
    saving = (checkpointers, recorded, save_checks)
    _GroupRun(cell, group, first_step, seeds, record, saving, checks=checks, criterion=criterion, bar=bar).train()
    for i, seed in enumerate(group):
        models[seed], optimizers[seed] = seeds.seed(i)
    return record


class _GroupRun:
    """One group of seeds in training (:func:`_train_group`): the seeds stacked, each one's held-out batch
    and checks, the losses not looked at yet, the progress bar, and the time spent on checks and saves
    (kept out of the training time). Fills ``record`` as it goes; ``saving``: the seeds' checkpointers, what each
    checkpoint records, and the call that writes a seed's checks."""

    def __init__(self, cell, group, first_step, seeds: SeedGroup, record: dict, saving, *, checks, criterion, bar):
        self.cell, self.settings, self.group, self.first_step = cell, cell.settings, group, first_step
        self.checkpointers, self.recorded, self.save_checks = saving
        self.seeds, self.record, self.checks, self.criterion, self.bar = seeds, record, checks, criterion, bar
        self.stops = self.settings.protocol == "to-criterion"
        self.per_dispatch = self.settings.steps_per_dispatch
        self.on_device = self.settings.batches == "device"
        if self.on_device:
            self.make_batch = DeviceBatches(cell.task, cell.lengths, self.settings.batch_size)
            self.data, self.keys = seeds.replicate((self.make_batch.data, jnp.stack([seed_key(s) for s in group])))
        self.held_out = {seed: check_batch(cell, seed) for seed in group}
        self.pending = []  # the losses of the steps since the last look at them (left on the device until then)
        self.looked = first_step  # the steps whose losses were looked at
        self.progress = None
        self.paused = 0.0  # checks and checkpoint writes, kept out of the training time
        self.began = time.perf_counter()
        self.frozen = [self.stops and self.learned(seed) for seed in group]

    def learned(self, seed) -> bool:
        return held(self.checks[seed], self.criterion) is not None

    def batches(self):
        """What each call of :meth:`step` trains on: the seeds' stacked host batches of one step,
        or (device batches) the first step of a dispatch."""
        if self.on_device:
            yield from itertools.count(self.first_step, self.per_dispatch)
            return
        for step in itertools.count(self.first_step):
            per_seed = [train_batch(self.settings, seed, step) for seed in self.group]
            yield {name: np.stack([b[name] for b in per_seed]) for name in per_seed[0]}

    def step(self, group_, _, batch):
        """One call: a step (host batches) or a dispatch of steps (device batches); the first one's time is
        compilation, after which the progress bar starts."""
        if self.on_device:
            losses = group_.train(self.make_batch, self.data, self.keys, batch, self.per_dispatch, self.frozen)
        else:
            losses = group_.step(batch, self.frozen)  # [seeds]; device batches: [steps, seeds]
        self.pending.append(losses)
        if self.progress is None and self.record["compile_seconds"] == 0.0:
            jax.block_until_ready(losses)
            self.record["compile_seconds"] = time.perf_counter() - self.began
            self.began = time.perf_counter()
            if self.bar is not None:
                seed_list = ",".join(map(str, self.group))
                self.progress = self.bar(
                    self.settings.steps,
                    self.first_step + self.per_dispatch,
                    f"{self.cell.task_name} / {self.cell.label} / seeds {seed_list}",
                )
        elif self.progress is not None:
            self.progress.update(self.per_dispatch)
        return losses

    def finite(self) -> None:
        """Stops the cell at a non-finite loss (before it is checked or saved), naming the step."""
        for loss in self.pending:
            for values in np.asarray(loss).reshape(-1, len(self.group)):  # one row of the seeds' losses a step
                bad = np.flatnonzero(~np.isfinite(values))
                if bad.size:
                    if self.progress is not None:
                        self.progress.close()
                    raise DivergedError(self.cell, [self.group[i] for i in bad], self.looked + 1, float(values[bad[0]]))
                self.looked += 1
        self.pending.clear()

    def check(self, step) -> bool:
        """Each seed still training scored on its held-out batch; whether every seed has stopped."""
        jax.block_until_ready(self.seeds.state)  # the steps queued so far count as training
        self.finite()
        started = time.perf_counter()
        for i, seed in enumerate(self.group):
            if self.frozen[i]:
                continue  # stopped at its criterion: its state, and so its score, no longer change
            model, _ = self.seeds.seed(i)
            self.checks[seed].append([step, check_score(model, self.cell, self.held_out[seed], self.criterion)])
            self.frozen[i] = self.stops and self.learned(seed)
        self.paused += time.perf_counter() - started
        if self.progress is not None:
            self.progress.set_postfix(check=" ".join(f"{self.checks[seed][-1][1]:.3f}" for seed in self.group))
        return all(self.frozen)

    def save(self, step) -> None:
        """Each seed's checks, then its checkpoint at ``step``."""
        jax.block_until_ready(self.seeds.state)
        self.finite()  # a diverged state is never saved, so a re-run resumes from finite weights
        started = time.perf_counter()
        for i, seed in enumerate(self.group):
            # The checks first: a kill between the two leaves checks a step ahead of the newest
            # checkpoint, which reading them up to the restored step drops.
            self.save_checks(seed)
            model, optimizer = self.seeds.seed(i)
            self.checkpointers[seed].save(step, model, optimizer, config=self.recorded[seed])
        self.paused += time.perf_counter() - started

    def train(self) -> None:
        """Trains to the end (``fit`` counts calls of :meth:`step`: dispatches of ``per_dispatch`` steps, one
        step with host batches) and records the times, the final losses and each seed's steps."""
        per_dispatch, settings, record = self.per_dispatch, self.settings, self.record
        losses = fit(
            self.seeds,
            None,
            self.batches(),
            steps=settings.steps // per_dispatch,
            start_step=self.first_step // per_dispatch,
            log=None,
            step_fn=self.step,
            save=lambda dispatch: self.save(dispatch * per_dispatch),
            checkpoint_every=settings.checkpoint_every // per_dispatch,
            check_every=settings.check_every // per_dispatch,
            check=lambda dispatch: self.check(dispatch * per_dispatch),
        )
        jax.block_until_ready(self.seeds.state)
        self.finite()
        record["train_seconds"] = time.perf_counter() - self.began - self.paused
        record["checkpoint_seconds"] = self.paused
        record["final_loss"] = [float(x) for x in np.asarray(losses[-1]).reshape(-1, len(self.group))[-1]]
        record["steps"] = {
            seed: (held(self.checks[seed], self.criterion) if self.stops else None)
            or self.first_step + len(losses) * per_dispatch
            for seed in self.group
        }
        if self.progress is not None:
            self.progress.close()
