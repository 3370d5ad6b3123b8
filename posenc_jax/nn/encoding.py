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
from posenc_jax.functional.core.registry import resolve_encoding
from posenc_jax.functional.core.validation import check_count, check_number

__all__ = ["PositionEncoding", "check_dropout_rate", "check_rngs", "check_size", "resolve_config"]


def resolve_config(encoding):
    """A config from a registered name (``"t5"``) or a config object (returned as is)."""
    encoding = resolve_encoding(encoding)
    if not isinstance(encoding, EncodingConfig):
        raise ValueError(
            f"an encoding must be a registered name or an EncodingConfig (e.g. encoding_config('t5')), got {encoding!r}"
        )
    return encoding


def check_size(name: str, value, minimum: int = 1) -> None:
    """A module's size: an integer >= ``minimum`` (TypeError for a float or a bool, ValueError below it)."""
    check_count(name, value, minimum)


def check_rngs(rngs) -> None:
    """Refuses ``rngs`` that are not ``nnx.Rngs`` (an int or a bare key is the common slip)."""
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(
            f"rngs must be flax.nnx.Rngs, got {rngs!r}; make them from a seed or a key, e.g. rngs=nnx.Rngs(0)"
        )


def check_dropout_rate(rate) -> float:
    """A dropout rate: a number in [0, 1)."""
    return check_number("dropout_rate", rate, at_least=0, below=1, fix="the fraction of weights dropped, 0.0 for none")


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
        check_rngs(rngs)
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
