"""Randomized positional encodings (Ruoss et al. 2023).

At train time the positions of a length-T sequence are a sorted sample without
replacement from ``[0, max_length)``, drawn afresh for each batch (or each
example), so the model sees position values from the whole range it will meet
at test time while training on short sequences. At evaluation the positions are
again a random sorted sample (as in the authors' code; ``evaluation="arange"``
keeps the plain positions instead). The positions feed any position-consuming
encoding unchanged: sinusoidal, learned (with a table of ``max_length`` rows),
RoPE, ALiBi, the relative encodings.

Registered as ``"randomized"``, it acts on the positions themselves, so it is a
modifier of another encoding: ``Transformer(encoding=["rope", "randomized"])``, or
``--encodings rope+randomized`` in the benchmark. The model passes it the positions
it was given, and every other encoding sees ``sample[positions]``: the given
positions index a sorted random sample of ``T`` values, so order, gaps between
packed segments and padding keep their meaning.

Reference: Ruoss et al., "Randomized Positional Encodings Boost Length
Generalization of Transformers", ACL 2023, arXiv:2305.16843.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import ParameterFree, Placement, pytree_dataclass
from posenc_jax.functional.core.positions import batched_positions
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.core.validation import check_key, check_values

__all__ = ["RandomizedPositions", "randomized_positions"]

RUOSS = Source.paper(
    "ruoss2023randomized",
    title="Randomized Positional Encodings Boost Length Generalization of Transformers",
    authors="Ruoss, Anian and Del{\\'e}tang, Gr{\\'e}goire and Genewein, Tim and Grau-Moya, Jordi and "
    "Csord{\\'a}s, R{\\'o}bert and Bennani, Mehdi and Legg, Shane and Veness, Joel",
    year=2023,
    arxiv="2305.16843",
)


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
    check_key("key", key)
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


@register_encoding(
    "randomized",
    description="Positions replaced by a sorted random sample from a larger range; a modifier of another encoding.",
    source=RUOSS,
    kv_cache=False,  # a cache would need one sample for the whole generation
    small_settings=dict(max_length=32),
    hooks=("sample",),
    tiled=(),
    cached=(),
    prepared=None,
)
@pytree_dataclass
class RandomizedPositions(ParameterFree):
    """A position sampler: random sorted positions in training and (by default) in evaluation.

    Example:
      >>> sampler = RandomizedPositions(max_length=64, evaluation="arange")
      >>> sampler(jax.random.key(0), 5, train=False)
      Array([0, 1, 2, 3, 4], dtype=int32)
    """

    max_length: int = 2048
    evaluation: Literal["arange", "random"] = "random"
    per_example: bool = False
    acts_on: ClassVar[Placement] = "positions"

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

    def sample(self, key: jax.Array, positions: jax.Array, *, train: bool) -> jax.Array:
        """The positions every other encoding sees: ``sample[positions]`` for a sorted sample of ``T`` values.

        ``positions`` (``[T]`` or ``[B, T]``) must lie in ``[0, T)``, as the positions of a
        sequence (or of packed sequences) of ``T`` tokens do; others are an error.
        """
        positions = batched_positions(positions)
        length = positions.shape[-1]
        if not train and self.evaluation == "arange":
            return positions
        table = self(key, length, train=True, batch_size=positions.shape[0] if self.per_example else None)

        def check(pos):
            pos = np.asarray(pos)
            if pos.size and (pos.min() < 0 or pos.max() >= length):
                raise ValueError(
                    f"randomized positions index a sample of {length} values, so positions must lie in "
                    f"[0, {length}), got {int(pos.min())}..{int(pos.max())}; pass the positions of the sequence "
                    f"(e.g. jnp.arange(T))"
                )

        check_values(check, positions, within=(0, length))
        return jnp.take_along_axis(jnp.broadcast_to(table, positions.shape), positions, axis=-1)

    def for_lengths(self, *, train_length: int, max_length: int, head_dim: int) -> RandomizedPositions:
        """A sampling range four times the longest test length (Ruoss et al.: 2048 for tests up to 500)."""
        return dataclasses.replace(self, max_length=4 * max_length)
