"""Plain float64 NumPy transliterations of the source pseudocode.

These are the obviously-correct references that every fast path in
``posenc_jax.functional`` is tested against. They follow the seeds line by line
(d2l's ``PositionalEncoding``, Su's RoPE pseudocode, the survey's attention and
relative-encoding einsums) or the reference code a docstring names, may
materialise whatever they like, and are not meant to be fast.
"""

from posenc_jax.reference import relative, sandwich
from posenc_jax.reference.absolute import d2l_positional_encoding
from posenc_jax.reference.attention import seed_attention
from posenc_jax.reference.rope import rope_by_rotation_matrices, su_rope

__all__ = ["d2l_positional_encoding", "relative", "rope_by_rotation_matrices", "sandwich", "seed_attention", "su_rope"]
