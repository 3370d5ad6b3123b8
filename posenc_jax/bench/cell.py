"""One cell of the extrapolation benchmark: a task and an encoding, trained and evaluated.

A cell's seeds train together: their models and optimiser states are stacked along a
leading seed axis and one ``jax.vmap``-ed, jitted step updates them all, so a cell
compiles once and each step serves every seed (:class:`SeedGroup`). Each seed keeps its
own data (the batch of step k depends only on (seed, k)), its own checkpoints and its
own rows. The plain reference is :func:`posenc_jax.training.train_step`, one seed at a
time; ``tests/test_bench.py`` checks that the two agree to float32 rounding (they are not
bitwise equal: XLA batches the seeds' matrix products, which rounds differently), and
``benchmarks/seed_vmap.py`` measures the speed-up.

Batches are made on the host, one jitted step a call (``Preset.batches="host"``), or inside
the jitted program (``"device"``, :mod:`posenc_jax.bench.device_batches`), where one call runs
``Preset.steps_per_dispatch`` steps (:meth:`SeedGroup.train`, a ``lax.scan`` over steps): an
accelerator then no longer waits on the host between steps. ``benchmarks/train_dispatch.py``
measures the three side by side.
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from posenc_jax.bench.device_batches import DeviceBatches, seed_key, step_key
from posenc_jax.bench.ledger import checkpoint_dir, write_text
from posenc_jax.bench.presets import Preset, TaskLengths, finetune_batch
from posenc_jax.checkpoint import Checkpointer, CheckpointError
from posenc_jax.functional.core.normalizers import normalizer_config
from posenc_jax.functional.core.registry import encoding_config, encoding_info
from posenc_jax.functional.core.validation import reraise_check_errors
from posenc_jax.nn import Transformer, with_encoding
from posenc_jax.training import cross_entropy_loss, fit, make_optimizer, train_step, warmup_cosine_adamw

__all__ = [
    "SUPPORTED_IMPLEMENTATIONS",
    "Cell",
    "Criterion",
    "SeedGroup",
    "build",
    "build_model",
    "check_batch",
    "check_score",
    "held",
    "position_buckets",
    "encodings_for",
    "finetuned",
    "evaluate",
    "train_batch",
]

# The attention implementations evaluation runs (the model's `implementation=`).
SUPPORTED_IMPLEMENTATIONS = ("materialize", "blockwise", "auto")


def row_label(encoding: str, normalizer: str) -> str:
    """The ``encoding`` field of a result row: the encoding, with ``|normaliser`` unless softmax."""
    return encoding if normalizer == "softmax" else f"{encoding}|{normalizer}"


@dataclasses.dataclass(frozen=True)
class Cell:
    """A task x encoding x normaliser: the unit that is built, trained (all seeds together) and evaluated."""

    task_name: str
    task: object
    encoding: str
    normalizer: str
    lengths: TaskLengths

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


def build_model(task, preset: Preset, configs, seed: int, normalizer: str = "softmax") -> Transformer:
    """The benchmark's Transformer for ``task`` with the encoding ``configs``, initialised from ``seed``
    (every layer's query projection scaled by ``preset.query_init_scale``)."""
    model = Transformer(
        vocab_size=task.vocab_size,
        model_dim=preset.model_dim,
        num_layers=preset.num_layers,
        num_heads=preset.num_heads,
        mlp_dim=preset.mlp_dim,
        encoding=configs,
        causal=task.kind == "decoder",
        normalizer=normalizer_config(normalizer),
        dropout_rate=preset.dropout_rate,
        rngs=nnx.Rngs(params=seed, dropout=seed + 1),
    )
    if preset.query_init_scale != 1.0:
        for block in model.blocks:
            query = block.attention.query
            query.kernel[...] = query.kernel[...] * preset.query_init_scale
    return model


def train_batch(task, preset: Preset, seed: int, step: int, lengths: TaskLengths) -> dict:
    """The training batch of ``step`` for ``seed``: it depends on (seed, step) alone, so a
    resumed run sees the data an uninterrupted one would."""
    rng = np.random.default_rng([seed, step])
    return task.batch(
        rng,
        task.train_lengths(rng, lengths.train, preset.batch_size, minimum=lengths.train_min),
        pad_to=task.max_tokens(lengths.train),
    )


def eval_batches(cell: Cell, seed: int, length: int):
    """The test batches of one length: ``examples`` examples, ``batch`` at a time; for text, the
    same characters at every length, in non-overlapping windows of that length."""
    if cell.lengths.text:
        yield from cell.task.evaluation_windows(length, cell.lengths.examples, cell.lengths.batch)
        return
    rng = np.random.default_rng([seed, 1_000_003, length])
    examples, size = cell.lengths.examples, cell.lengths.batch
    for start in range(0, examples, size):
        yield cell.task.batch(
            rng, [length] * min(size, examples - start), split="test", pad_to=cell.eval_tokens(length)
        )


def check_batch(cell: Cell, preset: Preset, seed: int) -> dict:
    """The held-out examples training checks its progress on: ``preset.check_examples`` of them at
    the longest training length (text: windows of the training context from the validation
    split), drawn apart from the test examples."""
    rng = np.random.default_rng([seed, 2_000_003])
    length = cell.lengths.train
    if cell.lengths.text:
        starts = rng.integers(0, len(cell.task.validation) - length - 1, preset.check_examples)
        return {**cell.task.windows_at("validation", starts, length), "starts": starts}
    return cell.task.batch(rng, [length] * preset.check_examples, split="test", pad_to=cell.eval_tokens(length))


def position_buckets(train_length: int, length: int) -> list[tuple[str, int, int]]:
    """``(label, first, end)`` position ranges of a window of ``length``: below the training
    length, then doublings of it (``"1-2x"``, ``"2-4x"``, ...), so that the loss past the
    training length is read directly."""
    buckets = [("<1x", 0, min(train_length, length))]
    low = 1
    while low * train_length < length:
        buckets.append((f"{low}-{2 * low}x", low * train_length, min(2 * low * train_length, length)))
        low *= 2
    return buckets


@functools.partial(nnx.jit, static_argnames=("implementation", "mesh", "ring"))
def _predict(model, batch, implementation, mesh, ring):
    inputs, positions, key_mask = batch["inputs"], batch["positions"], batch.get("key_mask")
    logits = model(inputs, positions, key_mask=key_mask, implementation=implementation, mesh=mesh, ring=ring)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target_log_probs = jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
    return {"predictions": logits.argmax(-1), "target_log_probs": target_log_probs}


@reraise_check_errors()  # a check failing inside the step raises its own error, not JAX's
def predict(model, batch: dict, *, implementation: str = "materialize", mesh=None, ring: bool = False) -> dict:
    """The argmax predictions and the targets' log-probabilities of ``batch``.

    ``mesh``: with ``implementation="blockwise"``, a :class:`jax.sharding.Mesh` whose devices
    share each sequence's queries (the model's ``mesh=``), or None for one device. ``ring``:
    the keys and values split over the mesh's devices too, passed round them (the model's ``ring=``).
    """
    if implementation not in SUPPORTED_IMPLEMENTATIONS:
        raise ValueError(
            f"evaluation with implementation={implementation!r} is not one the model runs; "
            f"supported: {SUPPORTED_IMPLEMENTATIONS}"
        )
    return _predict(model, batch, implementation, mesh, ring)  # the model checks ring (a bool) by name


def sequence_mesh(implementation: str):
    """The mesh a long evaluation splits its sequences' queries over: every local device, when
    there are several and the evaluation goes blockwise; else None (one device)."""
    if implementation != "blockwise" or jax.local_device_count() < 2:
        return None
    return Mesh(np.asarray(jax.local_devices()), ("sequence",))


def evaluate(model, cell: Cell, preset: Preset, seed: int, length: int) -> dict:
    """The task's metric at ``length`` over the test examples: ``{"value": ...}``, and for text
    also ``"buckets"``, bits per character by position range (:func:`position_buckets`)."""
    implementation = preset.implementation_at(cell.eval_tokens(length))
    mesh = sequence_mesh(implementation)
    if not cell.lengths.text:
        scores = []
        for batch in eval_batches(cell, seed, length):
            outputs = predict(
                model, {k: jnp.asarray(v) for k, v in batch.items()}, implementation=implementation, mesh=mesh
            )
            scores.append(cell.task.score(np.asarray(outputs[cell.task.scored_on]), batch))
        return {"value": float(np.concatenate(scores).mean())}
    nats = np.zeros(length)  # summed over windows, per position
    windows = 0
    for batch in eval_batches(cell, seed, length):
        outputs = predict(
            model, {k: jnp.asarray(v) for k, v in batch.items()}, implementation=implementation, mesh=mesh
        )
        nats -= np.asarray(outputs["target_log_probs"], np.float64).sum(0)
        windows += len(batch["inputs"])
    bits = nats / np.log(2.0) / windows
    buckets = {
        label: float(bits[first:end].mean()) for label, first, end in position_buckets(cell.lengths.train, length)
    }
    return {"value": float(bits.mean()), "buckets": buckets}


@functools.cache
def _finetune_transform(preset: Preset):
    """The fine-tuning optimiser: one object per preset, so every seed's and variant's fine-tuning
    step compiles once."""
    return warmup_cosine_adamw(
        learning_rate=preset.finetune_learning_rate,
        total_steps=preset.finetune_steps,
        warmup_steps=preset.finetune_steps // 10,
        weight_decay=preset.weight_decay,
    )


def finetuned(model: Transformer, cell: Cell, preset: Preset, variant, seed: int) -> Transformer:
    """A copy of the trained ``model`` with ``variant``'s encoding sized for ``finetune_multiple``
    times the training context, fine-tuned there for ``preset.finetune_steps`` steps (the
    protocol of Chen et al. 2023 and Peng et al. 2023; the model itself is unchanged). Each
    step's windows depend only on (seed, step), and the optimiser starts afresh."""
    tokens = cell.train_tokens * preset.finetune_multiple
    graphdef, state = nnx.split(model)
    tuned = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    if variant.encoding != variant.trained:
        config = variant.config(
            train_tokens=cell.train_tokens, eval_tokens=tokens, head_dim=preset.model_dim // preset.num_heads
        )
        tuned = with_encoding(tuned, config)
    optimizer = make_optimizer(tuned, _finetune_transform(preset))
    windows = finetune_batch(preset, cell.train_tokens)
    for step in range(preset.finetune_steps):
        batch = cell.task.batch(np.random.default_rng([seed, 3_000_017, step]), [tokens] * windows)
        train_step(tuned, optimizer, {k: jnp.asarray(v) for k, v in batch.items()})
    return tuned


def check_score(model, cell: Cell, batch: dict, criterion: Criterion) -> float:
    """The task's metric on the held-out check examples; for a criterion with a ``reference``
    (text), the metric less the reference's on the same characters (bits per character below the
    n-gram model's where negative)."""
    outputs = predict(model, {k: jnp.asarray(v) for k, v in batch.items() if k != "starts"})
    score = float(cell.task.score(np.asarray(outputs[cell.task.scored_on]), batch).mean())
    if criterion.reference is None:
        return score
    length = batch["targets"].shape[1]
    return score - float(np.mean([criterion.reference[s + 1 : s + length + 1].mean() for s in batch["starts"]]))


@dataclasses.dataclass(frozen=True)
class Criterion:
    """What "learned" means for one task: a score of at least ``threshold`` (``higher_is_better``)
    or below it, at the longest training length.

    For text, ``reference`` holds the best n-gram model's bits for every character of the
    validation split, and the score checked is the model's bits per character less the
    n-gram's on the same characters, below ``threshold`` = 0: the same test the gate applies
    to the test characters, free of the sampling noise of comparing different characters."""

    threshold: float
    higher_is_better: bool
    reference: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def met(self, score: float) -> bool:
        return score >= self.threshold if self.higher_is_better else score < self.threshold


def held(checks: list, criterion: Criterion) -> int | None:
    """The first step at which ``criterion`` held at two checks in a row, from ``[[step, score], ...]``; or None."""
    for (_, first), (step, second) in zip(checks, checks[1:], strict=False):
        if criterion.met(first) and criterion.met(second):
            return step
    return None


@jax.jit
def _stack(trees):
    """The states in ``trees`` stacked along a new leading axis (one compilation per structure)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


@jax.jit
def _slice(tree, i):
    """Entry ``i`` (traced, so one compilation serves every seed) of each stacked leaf."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _one_step(graphdef, state, batch):
    """One optimisation step of one seed: its new state and the loss before the update."""
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: cross_entropy_loss(m, batch))(model)
    # optax mixes Python floats with int32 step counts, which strict dtype promotion refuses.
    with jax.numpy_dtype_promotion("standard"):
        optimizer.update(model, grads)
    return nnx.split((model, optimizer))[1], loss


def _keep_frozen(new, state, frozen):
    """``new``, except the seeds where ``frozen`` (``[S]`` bool), which keep ``state``."""

    def keep(updated, old):
        mask = frozen.reshape(frozen.shape + (1,) * (updated.ndim - 1))
        return jax.lax.select(jnp.broadcast_to(mask, updated.shape), old, updated)

    return jax.tree.map(keep, new, state)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _train_step(graphdef, state, batch, batched: bool, frozen):
    """One optimisation step of every seed: ``state`` and ``batch`` carry a leading seed axis.
    ``batched``: the seeds as one batched computation (``jax.vmap``), else one after another
    inside the same program (``jax.lax.map``). Seeds where ``frozen`` (a ``[S]`` bool array)
    keep their state: a seed that has learned its task stops there while the others train on."""
    one = functools.partial(_one_step, graphdef)
    if batched:
        new, losses = jax.vmap(one)(state, batch)
    else:
        new, losses = jax.lax.map(lambda pair: one(*pair), (state, batch))
    return _keep_frozen(new, state, frozen), losses


def _shard_batch(batch: dict, mesh) -> dict:
    """A batch made inside the program, split along its examples over a data-parallel mesh (as
    :func:`_place` places a host batch); the shared positions replicated."""
    if mesh is None:
        return batch
    spec = lambda x: NamedSharding(mesh, PartitionSpec("data") if x.ndim >= 2 else PartitionSpec())
    return {name: jax.lax.with_sharding_constraint(x, spec(x)) for name, x in batch.items()}


@functools.partial(jax.jit, static_argnums=(0, 3, 6, 7, 9))
def _train_steps(graphdef, state, data, make_batch, keys, first_step, steps: int, batched: bool, frozen, mesh):
    """``steps`` optimisation steps of every seed in one program (a ``lax.scan`` over steps), each
    seed's batch of step k made here by ``make_batch(data, key)`` from its key (``keys``, ``[S]``)
    folded with k. Returns the new state and the losses, ``[steps, S]``. ``batched`` and
    ``frozen`` as for :func:`_train_step`."""

    def one(state, key, step):
        batch = _shard_batch(make_batch(data, step_key(key, step)), mesh)
        return _one_step(graphdef, state, batch)

    def step(state, k):
        at = first_step + k
        if batched:
            new, losses = jax.vmap(one, in_axes=(0, 0, None))(state, keys, at)
        else:
            new, losses = jax.lax.map(lambda pair: one(*pair, at), (state, keys))
        return _keep_frozen(new, state, frozen), losses

    return jax.lax.scan(step, state, jnp.arange(steps, dtype=jnp.int32))


def default_batched() -> bool:
    """Whether seeds train vmapped by default: yes on a GPU or TPU; on a CPU they run one after
    another inside the one compiled program (measured faster there, see benchmarks/seed_vmap.py)."""
    return jax.default_backend() != "cpu"


def _place(batch: dict, mesh) -> dict:
    """Seed-stacked arrays on the device(s): ``[S, B, ...]`` split along B over a data-parallel mesh,
    the shared positions ``[S, T]`` replicated."""
    if mesh is None:
        return {name: jnp.asarray(x) for name, x in batch.items()}
    return {
        name: jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "data") if x.ndim >= 3 else PartitionSpec()))
        for name, x in batch.items()
    }


class SeedGroup:
    """The models and optimisers of several seeds, stacked along a leading axis and trained by one
    vmapped step.

    Args:
      models, optimizers: one per seed, built the same way (same graph, other values).
      mesh: a data-parallel mesh to split each batch over, or None.
      batched: vmap the seeds (one batched computation) or map over them inside the one
        program (``jax.lax.map``); default: vmap on accelerators, map on a CPU (see
        :func:`default_batched`).

    Example:
      >>> import optax
      >>> models = [Transformer(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=32,
      ...                       rngs=nnx.Rngs(s)) for s in (0, 1)]
      >>> group = SeedGroup(models, [make_optimizer(m, optax.adam(1e-3)) for m in models])
      >>> batch = {"inputs": np.zeros((2, 4, 5), np.int32), "targets": np.ones((2, 4, 5), np.int32),
      ...          "positions": np.tile(np.arange(5, dtype=np.int32), (2, 1))}
      >>> with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes Python floats and int32
      ...     losses = group.step(batch)
      >>> losses.shape  # one loss per seed
      (2,)
    """

    def __init__(self, models, optimizers, *, mesh=None, batched: bool | None = None):
        self.size = len(models)
        self.batched = default_batched() if batched is None else batched
        self.graphdef, _ = nnx.split((models[0], optimizers[0]))
        self.state = _stack([nnx.split((m, o))[1] for m, o in zip(models, optimizers, strict=True)])
        self.mesh = mesh
        if mesh is not None:
            self.state = jax.device_put(self.state, NamedSharding(mesh, PartitionSpec()))

    @reraise_check_errors()
    def step(self, batch: dict, frozen=None) -> jax.Array:
        """One step of every seed on ``batch`` (arrays with a leading seed axis); returns the losses.
        Seeds marked in ``frozen`` (a sequence of bools, one per seed) keep their state."""
        frozen = jnp.zeros(self.size, bool) if frozen is None else jnp.asarray(frozen, bool)
        self.state, losses = _train_step(self.graphdef, self.state, _place(batch, self.mesh), self.batched, frozen)
        return losses

    def replicate(self, tree):
        """``tree``'s arrays on the device(s), whole on each device of the mesh."""
        if self.mesh is None:
            return jax.device_put(tree)
        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))

    @reraise_check_errors()
    def train(self, make_batch: DeviceBatches, data, keys, first_step: int, steps: int, frozen=None) -> jax.Array:
        """Steps ``first_step`` to ``first_step + steps`` of every seed in one dispatch, each batch
        made on the device: ``make_batch(data, key)`` with the seed's key (``keys``, one per seed,
        :func:`~posenc_jax.bench.device_batches.seed_key`) folded with the step. Returns the losses,
        ``[steps, S]``. Seeds marked in ``frozen`` keep their state throughout."""
        frozen = jnp.zeros(self.size, bool) if frozen is None else jnp.asarray(frozen, bool)
        self.state, losses = _train_steps(
            self.graphdef,
            self.state,
            data,
            make_batch,
            keys,
            jnp.int32(first_step),
            steps,
            self.batched,
            frozen,
            self.mesh,
        )
        return losses

    def seed(self, i: int):
        """``(model, optimizer)`` of the i-th seed, as separate objects holding its current state."""
        return nnx.merge(self.graphdef, _slice(self.state, i))


@functools.cache
def optimizer_transform(preset: Preset):
    """The preset's AdamW with warm-up and cosine decay: one object per preset, so that optimisers
    built from it share their (static) graph and a jitted step compiles once for all seeds."""
    return warmup_cosine_adamw(
        learning_rate=preset.learning_rate,
        total_steps=preset.steps,
        warmup_steps=max(0, int(preset.warmup_fraction * preset.steps)),
        weight_decay=preset.weight_decay,
    )


def build(cell: Cell, preset: Preset, configs, seed: int):
    """``(model, optimizer)`` of one seed of ``cell``, freshly initialised."""
    model = build_model(cell.task, preset, configs, seed, cell.normalizer)
    return model, make_optimizer(model, optimizer_transform(preset))


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


def _checks_path(out: pathlib.Path, settings: str, cell: Cell, seed: int) -> pathlib.Path:
    """Where one seed keeps its held-out checks, ``[[step, score], ...]``, beside its checkpoints."""
    return checkpoint_dir(out, settings, cell.task_name, cell.label, seed).with_suffix(".checks.json")


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
    preset: Preset,
    seeds: list[int],
    todo: dict,
    *,
    out: pathlib.Path,
    settings: str,
    write,
    criterion: Criterion,
    stamp: dict | None = None,
    mesh=None,
    bar=None,
) -> list[dict]:
    """Trains the seeds of ``cell`` together (resuming from their checkpoints) for the preset's
    budget of steps (``fixed-budget``) or to criterion (``to-criterion``), then evaluates each.

    Args:
      cell: the task, encoding and normaliser.
      preset: the settings this task trains with (``Preset.for_task``).
      seeds: the seeds to train (those with rows left to measure).
      todo: per seed, the rows left: ``(variant, length)`` pairs, ``variant`` None for the
        trained encoding or an :class:`~posenc_jax.bench.presets.EvalVariant`.
      out, settings: the output folder and the preset's fingerprint (where checkpoints go).
      write: called with each result row as soon as it is measured.
      criterion: when a seed has learned the task (checked on held-out examples every
        ``preset.check_every`` steps; the first step at which it held at two checks in a row is
        each row's ``criterion_step``). Under ``to-criterion`` a seed stops there, and the cell
        when every seed has, or at ``preset.steps``; under ``fixed-budget`` every seed trains
        ``preset.steps`` steps.
      stamp: fields every row carries (the commit that made it).
      mesh: a data-parallel mesh, or None.
      bar: ``bar(total, initial, description)`` makes a progress bar (tqdm's interface); it is
        made after the first step, so its rate does not count compilation.

    Returns:
      One timing record per group of seeds trained together: normally one; more only when a
      kill left seeds at steps they do not share.
    """
    head_dim = preset.model_dim // preset.num_heads
    configs = encodings_for(cell.encoding, head_dim, cell.train_tokens, cell.max_tokens)
    built = {seed: build(cell, preset, configs, seed) for seed in seeds}
    models = {seed: m for seed, (m, _) in built.items()}
    optimizers = {seed: o for seed, (_, o) in built.items()}
    # Two steps kept, so a damaged newest one falls back to the one before (same results: the
    # data of step k depends only on (seed, k)). Each records what it is a checkpoint of.
    with contextlib.ExitStack() as stack:
        checkpointers = {
            seed: stack.enter_context(
                contextlib.closing(
                    Checkpointer(
                        checkpoint_dir(out, settings, cell.task_name, cell.label, seed),
                        max_to_keep=2,
                        process_local=jax.process_count() > 1,  # each host of a several-host run its own
                    )
                )
            )
            for seed in seeds
        }
        recorded = {
            seed: {
                "settings": settings,
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
            built = {seed: build(cell, preset, configs, seed) for seed in seeds}
            models = {seed: m for seed, (m, _) in built.items()}
            optimizers = {seed: o for seed, (_, o) in built.items()}
            start = dict.fromkeys(seeds, 0)
        checks = {seed: _read_checks(_checks_path(out, settings, cell, seed), start[seed]) for seed in seeds}
        groups = {}
        for seed in seeds:
            groups.setdefault(start[seed], []).append(seed)
        records = []
        for first_step, group in sorted(groups.items()):
            cpu_began = time.process_time()  # this process's CPU time, every thread's
            record = _train_group(
                cell,
                preset,
                group,
                first_step,
                models,
                optimizers,
                checkpointers,
                recorded,
                checks=checks,
                criterion=criterion,
                save_checks=lambda seed: _write_checks(_checks_path(out, settings, cell, seed), checks[seed]),
                mesh=mesh,
                bar=bar,
            )
            began = time.perf_counter()
            for seed in group:
                training = {
                    "steps": record["steps"][seed],
                    "criterion_step": held(checks[seed], criterion),
                    "check_score": checks[seed][-1][1] if checks[seed] else None,
                    "protocol": preset.protocol,
                }
                tuned = {}  # fine-tuned models, one per variant, made when first needed
                for variant, length in todo[seed]:
                    model = models[seed]
                    label = cell.label
                    if variant is not None and variant.protocol == "finetune":
                        if variant not in tuned:
                            tuned[variant] = finetuned(model, cell, preset, variant, seed)
                        model = tuned[variant]
                        label = variant.label
                    elif variant is not None:
                        tokens = cell.task.max_tokens(length)
                        config = variant.config(train_tokens=cell.train_tokens, eval_tokens=tokens, head_dim=head_dim)
                        model = with_encoding(model, config)
                        label = variant.label
                    measured = evaluate(model, cell, preset, seed, length)
                    write({**_row(cell, preset, label, seed, length, measured), **training, **(stamp or {})})
            record["eval_seconds"] = time.perf_counter() - began
            # Beside the wall seconds, the CPU seconds this process used for the group: a cell that ran
            # beside other work on a shared machine used fewer cores per second of its wall time.
            record["cpu_seconds"] = time.process_time() - cpu_began
            records.append(record)
        return records


def _row(cell: Cell, preset: Preset, label: str, seed: int, length: int, measured: dict) -> dict:
    return {
        "task": cell.task_name,
        "encoding": label,
        "seed": seed,
        "length": int(length),
        "metric": cell.task.metric,
        **measured,
        "train_length": int(cell.lengths.train),
        "in_distribution": bool(length <= cell.lengths.train),
        "preset": preset.name,
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

    def __init__(self, cell, preset, seeds: list[int], step: int, loss: float):
        self.seeds, self.step, self.loss = list(seeds), step, loss
        super().__init__(
            f"training diverged: {cell.task_name} / {cell.label}, seed{'s' if len(seeds) > 1 else ''} "
            f"{','.join(map(str, seeds))}: the loss is {loss} at step {step} of {preset.steps} (learning rate "
            f"{preset.learning_rate}); no rows were written for this cell. Lower --learning-rate, or leave this "
            "encoding out with --encodings; the rows of earlier cells are kept and the same command resumes"
        )


def _train_group(
    cell,
    preset,
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
    most to ``preset.steps``; afterwards ``models[seed]`` and ``optimizers[seed]`` hold each
    seed's trained state and ``checks[seed]`` its checks. So a seed's result depends on its own
    seed alone, not on which seeds it trained beside.

    Under the ``fixed-budget`` protocol (``preset.protocol``) no seed stops: every seed trains
    exactly ``preset.steps`` steps, and the checks only record when each met the criterion
    (its steps to criterion, a measurement).

    With ``preset.batches == "device"`` each call runs ``preset.steps_per_dispatch`` steps, their
    batches made on the device (:meth:`SeedGroup.train`); :func:`fit` then counts dispatches,
    and the checks, checkpoints and steps it reports are converted back to steps."""
    stops = preset.protocol == "to-criterion"
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
    if first_step >= preset.steps or (stops and all(held(checks[seed], criterion) is not None for seed in group)):
        return record
    per_dispatch = preset.steps_per_dispatch
    if first_step % per_dispatch:
        raise ValueError(
            f"{cell.task_name} / {cell.label}: resuming at step {first_step}, which is not a multiple of "
            f"steps_per_dispatch={per_dispatch}; checkpoints of these settings are saved between dispatches"
        )
    seeds = SeedGroup([models[s] for s in group], [optimizers[s] for s in group], mesh=mesh)
    on_device = preset.batches == "device"
    if on_device:
        make_batch = DeviceBatches(cell.task, cell.lengths, preset.batch_size)
        data, keys = seeds.replicate((make_batch.data, jnp.stack([seed_key(s) for s in group])))
    held_out = {seed: check_batch(cell, preset, seed) for seed in group}
    pending = []  # the losses of the steps since the last look at them (left on the device until then)
    looked = first_step  # the steps whose losses were looked at
    progress = None
    paused = 0.0  # checks and checkpoint writes, kept out of the training time
    began = time.perf_counter()

    def batches():
        """What each call of ``step_fn`` trains on: the seeds' stacked host batches of one step,
        or (device batches) the first step of a dispatch."""
        if on_device:
            yield from itertools.count(first_step, per_dispatch)
            return
        for step in itertools.count(first_step):
            per_seed = [train_batch(cell.task, preset, seed, step, cell.lengths) for seed in group]
            yield {name: np.stack([b[name] for b in per_seed]) for name in per_seed[0]}

    def learned(seed) -> bool:
        return held(checks[seed], criterion) is not None

    frozen = [stops and learned(seed) for seed in group]

    def step_fn(group_, _, batch):
        nonlocal began, progress
        if on_device:
            losses = group_.train(make_batch, data, keys, batch, per_dispatch, frozen)  # [steps, seeds]
        else:
            losses = group_.step(batch, frozen)
        pending.append(losses)
        if progress is None and record["compile_seconds"] == 0.0:  # the first call: its time is compilation
            jax.block_until_ready(losses)
            record["compile_seconds"] = time.perf_counter() - began
            began = time.perf_counter()
            if bar is not None:
                progress = bar(
                    preset.steps, first_step + per_dispatch, f"{cell.task_name} / {cell.label} / seeds {seed_list}"
                )
        elif progress is not None:
            progress.update(per_dispatch)
        return losses

    def finite() -> None:
        """Stops the cell at a non-finite loss (before it is checked or saved), naming the step."""
        nonlocal looked
        for loss in pending:
            for values in np.asarray(loss).reshape(-1, len(group)):  # one row of the seeds' losses a step
                bad = np.flatnonzero(~np.isfinite(values))
                if bad.size:
                    if progress is not None:
                        progress.close()
                    raise DivergedError(cell, preset, [group[i] for i in bad], looked + 1, float(values[bad[0]]))
                looked += 1
        pending.clear()

    def check(step) -> bool:
        nonlocal paused
        jax.block_until_ready(seeds.state)  # the steps queued so far count as training
        finite()
        started = time.perf_counter()
        for i, seed in enumerate(group):
            if frozen[i]:
                continue  # stopped at its criterion: its state, and so its score, no longer change
            model, _ = seeds.seed(i)
            checks[seed].append([step, check_score(model, cell, held_out[seed], criterion)])
            frozen[i] = stops and learned(seed)
        paused += time.perf_counter() - started
        if progress is not None:
            progress.set_postfix(check=" ".join(f"{checks[seed][-1][1]:.3f}" for seed in group))
        return all(frozen)

    def save(step) -> None:
        nonlocal paused
        jax.block_until_ready(seeds.state)
        finite()  # a diverged state is never saved, so a re-run resumes from finite weights
        started = time.perf_counter()
        for i, seed in enumerate(group):
            # The checks first: a kill between the two leaves checks a step ahead of the newest
            # checkpoint, which reading them up to the restored step drops.
            save_checks(seed)
            model, optimizer = seeds.seed(i)
            checkpointers[seed].save(step, model, optimizer, config=recorded[seed])
        paused += time.perf_counter() - started

    seed_list = ",".join(map(str, group))
    # fit counts calls of step_fn: dispatches of per_dispatch steps (one step with host batches).
    losses = fit(
        seeds,
        None,
        batches(),
        steps=preset.steps // per_dispatch,
        start_step=first_step // per_dispatch,
        log=None,
        step_fn=step_fn,
        save=lambda dispatch: save(dispatch * per_dispatch),
        checkpoint_every=preset.checkpoint_every // per_dispatch,
        check_every=preset.check_every // per_dispatch,
        check=lambda dispatch: check(dispatch * per_dispatch),
    )
    jax.block_until_ready(seeds.state)
    finite()
    record["train_seconds"] = time.perf_counter() - began - paused
    record["checkpoint_seconds"] = paused
    record["final_loss"] = [float(x) for x in np.asarray(losses[-1]).reshape(-1, len(group))[-1]]
    record["steps"] = {
        seed: (held(checks[seed], criterion) if stops else None) or first_step + len(losses) * per_dispatch
        for seed in group
    }
    if progress is not None:
        progress.close()
    for i, seed in enumerate(group):
        models[seed], optimizers[seed] = seeds.seed(i)
    return record
