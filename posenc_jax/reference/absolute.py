"""Reference sinusoidal table: d2l §11.6 ``PositionalEncoding``, in float64."""

import numpy as np


def d2l_positional_encoding(max_len: int, num_hiddens: int) -> np.ndarray:
    """``P`` of d2l's ``PositionalEncoding``: ``[max_len, num_hiddens]`` float64.

    Transliterated from the source::

        X = arange(max_len).reshape(-1, 1) / power(10000, arange(0, num_hiddens, 2) / num_hiddens)
        P[:, :, 0::2] = sin(X)
        P[:, :, 1::2] = cos(X)
    """
    P = np.zeros((max_len, num_hiddens))
    X = np.arange(max_len, dtype=np.float64).reshape(-1, 1) / np.power(
        10000.0, np.arange(0, num_hiddens, 2, dtype=np.float64) / num_hiddens
    )
    P[:, 0::2] = np.sin(X)
    P[:, 1::2] = np.cos(X)
    return P
