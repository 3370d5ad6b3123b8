"""Blockwise attention: the same function, in tiles, in memory linear in the length.

:func:`blockwise_attention` computes exactly what
:func:`~posenc_jax.functional.core.attention.dot_product_attention` computes, without ever
holding the ``[B, N, T, S]`` scores. Queries are cut into blocks of ``block_q`` rows and
keys into blocks of ``block_k``; for each query block a ``lax.scan`` visits the key blocks
and keeps, per query row, a running maximum ``m``, a running denominator ``l`` and a
running output ``o`` (the online softmax of Milakov & Gimelshein 2018, as in
FlashAttention, Dao et al. 2022):

    m' = max(m, max_s s[t, s])          c = exp(m - m')
    p  = exp(s - m')                    l' = c·l + Σ_s p
    o' = c·o + p · v                    out = o / l   (after the last key block)

Only one ``[B, N, block_q, block_k]`` tile of scores exists at a time. Every hook is
computed per tile, from the tile's own positions (the call's :class:`AttentionContext` cut to
the tile by :meth:`~AttentionContext.tile`: its positions and mask are the tile's):

* ``rotate`` hooks that rotate each token by its own position (RoPE and its fixed scalings, axial
  RoPE: :class:`~posenc_jax.functional.core.hooks.PerTokenRotation`) rotate each query block once
  and each key tile at each step, so no rotated copy of q and k is stored; so do those that do once
  one value of the whole call is fixed (xPos's centre, the length of dynamic NTK and LongRoPE:
  :class:`~posenc_jax.functional.core.hooks.PerCallRotation`), fixed before tiling; any other
  rotation runs once on the whole q and k.
* ``logits`` hooks (T5, ALiBi, Kerple, FIRE, Sandwich, the clipped and functional relative
  biases, Shaw's R_K, Transformer-XL, DeBERTa) compute their tile from the tile's positions
  and the tile's q and k, by a tile form of their own where they have one: a bias of the distance
  alone (:class:`~posenc_jax.functional.core.hooks.DistanceBias`, Kerple) from the tile's
  ``bq + bk - 1`` distances where its positions are runs, a clipped table (Shaw, DeBERTa:
  :class:`~posenc_jax.functional.core.hooks.TiledLogits`) from one row where the whole tile is past
  the clip, which they join to the tile's queries and keys (:class:`~posenc_jax.functional.core.hooks.TiledScores`:
  content and term one contraction); per-key arrays a hook read from a KV cache are cut to the tile's
  keys (``map_key_features``). A hook whose tile depends on key tiles after it (CoPE: its gate
  sums run over the keys up to the query) is a :class:`CarriedLogits`: key blocks are then
  visited last first and the hook carries its sums from tile to tile.
* ``values`` hooks (Shaw's R_V) must be linear in the weights: the tile's term is accumulated
  beside the output with the same rescaling ``c`` and divided by the same denominator (Shaw's
  tile past its clip: each row's weights summed into one table row,
  :class:`~posenc_jax.functional.core.hooks.TiledValues`).
* Normalisers bring their tiled form through the contract (the declared form ``tiled.weights``,
  :class:`~posenc_jax.functional.core.hooks.TiledNormalize`), so a user's normaliser tiles
  too: softmax and URPE (softmax times a per-tile Toeplitz factor) online as above; L2 online
  with ``l`` the running sum of ``p²`` (rescaled by ``c²``) and ``√l`` at the end; relu²/n
  with no maximum at all (``p = relu(s)²``, divided by n at the end).

A hook that cannot be computed per tile says so (it derives from ``MaterializeOnly``)
and is refused with an error that names it; nothing is silently materialised.

A causal key block that every query of the block is before (by position) is skipped with a
``lax.cond``. Gradients: each query block and each key step is a ``jax.checkpoint``, so the
backward pass recomputes tiles instead of storing them, and its memory stays linear in T and
S (the per-query-block residuals are ``[B, block_q, N, H]`` per key block).

Dropout draws its keep-mask per tile (``fold_in`` of the query and key block indices): the
same distribution as the materialising path's, not the same mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import einops
import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.forms import forms_of
from posenc_jax.functional.core.hooks import (
    AttentionContext,
)
from posenc_jax.functional.core.tiles import (
    _finish,
    _key_side,
    _Plan,
    _plan,
    _query_tile,
    _start,
    _tile,
    _tile_step,
    tile_loop,
)

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "KeyRing", "blockwise_attention", "check_blockwise"]

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


@dataclasses.dataclass(frozen=True)
class KeyRing:
    """Keys passed round a ring of devices (ring attention, Liu et al. 2023, arXiv:2310.01889).

    Inside ``shard_map`` over the mesh axis ``axis`` of ``size`` devices, device ``d`` holds
    shard ``d`` of the keys and values (``S / size`` consecutive keys). The blockwise
    attention visits its own shard with all its query blocks, hands the shard to device
    ``d + 1`` (``lax.ppermute``) and takes device ``d - 1``'s, ``size`` times; its running
    statistics stay where its queries are. No device ever holds more than one shard.
    """

    axis: str
    size: int


def check_blockwise(hooks: Sequence, normalizer) -> None:
    """Raises a ValueError naming the first hook or normaliser that cannot run in tiles."""
    for hook in hooks:
        if forms_of(hook).tiled is None:
            raise ValueError(
                f"{type(hook).__name__} cannot be computed per tile (its forms: tiled=None); use "
                f"implementation='materialize' for it"
            )
    if not forms_of(normalizer).has("tiled", "weights"):
        raise ValueError(
            f"the normalizer {normalizer!r} has no blockwise form (its class declares no tiled.weights: tile_init, "
            f"tile_weights, tile_denominator); use implementation='materialize' for it"
        )


def _entry(stacked, index):
    """Entry ``index`` of ``stacked``, a pytree of arrays stacked along axis 0."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), stacked)


def _update_at(stacked, index, fn):
    """``stacked`` (a pytree of arrays stacked along axis 0) with entry ``index`` replaced by ``fn(index, entry)``,
    in place inside a loop."""
    entry = fn(index, _entry(stacked, index))
    return jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, index, 0), stacked, entry)


def _check_arguments(hooks, normalizer, block_q, block_k, dropout_rate, dropout_rng) -> None:
    check_blockwise(hooks, normalizer)
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng PRNG key")


def _over_all_keys(plan: _Plan, key, value) -> jax.Array:
    """Every query block against every key tile: ``[nq, B, bq, N, H]``."""
    if plan.paired:
        return _over_paired_blocks(plan, key, value)
    q_blocks = jnp.arange(plan.num_q_blocks)
    keys = _key_side(plan, key, value, None)

    def attend(qi):
        block = _query_tile(plan, qi)
        return _finish(plan, block, tile_loop(plan, qi, block, _start(plan, block), keys, 0))

    return jax.lax.map(jax.checkpoint(attend), q_blocks)


def _pairs(num_blocks: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Causal query blocks in pairs that see as many key tiles together: block i sees tiles 0..i, so blocks i and
    n - 1 - i see n + 1 (n even); n odd: blocks i and n - 2 - i see n, and so does block n - 1 alone (-1: none).
    Returns the first and second block of each pair and the tiles a pair sees."""
    if num_blocks % 2 == 0:
        first = np.arange(num_blocks // 2)
        return first, num_blocks - 1 - first, num_blocks + 1
    first = np.arange((num_blocks - 1) // 2)
    return np.append(first, num_blocks - 1), np.append(num_blocks - 2 - first, -1), num_blocks


def _over_paired_blocks(plan: _Plan, key, value) -> jax.Array:
    """:func:`_over_all_keys` where the tiles a causal query block sees are known while tracing (positions the
    indices, square tiles): query block i sees key tiles 0..i, so two blocks (:func:`_pairs`) go through one
    scan of a fixed length, the first's tiles then the second's, and no tile is skipped by a conditional
    (a ``cond`` in the loop is compiled with both branches, in the backward pass three times over, and its
    transposed hidden branch makes zeros of every residual)."""
    keys = _key_side(plan, key, value, None)
    first, second, steps = _pairs(plan.num_q_blocks)

    def pair(blocks):
        a, b = blocks
        lone = b < 0  # n odd: the last block, alone; its scan never reaches a second block
        b = jnp.maximum(b, 0)
        block_a = _query_tile(plan, a)
        start = _start(plan, block_a)

        def step(carry, j):
            running, done = carry
            # The first block has seen its tiles 0..a: its carry is kept, and the second block starts.
            switch = j == a + 1
            done = jax.tree.map(lambda x, y: jnp.where(switch, x, y), running, done)
            running = jax.tree.map(lambda x, y: jnp.where(switch, x, y), start, running)
            qi, kj = jnp.where(j <= a, a, b), jnp.where(j <= a, j, j - a - 1)
            q_segments = _tile(plan.query_segments, qi, plan.block_q, 1)
            q_extra = _tile(keys.mask_columns, qi, plan.block_q, 2)
            running = _tile_step(plan, qi, _query_tile(plan, qi), keys, 0, q_segments, q_extra, running, kj)
            return (running, done), None

        (running, done), _ = jax.lax.scan(jax.checkpoint(step), (start, start), jnp.arange(steps))
        last = _finish(plan, _query_tile(plan, jnp.where(lone, a, b)), running)
        return jnp.where(lone, last, _finish(plan, block_a, done)), last

    firsts, seconds = jax.lax.map(jax.checkpoint(pair), (jnp.asarray(first), jnp.asarray(second)))
    # The blocks in order: the pairs' first blocks count up, their second ones down (slices, not a gather,
    # whose transpose XLA would try to fold as a constant scatter); n odd: the last block's pair has no second.
    if plan.num_q_blocks % 2 == 0:
        return jnp.concatenate([firsts, seconds[::-1]])
    return jnp.concatenate([firsts[:-1], seconds[:-1][::-1], firsts[-1:]])


def _over_ring(plan: _Plan, key, value, ring: KeyRing) -> jax.Array:
    """Every query block against each key shard of the ring in turn: ``[nq, B, bq, N, H]``.

    Pass p: this device holds shard (d - p) mod P (its own first), visits its tiles with every query block,
    then hands it to the next device. Visiting d, d - 1, ..., 0 keeps a carried hook's order for the keys a
    causal query sees; the shards after d, visited last, are hidden from every query here.
    """
    q_blocks = jnp.arange(plan.num_q_blocks)
    device = jax.lax.axis_index(ring.axis)
    to_next = [(i, (i + 1) % ring.size) for i in range(ring.size)]

    def one_pass(passing, p):
        carries, key, value = passing
        shard = (device - p) % ring.size
        keys = _key_side(plan, key, value, shard)
        visit_one = jax.checkpoint(
            lambda qi, c: tile_loop(plan, qi, _query_tile(plan, qi), c, keys, shard * plan.num_k_blocks)
        )
        # Each query block's carry is updated where it lies (a loop over the blocks, not a map from the old
        # carries to new ones), so the running outputs are held once, not twice, while a pass updates them.
        carries = jax.lax.fori_loop(0, plan.num_q_blocks, lambda qi, c: _update_at(c, qi, visit_one), carries)
        key, value = jax.lax.ppermute((key, value), ring.axis, to_next)
        return (carries, key, value), None

    carries = jax.lax.map(lambda qi: _start(plan, _query_tile(plan, qi)), q_blocks)
    (carries, _, _), _ = jax.lax.scan(one_pass, (carries, key, value), jnp.arange(ring.size))
    # Each block's outputs are written over its running outputs, so no second [nq, B, bq, N, H] array is made.
    state, acc, vacc, _ = carries

    def finished(qi, acc):
        return _finish(plan, _query_tile(plan, qi), (_entry(state, qi), acc, _entry(vacc, qi), ()))

    return jax.lax.fori_loop(0, plan.num_q_blocks, lambda qi, acc: _update_at(acc, qi, finished), acc)


def blockwise_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    hooks: Sequence,
    normalizer,
    context: AttentionContext,
    key_mask: jax.Array | None,
    query_segment_ids: jax.Array | None,
    key_segment_ids: jax.Array | None,
    mask: jax.Array | None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    broadcast_dropout: bool = False,
    ring: KeyRing | None = None,
) -> jax.Array:
    """Attention over tiles; the inputs as checked by ``dot_product_attention``'s first stage.

    Use it through ``dot_product_attention(..., implementation="blockwise")``, which checks
    the arguments and builds ``context`` (whose ``mask`` is None here: the mask is built per
    tile from the positions, ``key_mask``, the segment ids and ``mask``).

    With ``ring`` (inside ``shard_map``, see :class:`KeyRing`), ``key`` and ``value`` are
    this device's shard of the keys, and everything else about the keys (``context``'s key
    positions, ``key_mask``, ``key_segment_ids``, the columns of ``mask``, per-key arrays of
    hooks) is the whole call's. Either way each query block goes through :func:`tile_loop`.

    Returns:
      ``[B, T, N, H]`` float32.
    """
    _check_arguments(hooks, normalizer, block_q, block_k, dropout_rate, dropout_rng)
    masks = (key_mask, query_segment_ids, key_segment_ids, mask)
    plan, key = _plan(
        query,
        key,
        hooks,
        normalizer,
        context,
        masks,
        block_q,
        block_k,
        (dropout_rate, dropout_rng, bool(broadcast_dropout)),
        ring,
    )
    blocks = _over_all_keys(plan, key, value) if ring is None else _over_ring(plan, key, value, ring)
    out = einops.rearrange(blocks, "Q B T N H -> B (Q T) N H")  # [nq, B, bq, N, H] -> [B, T, N, H]
    return out[:, : query.shape[1]]
