"""The config protocol for encodings without parameters: each is its own config.

Every registered encoding config has ``init(key, *, num_heads, head_dim,
model_dim) -> params`` and ``build(params) -> encoding`` (see
:mod:`posenc_jax.functional.registry`). For a parameter-free encoding ``init``
returns no parameters and ``build`` returns the encoding itself.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["ParameterFree"]


class ParameterFree:
    """Mixin: ``init`` makes no parameters, ``build`` returns ``self``."""

    shares_bias: ClassVar[bool] = False

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        return {}

    def build(self, params: dict):
        return self
