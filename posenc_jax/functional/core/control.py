"""A conditional that stays one under ``jax.vmap``.

``vmap`` turns a ``lax.cond`` with a batched predicate into a ``select`` that computes both
branches for every example. :func:`cond_over_batch` reduces a batched predicate instead, so
the rare branch (a value out of range) costs nothing when it is not taken: the in-``jit``
range checks of :mod:`~posenc_jax.functional.core.validation` use it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["cond_over_batch"]


def cond_over_batch(pred: jax.Array, true_fn: Callable, false_fn: Callable, *operands):
    """``lax.cond(pred, true_fn, false_fn, *operands)`` that stays a conditional under ``jax.vmap``.

    ``vmap`` turns a ``cond`` whose predicate is batched into a ``select`` that computes both
    branches for every example. Here a batched predicate is reduced first: the whole batch
    takes ``true_fn`` when the predicate holds for every example, and otherwise ``false_fn``
    (both vmapped), still as one conditional. So ``false_fn`` must give ``true_fn``'s result
    wherever ``pred`` holds. Nested ``vmap`` reduces over every batch axis in turn. It has no
    reverse-mode derivative (``jax.custom_batching.custom_vmap``): use it for terms that are not
    differentiated (under ``stop_gradient``).

    Args:
      pred: boolean scalar.
      true_fn, false_fn: functions of ``*operands`` returning the same pytree of arrays.
      operands: pytrees of arrays.

    Returns:
      the branch's result.
    """

    @jax.custom_batching.custom_vmap
    def run(pred, operands):
        return jax.lax.cond(pred, true_fn, false_fn, *operands)

    @run.def_vmap
    def batched(axis_size, in_batched, pred, operands):
        pred_batched, operands_batched = in_batched
        pred = pred.all() if pred_batched else pred
        if not any(jax.tree.leaves(operands_batched)):
            out = cond_over_batch(pred, true_fn, false_fn, *operands)
            out = jax.tree.map(lambda x: jnp.broadcast_to(x, (axis_size, *x.shape)), out)
        else:
            axes = jax.tree.map(lambda b: 0 if b else None, operands_batched)
            out = cond_over_batch(pred, jax.vmap(true_fn, in_axes=axes), jax.vmap(false_fn, in_axes=axes), *operands)
        return out, jax.tree.map(lambda _: True, out)

    return run(pred, operands)
