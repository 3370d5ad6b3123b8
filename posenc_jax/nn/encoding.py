"""A Flax NNX module that holds one encoding's parameters.

Every encoding config (an :class:`~posenc_jax.functional.core.hooks.EncodingConfig`, see
:mod:`posenc_jax.functional.core.registry`) says how to make its parameters (``init``),
how to turn them into a hook object (``build``), and where it acts (``acts_on``).
:class:`PositionEncoding` stores those parameters as ``nnx.Param``
and, when called, returns the hook built from their current values. Parameter-free
encodings hold nothing and return themselves.
"""

from __future__ import annotations

from flax import nnx

from posenc_jax.functional.core.hooks import EncodingConfig
from posenc_jax.functional.core.registry import encoding_config

__all__ = ["PositionEncoding", "resolve_config"]


def resolve_config(encoding):
    """A config from a registered name (``"t5"``) or a config object (returned as is)."""
    if isinstance(encoding, str):
        return encoding_config(encoding)
    if not isinstance(encoding, EncodingConfig):
        raise ValueError(
            f"an encoding must be a registered name or an EncodingConfig (e.g. encoding_config('t5')), got {encoding!r}"
        )
    return encoding


def check_size(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class PositionEncoding(nnx.Module):
    """The parameters of one encoding; ``module()`` returns its hook object.

    Args:
      encoding: a registered name or config (e.g. ``"t5"``, ``T5Config(num_buckets=64)``).
      num_heads, head_dim, model_dim: the attention sizes the parameters are made for.
      rngs: ``nnx.Rngs`` with a ``params`` stream.

    Example:
      >>> enc = PositionEncoding("t5", num_heads=4, head_dim=16, model_dim=64, rngs=nnx.Rngs(0))
      >>> enc.table[...].shape
      (32, 4)
      >>> type(enc()).__name__
      'T5Bias'
    """

    def __init__(self, encoding, *, num_heads: int, head_dim: int, model_dim: int, rngs: nnx.Rngs):
        self.config = resolve_config(encoding)
        # The sizes the parameters are made for, so another encoding can be checked against them.
        self.sizes = (("num_heads", num_heads), ("head_dim", head_dim), ("model_dim", model_dim))
        params = self.config.init(rngs.params(), num_heads=num_heads, head_dim=head_dim, model_dim=model_dim)
        self.param_names = tuple(sorted(params))
        for name in self.param_names:
            setattr(self, name, nnx.Param(params[name]))

    @property
    def acts_on(self) -> str:
        """Where the encoding acts (its config's ``acts_on``)."""
        return self.config.acts_on

    def __call__(self):
        return self.config.build({name: getattr(self, name)[...] for name in self.param_names})
