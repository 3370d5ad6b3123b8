"""Forward-mode autodiff through the library: :func:`plain_autodiff`.

A few operations carry a hand-written reverse-mode gradient (a custom VJP) because plain
autodiff's is slow on some backends: broadcasting a shared term over the batch
(:func:`~posenc_jax.functional.kernels.broadcast.broadcast_to`), the lookup of a learned relative
table, the gathers and sums by clipped distance (Shaw, DeBERTa) and Transformer-XL's shift.
JAX cannot push forward-mode tangents (``jax.jvp``, ``jax.jacfwd``, forward-over-reverse
Hessian products) through a custom VJP. Inside ``with plain_autodiff():`` those operations are
traced in their plain form instead: the same values, plain autodiff's gradients in both modes.

The setting is read when a function is traced. A function jitted and traced before the block
keeps the form it was traced with; trace it again inside (a new ``jax.jit``) to get the plain
form. Values never depend on it, only which autodiff modes work and how fast.

Example:
  >>> from posenc_jax.functional import Shaw, dot_product_attention
  >>> x, pos = jnp.ones((1, 3, 1, 2)), jnp.arange(3)
  >>> attend = lambda x: dot_product_attention(
  ...     x, x, x, query_positions=pos, key_positions=pos, encodings=[Shaw(1, jnp.ones((3, 2)))])
  >>> with plain_autodiff():
  ...     tangent = jax.jvp(attend, (x,), (x,))[1]
  >>> tangent.shape
  (1, 3, 1, 2)
"""

from __future__ import annotations

import contextlib
import contextvars

__all__ = ["custom_gradients", "plain_autodiff"]

_PLAIN = contextvars.ContextVar("posenc_jax_plain_autodiff", default=False)


@contextlib.contextmanager
def plain_autodiff():
    """Trace the library's custom-gradient operations in their plain form (for ``jax.jvp``)."""
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


def custom_gradients() -> bool:
    """Whether operations with a custom VJP use it (False inside :func:`plain_autodiff`)."""
    return not _PLAIN.get()
