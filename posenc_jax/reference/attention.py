"""Reference attention: the survey pseudocode's einsums, in float64."""

import numpy as np


def seed_attention(Q, K, V, mask=None, bias=None):
    """``softmax((einsum('bik,bjk->bij', Q, K)) / sqrt(d) + bias) @ V`` per head, float64.

    Q: ``[b, i, k]``, K and V: ``[b, j, k]`` (one head per leading index),
    mask: boolean ``[b, i, j]`` (True = attend), bias: ``[b, i, j]`` added after
    the scaling. Fully masked rows give zeros. Transliterated from the source::

        Attn = softmax(einsum("bik,bjk->bij", Q, K) / sqrt(d))
        O = einsum("bij,bjk->bik", Attn, V)
    """
    Q, K, V = (np.asarray(a, np.float64) for a in (Q, K, V))
    d = Q.shape[-1]
    logits = np.einsum("bik,bjk->bij", Q, K) / np.sqrt(d)
    if bias is not None:
        logits = logits + bias
    if mask is None:
        mask = np.ones(logits.shape, bool)
    logits = np.where(mask, logits, -np.inf)
    row_max = np.max(logits, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(mask, np.exp(logits - row_max), 0.0)
    total = e.sum(-1, keepdims=True)
    attn = e / np.where(total > 0, total, 1.0)
    return np.einsum("bij,bjk->bik", attn, V)
