"""Training pieces shared by the benchmarks and Colabs: optimizer, loss, a jitted
data-parallel train step.

Data parallelism uses ``jax.sharding``: a one-axis ``Mesh`` named ``"data"`` over
the local devices, the model and optimizer state replicated, each batch split
along its first axis (``NamedSharding(mesh, P("data"))``). XLA inserts the
gradient all-reduce, so the same step runs on one CPU, 8 TPU cores or several
GPUs, and gives the same loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "cross_entropy_loss",
    "data_parallel_mesh",
    "make_optimizer",
    "replicate",
    "shard_batch",
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


@nnx.jit
def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: dict) -> jax.Array:
    """One jitted optimisation step on ``batch``; returns the loss before the update."""
    loss, grads = nnx.value_and_grad(lambda m: cross_entropy_loss(m, batch))(model)
    optimizer.update(model, grads)
    return loss


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
