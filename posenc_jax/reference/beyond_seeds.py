"""Reference versions of the encodings beyond the seeds, float64 NumPy.

Each transliterates the authors' released code (or the paper's formula where the
docstring says so), materialising whatever it likes.
"""

import math

import numpy as np


def alibi_get_slopes(n):
    """Press et al.'s ``get_slopes`` from the ALiBi repository, verbatim in structure."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + alibi_get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


def yarn_inverse_frequencies(dim, base, scale, original_max_position_embeddings, beta_fast=32, beta_slow=1):
    """The YaRN authors' ``_yarn`` frequency computation (``find_correction_range`` + linear ramp mask)."""

    def find_correction_dim(num_rotations):
        return (dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(find_correction_dim(beta_fast)), 0)
    high = min(math.ceil(find_correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (scale * pos_freqs)
    inv_freq_mask = 1 - ramp
    inv_freq = inv_freq_interpolation * (1 - inv_freq_mask) + inv_freq_extrapolation * inv_freq_mask
    mscale = 0.1 * math.log(scale) + 1.0 if scale > 1 else 1.0
    return inv_freq, mscale


def llama3_inverse_frequencies(dim, base, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Llama 3.1's ``apply_scaling`` loop over frequencies."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / factor + smooth * freq)
    return np.asarray(new_freqs)


def xpos_qk(q, k, q_pos, k_pos, centre, scale_base=512, gamma=0.4, base=10000.0):
    """xPos on one head, ``q`` ``[T, d]`` and ``k`` ``[S, d]``: RoPE (interleaved), then
    ``ζ ** ((m - c)/scale_base)`` on queries and its inverse on keys, ``ζ_i = (2i/d + γ)/(1 + γ)``
    (the torchscale ``XPOS`` module, with an explicit centre c)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    d = q.shape[-1]
    theta = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    zeta = (np.arange(0, d, 2, dtype=np.float64) + gamma * d) / ((1 + gamma) * d)

    def rotate(x, pos, sign):
        angles = np.asarray(pos, np.float64)[:, None] * theta
        scale = zeta[None, :] ** (sign * (np.asarray(pos, np.float64)[:, None] - centre) / scale_base)
        cos = np.repeat(np.cos(angles) * scale, 2, -1)
        sin = np.repeat(np.sin(angles) * scale, 2, -1)
        x2 = np.stack([-x[:, 1::2], x[:, ::2]], -1).reshape(x.shape)
        return x * cos + x2 * sin

    return rotate(q, q_pos, 1.0), rotate(k, k_pos, -1.0)


def cope(query, attn_logits, pos_emb, npos_max):
    """The CoPE authors' module, ``forward(query, attn_logits)``, in NumPy.

    query ``[b, i, d]``, attn_logits ``[b, i, j]`` (already scaled and masked with
    ``+ log(mask)``), pos_emb ``[d, npos_max]``. Returns the ``[b, i, j]`` term to add.
    """
    gates = 1 / (1 + np.exp(-attn_logits))
    pos = np.flip(np.cumsum(np.flip(gates, -1), -1), -1)
    pos = np.minimum(pos, npos_max - 1)
    pos_ceil = np.ceil(pos).astype(int)
    pos_floor = np.floor(pos).astype(int)
    logits_int = query @ pos_emb
    logits_ceil = np.take_along_axis(logits_int, pos_ceil, -1)
    logits_floor = np.take_along_axis(logits_int, pos_floor, -1)
    w = pos - pos_floor
    return logits_ceil * w + logits_floor * (1 - w)


def fire_bias(params, q_pos, k_pos):
    """FIRE's formula ``f(ψ(i - j) / ψ(max(L, i)))``, ``ψ(x) = log(c x + 1)``, as ``[N, T, S]``."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    c, L = abs(float(p["c"])), abs(float(p["threshold"]))
    i = np.asarray(q_pos, np.float64)[:, None]
    j = np.asarray(k_pos, np.float64)[None, :]
    x = np.log(c * np.maximum(i - j, 0) + 1) / np.log(c * np.maximum(L, i) + 1)
    h = np.maximum(x[..., None] * p["w1"] + p["b1"], 0)  # [T, S, hidden]
    return (h @ p["w2"] + p["b2"]).transpose(2, 0, 1)
