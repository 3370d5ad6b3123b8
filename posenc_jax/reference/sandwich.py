"""Reference Sandwich bias (Chi et al. 2023, arXiv:2212.10356), float64 NumPy.

A direct transliteration of the formula of NeMo's ``SandwichRelativePositionEmbedding``
(written with the authors): the relative distances are materialised as ``[T, S]``, the
cosines as ``[T, S, dim/2]``, and summed explicitly, with no trigonometric identity.
"""

import numpy as np


def sandwich_bias(num_heads, query_positions, key_positions, dim, base=10000.0):
    """``bias[h-1, t, s] = (Σ_{i=1}^{dim/2} cos(r θ_i) - dim/2) / (h · 8 / N)``, ``[N, T, S]`` float64.

    ``r = key_positions[s] - query_positions[t]`` and ``θ_i = base^(-2i/dim)`` for
    ``i = 1..dim/2``. Positions are 1-D: ``[T]`` and ``[S]``.

    Example:
      >>> sandwich_bias(1, [0, 1], [0, 1], dim=2).shape
      (1, 2, 2)
    """
    relative_position = np.asarray(key_positions, np.int64)[None, :] - np.asarray(query_positions, np.int64)[:, None]
    i = np.arange(1, dim // 2 + 1, dtype=np.float64)
    inv_freq = 1.0 / (float(base) ** (2.0 * i / dim))
    angles = relative_position[:, :, None].astype(np.float64) * inv_freq  # [T, S, dim/2]
    summed = np.cos(angles).sum(axis=-1)  # [T, S]
    heads = np.arange(1, num_heads + 1, dtype=np.float64)[:, None, None]
    return (summed[None] - dim / 2) / (heads * 8 / num_heads)
