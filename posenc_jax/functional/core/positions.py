"""Positions and the phases computed from them.

Positions are explicit integer arrays, ``[T]`` or ``[B, T]``, never implied by an
array's length. This file validates them and turns them into rotation angles
``positions * inverse_frequency`` for the sinusoidal and rotary encodings.

Why the angles need care: at position 100,000 the highest-frequency angle is
100,000 rad. Its float32 product is off by up to ~0.004 rad (half an ulp of
1e5), which is already larger than the bfloat16 rounding of a rotated query.
:func:`position_angles` therefore reduces the angle modulo one turn in exact
32-bit fixed-point integer arithmetic before it ever becomes a float, so the
phase is right to ~1e-6 rad at any int32 position, on CPU, GPU and TPU alike.

Supported range: every int32 position, ``-2**31 <= p <= 2**31 - 1`` (wider integer
arrays are accepted when their values fit, and refused otherwise). Two such positions
can be up to ``2**32 - 1`` apart, which int32 cannot hold, so distances are never
taken with a plain int32 subtraction (it would wrap around and turn a far-future key
into a past one): :func:`position_difference` gives them exactly in int32 when they
fit (``|j - i| <= 2**31 - 1``, always the case for non-negative positions) and
saturated at ``±(2**31 - 1)`` otherwise, which changes nothing for a mask or an
encoding that clips distances; encodings linear or logarithmic in the distance
(ALiBi, Kerple, FIRE) take it in float32, rounded once from the exact integer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "known_indices",
    "add_position_encoding",
    "batched_positions",
    "check_embed_positions",
    "check_positions",
    "inverse_frequencies",
    "position_angles",
    "position_difference",
    "with_batch_axis",
]

# Positions are split into four 8-bit digits; each digit's contribution to the
# phase is a product of an 8-bit integer with a 32-bit fixed-point number of turns.
_DIGIT_BITS = 8
_NUM_DIGITS = 4


def check_positions(positions, name: str = "positions") -> jax.Array:
    """Validates an integer position array and returns it as int32.

    Args:
      positions: integer array ``[T]`` or ``[B, T]`` (any leading axes allowed).
      name: the argument's name, used in error messages.

    Returns:
      ``positions`` as an int32 array.

    Raises:
      ValueError: if ``positions`` is not an integer array, is a scalar, or holds a
        value outside int32 (every int32 value is supported; see the module docstring).
    """
    if isinstance(positions, (list, tuple, range)):
        positions = np.asarray(positions)
    if not isinstance(positions, (jax.Array, np.ndarray, np.generic)):
        raise ValueError(f"{name} must be an integer array of shape [T] or [B, T], got {type(positions).__name__}")
    dtype = np.dtype(positions.dtype)
    if not (np.issubdtype(dtype, np.integer)):
        raise ValueError(
            f"{name} must have an integer dtype, got {dtype}; positions are token indices "
            f"(pass e.g. jnp.arange(T) or {name}.astype(jnp.int32))"
        )
    if np.ndim(positions) == 0:
        raise ValueError(f"{name} must have at least one axis [T], got a scalar")
    if dtype.itemsize > 4 or dtype == np.uint32:
        # Wider than int32: values must fit, or the cast would wrap silently.
        try:
            values = np.asarray(positions)
        except jax.errors.TracerArrayConversionError:
            raise ValueError(
                f"{name} of dtype {dtype} cannot be range-checked under jit; pass int32 positions "
                f"({name}.astype(jnp.int32))"
            ) from None
        limit = np.iinfo(np.int32)
        if values.size and (values.min() < limit.min or values.max() > limit.max):
            bad = values.max() if values.max() > limit.max else values.min()
            raise ValueError(f"{name} must fit in int32 (|position| < 2**31), got {bad}")
    return jnp.asarray(positions, jnp.int32)


def batched_positions(positions, name: str = "positions") -> jax.Array:
    """:func:`check_positions`, with a leading batch axis added to ``[T]``: int32 ``[B|1, T]``."""
    return with_batch_axis(check_positions(positions, name))


def with_batch_axis(positions: jax.Array) -> jax.Array:
    """Positions ``[T]`` or ``[B, T]`` as ``[B|1, T]``, taken as they are: for positions already checked.

    Example:
      >>> with_batch_axis(jnp.arange(3)).shape
      (1, 3)
    """
    return positions if positions.ndim >= 2 else positions[None]


_INT32_LIMIT = 2**31 - 1


def position_difference(minuend, subtrahend, *, dtype=jnp.int32) -> jax.Array:
    """``minuend - subtrahend`` of int32 positions without int32 wrap-around (broadcasting).

    The difference of two int32 positions needs 33 bits. With ``dtype=jnp.int32`` it
    is exact when it fits (``|d| <= 2**31 - 1``) and saturated at ``±(2**31 - 1)``
    otherwise (a distance beyond every clip distance and every mask's reach, with its
    sign right); with ``dtype=jnp.float32`` it is the exact difference rounded once to
    float32 (exact up to ``2**24``, relative error below ``2**-24`` beyond).

    Example:
      >>> position_difference(jnp.array([2**31 - 1, 5]), jnp.array([-1, 7]))
      Array([2147483647,         -2], dtype=int32)
      >>> position_difference(jnp.array([2**31 - 1]), jnp.array([-2**31]), dtype=jnp.float32)
      Array([4.2949673e+09], dtype=float32)
    """
    a = jnp.asarray(minuend, jnp.int32)
    b = jnp.asarray(subtrahend, jnp.int32)
    if jnp.dtype(dtype) == jnp.float32:
        # 16-bit halves: each partial difference is a small exact integer, so the sum rounds once.
        high = (a >> 16) - (b >> 16)
        low = (a & 0xFFFF) - (b & 0xFFFF)
        return high.astype(jnp.float32) * jnp.float32(65536.0) + low.astype(jnp.float32)
    if jnp.dtype(dtype) != jnp.int32:
        raise ValueError(f"dtype must be jnp.int32 or jnp.float32, got {dtype}")
    wrapped = a - b  # two's complement: wraps when the true difference needs 33 bits
    overflow = ((a ^ b) & (a ^ wrapped)) < 0  # operands of different signs, result of the wrong sign
    saturated = jnp.where(a >= 0, _INT32_LIMIT, -_INT32_LIMIT)
    # -2**31 itself is clamped too, so negating a difference never wraps.
    return jnp.where(overflow, saturated, jnp.maximum(wrapped, -_INT32_LIMIT))


def inverse_frequencies(dim: int, *, base: float = 10000.0) -> np.ndarray:
    """The sinusoidal frequency ladder ``base ** (-2i / dim)`` for ``i < dim / 2``.

    Shared by the sinusoidal absolute encoding (Vaswani et al. 2017,
    arXiv:1706.03762) and RoPE (Su et al. 2021, arXiv:2104.09864). Computed on
    the host in float64, so it is exact to double precision and static under jit.

    Args:
      dim: an even number of encoded dimensions (the model dim for sinusoidal,
        the rotary dim for RoPE).
      base: the wavelength base (10,000 in both papers).

    Returns:
      ``[dim // 2]`` float64 numpy array, decreasing from 1.

    Example:
      >>> inverse_frequencies(4)
      array([1.  , 0.01])
    """
    if not isinstance(dim, (int, np.integer)) or dim < 2 or dim % 2:
        raise ValueError(f"dim must be an even integer >= 2, got {dim!r}")
    try:
        valid = not isinstance(base, (str, bytes)) and 1.0 < float(base) < math.inf
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise ValueError(f"base must be a finite number > 1 (the wavelength base, 10000 in the papers), got {base!r}")
    return np.power(float(base), -np.arange(0, dim, 2, dtype=np.float64) / dim)


def position_angles(positions, inverse_frequency) -> jax.Array:
    """Rotation angles ``positions[..., t] * inverse_frequency[f]``, reduced to [-π, π).

    With a concrete (host-known) ``inverse_frequency`` the product is reduced
    modulo 2π exactly: each frequency becomes a 32-bit fixed-point fraction of
    a turn per 8-bit digit of the position, the digits' products wrap in uint32
    arithmetic (which is exact modulo one turn), and only the final phase is
    converted to float32. The error is below ~1e-6 rad for any |position| < 2**31
    and frequencies up to 1 rad per position (the sinusoidal and RoPE ladders);
    larger frequencies add float64 rounding of ``freq / 2π`` times the position.
    A traced ``inverse_frequency`` (learned or computed inside jit) falls back
    to the plain float32 product.

    Args:
      positions: integer array ``[..., T]``.
      inverse_frequency: ``[F]`` angular frequencies in radians per position.

    Returns:
      ``[..., T, F]`` float32 angles, equal to the exact product modulo 2π.

    Example:
      >>> position_angles(jnp.array([0, 1, 2]), np.array([1.0, 0.5])).shape
      (3, 2)
    """
    return _position_angles(check_positions(positions), inverse_frequency)


def _position_angles(positions: jax.Array, inverse_frequency) -> jax.Array:
    """:func:`position_angles` of int32 positions already checked (where they entered), taken as they are."""
    try:
        freq = np.asarray(inverse_frequency, np.float64)
    except jax.errors.TracerArrayConversionError:
        if inverse_frequency.ndim != 1:
            raise ValueError(f"inverse_frequency must have shape [F], got shape {inverse_frequency.shape}") from None
        freq = inverse_frequency.astype(jnp.float32)
        return positions.astype(jnp.float32)[..., None] * freq.reshape((1,) * positions.ndim + freq.shape)
    if freq.ndim != 1:
        raise ValueError(f"inverse_frequency must have shape [F], got shape {freq.shape}")
    if not np.isfinite(freq).all():
        raise ValueError(f"inverse_frequency must be finite, got {freq}")
    turns_per_position = freq / (2.0 * math.pi)
    # digit_turns[k, f]: the phase (in 2**-32 turns) contributed by one unit of digit k.
    digit_turns = np.stack(
        [
            np.round(np.mod(turns_per_position * 2.0 ** (_DIGIT_BITS * k), 1.0) * 2.0**32) % 2.0**32
            for k in range(_NUM_DIGITS)
        ]
    ).astype(np.uint32)
    digit_turns = digit_turns.reshape((_NUM_DIGITS,) + (1,) * positions.ndim + freq.shape)

    magnitude = jnp.abs(positions).astype(jnp.uint32)[..., None]
    phase = jnp.zeros(magnitude.shape[:-1] + freq.shape, jnp.uint32)
    for k in range(_NUM_DIGITS):
        digit = (magnitude >> (_DIGIT_BITS * k)) & ((1 << _DIGIT_BITS) - 1)
        phase = phase + digit * jnp.asarray(digit_turns[k])  # wraps modulo 2**32: one turn
    # Reinterpret as signed so the phase lands in [-1/2, 1/2) turn.
    signed = jax.lax.bitcast_convert_type(phase, jnp.int32).astype(jnp.float32)
    angles = signed * jnp.float32(2.0 * math.pi / 2.0**32)
    return jnp.where(positions[..., None] < 0, -angles, angles)


def check_embed_positions(x: jax.Array, positions) -> jax.Array:
    """Validates ``positions`` (``[T]`` or ``[B, T]``) for embeddings ``x`` ``[..., T, D]``; returns int32."""
    positions = check_positions(positions)
    if x.ndim < 2:
        raise ValueError(f"x must have shape [..., T, D], got {x.shape}")
    if positions.shape[-1] != x.shape[-2] or positions.ndim > x.ndim - 1:
        raise ValueError(
            f"positions of shape {positions.shape} do not fit x of shape {x.shape}: "
            f"expected [T] or [B, T] with T = {x.shape[-2]}"
        )
    return positions


def add_position_encoding(x: jax.Array, pe: jax.Array) -> jax.Array:
    """``x + pe`` in float32, cast back to ``x.dtype``; ``pe`` [..., T, D] left-padded to x's rank."""
    if pe.ndim < x.ndim:
        pe = pe.reshape((1,) * (x.ndim - pe.ndim) + pe.shape)
    return (x.astype(jnp.float32) + pe.astype(jnp.float32)).astype(x.dtype)


def known_indices(query_positions, key_positions, q_len: int, k_len: int) -> bool:
    """Whether the positions are concrete arrays (not traced) holding ``0..T-1`` and ``0..S-1`` in every row."""
    for positions, length in ((query_positions, q_len), (key_positions, k_len)):
        if positions is None or isinstance(positions, jax.core.Tracer):
            return False
        values = np.asarray(positions)
        if values.shape[-1] != length or not np.array_equal(values, np.broadcast_to(np.arange(length), values.shape)):
            return False
    return True
