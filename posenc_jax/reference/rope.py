"""Reference RoPE: Su's pseudocode and the explicit rotation-matrix form, in float64."""

import numpy as np


def _sinusoidal_pos(positions: np.ndarray, hidden_size: int, base: float) -> np.ndarray:
    # sinusoidal_pos[..., t, 2i] = sin(p_t θ_i), [..., t, 2i+1] = cos(p_t θ_i), θ_i = base^(-2i/d)
    theta = np.power(float(base), -np.arange(0, hidden_size, 2, dtype=np.float64) / hidden_size)
    angles = np.asarray(positions, np.float64)[..., None] * theta
    pos = np.zeros(angles.shape[:-1] + (hidden_size,))
    pos[..., 0::2] = np.sin(angles)
    pos[..., 1::2] = np.cos(angles)
    return pos


def su_rope(qw: np.ndarray, positions: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """Su's RoPE pseudocode, line for line, for ``qw`` of shape ``[batch, seq_len, heads, d]``.

    From the RoFormer authors' reference pseudocode::

        cos_pos = repeat_elements(sinusoidal_pos[..., None, 1::2], rep=2, axis=-1)
        sin_pos = repeat_elements(sinusoidal_pos[..., None, ::2], rep=2, axis=-1)
        qw2 = stack([-qw[..., 1::2], qw[..., ::2]], 4)
        qw2 = reshape(qw2, shape(qw))
        qw = qw * cos_pos + qw2 * sin_pos

    ``positions`` is ``[seq_len]`` or ``[batch, seq_len]``.
    """
    qw = np.asarray(qw, np.float64)
    positions = np.asarray(positions)
    if positions.ndim == 1:
        positions = positions[None]
    sinusoidal_pos = _sinusoidal_pos(positions, qw.shape[-1], base)  # [batch|1, seq_len, d]
    cos_pos = np.repeat(sinusoidal_pos[..., None, 1::2], 2, axis=-1)
    sin_pos = np.repeat(sinusoidal_pos[..., None, ::2], 2, axis=-1)
    qw2 = np.stack([-qw[..., 1::2], qw[..., ::2]], 4)
    qw2 = np.reshape(qw2, qw.shape)
    return qw * cos_pos + qw2 * sin_pos


def rope_by_rotation_matrices(x: np.ndarray, positions: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """RoPE as the paper's block-diagonal matrix ``R_Θ,m`` applied to ``x`` ``[T, d]``.

    ``R_Θ,m = diag(R(m θ_0), ..., R(m θ_{d/2-1}))`` with ``R(a) = [[cos a, -sin a], [sin a, cos a]]``
    acting on interleaved pairs. Builds the full ``[T, d, d]`` matrices on purpose.
    """
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    theta = np.power(float(base), -np.arange(0, d, 2, dtype=np.float64) / d)
    out = np.empty_like(x)
    for t, m in enumerate(np.asarray(positions)):
        R = np.zeros((d, d))
        for i, th in enumerate(theta):
            c, s = np.cos(m * th), np.sin(m * th)
            R[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[c, -s], [s, c]]
        out[t] = R @ x[t]
    return out
