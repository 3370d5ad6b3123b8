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
* Normalisers bring their tiled form through the contract
  (:class:`~posenc_jax.functional.core.hooks.TiledNormalize`), so a user's normaliser tiles
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
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import einops
import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.forms import forms_of
from posenc_jax.functional.core.hooks import (
    AttentionContext,
    DistanceBias,
    Logits,
    Rotate,
    TiledNormalize,
    Values,
    rotates_each_token,
    with_per_call_rotations_fixed,
)
from posenc_jax.functional.core.operations import broadcast_to
from posenc_jax.functional.core.products import content_scores, masked_value_product, value_product
from posenc_jax.functional.core.relative import toeplitz_where_runs

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


class _Keys(NamedTuple):
    """The keys one pass of the blockwise attention visits, padded to whole tiles."""

    key: jax.Array
    value: jax.Array
    valid: jax.Array | None
    positions: jax.Array
    segments: jax.Array | None
    mask_columns: jax.Array | None
    hooks: list


def check_blockwise(hooks: Sequence, normalizer) -> None:
    """Raises a ValueError naming the first hook or normaliser that cannot run in tiles."""
    for hook in hooks:
        if forms_of(hook).tiled is None:
            raise ValueError(
                f"{type(hook).__name__} cannot be computed per tile (its forms: tiled=None); use "
                f"implementation='materialize' for it"
            )
    if not isinstance(normalizer, TiledNormalize):
        raise ValueError(
            f"the normalizer {normalizer!r} has no blockwise form (it does not fill TiledNormalize: tile_init, "
            f"tile_weights, tile_denominator); use implementation='materialize' for it"
        )


def _pad_to(x: jax.Array, length: int, axis: int, *, edge: bool = False) -> jax.Array:
    """``x`` padded along ``axis`` to ``length`` (with zeros, or by repeating the last entry)."""
    extra = length - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, mode="edge" if edge else "constant")


def _tile(x: jax.Array | None, index, size: int, axis: int) -> jax.Array | None:
    """The ``index``-th block of ``size`` along ``axis`` (a broadcast axis of 1 is kept whole)."""
    if x is None or x.shape[axis] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


def _tile_product(p: jax.Array, value: jax.Array, mask: jax.Array | None) -> jax.Array:
    """``Σ_s p[b,n,t,s] · v[b,s,n]`` over a tile, ``[B, bq, N, H]`` float32, exact whatever masked values hold.

    ``p`` is zero where the mask is False, but ``0 · NaN`` is NaN: with a mask, the tile's
    product is :func:`~posenc_jax.functional.core.products.masked_value_product` (the einsum
    on the finite values plus the ``±inf`` or NaN each row's seen non-finite values bring).
    """
    return value_product(p, value) if mask is None else masked_value_product(p, value, mask)


def _joined_scores(q, k, joined: Sequence, context: AttentionContext) -> jax.Array:
    """The tile's content scores ``scale · q·k`` plus the terms of the ``joined`` :class:`ScoreFeatures` hooks,
    their features appended to q and k: ``[B, N, bq, bk]`` float32, one contraction."""
    if not joined:
        return content_scores(q, k, context.scale)
    features = [hook.score_features(q, k, context) for hook in joined]
    per_key = [jnp.broadcast_to(fk[:, :, None, :], (*k.shape[:3], fk.shape[-1])) for _, fk in features]
    q = jnp.concatenate([q, *(fq.astype(jnp.float32) for fq, _ in features)], axis=-1)
    k = jnp.concatenate([k, *(fk.astype(jnp.float32) for fk in per_key)], axis=-1)
    return content_scores(q, k, context.scale)


def _distance_tile(hook: DistanceBias, q, k, context: AttentionContext) -> jax.Array:
    """A :class:`DistanceBias` hook's ``[B|1, N, bq, bk]`` tile: from the tile's ``bq + bk - 1`` distances
    where its positions are runs, else its ``logits`` pair by pair."""
    return toeplitz_where_runs(
        lambda distance: hook.distance_bias(distance, context),
        lambda: hook.logits(q, k, context),
        context.query_positions,
        context.key_positions,
    )


def _entry(stacked, index):
    """Entry ``index`` of ``stacked``, a pytree of arrays stacked along axis 0."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), stacked)


def _update_at(stacked, index, fn):
    """``stacked`` (a pytree of arrays stacked along axis 0) with entry ``index`` replaced by ``fn(index, entry)``,
    in place inside a loop."""
    entry = fn(index, _entry(stacked, index))
    return jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, index, 0), stacked, entry)


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
    ring: KeyRing | None = None,
) -> jax.Array:
    """Attention over tiles; the inputs as checked by ``dot_product_attention``'s first stage.

    Use it through ``dot_product_attention(..., implementation="blockwise")``, which checks
    the arguments and builds ``context`` (whose ``mask`` is None here: the mask is built per
    tile from the positions, ``key_mask``, the segment ids and ``mask``).

    With ``ring`` (inside ``shard_map``, see :class:`KeyRing`), ``key`` and ``value`` are
    this device's shard of the keys, and everything else about the keys (``context``'s key
    positions, ``key_mask``, ``key_segment_ids``, the columns of ``mask``, per-key arrays of
    hooks) is the whole call's.

    Returns:
      ``[B, T, N, H]`` float32.
    """
    check_blockwise(hooks, normalizer)
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    batch, q_len, num_heads, head_dim = query.shape
    k_len = key.shape[1]
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng PRNG key")

    # A rotation by each token's own position is applied per tile (a query block once, a key tile at each
    # step), so no rotated copy of q and k is stored; one that depends on the whole call through one value
    # is fixed at this call's first; any other rotation runs once on the whole q and k.
    hooks = with_per_call_rotations_fixed(hooks, context)
    per_token = [rotates_each_token(h) for h in hooks]
    for hook, tiled in zip(hooks, per_token, strict=True):
        if isinstance(hook, Rotate) and not tiled:
            query, key = hook.rotate(query, key, context)
    rotations = [hook for hook, tiled in zip(hooks, per_token, strict=True) if tiled]
    block_q, block_k = min(int(block_q), q_len), min(int(block_k), k_len)
    num_q_blocks, num_k_blocks = math.ceil(q_len / block_q), math.ceil(k_len / block_k)
    q_pad, k_pad = num_q_blocks * block_q, num_k_blocks * block_k

    # relu²/n's n per query, as stage 1 counted it (None: all S keys); padded queries repeat the last.
    counts = context.sequence_lengths
    counts = None if counts is None else _pad_to(counts, q_pad, 1, edge=True)
    # Padded queries are computed and dropped.
    query = _pad_to(query, q_pad, 1)
    # Without positions (no mask or hook reads them) the tiles still need some: the indices.
    whole_k_len = k_len if ring is None else k_len * ring.size
    qpos = jnp.arange(q_len) if context.query_positions is None else context.query_positions
    qpos = _pad_to(jnp.atleast_2d(qpos), q_pad, 1, edge=True)
    all_kpos = jnp.atleast_2d(jnp.arange(whole_k_len) if context.key_positions is None else context.key_positions)
    all_valid = None if key_mask is None else jnp.asarray(key_mask)
    all_valid = None if all_valid is None else (all_valid if all_valid.ndim == 2 else all_valid[None])
    qseg = all_kseg = None
    if query_segment_ids is not None:
        qseg = _pad_to(jnp.atleast_2d(jnp.asarray(query_segment_ids)), q_pad, 1, edge=True)
        all_kseg = jnp.atleast_2d(jnp.asarray(key_segment_ids))
    extra = None
    if mask is not None:
        extra = jnp.asarray(mask)
        extra = extra.reshape((1,) * (4 - extra.ndim) + extra.shape)
        extra = _pad_to(extra, q_pad, 2) if extra.shape[2] != 1 else extra

    carried = [hook for hook in hooks if forms_of(hook).has("tiled", "carried")]
    # Terms that split into per-query and per-key features join the tile's content product (as in the
    # materialising path): one contraction, and no [B, N, bq, bk] term of their own to add.
    joinable = query.dtype == jnp.float32 and key.dtype == jnp.float32
    joined = [joinable and forms_of(hook).has("fused", "features") for hook in hooks]
    values_hooks = [hook for hook in hooks if isinstance(hook, Values)]
    key_order = jnp.arange(num_k_blocks)[::-1] if carried else jnp.arange(num_k_blocks)
    causal = context.causal
    if ring is not None and carried and not causal:
        raise ValueError(
            f"{type(carried[0]).__name__} carries its sums from the last key to the first, which a ring of key "
            f"shards visits in that order only for causal attention; pass causal=True, or gather the keys (ring=False)"
        )

    def key_side(key, value, shard):
        """The keys one pass visits: ``key`` and ``value`` (all of them, or shard ``shard`` of the ring's),
        with the whole call's per-key arrays cut to the same keys, invalid keys zeroed (their NaNs reach
        nothing) and all padded to whole tiles (padded keys invalid)."""
        cut = (lambda x, axis: x) if shard is None else (lambda x, axis: _tile(x, shard, k_len, axis))
        key_valid = None if all_valid is None else cut(all_valid, 1)
        if key_valid is not None:
            key = jnp.where(key_valid[:, :, None, None], key, jnp.zeros((), key.dtype))
            value = jnp.where(key_valid[:, :, None, None], value, jnp.zeros((), value.dtype))
        if k_pad != k_len:
            real = jnp.arange(k_pad) < k_len
            key_valid = real[None] if key_valid is None else _pad_to(key_valid, k_pad, 1) & real[None]
        columns = None
        if extra is not None:
            columns = _pad_to(cut(extra, 3), k_pad, 3) if extra.shape[3] != 1 else extra
        return _Keys(
            key=_pad_to(key, k_pad, 1),
            value=_pad_to(value, k_pad, 1),
            valid=key_valid,
            positions=_pad_to(cut(all_kpos, 1), k_pad, 1, edge=True),
            segments=None if all_kseg is None else _pad_to(cut(all_kseg, 1), k_pad, 1, edge=True),
            mask_columns=columns,
            # Per-key arrays a hook read from a KV cache (DeBERTa's key projections, Transformer-XL's u·k, the
            # functional encoding's key sinusoids): the same keys', padded as the keys are.
            hooks=[
                hook.map_key_features(lambda x: _pad_to(cut(x, 1), k_pad, 1))
                if forms_of(hook).has("cached", "key_features")
                else hook
                for hook in hooks
            ],
        )

    def query_side(qi):
        q = _tile(query, qi, block_q, 1)
        q_positions = _tile(qpos, qi, block_q, 1)
        q_context = context.tile(q_positions, q_positions, sequence_lengths=_tile(counts, qi, block_q, 1))
        for hook in rotations:  # the queries' half of the rotation (the keys' half, of q itself, is dropped)
            q = hook.rotate(q, q, q_context)[0]
        return q, q_positions, q_context

    def start(query_block):
        """A query block's carry before any key: the normaliser's running statistics, the running output,
        the running value terms, the carried hooks' sums."""
        q, _, q_context = query_block
        return (
            normalizer.tile_init((batch, num_heads, block_q)),
            jnp.zeros((batch, block_q, num_heads, head_dim), jnp.float32),
            tuple(jnp.zeros((batch, block_q, num_heads, head_dim), jnp.float32) for _ in values_hooks),
            tuple(hook.init_carry(q, q_context) for hook in carried),
        )

    def visit(qi, query_block, carry, keys: _Keys, first_tile):
        """``carry`` after query block ``qi`` has seen the key tiles of ``keys`` (numbered from ``first_tile``)."""
        q, q_positions, q_context = query_block
        values_hooks = [hook for hook in keys.hooks if isinstance(hook, Values)]
        q_segments = _tile(qseg, qi, block_q, 1)
        q_extra = _tile(keys.mask_columns, qi, block_q, 2)

        def step(carry, kj):
            state, acc, vacc, hook_carry = carry
            k = _tile(keys.key, kj, block_k, 1)
            v = _tile(keys.value, kj, block_k, 1)
            k_positions = _tile(keys.positions, kj, block_k, 1)
            for hook in rotations:  # the keys' half (the queries' half, of k itself, is dropped)
                k = hook.rotate(k, k, context.tile(k_positions, k_positions))[1]
            tile_mask = None
            parts = []
            if causal:
                parts.append(k_positions[:, None, None, :] <= q_positions[:, None, :, None])
            if keys.valid is not None:
                parts.append(_tile(keys.valid, kj, block_k, 1)[:, None, None, :])
            if q_segments is not None:
                parts.append(q_segments[:, None, :, None] == _tile(keys.segments, kj, block_k, 1)[:, None, None, :])
            if q_extra is not None:
                parts.append(_tile(q_extra, kj, block_k, 3))
            for part in parts:
                tile_mask = part if tile_mask is None else jnp.logical_and(tile_mask, part)
            tile_context = context.tile(q_positions, k_positions, mask=tile_mask)

            tile_hooks = [
                hook.map_key_features(lambda x: _tile(x, kj, block_k, 1))
                if forms_of(hook).has("cached", "key_features")
                else hook
                for hook in keys.hooks
            ]
            # Hooks that form the scores with the content product (a term that is a shift of q or k on some
            # tiles) are composed around it; the others' terms are added to what it gives.
            scoring = [joinable and not any(joined) and forms_of(hook).has("tiled", "scores") for hook in tile_hooks]
            if any(joined):
                s = _joined_scores(q, k, [h for h, j in zip(tile_hooks, joined, strict=True) if j], tile_context)
            else:
                content = functools.partial(content_scores, scale=tile_context.scale)
                for hook, scores in zip(tile_hooks, scoring, strict=True):
                    if scores:
                        content = functools.partial(hook.tile_scores, context=tile_context, content=content)
                s = content(q, k)
            new_hook_carry = []
            content_only = not any(joined) and not any(scoring)  # s is exactly scale · q·k until a term is added
            for hook, is_joined, scores in zip(tile_hooks, joined, scoring, strict=True):
                if is_joined or scores:
                    continue
                if forms_of(hook).has("tiled", "carried"):
                    hook_state = hook_carry[len(new_hook_carry)]
                    if content_only and forms_of(hook).has("tiled", "carried_from_content"):
                        term, c = hook.carried_logits_from_content(s, q, k, tile_context, hook_state)
                    else:
                        term, c = hook.carried_logits(q, k, tile_context, hook_state)
                    new_hook_carry.append(c)
                elif forms_of(hook).has("tiled", "logits"):
                    term = hook.tile_logits(q, k, tile_context)
                elif forms_of(hook).has("tiled", "distance"):
                    term = _distance_tile(hook, q, k, tile_context)
                else:
                    term = hook.logits(q, k, tile_context) if isinstance(hook, Logits) else None
                if term is not None:
                    term = term.astype(jnp.float32)
                    s = s + broadcast_to(term.reshape((1,) * (4 - term.ndim) + term.shape), s.shape)
                    content_only = False
            visible = jnp.ones(s.shape, bool) if tile_mask is None else jnp.broadcast_to(tile_mask, s.shape)

            p, state, correction = normalizer.tile_weights(s, visible, state, tile_context)
            if dropout_rate > 0.0:
                rng = jax.random.fold_in(jax.random.fold_in(dropout_rng, qi), first_tile + kj)
                keep = jax.random.bernoulli(rng, 1.0 - dropout_rate, p.shape)
                p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
            out = _tile_product(p, v, tile_mask)
            terms = []
            for hook in values_hooks:
                term = (
                    hook.tile_values(p, tile_context)
                    if forms_of(hook).has("tiled", "values")
                    else hook.values(p, tile_context)
                )
                terms.append(jnp.zeros_like(acc) if term is None else term.astype(jnp.float32))
            if correction is not None:
                rescale = einops.rearrange(correction, "B N T -> B T N 1")
                acc = acc * rescale
                vacc = tuple(a * rescale for a in vacc)
            acc = acc + out
            vacc = tuple(a + t for a, t in zip(vacc, terms, strict=True))
            return (state, acc, vacc, tuple(new_hook_carry))

        def maybe_step(carry, kj):
            if not causal:
                return step(carry, kj)
            # Every query of the block is before every key of the key block: nothing to see, and a
            # carried hook's sums pass through unchanged (the tile's gates are all masked).
            hidden = jnp.all(_tile(keys.positions, kj, block_k, 1).min(-1) > q_positions.max(-1))
            return jax.lax.cond(hidden, lambda c, _: c, step, carry, kj)

        # The checkpoint holds the cond too: a differentiated cond would keep its branch's residuals
        # for every key block, and the backward pass's memory would grow with T x S.
        maybe_step = jax.checkpoint(maybe_step)
        carry, _ = jax.lax.scan(lambda c, kj: (maybe_step(c, kj), None), carry, key_order)
        return carry

    def finish(query_block, carry):
        """A query block's outputs ``[B, bq, N, H]`` from its carry after every key."""
        _, _, q_context = query_block
        state, acc, vacc, _ = carry
        acc = acc + sum(vacc) if vacc else acc
        denominator = jnp.broadcast_to(normalizer.tile_denominator(state, q_context), (batch, num_heads, block_q))
        denominator = jnp.where(denominator > 0, denominator, 1.0)
        return acc / einops.rearrange(denominator, "B N T -> B T N 1")

    q_blocks = jnp.arange(num_q_blocks)
    if ring is None:
        keys = key_side(key, value, None)

        def attend(qi):
            block = query_side(qi)
            return finish(block, visit(qi, block, start(block), keys, 0))

        blocks = jax.lax.map(jax.checkpoint(attend), q_blocks)
    else:
        # Pass p: this device holds shard (d - p) mod P (its own first), visits its tiles with every query
        # block, then hands it to the next device. Visiting d, d - 1, ..., 0 keeps a carried hook's order for
        # the keys a causal query sees; the shards after d, visited last, are hidden from every query here.
        device = jax.lax.axis_index(ring.axis)
        to_next = [(i, (i + 1) % ring.size) for i in range(ring.size)]

        def one_pass(passing, p):
            carries, key, value = passing
            shard = (device - p) % ring.size
            keys = key_side(key, value, shard)
            visit_one = jax.checkpoint(lambda qi, c: visit(qi, query_side(qi), c, keys, shard * num_k_blocks))
            # Each query block's carry is updated where it lies (a loop over the blocks, not a map from the old
            # carries to new ones), so the running outputs are held once, not twice, while a pass updates them.
            carries = jax.lax.fori_loop(0, num_q_blocks, lambda qi, c: _update_at(c, qi, visit_one), carries)
            key, value = jax.lax.ppermute((key, value), ring.axis, to_next)
            return (carries, key, value), None

        carries = jax.lax.map(lambda qi: start(query_side(qi)), q_blocks)
        (carries, _, _), _ = jax.lax.scan(one_pass, (carries, key, value), jnp.arange(ring.size))
        # Each block's outputs are written over its running outputs, so no second [nq, B, bq, N, H] array is made.
        state, acc, vacc, _ = carries

        def finished(qi, acc):
            return finish(query_side(qi), (_entry(state, qi), acc, _entry(vacc, qi), ()))

        blocks = jax.lax.fori_loop(0, num_q_blocks, lambda qi, acc: _update_at(acc, qi, finished), acc)
    out = einops.rearrange(blocks, "Q B T N H -> B (Q T) N H")  # [nq, B, bq, N, H] -> [B, T, N, H]
    return out[:, :q_len]
