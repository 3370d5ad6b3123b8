"""posenc_jax: transformer positional encodings in JAX, correct to the reference.

``posenc_jax.functional`` holds the pure functions (no Flax); ``posenc_jax.reference``
holds plain float64 NumPy transliterations of the source pseudocode that the
fast paths are tested against.
"""

from posenc_jax import functional

__version__ = "0.2.0"

__all__ = ["functional", "__version__"]
