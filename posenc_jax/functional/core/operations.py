"""Operations with more than one form: the plain form here, faster forms registered by ``kernels/``.

Core never imports ``kernels/``. It calls an :class:`Operation`, whose plain form (plain
``jax.numpy``, autodiff's own derivatives) is defined beside it; ``kernels/`` imports core and
registers faster forms of the same operation, for one backend (``"cpu"``: shaped on XLA:CPU)
or for every backend (``"any"``: custom derivatives that gather where autodiff would scatter,
conditionals on what the positions allow). Every form gives the same values; the tests hold
each to the plain form.

The backend is read at one place, :func:`current_backend`, when a function is traced: a jitted
function keeps the forms of the backend it was traced for, as it keeps that backend. The tests
replace :func:`current_backend` to trace another backend's forms on the CPU.

Example:
  >>> double = Operation("double", lambda x: x + x)
  >>> _ = double.implement(backend="any")(lambda x: 2 * x)
  >>> double(jnp.arange(3)).tolist()
  [0, 2, 4]
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["Operation", "broadcast_to", "current_backend", "sum_to_shape"]

ANY = "any"


def current_backend() -> str:
    """JAX's default backend (``"cpu"``, ``"gpu"``, ``"tpu"``): the one place a form is chosen from."""
    return jax.default_backend()


class Operation:
    """An operation core calls, with its plain form and the forms ``kernels/`` registers for it.

    Calling it runs, for :func:`current_backend`, the form registered for that backend, else
    the form registered for every backend, else the plain form.
    """

    def __init__(self, name: str, plain: Callable):
        self.name = name
        self.plain = plain
        self._forms: dict[str, Callable] = {}

    def implement(self, *, backend: str = ANY) -> Callable[[Callable], Callable]:
        """A decorator registering a form of this operation for ``backend`` (``"any"``: every backend)."""

        def register(form: Callable) -> Callable:
            self._forms[backend] = form
            return form

        return register

    def form(self) -> Callable:
        """The form that runs on the current backend."""
        forms = self._forms
        return forms.get(current_backend()) or forms.get(ANY) or self.plain

    def __call__(self, *args, **kwargs):
        return self.form()(*args, **kwargs)

    def implemented(self) -> bool:
        """Whether a form other than the plain one runs on the current backend."""
        return self.form() is not self.plain

    def __repr__(self) -> str:
        return f"Operation({self.name!r}, forms={sorted(self._forms)})"


def broadcast_axes(shape: tuple, target: tuple) -> tuple[int, ...]:
    """Axes of ``target`` along which an array of ``shape`` is broadcast (checked)."""
    if len(shape) > len(target) or any(d not in (1, t) for d, t in zip(shape[::-1], target[::-1], strict=False)):
        raise ValueError(f"an array of shape {tuple(shape)} does not broadcast to {tuple(target)}")
    padded = (1,) * (len(target) - len(shape)) + tuple(shape)
    return tuple(axis for axis, (d, t) in enumerate(zip(padded, target, strict=True)) if d == 1 and t != 1)


def _plain_sum_to_shape(x: jax.Array, shape: tuple) -> jax.Array:
    return x.sum(axis=broadcast_axes(shape, x.shape), keepdims=True).reshape(shape)


SUM_TO_SHAPE = Operation("sum_to_shape", _plain_sum_to_shape)
BROADCAST_TO = Operation("broadcast_to", jnp.broadcast_to)


def sum_to_shape(x: jax.Array, shape: tuple) -> jax.Array:
    """``x`` summed over the axes along which an array of ``shape`` is broadcast to ``x.shape``.

    The transpose of ``jnp.broadcast_to(y, x.shape)`` for ``y`` of ``shape``: the same sums
    as ``x.sum(axes, keepdims=True)``, in the form of the current backend (on the CPU, short
    axes summed as an elementwise sum of their slices: :mod:`posenc_jax.functional.kernels.broadcast`).

    Args:
      x: the array to reduce, ``[..., B, N, T, S]`` say.
      shape: a shape that broadcasts to ``x.shape``.

    Returns:
      An array of ``shape`` and ``x``'s dtype.

    Example:
      >>> sum_to_shape(jnp.arange(6.0).reshape(3, 2), (1, 2)).tolist()
      [[6.0, 9.0]]
    """
    shape = tuple(shape)
    broadcast_axes(shape, x.shape)
    return SUM_TO_SHAPE(x, shape)


def broadcast_to(x: jax.Array, shape: tuple) -> jax.Array:
    """``jnp.broadcast_to(x, shape)`` whose gradient sums the broadcast axes as :func:`sum_to_shape` does.

    Use it where a term shared by the batch meets ``[B, N, T, S]`` scores or weights
    (``scores + broadcast_to(bias, scores.shape)``): the values and gradients are those of
    plain broadcasting; only the form of the gradient's reduction differs by backend.

    Example:
      >>> bias = jnp.array([[1.0, 2.0]])  # [1, S], shared by 3 rows
      >>> jax.grad(lambda b: (broadcast_to(b, (3, 2)) * jnp.arange(6.0).reshape(3, 2)).sum())(bias).tolist()
      [[6.0, 9.0]]
    """
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    broadcast_axes(x.shape, shape)  # checked here, before any derivative is traced
    return BROADCAST_TO(x, shape)
