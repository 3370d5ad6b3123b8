"""Which path computes an attention call: the dispatch rule of ``implementation``, and the operations
core hands a call to.

``"materialize"`` builds the ``[B, N, T, S]`` scores; ``"blockwise"`` computes the same attention in
tiles (:mod:`~posenc_jax.functional.core.blockwise`); ``"pallas"`` runs the flash-attention kernels
that ``kernels/pallas`` registers (:data:`PALLAS_ATTENTION`); ``"auto"`` (the default):

- on a backend with a fused attention (:data:`FUSED_ATTENTION`; the GPU's cuDNN, registered by
  ``kernels/cudnn.py``), where the scores hold no term (every hook only rotates, or acts before
  attention) and the call allows it from facts known while tracing (:func:`plain_scores`), hands
  the rotated q and k to it, unless it refuses the call;
- else goes blockwise by size (:func:`goes_blockwise`: the backend's measured threshold of float32
  scores, and more than one default tile) when every hook and the normaliser have a tiled form,
  and the weights are not asked for;
- else materialises.

Core never imports a kernel: the kernels register their forms of these operations
(:class:`~posenc_jax.functional.core.operations.Operation`) when ``posenc_jax.functional`` is imported.
"""

from __future__ import annotations

from collections.abc import Sequence

from posenc_jax.functional.core import operations
from posenc_jax.functional.core.blockwise import DEFAULT_BLOCK_Q, check_blockwise
from posenc_jax.functional.core.forms import declares, forms_of
from posenc_jax.functional.core.hooks import hook_names
from posenc_jax.functional.core.operations import current_backend
from posenc_jax.functional.core.positions import known_indices

__all__ = [
    "AUTO_TILED_FROM_LENGTH",
    "FUSED_ATTENTION",
    "IMPLEMENTATIONS",
    "MATERIALIZE_LIMIT_BYTES",
    "MATERIALIZE_LIMIT_BYTES_BY_BACKEND",
    "PALLAS_ATTENTION",
    "goes_blockwise",
    "goes_blockwise_for",
    "known_indices",
    "plain_scores",
]

IMPLEMENTATIONS = ("auto", "materialize", "blockwise", "pallas")
# "auto" goes blockwise when the float32 [B, N, T, S] scores would exceed this many bytes on the backend
# (jax.default_backend()): where blockwise attention's forward and backward becomes the faster, as
# `python benchmarks/blockwise.py --auto-threshold` measures it. A backend not in the table: the default.
MATERIALIZE_LIMIT_BYTES = 1 << 30
MATERIALIZE_LIMIT_BYTES_BY_BACKEND: dict[str, int] = {
    # Measured (2 cores, jax 0.10.2; docs/blockwise/auto-threshold-cpu.md): blockwise forward+backward is the
    # faster from 16 MiB of scores on when the sequence spans more than one tile (0.72x at T = 1,024 with 4
    # heads, 0.55x at 4,096), and the slower within one tile (1.43x at T = 512 with 8 heads).
    "cpu": 8 << 20,
    "gpu": 1 << 30,  # unmeasured: the default
    "tpu": 1 << 30,  # unmeasured: the default
}
# ... and "auto" materialises a sequence of at most this many queries and keys whatever the batch: within one
# default tile the blockwise loop is the materialised computation plus its own overhead.
AUTO_TILED_FROM_LENGTH = DEFAULT_BLOCK_Q


def goes_blockwise(implementation: str, *, batch: int, num_heads: int, query_length: int, key_length: int) -> bool:
    """Whether ``implementation`` computes attention of these sizes in tiles.

    ``"auto"`` does when the float32 ``[B, N, T, S]`` scores would exceed the threshold of
    the backend (``MATERIALIZE_LIMIT_BYTES_BY_BACKEND``; ``MATERIALIZE_LIMIT_BYTES`` for one not
    in it) and T or S exceeds ``AUTO_TILED_FROM_LENGTH`` (512, one default tile: within one tile
    the blockwise loop is the materialised computation and its overhead, whatever the batch).
    It then still materialises a hook or normaliser without a blockwise form, which this size
    rule does not see; a model's per-forward terms follow the whole rule (:func:`forward_terms`).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation != "auto":
        return implementation == "blockwise"
    limit = MATERIALIZE_LIMIT_BYTES_BY_BACKEND.get(current_backend(), MATERIALIZE_LIMIT_BYTES)
    one_tile = max(query_length, key_length) <= AUTO_TILED_FROM_LENGTH
    return not one_tile and 4 * batch * num_heads * query_length * key_length > limit


def goes_blockwise_for(
    implementation: str,
    *,
    batch: int,
    num_heads: int,
    query_length: int,
    key_length: int,
    hooks: Sequence,
    normalizer,
    return_weights: bool = False,
) -> bool:
    """The blockwise rule: :func:`goes_blockwise` by size, and ``"auto"`` materialises what has no
    blockwise form or whose weights are asked for (the caller did not ask for blockwise)."""
    tiled = goes_blockwise(
        implementation, batch=batch, num_heads=num_heads, query_length=query_length, key_length=key_length
    )
    if implementation != "auto":
        return tiled
    return tiled and not return_weights and _has_blockwise_form(hooks, normalizer)


def _has_blockwise_form(hooks, normalizer) -> bool:
    for item in (*hooks, normalizer):
        forms_of(item)  # a class defining a form it does not declare is refused by name here, not materialised
    try:
        check_blockwise(hooks, normalizer)
    except ValueError:
        return False
    return True


def _no_pallas(call, normalizer, masks, dropout, blocks):
    raise ValueError(
        "implementation='pallas' needs posenc_jax.functional.kernels (import posenc_jax.functional, which imports it)"
    )


# implementation="pallas": the flash-attention kernels of kernels/pallas, registered there (core never imports them).
PALLAS_ATTENTION = operations.Operation("pallas_attention", _no_pallas)


def _not_fused(query, key, value, *, causal: bool, scale: float):
    """The plain form of ``FUSED_ATTENTION``: no fused kernel here (None: the attention computes it itself)."""
    return None


# implementation="auto" where the scores are plain scale · q'·k' (see plain_scores): a backend's fused attention
# of the rotated q and k, registered by kernels/ (the GPU's: cuDNN), returning None where it cannot take the call.
FUSED_ATTENTION = operations.Operation("fused_attention", _not_fused)


def plain_scores(call, normalizer, masks, dropout_rate, return_weights, positions_are_indices) -> bool:
    """Whether, from facts known at trace time, this call is plain softmax attention of its (rotated) q and k
    with at most a causal mask that counts indices: no term in the scores or the output (every hook only
    rotates, or acts before attention), softmax, no key mask, segments, extra mask, dropout or weights, and,
    when causal, T == S and positions known to be the indices ``0..T-1`` (a causal mask of other positions
    is not the index mask a fused kernel applies): ``positions_are_indices``, True or False as the caller
    knows it (a module that made them), or None: the concrete positions read here, last, so only a call that
    is otherwise plain reads them (``dot_product_attention``'s)."""
    if any(set(hook_names(hook)) & {"logits", "values", "normalize"} for hook in call.hooks):
        return False
    if not declares(normalizer, "softmax") or any(m is not None for m in masks) or dropout_rate or return_weights:
        return False
    context = call.context
    if not context.causal:
        return True
    q_len, k_len = call.query.shape[1], call.key.shape[1]
    if q_len != k_len:
        return False
    if positions_are_indices is None:
        return known_indices(context.query_positions, context.key_positions, q_len, k_len)
    return positions_are_indices
