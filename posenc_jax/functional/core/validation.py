"""Checks at the public boundary, worded one way everywhere.

A public entry point refuses what it cannot mean before tracing: a setting of the wrong
Python type is a ``TypeError``, a value out of range (NaN and infinities included) a
``ValueError``, and either message names the argument, the value and what to give
instead. These checks read static facts only (Python numbers, shapes, dtypes), so they
cost nothing inside ``jit``.

Facts about the *data* exist only when the data is concrete: :func:`check_values` runs
such a check at once on a concrete array (before anything is traced), and, when the
array is traced, runs the same check on its values when the computation runs, and only
when a value is out of range (``jax.debug.callback`` inside a conditional), so the error
has the same words either way and a bad input never turns into NaN or a silently clipped
value.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.control import cond_over_batch

__all__ = ["check_count", "check_key", "check_number", "check_values"]


def _bounds(above, at_least, below, at_most) -> str:
    parts = []
    if above is not None:
        parts.append(f"> {above:g}")
    if at_least is not None:
        parts.append(f">= {at_least:g}")
    if below is not None:
        parts.append(f"< {below:g}")
    if at_most is not None:
        parts.append(f"<= {at_most:g}")
    return " and ".join(parts)


def check_number(
    name: str,
    value,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    fix: str = "",
    optional: bool = False,
) -> float | None:
    """``value`` as a float, or an error naming ``name``: a finite number within the bounds.

    Args:
      name: the argument's name, as the caller wrote it (``"scale_base"``).
      value: a Python or NumPy real number (not a bool, a string or an array).
      above, at_least, below, at_most: the bounds (open, closed, open, closed).
      fix: what to give instead, appended to the message (``"512 in the paper"``).
      optional: None is accepted (and returned).

    Raises:
      TypeError: ``value`` is not a real number (a string, a bool, None, an array).
      ValueError: ``value`` is NaN, infinite or out of the bounds.

    Example:
      >>> check_number("gamma", 0.4, above=0)
      0.4
    """
    if value is None and optional:
        return None
    hint = f"; {fix}" if fix else ""
    real = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not real:
        raise TypeError(f"{name} must be a number{' (or None)' if optional else ''}, got {value!r}{hint}")
    number = float(value)
    bounds = _bounds(above, at_least, below, at_most)
    inside = (
        math.isfinite(number)
        and (above is None or number > above)
        and (at_least is None or number >= at_least)
        and (below is None or number < below)
        and (at_most is None or number <= at_most)
    )
    if not inside:
        raise ValueError(f"{name} must be a finite number{' ' + bounds if bounds else ''}, got {value!r}{hint}")
    return number


def check_count(name: str, value, minimum: int = 1, *, fix: str = "") -> int:
    """``value`` as an int, or an error naming ``name``: an integer (not a bool or a float) ``>= minimum``.

    Example:
      >>> check_count("max_length", 8)
      8
    """
    hint = f"; {fix}" if fix else ""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}{hint}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}{hint}")
    return int(value)


def check_key(name: str, value) -> None:
    """Refuses a ``value`` that is not a ``jax.random`` key (a typed key or a raw uint32 ``[2]`` key).

    An int is the common slip (``key=0``); the message says how to make a key from it.
    """
    if isinstance(value, (jax.Array, np.ndarray)):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            return
        if value.dtype == np.uint32 and value.shape[-1:] == (2,):
            return
        what = f"an array of dtype {value.dtype} and shape {value.shape}"
    else:
        what = repr(value)
    raise TypeError(f"{name} must be a jax.random key, got {what}; make one with jax.random.key(seed)")


def check_values(check: Callable[..., None], array, *, within: tuple, context: tuple = ()) -> None:
    """Runs ``check`` (which raises on bad values) on ``array``'s values (and ``context``'s, passed
    after them): now when they are concrete; when any is traced, only if some value of ``array``
    lies outside ``within = [low, high)`` (either bound None for none, or an array broadcasting
    against ``array``), when the computation runs (the same error, inside JAX's runtime error).

    Inside ``jit`` the test is one reduction and one conditional (:func:`cond_over_batch`, a
    conditional also under ``vmap``): the host is called only for bad data, so a training step
    pays no transfer and no callback for its checks.
    """
    try:
        values = [np.asarray(x) for x in (array, *context)]
    except jax.errors.TracerArrayConversionError:
        low, high = within

        def tell(operands):
            jax.debug.callback(lambda *values: check(*map(np.asarray, values)), *operands)
            return jnp.zeros((), bool)

        inside = jnp.ones(jnp.shape(array), bool)
        if low is not None:
            inside &= array >= low
        if high is not None:
            inside &= array < high
        # under vmap: every example's values
        cond_over_batch(jnp.all(inside), lambda operands: jnp.zeros((), bool), tell, (array, *context))
        return
    check(*values)


def check_init_std(init_std) -> float:
    """An initial table's standard deviation: a finite number >= 0."""
    return check_number(
        "init_std", init_std, at_least=0, fix="the standard deviation of the initial table, 0.02 by default"
    )


def check_init_sizes(key, num_heads, head_dim, model_dim) -> None:
    """What every ``EncodingConfig.init`` is given: a ``jax.random`` key and sizes >= 1."""
    check_key("key", key)
    for name, size in (("num_heads", num_heads), ("head_dim", head_dim), ("model_dim", model_dim)):
        check_count(name, size)
