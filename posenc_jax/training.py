"""Training pieces shared by the benchmarks and Colabs: optimizer, loss, a jitted
data-parallel train step.

Data parallelism uses ``jax.sharding``: a one-axis ``Mesh`` named ``"data"`` over
the local devices, the model and optimizer state replicated, each batch split
along its first axis (``NamedSharding(mesh, P("data"))``). XLA inserts the
gradient all-reduce, so the same step runs on one CPU, 8 TPU cores or several
GPUs, and gives the same loss.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from posenc_jax.functional.core.validation import reraise_check_errors

__all__ = [
    "cross_entropy_loss",
    "data_parallel_mesh",
    "fit",
    "make_optimizer",
    "replicate",
    "shard_batch",
    "TrainingDiverged",
    "train_step",
    "warmup_cosine_adamw",
]


def warmup_cosine_adamw(
    *,
    learning_rate: float,
    total_steps: int,
    warmup_steps: int,
    weight_decay: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.98,
    clip_norm: float | None = 1.0,
) -> optax.GradientTransformation:
    """AdamW with linear warmup to ``learning_rate`` and cosine decay to 0 at ``total_steps``.

    The rate rises linearly from ``learning_rate / warmup_steps`` at the first step (a warmup
    from 0 would make that step a no-op) to ``learning_rate`` at step ``warmup_steps``, then
    follows a cosine down to 0 at ``total_steps``.

    Example:
      >>> tx = warmup_cosine_adamw(learning_rate=1e-3, total_steps=100, warmup_steps=10)
    """
    if total_steps < 1 or not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"need total_steps >= 1 and 0 <= warmup_steps < total_steps, got {total_steps} and {warmup_steps}"
        )
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=learning_rate / max(warmup_steps, 1),
        peak_value=learning_rate,
        warmup_steps=warmup_steps,
        decay_steps=total_steps,
        end_value=0.0,
    )
    adamw = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay)
    return adamw if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), adamw)


def make_optimizer(model: nnx.Module, tx: optax.GradientTransformation) -> nnx.Optimizer:
    """An ``nnx.Optimizer`` over the model's ``nnx.Param`` variables."""
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def cross_entropy_loss(model: nnx.Module, batch: dict, *, deterministic: bool = False) -> jax.Array:
    """Mean next-token (or per-token) cross-entropy over ``batch["weights"]``.

    ``batch``: ``inputs`` ``[B, T]`` int, ``targets`` ``[B, T]`` int, ``positions``
    ``[T]`` or ``[B, T]``, optional ``weights`` ``[B, T]`` (1 where a target counts),
    ``segment_ids`` and ``key_mask``.
    """
    logits = model(
        batch["inputs"],
        batch["positions"],
        segment_ids=batch.get("segment_ids"),
        key_mask=batch.get("key_mask"),
        deterministic=deterministic,
    )
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
    weights = batch.get("weights")
    weights = jnp.ones_like(nll) if weights is None else weights.astype(jnp.float32)
    return (nll * weights).sum() / jnp.maximum(weights.sum(), 1.0)


@reraise_check_errors()  # a check failing inside the step raises its own error, not JAX's
@nnx.jit
def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: dict) -> jax.Array:
    """One jitted optimisation step on ``batch``; returns the loss before the update.

    ``batch`` is a dict of arrays:

    ==================  ==============  =====================================================
    key                 shape, dtype    meaning
    ==================  ==============  =====================================================
    ``inputs``          ``[B, T]`` int  tokens fed to the model
    ``targets``         ``[B, T]`` int  the token to predict at each position (for a
                                        language model, ``inputs`` shifted by one)
    ``positions``       ``[T]`` or      each token's position (explicit, so offsets, packing
                        ``[B, T]`` int  and randomized positions need nothing else)
    ``weights``         ``[B, T]``      optional: 1 where the target counts in the loss, 0
                                        where not (padding, the prompt part); default all 1
    ``segment_ids``     ``[B, T]`` int  optional: packed sequences (a token attends only to
                                        its own segment)
    ``key_mask``        ``[B, T]`` bool optional: True for real tokens, False for padding
    ==================  ==============  =====================================================

    The loss is :func:`cross_entropy_loss`, the mean over the weighted targets. The step
    compiles once per batch shape.
    """
    loss, grads = nnx.value_and_grad(lambda m: cross_entropy_loss(m, batch))(model)
    # optax mixes Python floats with int32 step counts, which strict dtype promotion refuses.
    with jax.numpy_dtype_promotion("standard"):
        optimizer.update(model, grads)
    return loss


class TrainingDiverged(ValueError):
    """The training loss is NaN or infinite: :func:`fit` stops at the step it reads it (a log line or a
    checkpoint), before logging or saving the diverged state."""


def _check_loss(loss, step: int, steps: int, saved: int | None) -> None:
    """Raises :class:`TrainingDiverged` naming the step when ``loss`` (a float or an array) is not finite."""
    values = np.asarray(loss, dtype=np.float64)
    if np.all(np.isfinite(values)):
        return
    resume = (
        f"the last checkpoint is step {saved}: restore it with Checkpointer.restore and fit again from there"
        if saved is not None
        else "no checkpoint was saved by this fit"
    )
    raise TrainingDiverged(
        f"training diverged: the loss is {np.asarray(loss).tolist()} at step {step} of {steps}, and this state is "
        f"not saved; lower the learning rate (or clip gradients, e.g. optax.clip_by_global_norm); {resume}"
    )


def fit(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batches: Iterable[dict],
    *,
    steps: int,
    log_every: int = 100,
    checkpointer=None,
    checkpoint_every: int | None = None,
    checkpoint_config: Mapping | None = None,
    start_step: int = 0,
    progress: bool = False,
    log: Callable[[str], None] | None = print,
    step_fn: Callable | None = None,
    save: Callable[[int], None] | None = None,
    check_every: int | None = None,
    check: Callable[[int], bool] | None = None,
) -> list:
    """Trains ``model`` with :func:`train_step` on batches from an iterable, up to step ``steps``,
    or until ``check`` says to stop.

    Args:
      model, optimizer: as for :func:`train_step` (``make_optimizer(model, tx)``).
      batches: an iterable of batch dicts in :func:`train_step`'s format; it must last
        ``steps - start_step`` batches (fewer is an error that says how many it gave).
      steps: the step to train up to.
      log_every: log ``step N/steps  loss L  (S steps/s)`` every this many steps (and at
        the end) through ``log``; None or 0 for no log lines.
      checkpointer: a :class:`posenc_jax.checkpoint.Checkpointer`; the model and optimizer
        are saved every ``checkpoint_every`` steps and at the end.
      checkpoint_every: steps between checkpoints (default: only at the end).
      checkpoint_config: recorded with each checkpoint (``Checkpointer.save``'s ``config``).
      start_step: the step to count from (after ``Checkpointer.restore``, its step).
      progress: show a tqdm progress bar (needs ``tqdm``, in the ``bench`` extra).
      log: where log lines go (default ``print``).
      step_fn: ``step_fn(model, optimizer, batch) -> loss`` in place of :func:`train_step`
        (the benchmark passes one that steps several seeds together; its loss may be an array).
      save: ``save(step)`` in place of ``checkpointer.save`` (when saving means more than one
        model: the benchmark saves each seed), at the same moments.
      check_every, check: every ``check_every`` steps and at the last, ``check(step)`` is
        called after the step; when it returns True training stops there (saved first, as at
        the end): training to a criterion.

    Returns:
      The loss of every step run (floats; arrays where ``step_fn`` returns them).

    Raises:
      TrainingDiverged: the loss read for a log line, or before a save through ``checkpointer``,
        is NaN or infinite (a learning rate too high, most often); the diverged state is not
        saved, and the message names the step and the last checkpoint to resume from. (With
        ``save`` the caller checks its own saves: the benchmark does.)

    Example:
      >>> from posenc_jax.nn import Transformer
      >>> model = Transformer(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=32,
      ...                     encoding="rope", rngs=nnx.Rngs(0))
      >>> optimizer = make_optimizer(model, warmup_cosine_adamw(learning_rate=1e-2, total_steps=5, warmup_steps=1))
      >>> tokens = jnp.arange(18).reshape(2, 9) % 8
      >>> batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": jnp.arange(8)}
      >>> losses = fit(model, optimizer, [batch] * 5, steps=5, log_every=0)
      >>> len(losses), losses[-1] < losses[0]
      (5, True)
    """
    if not isinstance(steps, int) or steps < 1 or not 0 <= start_step <= steps:
        raise ValueError(
            f"need steps >= 1 and 0 <= start_step <= steps, got steps={steps!r}, start_step={start_step!r}"
        )
    if checkpoint_every is not None and (checkpointer is None and save is None or checkpoint_every < 1):
        raise ValueError(
            f"checkpoint_every={checkpoint_every!r} needs a checkpointer (or save) and a value >= 1 "
            "(steps between saves)"
        )
    if (check is None) != (check_every is None) or (check_every is not None and check_every < 1):
        raise ValueError(
            f"check and check_every go together, check_every >= 1 (steps between checks); got check={check!r}, "
            f"check_every={check_every!r}"
        )
    saved = None  # the last step fit saved through checkpointer
    checked = 0  # losses[:checked] were read and finite

    def _check_losses(step):
        nonlocal checked
        for offset, loss in enumerate(jax.device_get(losses[checked:])):  # one transfer
            _check_loss(loss, step - len(losses) + checked + offset + 1, steps, saved)
        checked = len(losses)

    if save is None and checkpointer is not None:

        def save(step):
            nonlocal saved
            # A diverged state is never saved: restore would refuse it later, far from its cause.
            _check_losses(step)
            checkpointer.save(step, model, optimizer, config=checkpoint_config)
            saved = step

    step_fn = train_step if step_fn is None else step_fn
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, initial=start_step, unit="step")
    losses: list = []
    iterator = iter(batches)
    began = time.perf_counter()
    step = start_step
    try:
        while step < steps:
            try:
                batch = next(iterator)
            except StopIteration:
                raise ValueError(
                    f"batches ran out after {step - start_step} batches; training to step {steps} from step "
                    f"{start_step} needs {steps - start_step}"
                ) from None
            loss = step_fn(model, optimizer, batch)  # left on the device: reading it waits for the step
            losses.append(loss)
            step += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(np.mean(loss)):.4f}")
            if log is not None and log_every and (step % log_every == 0 or step == steps):
                _check_losses(step)
                rate = (step - start_step) / max(time.perf_counter() - began, 1e-9)
                log(f"step {step}/{steps}  loss {np.mean(loss):.4f}  ({rate:.1f} steps/s)")
            stop = check is not None and (step % check_every == 0 or step == steps) and bool(check(step))
            if save is not None and (
                stop or step == steps or (checkpoint_every is not None and step % checkpoint_every == 0)
            ):
                save(step)
            if stop:
                break
    finally:
        if bar is not None:
            bar.close()
    return [float(x) if np.ndim(x) == 0 else np.asarray(x) for x in losses]


def data_parallel_mesh(devices=None) -> Mesh:
    """A one-axis ``("data",)`` mesh over ``devices`` (default: all local devices)."""
    devices = jax.local_devices() if devices is None else list(devices)
    return Mesh(np.asarray(devices), ("data",))


def replicate(obj: nnx.Module, mesh: Mesh):
    """Places an NNX module's (or optimizer's) whole state on every device of ``mesh``, in place."""
    state = nnx.state(obj)
    nnx.update(obj, jax.device_put(state, NamedSharding(mesh, PartitionSpec())))
    return obj


def shard_batch(batch: dict, mesh: Mesh) -> dict:
    """Splits every array whose first axis is the batch (that of ``batch["inputs"]``) over
    ``mesh``; the rest (shared positions ``[T]`` or ``[1, T]``) are replicated."""
    num_devices = mesh.devices.size
    batch_size = jnp.shape(batch["inputs"])[0] if "inputs" in batch else None

    def place(x):
        x = jnp.asarray(x)
        if x.ndim >= 1 and (x.shape[0] == batch_size if batch_size is not None else x.ndim >= 2):
            if x.shape[0] % num_devices:
                raise ValueError(
                    f"batch size {x.shape[0]} is not divisible by the {num_devices} devices of the mesh; "
                    f"use a multiple of {num_devices}"
                )
            return jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))

    return {name: place(value) for name, value in batch.items()}
