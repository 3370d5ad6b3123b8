"""The one place the Pallas kernels choose interpret mode, and the pieces every kernel shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from posenc_jax.functional.core import operations

__all__ = ["Layout", "dot", "interpret_mode", "kernel_call", "masked_scores", "tile_bias"]

# The score of a masked pair: finite, so a row with no visible key has a finite running maximum.
MASKED = float(jnp.finfo(jnp.float32).min)


def interpret_mode(interpret: bool | None = None) -> bool:
    """Whether a kernel runs in Pallas' interpret mode: on the CPU (no Triton or Mosaic there), unless
    ``interpret`` says otherwise (``False`` to lower for a device, e.g. under ``jax.export``)."""
    return operations.current_backend() == "cpu" if interpret is None else bool(interpret)


def kernel_call(kernel, *, interpret: bool, **settings) -> Callable:
    """``pl.pallas_call(kernel, **settings)`` for every backend: interpreted, or lowered by Triton on a GPU
    and by Mosaic on a TPU (the platform is chosen when the program is lowered, so one traced function
    exports for both). Every grid axis is parallel: a program writes only its own output blocks."""
    if interpret:
        return pl.pallas_call(kernel, interpret=True, **settings)
    triton = pl.pallas_call(kernel, compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2), **settings)
    semantics = ("parallel",) * len(settings["grid"])
    mosaic = pl.pallas_call(kernel, compiler_params=pltpu.CompilerParams(dimension_semantics=semantics), **settings)
    return lambda *args: jax.lax.platform_dependent(*args, cuda=triton, rocm=triton, tpu=mosaic)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A call's static settings, shared by its forward and backward kernels.

    Attributes:
      block_q, block_k: tile sizes (they divide the padded lengths).
      q_len, k_len: padded lengths.
      groups: query heads per key/value head (N / K).
      causal: mask keys after the query by position.
      scale: the content-score scale.
      segments: whether segment ids are given; key_valid: whether a per-key validity is given.
      function: the bias's per-head function (None: no bias); num_parameters its parameter count.
      batched_positions, batched_segments, batched_valid: whether those arrays have a batch axis.
      interpret: Pallas' interpret mode.
      precision: the matrix products' precision (None: the backend's default, TF32 for float32 on a
        recent NVIDIA GPU; ``jax.lax.Precision.HIGHEST`` for full float32).
    """

    block_q: int
    block_k: int
    q_len: int
    k_len: int
    groups: int
    causal: bool
    scale: float
    segments: bool
    key_valid: bool
    function: Callable | None
    num_parameters: int
    batched_positions: tuple[bool, bool]
    batched_segments: tuple[bool, bool]
    batched_valid: bool
    interpret: bool
    precision: jax.lax.Precision | None = None


def dot(layout: Layout, a, b, contract=((1,), (0,))):
    """``a · b`` of two tiles (``contract``: the contracted axes, ``((1,), (1,))`` for ``a · bᵀ``) in float32,
    at the layout's precision."""
    return jax.lax.dot_general(
        a, b, (contract, ((), ())), precision=layout.precision, preferred_element_type=jnp.float32
    )


def tile_bias(layout: Layout, parameters, query_positions, key_positions):
    """The bias of a tile, ``[bq, bk]`` float32 (None without one): the encoding's per-head function on one
    head's parameter rows ``[1, P]`` and the tile's positions ``[bq, 1]``, ``[1, bk]``."""
    if layout.function is None:
        return None
    return layout.function(tuple(parameters), query_positions, key_positions).astype(jnp.float32)


def visible(layout: Layout, query_positions, key_positions, query_segments, key_segments, key_valid):
    """The tile's ``[bq, bk]`` boolean mask from its parts (None: every key visible)."""
    parts = []
    if layout.causal:
        parts.append(key_positions <= query_positions)
    if layout.segments:
        parts.append(query_segments == key_segments)
    if layout.key_valid:
        parts.append(key_valid != 0)
    mask = None
    for part in parts:
        mask = part if mask is None else jnp.logical_and(mask, part)
    return mask


def masked_scores(layout: Layout, q, k, bias, mask):
    """``scale · q kᵀ + bias`` of a tile in float32, masked pairs at :data:`MASKED`."""
    s = dot(layout, q, k, ((1,), (1,))) * layout.scale
    if bias is not None:
        s = s + bias
    return s if mask is None else jnp.where(mask, s, MASKED)
