"""RoPE scalings: how each context-extension method changes RoPE's frequencies.

Each scaling is a frozen dataclass with a registered ``name`` and two methods,
``inverse_frequencies(rotary_dim, base, length)`` (``[rotary_dim / 2]`` float64,
computed on the host so the phases stay exact) and ``attention_factor(length)``
(multiplies both rotated q and k, so scores scale by its square; 1 for most).
``length`` is the static number of keys of the current call; only dynamic NTK and
LongRoPE read it (``length_dependent``), so they cannot be used with a KV cache,
whose keys were rotated at other lengths. Pass one as ``RoPE(scaling=...)``.

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

import numpy as np

from posenc_jax.functional.positions import inverse_frequencies

__all__ = [
    "DynamicNTKScaling",
    "LinearScaling",
    "Llama3Scaling",
    "LongRoPEScaling",
    "NTKScaling",
    "YaRNScaling",
]


def _check_factor(factor):
    if not isinstance(factor, (int, float, np.floating, np.integer)) or not factor >= 1.0:
        raise ValueError(f"scaling factor must be a number >= 1 (the context-length multiple), got {factor!r}")


def _check_context(original_context):
    if not isinstance(original_context, (int, np.integer)) or original_context < 1:
        raise ValueError(f"original_context must be an integer >= 1, got {original_context!r}")


@dataclasses.dataclass(frozen=True)
class LinearScaling:
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
class NTKScaling:
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
class DynamicNTKScaling:
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


@dataclasses.dataclass(frozen=True)
class YaRNScaling:
    """YaRN: NTK-by-parts interpolation with β = 32, α = 1 and attention factor ``0.1 ln s + 1``."""

    factor: float
    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    name: ClassVar[str] = "yarn"

    def __post_init__(self):
        _check_factor(self.factor)
        _check_context(self.original_context)
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(f"need beta_fast > beta_slow > 0, got {self.beta_fast}, {self.beta_slow}")

    def _correction_dim(self, rotations: float, rotary_dim: int, base: float) -> float:
        # The dimension index whose wavelength makes `rotations` turns over the original context.
        return rotary_dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    def extrapolation_weight(self, rotary_dim: int, base: float) -> np.ndarray:
        """Per frequency, 1 where RoPE is kept (high frequency) and 0 where interpolated (low)."""
        low = max(math.floor(self._correction_dim(self.beta_fast, rotary_dim, base)), 0)
        high = min(math.ceil(self._correction_dim(self.beta_slow, rotary_dim, base)), rotary_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        return 1.0 - ramp

    def inverse_frequencies(self, rotary_dim: int, base: float, length: int | None = None) -> np.ndarray:
        plain = inverse_frequencies(rotary_dim, base=base)
        keep = self.extrapolation_weight(rotary_dim, base)
        return plain / self.factor * (1.0 - keep) + plain * keep

    def attention_factor(self, length: int | None = None) -> float:
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1: keep short wavelengths, divide long ones by ``factor``, blend between."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    name: ClassVar[str] = "llama3"

    def __post_init__(self):
        _check_factor(self.factor)
        _check_context(self.original_context)
        if not self.high_freq_factor > self.low_freq_factor > 0:
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
        return np.where(wavelength < high_wavelength, freq, np.where(wavelength > low_wavelength, freq / self.factor, blended))

    def attention_factor(self, length: int | None = None) -> float:
        return 1.0


@dataclasses.dataclass(frozen=True)
class LongRoPEScaling:
    """LongRoPE: per-frequency factors, ``short_factor`` up to the original context, ``long_factor`` beyond."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_context: int
    max_context: int
    name: ClassVar[str] = "longrope"
    length_dependent: ClassVar[bool] = True

    def __post_init__(self):
        _check_context(self.original_context)
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(
                f"short_factor and long_factor must have one entry per frequency (rotary_dim / 2), got "
                f"{len(self.short_factor)} and {len(self.long_factor)}"
            )
        if not self.max_context >= self.original_context:
            raise ValueError(
                f"max_context must be >= original_context={self.original_context}, got {self.max_context}"
            )

    def inverse_frequencies(self, rotary_dim: int, base: float, length: int | None = None) -> np.ndarray:
        if len(self.short_factor) != rotary_dim // 2:
            raise ValueError(
                f"LongRoPE factor lists have {len(self.short_factor)} entries but rotary_dim={rotary_dim} "
                f"needs {rotary_dim // 2}"
            )
        use_long = length is not None and length > self.original_context
        factors = np.asarray(self.long_factor if use_long else self.short_factor, np.float64)
        return inverse_frequencies(rotary_dim, base=base) / factors

    def attention_factor(self, length: int | None = None) -> float:
        scale = self.max_context / self.original_context
        if scale <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(scale) / math.log(self.original_context))
