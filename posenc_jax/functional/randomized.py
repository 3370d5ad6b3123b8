"""Randomized positional encodings (Ruoss et al. 2023).

At train time the positions of a length-T sequence are a sorted sample without
replacement from ``[0, max_length)``, drawn afresh for each batch (or each
example), so the model sees position values from the whole range it will meet
at test time while training on short sequences. At evaluation the positions are
``arange(T)`` or again a random sorted sample. The positions feed any
position-consuming encoding unchanged: sinusoidal, learned (with a table of
``max_length`` rows), RoPE, ALiBi, the relative encodings.

Reference: Ruoss et al., "Randomized Positional Encodings Boost Length
Generalization of Transformers", ACL 2023, arXiv:2305.16843.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RandomizedPositions", "randomized_positions"]


def randomized_positions(key: jax.Array, length: int, max_length: int, *, batch_size: int | None = None) -> jax.Array:
    """Sorted positions sampled without replacement from ``[0, max_length)``.

    Args:
      key: PRNG key.
      length: T, the number of positions (static).
      max_length: the range to sample from (static, >= T).
      batch_size: None for one ``[T]`` sample shared by the batch, or B for an
        independent ``[B, T]`` sample per example.

    Returns:
      int32 ``[T]`` or ``[B, T]``, strictly increasing.

    Example:
      >>> p = randomized_positions(jax.random.key(0), 8, 2048)
      >>> p.shape, bool((jnp.diff(p) > 0).all()), bool(p.max() < 2048)
      ((8,), True, True)
    """
    for name, value in (("length", length), ("max_length", max_length)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if max_length < length:
        raise ValueError(
            f"max_length={max_length} is smaller than the sequence length {length}; randomized positions "
            f"need max_length >= length (Ruoss et al. use 2048 for test lengths up to 500)"
        )

    def one(k):
        return jnp.sort(jax.random.choice(k, max_length, (length,), replace=False)).astype(jnp.int32)

    if batch_size is None:
        return one(key)
    return jax.vmap(one)(jax.random.split(key, batch_size))


@dataclasses.dataclass(frozen=True)
class RandomizedPositions:
    """A position sampler: random sorted positions in training, ``arange`` (or random) in evaluation.

    Example:
      >>> sampler = RandomizedPositions(max_length=64)
      >>> sampler(jax.random.key(0), 5, train=False)
      Array([0, 1, 2, 3, 4], dtype=int32)
    """

    max_length: int
    evaluation: Literal["arange", "random"] = "arange"
    per_example: bool = False

    def __post_init__(self):
        if self.evaluation not in ("arange", "random"):
            raise ValueError(f"evaluation must be 'arange' or 'random', got {self.evaluation!r}")
        if not isinstance(self.max_length, (int, np.integer)) or self.max_length < 1:
            raise ValueError(f"max_length must be an integer >= 1, got {self.max_length!r}")

    def __call__(self, key: jax.Array, length: int, *, train: bool, batch_size: int | None = None) -> jax.Array:
        if not train and self.evaluation == "arange":
            if length > self.max_length:
                raise ValueError(f"max_length={self.max_length} is smaller than the sequence length {length}")
            positions = jnp.arange(length, dtype=jnp.int32)
            return positions if batch_size is None else jnp.broadcast_to(positions, (batch_size, length))
        if self.per_example and batch_size is not None:
            return randomized_positions(key, length, self.max_length, batch_size=batch_size)
        positions = randomized_positions(key, length, self.max_length)
        return positions if batch_size is None else jnp.broadcast_to(positions, (batch_size, length))
