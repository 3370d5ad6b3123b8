"""RoPE scalings: how each context-extension method changes RoPE's frequencies.

Each scaling is a frozen dataclass with a registered ``name`` and two methods,
``inverse_frequencies(rotary_dim, base, length)`` (``[rotary_dim / 2]`` float64,
computed on the host so the phases stay exact) and ``attention_factor(length)``
(multiplies both rotated q and k, so scores scale by its square; 1 for most).
``length`` is the current sequence length, ``max(query_positions) + 1`` as in
Hugging Face transformers; only dynamic NTK and LongRoPE read it
(``length_dependent``), through ``angles(positions, rotary_dim, base, length)``
with ``length`` a traced scalar. Pass one as ``RoPE(scaling=...)``; each is also
registered as ``rope-<name>`` (``encoding_config("rope-yarn", factor=4.0,
original_context=512)``).

With ``θ_i = base ** (-2i / R)`` and scale factor ``s >= 1``:

* ``linear`` — position interpolation (Chen et al. 2023, arXiv:2306.15595):
  ``θ_i / s``; position p behaves like p / s.
* ``ntk`` — NTK-aware base change (bloc97 2023; YaRN paper eq. 16):
  ``base' = base · s ** (R / (R - 2))``.
* ``dynamic-ntk`` — NTK with the base recomputed from the current length L
  (as in Hugging Face transformers): plain RoPE for ``L <= L_orig``, else
  ``base' = base · (s·L/L_orig - (s - 1)) ** (R / (R - 2))``.
* ``yarn`` — YaRN (Peng et al. 2023, arXiv:2309.00071): "NTK-by-parts"
  interpolation with ramp bounds β = 32 and α = 1 rotations over the original
  context, and attention factor ``0.1 · ln s + 1``. The ramp follows the
  authors' released code (linear in the dimension index between the correction
  dimensions, floor/ceil rounded), which is what YaRN checkpoints use.
* ``llama3`` — Llama 3.1's frequency-dependent scaling (factor, low/high
  frequency factors, original context): wavelengths shorter than
  ``L_orig / high`` are kept, longer than ``L_orig / low`` divided by s, a smooth
  blend between.
* ``longrope`` — LongRoPE (Ding et al. 2024, arXiv:2402.13753) as in Phi-3:
  per-frequency rescale factors, the short list up to ``L_orig`` and the long list
  beyond, attention factor ``sqrt(1 + ln(s) / ln(L_orig))``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.positions import check_positions, inverse_frequencies, position_angles
from posenc_jax.functional.core.registry import Source, dataclass_settings, register_encoding
from posenc_jax.functional.core.validation import check_count, check_number
from posenc_jax.functional.encodings.rope import RoPE

__all__ = [
    "DynamicNTKScaling",
    "RopeScaling",
    "LinearScaling",
    "Llama3Scaling",
    "LongRoPEScaling",
    "NTKScaling",
    "YaRNScaling",
]


class RopeScaling:
    """Base of the RoPE scalings: angles from the host-computed frequencies, and sizing.

    Subclasses define ``inverse_frequencies(rotary_dim, base, length)`` and
    ``attention_factor(length)``; a length-dependent one also overrides :meth:`angles`.
    """

    name: ClassVar[str]
    length_dependent: ClassVar[bool] = False

    def angles(self, positions, rotary_dim: int, base: float, length) -> jax.Array:
        """``[..., T, R/2]`` float32 angles of ``positions`` for a sequence of ``length`` tokens."""
        return position_angles(positions, self.inverse_frequencies(rotary_dim, base, None))

    def for_lengths(self, *, train_length: int, max_length: int, rotary_dim: int) -> RopeScaling:
        """The scaling for a model trained on ``train_length`` tokens and tested up to ``max_length``."""
        settings = {"factor": max(1.0, max_length / train_length)}
        if "original_context" in {f.name for f in dataclasses.fields(self)}:
            settings["original_context"] = train_length
        return dataclasses.replace(self, **settings)


def _check_factor(factor):
    if not isinstance(factor, (int, float, np.floating, np.integer)) or not 1.0 <= factor < math.inf:
        raise ValueError(
            f"scaling factor must be a number >= 1 and finite (the context-length multiple), got {factor!r}"
        )


def _check_context(original_context):
    if not isinstance(original_context, (int, np.integer)) or original_context < 1:
        raise ValueError(f"original_context must be an integer >= 1, got {original_context!r}")


@dataclasses.dataclass(frozen=True)
class LinearScaling(RopeScaling):
    """Position interpolation: ``θ_i / factor`` (Chen et al. 2023)."""

    factor: float
    name: ClassVar[str] = "linear"

    def __post_init__(self):
        _check_factor(self.factor)

    def inverse_frequencies(self, rotary_dim: int, base: float, length: int | None = None) -> np.ndarray:
        return inverse_frequencies(rotary_dim, base=base) / self.factor

    def attention_factor(self, length: int | None = None) -> float:
        return 1.0


@dataclasses.dataclass(frozen=True)
class NTKScaling(RopeScaling):
    """NTK-aware: ``base · factor ** (R / (R - 2))``, applied from position 0."""

    factor: float
    name: ClassVar[str] = "ntk"

    def __post_init__(self):
        _check_factor(self.factor)

    def inverse_frequencies(self, rotary_dim: int, base: float, length: int | None = None) -> np.ndarray:
        new_base = base * self.factor ** (rotary_dim / (rotary_dim - 2)) if rotary_dim > 2 else base
        return inverse_frequencies(rotary_dim, base=new_base)

    def attention_factor(self, length: int | None = None) -> float:
        return 1.0


@dataclasses.dataclass(frozen=True)
class DynamicNTKScaling(RopeScaling):
    """Dynamic NTK: plain RoPE up to ``original_context``, NTK base grown with the length past it."""

    factor: float
    original_context: int
    name: ClassVar[str] = "dynamic-ntk"
    length_dependent: ClassVar[bool] = True

    def __post_init__(self):
        _check_factor(self.factor)
        _check_context(self.original_context)

    def inverse_frequencies(self, rotary_dim: int, base: float, length: int | None = None) -> np.ndarray:
        if length is None or length <= self.original_context or rotary_dim <= 2:
            return inverse_frequencies(rotary_dim, base=base)
        growth = self.factor * length / self.original_context - (self.factor - 1)
        return inverse_frequencies(rotary_dim, base=base * growth ** (rotary_dim / (rotary_dim - 2)))

    def attention_factor(self, length: int | None = None) -> float:
        return 1.0

    def angles(self, positions, rotary_dim: int, base: float, length) -> jax.Array:
        """Exact plain-RoPE angles up to ``original_context``; past it, the grown base's
        frequencies computed in float32 from the traced length (as transformers does)."""
        positions = check_positions(positions)
        plain = position_angles(positions, inverse_frequencies(rotary_dim, base=base))
        if rotary_dim <= 2:
            return plain
        length = jnp.asarray(length, jnp.float32)
        growth = self.factor * length / self.original_context - (self.factor - 1)
        grown_base = jnp.float32(base) * jnp.maximum(growth, 1.0) ** (rotary_dim / (rotary_dim - 2))
        exponents = jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim
        freq = grown_base**-exponents
        scaled = positions.astype(jnp.float32)[..., None] * freq.reshape((1,) * positions.ndim + freq.shape)
        return jnp.where(length > self.original_context, scaled, plain)


@dataclasses.dataclass(frozen=True)
class YaRNScaling(RopeScaling):
    """YaRN: NTK-by-parts interpolation with β = 32, α = 1 and attention factor ``0.1 ln s + 1``.

    The optional fields are those of Hugging Face transformers' ``rope_scaling`` for
    ``rope_type="yarn"``: ``attention_scaling`` fixes the attention factor (their
    ``attention_factor``); otherwise, with both ``mscale`` and ``mscale_all_dim`` set
    (DeepSeek-V2/V3), it is ``m(s, mscale) / m(s, mscale_all_dim)`` with
    ``m(s, a) = 0.1 · a · ln s + 1``, and ``m(s, 1)`` without them. ``truncate=False``
    keeps the ramp bounds unrounded (gpt-oss).
    """

    factor: float
    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_scaling: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    name: ClassVar[str] = "yarn"

    def __post_init__(self):
        _check_factor(self.factor)
        _check_context(self.original_context)
        check_number("beta_fast", self.beta_fast, above=0, fix="32 in the paper")
        check_number("beta_slow", self.beta_slow, above=0, fix="1 in the paper")
        if not self.beta_fast > self.beta_slow:
            raise ValueError(f"need beta_fast > beta_slow > 0, got {self.beta_fast}, {self.beta_slow}")
        check_number("attention_scaling", self.attention_scaling, above=0, optional=True)
        check_number("mscale", self.mscale, at_least=0, optional=True)
        check_number("mscale_all_dim", self.mscale_all_dim, at_least=0, optional=True)

    def _correction_dim(self, rotations: float, rotary_dim: int, base: float) -> float:
        # The dimension index whose wavelength makes `rotations` turns over the original context.
        return rotary_dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    def extrapolation_weight(self, rotary_dim: int, base: float) -> np.ndarray:
        """Per frequency, 1 where RoPE is kept (high frequency) and 0 where interpolated (low)."""
        low = self._correction_dim(self.beta_fast, rotary_dim, base)
        high = self._correction_dim(self.beta_slow, rotary_dim, base)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        return 1.0 - ramp

    def inverse_frequencies(self, rotary_dim: int, base: float, length: int | None = None) -> np.ndarray:
        plain = inverse_frequencies(rotary_dim, base=base)
        keep = self.extrapolation_weight(rotary_dim, base)
        return plain / self.factor * (1.0 - keep) + plain * keep

    def attention_factor(self, length: int | None = None) -> float:
        if self.attention_scaling is not None:
            return float(self.attention_scaling)

        def magnitude(scale: float, mscale: float = 1.0) -> float:
            return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0

        if self.mscale and self.mscale_all_dim:
            return magnitude(self.factor, self.mscale) / magnitude(self.factor, self.mscale_all_dim)
        return magnitude(self.factor)


@dataclasses.dataclass(frozen=True)
class Llama3Scaling(RopeScaling):
    """Llama 3.1: keep short wavelengths, divide long ones by ``factor``, blend between."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    name: ClassVar[str] = "llama3"

    def __post_init__(self):
        _check_factor(self.factor)
        _check_context(self.original_context)
        check_number("low_freq_factor", self.low_freq_factor, above=0, fix="1 in Llama 3")
        check_number("high_freq_factor", self.high_freq_factor, above=0, fix="4 in Llama 3")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"need high_freq_factor > low_freq_factor > 0, got {self.high_freq_factor}, {self.low_freq_factor}"
            )

    def inverse_frequencies(self, rotary_dim: int, base: float, length: int | None = None) -> np.ndarray:
        freq = inverse_frequencies(rotary_dim, base=base)
        wavelength = 2 * math.pi / freq
        low_wavelength = self.original_context / self.low_freq_factor
        high_wavelength = self.original_context / self.high_freq_factor
        smooth = (self.original_context / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * freq / self.factor + smooth * freq
        return np.where(
            wavelength < high_wavelength, freq, np.where(wavelength > low_wavelength, freq / self.factor, blended)
        )

    def attention_factor(self, length: int | None = None) -> float:
        return 1.0


@dataclasses.dataclass(frozen=True)
class LongRoPEScaling(RopeScaling):
    """LongRoPE: per-frequency factors, ``short_factor`` up to the original context, ``long_factor`` beyond.

    The attention factor is ``sqrt(1 + ln(s) / ln(original_context))`` with ``s = factor`` when
    given (transformers' optional ``factor``), else ``max_context / original_context``;
    ``attention_scaling`` fixes it instead (their ``attention_factor``).
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_context: int
    max_context: int
    factor: float | None = None
    attention_scaling: float | None = None
    name: ClassVar[str] = "longrope"
    length_dependent: ClassVar[bool] = True

    def __post_init__(self):
        _check_context(self.original_context)
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(
                f"short_factor and long_factor must have one entry per frequency (rotary_dim / 2), got "
                f"{len(self.short_factor)} and {len(self.long_factor)}"
            )
        for name in ("short_factor", "long_factor"):
            factors = getattr(self, name)
            fix = "give a tuple of numbers, one per frequency"
            if not isinstance(factors, (tuple, list, np.ndarray)):
                raise TypeError(f"LongRoPE {name} must be a tuple of numbers, got {factors!r}; {fix}")
            for i, factor in enumerate(factors):
                if isinstance(factor, (bool, np.bool_)) or not isinstance(
                    factor, (int, float, np.integer, np.floating)
                ):
                    raise TypeError(f"LongRoPE {name}[{i}] must be a number, got {factor!r}; {fix}")
            factors = np.asarray(factors, np.float64)
            if factors.ndim != 1 or not np.all(np.isfinite(factors) & (factors > 0)):
                raise ValueError(
                    f"LongRoPE {name} must be finite numbers > 0 (each frequency is divided by its factor), "
                    f"got {getattr(self, name)!r}"
                )
        check_count("max_context", self.max_context)
        if not self.max_context >= self.original_context:
            raise ValueError(f"max_context must be >= original_context={self.original_context}, got {self.max_context}")
        check_number("LongRoPE factor", self.factor, above=0, optional=True)
        check_number("attention_scaling", self.attention_scaling, above=0, optional=True)

    def inverse_frequencies(self, rotary_dim: int, base: float, length: int | None = None) -> np.ndarray:
        if len(self.short_factor) != rotary_dim // 2:
            raise ValueError(
                f"LongRoPE factor lists have {len(self.short_factor)} entries but rotary_dim={rotary_dim} "
                f"needs {rotary_dim // 2}"
            )
        use_long = length is not None and length > self.original_context
        factors = np.asarray(self.long_factor if use_long else self.short_factor, np.float64)
        return inverse_frequencies(rotary_dim, base=base) / factors

    def angles(self, positions, rotary_dim: int, base: float, length) -> jax.Array:
        """The short factors' angles up to ``original_context``, the long ones' past it (both exact)."""
        short = position_angles(positions, self.inverse_frequencies(rotary_dim, base, self.original_context))
        long = position_angles(positions, self.inverse_frequencies(rotary_dim, base, self.original_context + 1))
        return jnp.where(length > self.original_context, long, short)

    def for_lengths(self, *, train_length: int, max_length: int, rotary_dim: int) -> LongRoPEScaling:
        """Uniform factors: 1 up to the training length, ``max_length / train_length`` beyond."""
        factor = max(1.0, max_length / train_length)
        half = rotary_dim // 2
        return LongRoPEScaling(
            short_factor=(1.0,) * half,
            long_factor=(factor,) * half,
            original_context=train_length,
            max_context=max(max_length, train_length),
        )

    def attention_factor(self, length: int | None = None) -> float:
        if self.attention_scaling is not None:
            return float(self.attention_scaling)
        scale = self.factor if self.factor is not None else self.max_context / self.original_context
        if scale <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(scale) / math.log(self.original_context))


def _scaled_rope(scaling_type: type):
    """``factory(**settings)`` for ``rope-<name>``: the scaling's fields build the scaling, the rest RoPE's."""
    scaling_fields = {f.name for f in dataclasses.fields(scaling_type)}

    def factory(**settings):
        scaling = scaling_type(**{k: v for k, v in settings.items() if k in scaling_fields})
        return RoPE(scaling=scaling, **{k: v for k, v in settings.items() if k not in scaling_fields})

    settings, required = dataclass_settings(scaling_type)
    return factory, settings + ("base", "rotary_dim", "layout"), required


PI = Source.paper(
    "chen2023extending",
    title="Extending Context Window of Large Language Models via Positional Interpolation",
    authors="Chen, Shouyuan and Wong, Sherman and Chen, Liangjian and Tian, Yuandong",
    year=2023,
    arxiv="2306.15595",
)
YARN = Source.paper(
    "peng2023yarn",
    title="YaRN: Efficient Context Window Extension of Large Language Models",
    authors="Peng, Bowen and Quesnelle, Jeffrey and Fan, Honglu and Shippole, Enrico",
    year=2023,
    arxiv="2309.00071",
)
LLAMA3 = Source.paper(
    "grattafiori2024llama3",
    title="The Llama 3 Herd of Models",
    authors="Grattafiori, Aaron and others",
    year=2024,
    arxiv="2407.21783",
)
LONGROPE = Source.paper(
    "ding2024longrope",
    title="LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens",
    authors="Ding, Yiran and Zhang, Li Lyna and Zhang, Chengruidong and Xu, Yuanyuan and Shang, Ning and "
    "Xu, Jiahang and Yang, Fan and Yang, Mao",
    year=2024,
    arxiv="2402.13753",
)
_SCALINGS = (
    (
        "rope-pi",
        LinearScaling,
        "RoPE with position interpolation: every frequency divided by the factor.",
        PI,
        dict(factor=2.0),
    ),
    (
        "rope-ntk",
        NTKScaling,
        "RoPE with the NTK-aware base change base * s^(R/(R-2)) (YaRN paper, eq. 16).",
        YARN,
        dict(factor=2.0),
    ),
    (
        "rope-dynamic-ntk",
        DynamicNTKScaling,
        "RoPE with the NTK base regrown from the current length max(position) + 1 past the original context.",
        YARN,
        dict(factor=2.0, original_context=4),
    ),
    (
        "rope-yarn",
        YaRNScaling,
        "RoPE with YaRN's NTK-by-parts interpolation and attention factor 0.1 ln s + 1.",
        YARN,
        dict(factor=2.0, original_context=4),
    ),
    (
        "rope-llama3",
        Llama3Scaling,
        "RoPE with Llama 3.1's wavelength-dependent scaling.",
        LLAMA3,
        dict(factor=2.0, original_context=4),
    ),
    (
        "rope-longrope",
        LongRoPEScaling,
        "RoPE with LongRoPE's per-frequency factors, short up to the original context and long beyond.",
        LONGROPE,
        dict(short_factor=(1.0,) * 4, long_factor=(2.0,) * 4, original_context=4, max_context=16),
    ),
)
for _name, _type, _description, _source, _small in _SCALINGS:
    _factory, _settings, _required = _scaled_rope(_type)
    register_encoding(
        _name,
        description=_description,
        source=_source,
        factory=_factory,
        settings=_settings,
        required=_required,
        length_dependent=_type.length_dependent,
        kv_cache=not _type.length_dependent,
        small_settings=_small,
        hooks=("rotate",),
        tiled=(),
        cached=("rotation",),
        prepared="tables",
        fused=("per_call",),
    )(RoPE)
