"""Reference relative encodings, float64 NumPy, materialising R as ``[T, S, ...]`` on purpose.

Each follows the survey's einsum pseudocode or the reference code named
in its docstring. Positions are 1-D: ``q_pos`` ``[T]`` and ``k_pos`` ``[S]``; tensors
carry a leading batch-of-heads axis ``b`` as in that pseudocode (``Q`` ``[b, i, k]``).
"""

import math

import numpy as np


def _softmax(logits, mask):
    logits = np.where(mask, logits, -np.inf)
    row_max = np.max(logits, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(mask, np.exp(logits - row_max), 0.0)
    total = e.sum(-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


def shaw_attention(Q, K, V, P_K, P_V, q_pos, k_pos, max_distance, mask=None):
    """Shaw et al. 2018, the survey's pseudocode with ``R[i, j] = P[clip(k_pos[j] - q_pos[i], -k, k) + k]``::

        Attn = softmax((einsum("bik,bjk->bij", Q, K) + einsum("bik,ijk->bij", Q, R_K)) / sqrt(d))
        O = einsum("bij,bjk->bik", Attn, V) + einsum("bij,ijk->bik", Attn, R_V)

    ``P_K``, ``P_V``: ``[2k+1, d]`` (or None to drop that term).
    """
    Q, K, V = (np.asarray(a, np.float64) for a in (Q, K, V))
    d = Q.shape[-1]
    rel = np.asarray(k_pos)[None, :] - np.asarray(q_pos)[:, None]
    idx = np.clip(rel, -max_distance, max_distance) + max_distance
    logits = np.einsum("bik,bjk->bij", Q, K)
    if P_K is not None:
        R_K = np.asarray(P_K, np.float64)[idx]  # [i, j, d]
        logits = logits + np.einsum("bik,ijk->bij", Q, R_K)
    if mask is None:
        mask = np.ones(logits.shape, bool)
    attn = _softmax(logits / np.sqrt(d), mask)
    out = np.einsum("bij,bjk->bik", attn, V)
    if P_V is not None:
        R_V = np.asarray(P_V, np.float64)[idx]
        out = out + np.einsum("bij,ijk->bik", attn, R_V)
    return out


def sinusoid(distance, dim, layout="interleaved", base=10000.0):
    """The sinusoidal encoding of (possibly negative) distances, ``[..., dim]`` float64."""
    w = np.power(float(base), -np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.asarray(distance, np.float64)[..., None] * w
    if layout == "half":  # Transformer-XL: torch.cat([sin, cos], -1)
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)
    out = np.zeros(angles.shape[:-1] + (dim,))
    out[..., 0::2], out[..., 1::2] = np.sin(angles), np.cos(angles)
    return out


def functional_relative_logits(Q, q_pos, k_pos, base=10000.0):
    """The functional relative encoding as Shaw's fixed R: ``einsum("bik,ijk->bij", Q, R) / sqrt(d)``."""
    Q = np.asarray(Q, np.float64)
    d = Q.shape[-1]
    R = sinusoid(np.asarray(k_pos)[None, :] - np.asarray(q_pos)[:, None], d, base=base)  # [i, j, d]
    return np.einsum("bik,ijk->bij", Q, R) / np.sqrt(d)


def transformer_xl_logits(q, k, W_R, u, v, q_pos, k_pos, base=10000.0):
    """All four Transformer-XL terms (Dai et al. 2019, appendix B), the survey's XLNet pseudocode::

        (einsum("bik,bjk->bij", Q, K) + einsum("bik,ijk->bij", Q, R)
         + einsum("bik,bjk->bij", u, K) + einsum("bik,ijk->bij", v, R)) / sqrt(d)

    with ``R[i, j] = W_R · [sin, cos]((q_pos[i] - k_pos[j]) ω)`` per head.
    q: ``[T, N, H]``, k: ``[S, N, H]``, W_R: ``[D, N, H]``, u, v: ``[N, H]``. Returns ``[N, T, S]``.
    """
    q, k, W_R, u, v = (np.asarray(a, np.float64) for a in (q, k, W_R, u, v))
    H = q.shape[-1]
    pe = sinusoid(np.asarray(q_pos)[:, None] - np.asarray(k_pos)[None, :], W_R.shape[0], layout="half", base=base)
    R = np.einsum("ijD,DNH->NijH", pe, W_R)  # [N, T, S, H]
    out = (
        np.einsum("iNH,jNH->Nij", q, k)
        + np.einsum("iNH,NijH->Nij", q, R)
        + np.einsum("NH,jNH->Nj", u, k)[:, None, :]
        + np.einsum("NH,NijH->Nij", v, R)
    )
    return out / math.sqrt(H)


def t5_relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """T5's ``_relative_position_bucket`` (Mesh TensorFlow), transliterated; float32 logs as there."""
    ret = 0
    n = -np.asarray(relative_position, np.int64)
    if bidirectional:
        num_buckets //= 2
        ret += (n < 0).astype(np.int64) * num_buckets
        n = np.abs(n)
    else:
        n = np.maximum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    with np.errstate(divide="ignore", invalid="ignore"):  # log(0) where n == 0 is unused
        val_if_large = max_exact + (
            np.log(n.astype(np.float32) / np.float32(max_exact))
            / np.float32(math.log(max_distance / max_exact))
            * np.float32(num_buckets - max_exact)
        ).astype(np.int64)
    val_if_large = np.minimum(val_if_large, num_buckets - 1)
    ret += np.where(is_small, n, val_if_large)
    return ret


def t5_bias(table, q_pos, k_pos, bidirectional=True, max_distance=128):
    """``values = table[buckets]`` permuted to ``[N, T, S]``, as T5's ``compute_bias``."""
    rel = np.asarray(k_pos)[None, :] - np.asarray(q_pos)[:, None]
    buckets = t5_relative_position_bucket(rel, bidirectional, np.shape(table)[0], max_distance)
    return np.asarray(table, np.float64)[buckets].transpose(2, 0, 1)


def clipped_relative_bias(table, q_pos, k_pos, max_positions):
    """A PyTorch ``RelativePositionalBias.forward``: clamp, shift, look up, permute to ``[N, T, S]``."""
    relative_position = np.asarray(k_pos)[None, :] - np.asarray(q_pos)[:, None]
    relative_position = np.clip(relative_position, -max_positions, max_positions) + max_positions
    return np.asarray(table, np.float64)[relative_position].transpose(2, 0, 1)


def deberta_log_bucket_position(relative_pos, bucket_size, max_position):
    """DeBERTa-v2's ``make_log_bucket_position``, transliterated (float32 logs as in the torch code)."""
    relative_pos = np.asarray(relative_pos, np.int64)
    sign = np.sign(relative_pos)
    mid = bucket_size // 2
    abs_pos = np.where((relative_pos < mid) & (relative_pos > -mid), mid - 1, np.abs(relative_pos))
    log_pos = (
        np.ceil(
            np.log(abs_pos.astype(np.float32) / np.float32(mid))
            / np.log(np.float32((max_position - 1) / mid))
            * np.float32(mid - 1)
        )
        + mid
    )
    return np.where(abs_pos <= mid, relative_pos, log_pos * sign).astype(np.int64)


def deberta_c2p_p2c(q, k, pos_query, pos_key, q_pos, k_pos, span, position_buckets=0, max_relative_positions=512):
    """DeBERTa's c2p + p2c terms as in the DeBERTa-v2 reference ``disentangled_attention_bias``.

    ``relative_pos = q_ids - k_ids``; c2p gathers ``q · pos_keyᵀ`` at
    ``clamp(relative_pos + span)``; p2c gathers ``k · pos_queryᵀ`` at
    ``clamp(-r_pos + span)`` with ``r_pos = k_ids - q_ids`` laid out ``[key, query]``,
    then transposes. Materialised here as ``R[i, j]`` tensors as in the survey's
    pseudocode. q: ``[T, N, H]``, k: ``[S, N, H]``, pos_*: ``[2·span, N, H]``.
    Returns ``[N, T, S]`` including the ``1/√(3H)`` scale.
    """
    q, k, pos_query, pos_key = (np.asarray(a, np.float64) for a in (q, k, pos_query, pos_key))
    q_ids, k_ids = np.asarray(q_pos), np.asarray(k_pos)

    def bucket(rel):
        if position_buckets > 0:
            return deberta_log_bucket_position(rel, position_buckets, max_relative_positions)
        return rel

    relative_pos = bucket(q_ids[:, None] - k_ids[None, :])  # [T, S]
    c2p_pos = np.clip(relative_pos + span, 0, 2 * span - 1)
    r_pos = bucket(k_ids[:, None] - q_ids[None, :])  # [S, T]
    p2c_pos = np.clip(-r_pos + span, 0, 2 * span - 1)
    R_c2p = pos_key[c2p_pos]  # [T, S, N, H]
    R_p2c = pos_query[p2c_pos.T]  # [T, S, N, H]
    c2p = np.einsum("iNH,ijNH->Nij", q, R_c2p)
    p2c = np.einsum("ijNH,jNH->Nij", R_p2c, k)
    return (c2p + p2c) / math.sqrt(q.shape[-1] * 3)
