"""The seeds of a cell, trained together: stacked along a leading axis, one compiled step for all.

:class:`SeedGroup` stacks the models and optimiser states of a cell's seeds and updates them all
with one jitted step (``jax.vmap`` over the seeds on an accelerator, ``jax.lax.map`` on a CPU), or
runs several steps in one dispatch with batches made on the device (:meth:`SeedGroup.train`, a
``lax.scan`` over steps). The plain reference is :func:`posenc_jax.training.train_step`, one seed
at a time; ``tests/test_bench.py`` checks that the two agree to float32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from posenc_jax.bench.device_batches import DeviceBatches, step_key
from posenc_jax.functional.core.validation import reraise_check_errors
from posenc_jax.training import cross_entropy_loss

__all__ = ["SeedGroup", "default_batched"]


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
      >>> import numpy as np
      >>> import optax
      >>> from posenc_jax.nn import Transformer
      >>> from posenc_jax.training import make_optimizer
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
