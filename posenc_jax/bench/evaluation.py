"""What a cell measures: its test batches and scores, the held-out checks of training, fine-tuning.

:func:`evaluate` scores a trained model at one evaluation length (for text also by position
range, :func:`position_buckets`); :func:`check_batch` and :func:`check_score` are the held-out
checks training records its criterion from (:class:`Criterion`, :func:`held`); :func:`finetuned`
is the short fine-tune of RoPE's scaled variants; :func:`measure_seed` writes a trained seed's rows.
Each takes a :class:`~posenc_jax.bench.cell.Cell` (``cell``): its task, its resolved settings and its
lengths.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from posenc_jax.bench.settings import TaskSettings
from posenc_jax.functional.core.validation import reraise_check_errors
from posenc_jax.nn import Transformer, with_encoding
from posenc_jax.training import make_optimizer, train_step, warmup_cosine_adamw

__all__ = [
    "SUPPORTED_IMPLEMENTATIONS",
    "Criterion",
    "check_batch",
    "check_score",
    "eval_batches",
    "evaluate",
    "finetuned",
    "held",
    "measure_seed",
    "position_buckets",
    "predict",
    "sequence_mesh",
]

# The attention implementations evaluation runs (the model's `implementation=`).
SUPPORTED_IMPLEMENTATIONS = ("materialize", "blockwise", "auto")


def eval_batches(cell, seed: int, length: int):
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


def check_batch(cell, seed: int) -> dict:
    """The held-out examples training checks its progress on: ``check_examples`` of them at
    the longest training length (text: windows of the training context from the validation
    split), drawn apart from the test examples."""
    rng = np.random.default_rng([seed, 2_000_003])
    length = cell.lengths.train
    if cell.lengths.text:
        starts = rng.integers(0, len(cell.task.validation) - length - 1, cell.settings.check_examples)
        return {**cell.task.windows_at("validation", starts, length), "starts": starts}
    return cell.task.batch(rng, [length] * cell.settings.check_examples, split="test", pad_to=cell.eval_tokens(length))


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


def evaluate(model, cell, seed: int, length: int) -> dict:
    """The task's metric at ``length`` over the test examples: ``{"value": ...}``, and for text
    also ``"buckets"``, bits per character by position range (:func:`position_buckets`)."""
    implementation = cell.settings.implementation_at(cell.eval_tokens(length))
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


def measure_seed(cell, seed: int, model, todo: list, write, fields: dict) -> None:
    """Measures one trained seed's rows left (``todo``: ``(variant, length)`` pairs) and writes each, with
    ``fields`` (its training record and stamp): the trained encoding, each evaluation-only variant (the
    model with the variant's encoding), each fine-tuned one (fine-tuned once, when first needed)."""
    tuned = {}
    for variant, length in todo:
        evaluated, label = model, cell.label
        if variant is not None and variant.protocol == "finetune":
            if variant not in tuned:
                tuned[variant] = finetuned(model, cell, variant, seed)
            evaluated, label = tuned[variant], variant.label
        elif variant is not None:
            tokens = cell.task.max_tokens(length)
            config = variant.config(train_tokens=cell.train_tokens, eval_tokens=tokens, head_dim=cell.settings.head_dim)
            evaluated, label = with_encoding(model, config), variant.label
        measured = evaluate(evaluated, cell, seed, length)
        write({**_row(cell, label, seed, length, measured), **fields})


def _row(cell, label: str, seed: int, length: int, measured: dict) -> dict:
    return {
        "task": cell.task_name,
        "encoding": label,
        "seed": seed,
        "length": int(length),
        "metric": cell.task.metric,
        **measured,
        "train_length": int(cell.lengths.train),
        "in_distribution": bool(length <= cell.lengths.train),
        "preset": cell.settings.preset,
    }


@functools.cache
def _finetune_transform(settings: TaskSettings):
    """The fine-tuning optimiser: one object per task's settings, so every seed's and variant's
    fine-tuning step compiles once."""
    return warmup_cosine_adamw(
        learning_rate=settings.finetune_learning_rate,
        total_steps=settings.finetune_steps,
        warmup_steps=settings.finetune_steps // 10,
        weight_decay=settings.weight_decay,
    )


def finetuned(model: Transformer, cell, variant, seed: int) -> Transformer:
    """A copy of the trained ``model`` with ``variant``'s encoding sized for ``finetune_multiple``
    times the training context, fine-tuned there for ``finetune_steps`` steps (the
    protocol of Chen et al. 2023 and Peng et al. 2023; the model itself is unchanged). Each
    step's windows depend only on (seed, step), and the optimiser starts afresh."""
    settings = cell.settings
    tokens = cell.train_tokens * settings.finetune_multiple
    graphdef, state = nnx.split(model)
    tuned = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    if variant.encoding != variant.trained:
        config = variant.config(train_tokens=cell.train_tokens, eval_tokens=tokens, head_dim=settings.head_dim)
        tuned = with_encoding(tuned, config)
    optimizer = make_optimizer(tuned, _finetune_transform(settings))
    windows = settings.finetune_batch
    for step in range(settings.finetune_steps):
        batch = cell.task.batch(np.random.default_rng([seed, 3_000_017, step]), [tokens] * windows)
        train_step(tuned, optimizer, {k: jnp.asarray(v) for k, v in batch.items()})
    return tuned


def check_score(model, cell, batch: dict, criterion: Criterion) -> float:
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
