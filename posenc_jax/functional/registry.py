"""Encodings by name: frozen configuration dataclasses behind one registry.

``encoding_config("rope-yarn", factor=4.0, original_context=512)`` returns a frozen
config; every config has

* ``init(key, *, num_heads, head_dim, model_dim) -> dict`` of parameter arrays
  (empty for parameter-free encodings), and
* ``build(params) -> encoding``, the hook object for
  :func:`posenc_jax.functional.dot_product_attention` (or, for absolute encodings,
  an object with ``embed``).

Parameter-free encodings (NoPE, sinusoidal, RoPE and its scalings, xPos, axial
RoPE, ALiBi, the functional relative encoding) are their own configs. Learned
ones (learned absolute, Shaw, Transformer-XL, T5, DeBERTa, clipped bias, Kerple,
FIRE, CoPE) have a ``...Config`` holding their hyper-parameters; Flax modules hold
the parameters that ``init`` makes and call ``build`` in each forward pass.
``shares_bias`` says whether the encoding's bias depends on positions alone, so
that a model may compute it once per forward for all layers.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.absolute import LearnedAbsolute, NoPE, Sinusoidal
from posenc_jax.functional.alibi import ALiBi
from posenc_jax.functional.cope import CoPE
from posenc_jax.functional.deberta import DeBERTa
from posenc_jax.functional.fire import Fire, fire_init
from posenc_jax.functional.kerple import Kerple
from posenc_jax.functional.learned_relative import ClippedRelativeBias
from posenc_jax.functional.parameter_free import ParameterFree
from posenc_jax.functional.relative import check_max_distance
from posenc_jax.functional.rope import AxialRoPE, RoPE
from posenc_jax.functional.rope_scaling import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    NTKScaling,
    YaRNScaling,
)
from posenc_jax.functional.shaw import Shaw
from posenc_jax.functional.sinusoidal_relative import SinusoidalRelative
from posenc_jax.functional.t5 import T5Bias
from posenc_jax.functional.transformer_xl import TransformerXL
from posenc_jax.functional.xpos import XPos

__all__ = [
    "CoPEConfig",
    "ClippedBiasConfig",
    "DeBERTaConfig",
    "FireConfig",
    "KerpleConfig",
    "LearnedAbsoluteConfig",
    "ParameterFree",
    "ShawConfig",
    "T5Config",
    "TransformerXLConfig",
    "encoding_config",
    "encoding_names",
    "register_encoding",
]

_REGISTRY: dict[str, Callable] = {}


def register_encoding(name: str, factory: Callable | None = None):
    """Registers ``factory(**overrides) -> config`` under ``name`` (usable as a decorator)."""

    def add(f):
        if name in _REGISTRY:
            raise ValueError(f"encoding name {name!r} is already registered")
        _REGISTRY[name] = f
        return f

    return add(factory) if factory is not None else add


def encoding_names() -> list[str]:
    """The registered encoding names, sorted."""
    return sorted(_REGISTRY)


def encoding_config(name: str, **overrides):
    """The config registered as ``name``, with ``overrides`` for its fields.

    Example:
      >>> encoding_config("alibi")
      ALiBi(bidirectional=False)
      >>> encoding_config("rope-pi", factor=4.0).scaling
      LinearScaling(factor=4.0)
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown encoding {name!r}; known encodings: {', '.join(encoding_names())}")
    factory = _REGISTRY[name]
    try:
        return factory(**overrides)
    except TypeError as error:
        fields = list(inspect.signature(factory).parameters)
        raise ValueError(f"bad settings {overrides} for encoding {name!r} (its settings: {fields}): {error}") from None


def _normal(key, shape, std):
    return jax.random.normal(key, shape, jnp.float32) * std


@dataclasses.dataclass(frozen=True)
class LearnedAbsoluteConfig:
    """Learned absolute table ``[max_positions, D]``, N(0, 0.02) as in BERT."""

    max_positions: int = 512
    init_std: float = 0.02
    shares_bias: ClassVar[bool] = False

    def __post_init__(self):
        check_max_distance(self.max_positions, "max_positions")

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        return {"table": _normal(key, (self.max_positions, model_dim), self.init_std)}

    def build(self, params: dict):
        return LearnedAbsolute(params["table"])


@dataclasses.dataclass(frozen=True)
class ShawConfig:
    """Shaw et al. tables ``[2k+1, H]`` (or per head ``[N, 2k+1, H]``) for keys and, optionally, values."""

    max_distance: int = 16
    value_term: bool = True
    per_head: bool = False
    init_std: float = 0.02
    shares_bias: ClassVar[bool] = False

    def __post_init__(self):
        check_max_distance(self.max_distance)

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        rows = 2 * self.max_distance + 1
        shape = (num_heads, rows, head_dim) if self.per_head else (rows, head_dim)
        k1, k2 = jax.random.split(key)
        params = {"key_table": _normal(k1, shape, self.init_std)}
        if self.value_term:
            params["value_table"] = _normal(k2, shape, self.init_std)
        return params

    def build(self, params: dict):
        return Shaw(self.max_distance, params["key_table"], params.get("value_table"))


@dataclasses.dataclass(frozen=True)
class TransformerXLConfig:
    """Transformer-XL: ``W_R`` ``[D, N, H]`` (D = model dim by default), ``u``, ``v`` ``[N, H]`` at zero."""

    sinusoid_dim: int | None = None
    base: float = 10000.0
    shares_bias: ClassVar[bool] = False

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        dim = self.sinusoid_dim or model_dim
        if dim % 2:
            raise ValueError(f"the Transformer-XL sinusoid width must be even, got {dim}")
        return {
            "position_projection": _normal(key, (dim, num_heads, head_dim), 1.0 / np.sqrt(dim)),
            "content_bias": jnp.zeros((num_heads, head_dim)),
            "position_bias": jnp.zeros((num_heads, head_dim)),
        }

    def build(self, params: dict):
        return TransformerXL(params["position_projection"], params["content_bias"], params["position_bias"], base=self.base)


@dataclasses.dataclass(frozen=True)
class T5Config:
    """T5 bucket table ``[num_buckets, N]``."""

    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True
    init_std: float = 0.02
    shares_bias: ClassVar[bool] = True

    def __post_init__(self):
        T5Bias(jnp.zeros((self.num_buckets, 1)), bidirectional=self.bidirectional, max_distance=self.max_distance)

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        return {"table": _normal(key, (self.num_buckets, num_heads), self.init_std)}

    def build(self, params: dict):
        return T5Bias(params["table"], bidirectional=self.bidirectional, max_distance=self.max_distance)


@dataclasses.dataclass(frozen=True)
class DeBERTaConfig:
    """DeBERTa position tables ``Q_r``, ``K_r`` ``[2·span, N, H]``; span = buckets if bucketed."""

    span: int = 256
    position_buckets: int = 0
    max_relative_positions: int = 512
    init_std: float = 0.02
    shares_bias: ClassVar[bool] = False

    def __post_init__(self):
        check_max_distance(self.span, "span")
        if self.position_buckets and self.position_buckets != self.span:
            raise ValueError(
                f"with log buckets DeBERTa's span is the bucket count: span={self.span} != "
                f"position_buckets={self.position_buckets}"
            )

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        k1, k2 = jax.random.split(key)
        shape = (2 * self.span, num_heads, head_dim)
        return {"pos_query": _normal(k1, shape, self.init_std), "pos_key": _normal(k2, shape, self.init_std)}

    def build(self, params: dict):
        return DeBERTa(
            params["pos_query"], params["pos_key"], self.span, position_buckets=self.position_buckets,
            max_relative_positions=self.max_relative_positions,
        )


@dataclasses.dataclass(frozen=True)
class ClippedBiasConfig:
    """Learned clipped relative bias ``[2k+1, N]``, N(0, 0.02) as in seed 003."""

    max_distance: int = 128
    init_std: float = 0.02
    shares_bias: ClassVar[bool] = True

    def __post_init__(self):
        check_max_distance(self.max_distance)

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        return {"table": _normal(key, (2 * self.max_distance + 1, num_heads), self.init_std)}

    def build(self, params: dict):
        return ClippedRelativeBias(params["table"], self.max_distance)


@dataclasses.dataclass(frozen=True)
class KerpleConfig:
    """Kerple ``r1``, ``r2`` ``[N]``; kept positive (and r2 <= 2 for power) by clamping at ``eps``.

    Initialised as in the authors' code: ``r1 ~ U(0, 1)``, ``r2 ~ U(0, 2)`` (power) or
    ``U(0, 1)`` (log), then clamped.
    """

    variant: Literal["log", "power"] = "log"
    eps: float = 1e-2
    shares_bias: ClassVar[bool] = True

    def __post_init__(self):
        if self.variant not in ("log", "power"):
            raise ValueError(f"variant must be 'log' or 'power', got {self.variant!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        k1, k2 = jax.random.split(key)
        r2_max = 2.0 if self.variant == "power" else 1.0
        return {
            "r1": jax.random.uniform(k1, (num_heads,), minval=self.eps, maxval=1.0),
            "r2": jax.random.uniform(k2, (num_heads,), minval=self.eps, maxval=r2_max),
        }

    def build(self, params: dict):
        r1 = jnp.maximum(params["r1"], self.eps)
        r2 = jnp.maximum(params["r2"], self.eps)
        if self.variant == "power":
            r2 = jnp.minimum(r2, 2.0)
        return Kerple(r1, r2, variant=self.variant)


@dataclasses.dataclass(frozen=True)
class FireConfig:
    """FIRE MLP (``hidden`` units), ``c`` and threshold ``L``; see :func:`fire_init`."""

    hidden: int = 32
    c: float = 0.1
    threshold: float = 512.0
    shares_bias: ClassVar[bool] = True

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        return fire_init(key, num_heads, hidden=self.hidden, c=self.c, threshold=self.threshold)

    def build(self, params: dict):
        return Fire(params)


@dataclasses.dataclass(frozen=True)
class CoPEConfig:
    """CoPE position embeddings ``[P, H]`` (or ``[N, P, H]``), zeros at init as in the authors' code."""

    num_positions: int = 64
    per_head: bool = False
    shares_bias: ClassVar[bool] = False

    def __post_init__(self):
        check_max_distance(self.num_positions, "num_positions")

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        shape = (num_heads, self.num_positions, head_dim) if self.per_head else (self.num_positions, head_dim)
        return {"embeddings": jnp.zeros(shape)}

    def build(self, params: dict):
        return CoPE(params["embeddings"])


def _scaled_rope(scaling_cls):
    scaling_fields = {f.name for f in dataclasses.fields(scaling_cls)}

    def factory(**settings):
        scaling = scaling_cls(**{k: v for k, v in settings.items() if k in scaling_fields})
        return RoPE(scaling=scaling, **{k: v for k, v in settings.items() if k not in scaling_fields})

    factory.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in sorted(scaling_fields)]
        + [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in ("base", "rotary_dim", "layout")]
    )
    return factory


register_encoding("nope", NoPE)
register_encoding("sinusoidal", Sinusoidal)
register_encoding("learned", LearnedAbsoluteConfig)
register_encoding("rope", RoPE)
register_encoding("rope-pi", _scaled_rope(LinearScaling))
register_encoding("rope-ntk", _scaled_rope(NTKScaling))
register_encoding("rope-dynamic-ntk", _scaled_rope(DynamicNTKScaling))
register_encoding("rope-yarn", _scaled_rope(YaRNScaling))
register_encoding("rope-llama3", _scaled_rope(Llama3Scaling))
register_encoding("rope-longrope", _scaled_rope(LongRoPEScaling))
register_encoding("rope-2d", AxialRoPE)
register_encoding("xpos", XPos)
register_encoding("alibi", ALiBi)
register_encoding("kerple-log", lambda **kw: KerpleConfig(variant="log", **kw))
register_encoding("kerple-power", lambda **kw: KerpleConfig(variant="power", **kw))
register_encoding("fire", FireConfig)
register_encoding("cope", CoPEConfig)
register_encoding("shaw", ShawConfig)
register_encoding("transformer-xl", TransformerXLConfig)
register_encoding("t5", T5Config)
register_encoding("deberta", DeBERTaConfig)
register_encoding("clipped-bias", ClippedBiasConfig)
register_encoding("functional-relative", SinusoidalRelative)
