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
value. JAX reports such an error as ``JaxRuntimeError: INTERNAL: CpuCallback error`` with the
check's message many lines down; :func:`reraise_check_errors` (around the library's own
jitted entry points, and for a caller's ``jit``) raises the check's own error instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections import deque
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.control import cond_over_batch

__all__ = ["check_count", "check_key", "check_number", "check_values", "reraise_check_errors"]

# The errors of checks that failed inside a computation, newest last: what reraise_check_errors
# raises in place of the runtime error that carries one.
_FAILED: deque[Exception] = deque(maxlen=16)
_FAILED_LOCK = threading.Lock()
_OPEN = [0]  # reraise_check_errors blocks open now, in any thread


class _DropLoggedCheckFailures(logging.Filter):
    """Drops JAX's own log of a failed check's traceback ("jax.debug.callback failed") while a
    :func:`reraise_check_errors` block is open: that block raises the check's error itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        with _FAILED_LOCK:
            return not (_OPEN[0] and any(error is failed for failed in _FAILED))


logging.getLogger("jax._src.debugging").addFilter(_DropLoggedCheckFailures())


def _run_check(check: Callable[..., None], values) -> None:
    """Runs ``check`` on the host (from inside a computation), keeping the error it raises."""
    try:
        check(*map(np.asarray, values))
    except Exception as error:
        with _FAILED_LOCK:
            _FAILED.append(error)
        raise


def _failed_check(runtime_error: Exception) -> Exception | None:
    """The failed check's error that ``runtime_error`` carries (its type and message are in its text), or None."""
    text = str(runtime_error)
    with _FAILED_LOCK:
        for error in reversed(_FAILED):
            if f"{type(error).__name__}: {error}" in text:
                _FAILED.remove(error)
                return error
    return None


@contextlib.contextmanager
def reraise_check_errors():
    """Raises a check that failed inside a computation as its own error, not as JAX's runtime error.

    A :func:`check_values` check on traced values raises from a host callback while the
    computation runs; JAX then raises ``JaxRuntimeError: INTERNAL: CpuCallback error`` with the
    check's message some 17 lines down. Inside this block (or a function decorated with it)
    that error is raised instead: the same ``ValueError`` (or ``TypeError``) the check raises on
    concrete values, its message the first line. Other runtime errors pass through unchanged.

    The library's jitted entry points run inside it (:func:`~posenc_jax.nn.decode_step`'s step,
    :func:`~posenc_jax.generation.generate`, :func:`~posenc_jax.training.train_step`, the
    benchmark's steps); wrap a ``jit`` of your own in it likewise. On an accelerator the error
    may surface later, where the result is first read: keep that read inside the block too.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def check(ids):
      ...     raise ValueError(f"token id {ids.max()} is outside the vocabulary [0, 8)")
      >>> @jax.jit
      ... def lookup(ids):
      ...     check_values(check, ids, within=(0, 8))
      ...     return ids
      >>> with reraise_check_errors():
      ...     lookup(jnp.array([3, 9])).block_until_ready()
      Traceback (most recent call last):
      ...
      ValueError: token id 9 is outside the vocabulary [0, 8)
    """
    with _FAILED_LOCK:
        _OPEN[0] += 1
    try:
        yield
    except RuntimeError as error:  # jax.errors.JaxRuntimeError, XlaRuntimeError before it
        failed = _failed_check(error)
        if failed is None:
            raise
        raise failed.with_traceback(None) from None
    finally:
        with _FAILED_LOCK:
            _OPEN[0] -= 1


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
            jax.debug.callback(lambda *values: _run_check(check, values), *operands)
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
