"""The one online-softmax tile loop: one query tile against key tiles, every hook in its tiled form.

:func:`tile_loop` is the engine of blockwise attention
(:func:`~posenc_jax.functional.core.blockwise.blockwise_attention`): the one-device path runs it
once per query block over all the keys, ring attention once per query block and key shard, and
sequence-parallel attention (:func:`~posenc_jax.functional.core.sharded.sequence_parallel_attention`)
through either on each device. One step (:func:`_tile_step`) takes one query tile × key tile:

1. the key tile's rotation (a query tile is rotated once, by :func:`_query_tile`);
2. the tile's mask, from its parts (:func:`_tile_mask`: causal by position, key padding, segment
   ids, the tile of an extra mask);
3. the tile's scores (:func:`_tile_scores`): ``scale · q·k`` plus each hook's term from its
   declared tiled form (``distance``, ``logits``, ``scores``, ``carried``; see
   :mod:`~posenc_jax.functional.core.forms`), from what the hook computed once for the call
   (``per_call``) and once for the query block (``per_query_block``);
4. the online softmax's accumulation (:func:`_accumulate`): the normaliser's tiled form, the
   running output and value terms rescaled and added to.

:func:`_plan` sets a call up for the loop (its hooks sorted by what the loop does with them, its
per-query and per-key arrays padded to whole tiles); :func:`_finish` divides a query block's
running output by its denominator. See :mod:`~posenc_jax.functional.core.blockwise` for the
mathematics and the memory.
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
    hook_names,
    rotates_each_token,
    with_per_call_rotations_fixed,
)
from posenc_jax.functional.core.operations import broadcast_to
from posenc_jax.functional.core.positions import known_indices
from posenc_jax.functional.core.products import content_scores, masked_value_product, value_product
from posenc_jax.functional.core.relative import toeplitz_where_runs
from posenc_jax.functional.core.stages import _dropout

__all__ = ["tile_loop"]


class _Keys(NamedTuple):
    """The keys one pass of the blockwise attention visits, padded to whole tiles."""

    key: jax.Array
    value: jax.Array
    valid: jax.Array | None
    positions: jax.Array
    segments: jax.Array | None
    mask_columns: jax.Array | None
    hooks: list


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


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One blockwise call, set up: its settings, its hooks sorted by what the tile loop does with them,
    and the whole call's per-query and per-key arrays (padded to whole tiles where they are per query)."""

    hooks: list
    rotations: list  # rotations by each token's own position, applied per tile
    carried: list  # hooks that carry sums from key tile to key tile (CoPE)
    joined: list  # per hook: its features join the content product
    joinable: bool
    values_count: int
    normalizer: object
    context: AttentionContext
    causal: bool
    shape: tuple  # (B, N, H)
    block_q: int
    block_k: int
    num_q_blocks: int
    num_k_blocks: int
    k_len: int
    k_pad: int
    query: jax.Array
    query_positions: jax.Array
    counts: jax.Array | None
    query_segments: jax.Array | None
    key_positions: jax.Array
    key_valid: jax.Array | None
    key_segments: jax.Array | None
    extra: jax.Array | None
    key_order: jax.Array
    paired: bool  # causal, positions the indices, square tiles: query block i sees key tiles 0..i
    dropout_rate: float
    dropout_rng: jax.Array | None
    dropout_broadcast: bool  # one mask per tile for every batch row and head


class _QueryTile(NamedTuple):
    q: jax.Array
    positions: jax.Array
    context: AttentionContext


def _plan(query, key, hooks, normalizer, context, masks, block_q, block_k, dropout, ring):
    """The call set up for the tile loop, and ``key`` (rotated here when its rotation cannot go per tile).

    ``masks``: ``(key_mask, query_segment_ids, key_segment_ids, mask)``; ``dropout``: ``(rate, rng, broadcast)``.
    """
    key_mask, query_segment_ids, key_segment_ids, mask = masks
    batch, q_len, num_heads, head_dim = query.shape
    k_len = key.shape[1]
    # A rotation by each token's own position is applied per tile (a query block once, a key tile at each
    # step), so no rotated copy of q and k is stored; one that depends on the whole call through one value
    # is fixed at this call's first; any other rotation runs once on the whole q and k.
    hooks = with_per_call_rotations_fixed(hooks, context)
    per_token = [rotates_each_token(h) for h in hooks]
    for hook, tiled in zip(hooks, per_token, strict=True):
        if "rotate" in hook_names(hook) and not tiled:
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
    # What a hook's tiles share, computed once for the call (Transformer-XL's projected distances).
    whole = context.tile(qpos, all_kpos)
    hooks = [h.for_tiles(whole, block_q, block_k) if forms_of(h).has("tiled", "per_call") else h for h in hooks]
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
    values_count = sum(1 for hook in hooks if "values" in hook_names(hook))
    key_order = jnp.arange(num_k_blocks)[::-1] if carried else jnp.arange(num_k_blocks)
    if ring is not None and carried and not context.causal:
        raise ValueError(
            f"{type(carried[0]).__name__} carries its sums from the last key to the first, which a ring of key "
            f"shards visits in that order only for causal attention; pass causal=True, or gather the keys (ring=False)"
        )
    plan = _Plan(
        hooks=hooks,
        rotations=rotations,
        carried=carried,
        joined=joined,
        joinable=joinable,
        values_count=values_count,
        normalizer=normalizer,
        context=context,
        causal=context.causal,
        shape=(batch, num_heads, head_dim),
        block_q=block_q,
        block_k=block_k,
        num_q_blocks=num_q_blocks,
        num_k_blocks=num_k_blocks,
        k_len=k_len,
        k_pad=k_pad,
        query=query,
        query_positions=qpos,
        counts=counts,
        query_segments=qseg,
        key_positions=all_kpos,
        key_valid=all_valid,
        key_segments=all_kseg,
        extra=extra,
        key_order=key_order,
        paired=_sees_tiles_up_to_its_own(context, hooks, (q_len, k_len), (block_q, block_k), carried, ring),
        dropout_rate=dropout[0],
        dropout_rng=dropout[1],
        dropout_broadcast=dropout[2],
    )
    return plan, key


def _sees_tiles_up_to_its_own(context: AttentionContext, hooks, lengths, blocks, carried, ring) -> bool:
    """Whether query block i sees exactly key tiles 0..i, known while tracing: causal self-attention over
    positions that are the indices (concrete ``0..T-1``, or none given), in square tiles, one device, and no
    hook that carries sums across key tiles or shares a per-query-block table."""
    (q_len, k_len), (block_q, block_k) = lengths, blocks
    if not context.causal or ring is not None or carried or q_len != k_len or block_q != block_k:
        return False
    if any(forms_of(h).has("tiled", "per_query_block") for h in hooks):
        return False
    positions = [
        np.arange(n) if p is None else p for p, n in ((context.query_positions, q_len), (context.key_positions, k_len))
    ]
    return known_indices(*positions, q_len, k_len)


def _key_side(plan: _Plan, key, value, shard) -> _Keys:
    """The keys one pass visits: ``key`` and ``value`` (all of them, or shard ``shard`` of the ring's), with
    the whole call's per-key arrays cut to the same keys, invalid keys zeroed (their NaNs reach nothing) and
    all padded to whole tiles (padded keys invalid)."""
    k_len, k_pad = plan.k_len, plan.k_pad
    cut = (lambda x, axis: x) if shard is None else (lambda x, axis: _tile(x, shard, k_len, axis))
    key_valid = None if plan.key_valid is None else cut(plan.key_valid, 1)
    if key_valid is not None:
        key = jnp.where(key_valid[:, :, None, None], key, jnp.zeros((), key.dtype))
        value = jnp.where(key_valid[:, :, None, None], value, jnp.zeros((), value.dtype))
    if k_pad != k_len:
        real = jnp.arange(k_pad) < k_len
        key_valid = real[None] if key_valid is None else _pad_to(key_valid, k_pad, 1) & real[None]
    columns = None
    extra = plan.extra
    if extra is not None:
        columns = _pad_to(cut(extra, 3), k_pad, 3) if extra.shape[3] != 1 else extra
    return _Keys(
        key=_pad_to(key, k_pad, 1),
        value=_pad_to(value, k_pad, 1),
        valid=key_valid,
        positions=_pad_to(cut(plan.key_positions, 1), k_pad, 1, edge=True),
        segments=None if plan.key_segments is None else _pad_to(cut(plan.key_segments, 1), k_pad, 1, edge=True),
        mask_columns=columns,
        # Per-key arrays a hook read from a KV cache (DeBERTa's key projections, Transformer-XL's u·k, the
        # functional encoding's key sinusoids): the same keys', padded as the keys are.
        hooks=_cut_key_features(plan.hooks, lambda x: _pad_to(cut(x, 1), k_pad, 1)),
    )


def _cut_key_features(hooks: list, fn) -> list:
    """``hooks`` with ``fn`` applied to the per-key arrays of those that hold some (read from a KV cache)."""
    return [hook.map_key_features(fn) if forms_of(hook).has("cached", "key_features") else hook for hook in hooks]


def _query_tile(plan: _Plan, qi) -> _QueryTile:
    """Query block ``qi``: its queries (rotated), positions and context."""
    q = _tile(plan.query, qi, plan.block_q, 1)
    q_positions = _tile(plan.query_positions, qi, plan.block_q, 1)
    q_context = plan.context.tile(q_positions, q_positions, sequence_lengths=_tile(plan.counts, qi, plan.block_q, 1))
    for hook in plan.rotations:  # the queries' half of the rotation (the keys' half, of q itself, is dropped)
        q = hook.rotate(q, q, q_context)[0]
    return _QueryTile(q, q_positions, q_context)


def _start(plan: _Plan, block: _QueryTile):
    """A query block's carry before any key: the normaliser's running statistics, the running output, the
    running value terms, the carried hooks' sums."""
    batch, num_heads, head_dim = plan.shape
    zeros = lambda: jnp.zeros((batch, plan.block_q, num_heads, head_dim), jnp.float32)
    return (
        plan.normalizer.tile_init((batch, num_heads, plan.block_q)),
        zeros(),
        tuple(zeros() for _ in range(plan.values_count)),
        tuple(hook.init_carry(block.q, block.context) for hook in plan.carried),
    )


def _tile_mask(plan: _Plan, keys: _Keys, kj, q_positions, k_positions, q_segments, q_extra):
    """The tile's ``[B|1, N|1, bq, bk]`` boolean mask from its parts (None: every key visible)."""
    parts = []
    if plan.causal:
        parts.append(k_positions[:, None, None, :] <= q_positions[:, None, :, None])
    if keys.valid is not None:
        parts.append(_tile(keys.valid, kj, plan.block_k, 1)[:, None, None, :])
    if q_segments is not None:
        parts.append(q_segments[:, None, :, None] == _tile(keys.segments, kj, plan.block_k, 1)[:, None, None, :])
    if q_extra is not None:
        parts.append(_tile(q_extra, kj, plan.block_k, 3))
    tile_mask = None
    for part in parts:
        tile_mask = part if tile_mask is None else jnp.logical_and(tile_mask, part)
    return tile_mask


def _tile_scores(plan: _Plan, q, k, tile_hooks: list, tile_context: AttentionContext, hook_carry):
    """The tile's float32 ``[B, N, bq, bk]`` scores from each hook's tiled form, and the carried hooks' sums."""
    joined = plan.joined
    # Hooks that form the scores with the content product (a term that is a shift of q or k on some tiles)
    # are composed around it; the others' terms are added to what it gives.
    scoring = [plan.joinable and not any(joined) and forms_of(hook).has("tiled", "scores") for hook in tile_hooks]
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
        forms = forms_of(hook)
        if forms.has("tiled", "carried"):
            hook_state = hook_carry[len(new_hook_carry)]
            if content_only and forms.has("tiled", "carried_from_content"):
                term, c = hook.carried_logits_from_content(s, q, k, tile_context, hook_state)
            else:
                term, c = hook.carried_logits(q, k, tile_context, hook_state)
            new_hook_carry.append(c)
        elif forms.has("tiled", "logits"):
            term = hook.tile_logits(q, k, tile_context)
        elif forms.has("tiled", "distance"):
            term = _distance_tile(hook, q, k, tile_context)
        else:
            term = hook.logits(q, k, tile_context) if "logits" in hook_names(hook) else None
        if term is not None:
            term = term.astype(jnp.float32)
            s = s + broadcast_to(term.reshape((1,) * (4 - term.ndim) + term.shape), s.shape)
            content_only = False
    return s, tuple(new_hook_carry)


def _accumulate(plan: _Plan, s, v, tile_mask, tile_context, values_hooks, state, acc, vacc, dropout_key):
    """The online softmax's step: the tile's weights from its scores, the running statistics, output and
    value terms rescaled and added to (``dropout_key``: ``(query block, first key tile, key tile)``)."""
    visible = jnp.ones(s.shape, bool) if tile_mask is None else jnp.broadcast_to(tile_mask, s.shape)
    p, state, correction = plan.normalizer.tile_weights(s, visible, state, tile_context)
    if plan.dropout_rate > 0.0:
        qi, first_tile, kj = dropout_key
        rng = jax.random.fold_in(jax.random.fold_in(plan.dropout_rng, qi), first_tile + kj)
        p = _dropout(p, plan.dropout_rate, rng, plan.dropout_broadcast)
    out = _tile_product(p, v, tile_mask)
    terms = []
    for hook in values_hooks:
        term = (
            hook.tile_values(p, tile_context) if forms_of(hook).has("tiled", "values") else hook.values(p, tile_context)
        )
        terms.append(jnp.zeros_like(acc) if term is None else term.astype(jnp.float32))
    if correction is not None:
        rescale = einops.rearrange(correction, "B N T -> B T N 1")
        acc = acc * rescale
        vacc = tuple(a * rescale for a in vacc)
    acc = acc + out
    vacc = tuple(a + t for a, t in zip(vacc, terms, strict=True))
    return state, acc, vacc


def _tile_step(plan: _Plan, qi, block: _QueryTile, keys: _Keys, first_tile, q_segments, q_extra, carry, kj):
    """One query tile × key tile: ``carry`` after query block ``qi`` has seen key tile ``kj`` of ``keys``."""
    state, acc, vacc, hook_carry = carry
    k = _tile(keys.key, kj, plan.block_k, 1)
    v = _tile(keys.value, kj, plan.block_k, 1)
    k_positions = _tile(keys.positions, kj, plan.block_k, 1)
    for hook in plan.rotations:  # the keys' half (the queries' half, of k itself, is dropped)
        k = hook.rotate(k, k, plan.context.tile(k_positions, k_positions))[1]
    tile_mask = _tile_mask(plan, keys, kj, block.positions, k_positions, q_segments, q_extra)
    tile_context = plan.context.tile(block.positions, k_positions, mask=tile_mask)
    tile_hooks = _cut_key_features(keys.hooks, lambda x: _tile(x, kj, plan.block_k, 1))
    s, new_hook_carry = _tile_scores(plan, block.q, k, tile_hooks, tile_context, hook_carry)
    values_hooks = [hook for hook in keys.hooks if "values" in hook_names(hook)]
    state, acc, vacc = _accumulate(
        plan, s, v, tile_mask, tile_context, values_hooks, state, acc, vacc, (qi, first_tile, kj)
    )
    return (state, acc, vacc, new_hook_carry)


def tile_loop(plan: _Plan, qi, block: _QueryTile, carry, keys: _Keys, first_tile):
    """The one online-softmax tile loop: ``carry`` after query block ``qi`` has seen every key tile of
    ``keys`` (numbered from ``first_tile``). Blockwise attention runs it once per query block over all
    keys; ring attention once per query block and key shard; sequence-parallel attention through either."""
    q_segments = _tile(plan.query_segments, qi, plan.block_q, 1)
    q_extra = _tile(keys.mask_columns, qi, plan.block_q, 2)
    # What a hook's tiles share within this query block, computed once for it and read by every key tile
    # (CoPE's q·eᵀ over its positions).
    hooks = [
        h.for_query_block(block.q, block.context) if forms_of(h).has("tiled", "per_query_block") else h
        for h in keys.hooks
    ]
    keys = keys._replace(hooks=hooks)
    step = functools.partial(_tile_step, plan, qi, block, keys, first_tile, q_segments, q_extra)

    def maybe_step(carry, kj):
        if not plan.causal:
            return step(carry, kj)
        # Every query of the block is before every key of the key block: nothing to see, and a
        # carried hook's sums pass through unchanged (the tile's gates are all masked).
        hidden = jnp.all(_tile(keys.positions, kj, plan.block_k, 1).min(-1) > block.positions.max(-1))
        return jax.lax.cond(hidden, lambda c, _: c, step, carry, kj)

    # The checkpoint holds the cond too: a differentiated cond would keep its branch's residuals
    # for every key block, and the backward pass's memory would grow with T x S.
    maybe_step = jax.checkpoint(maybe_step)
    carry, _ = jax.lax.scan(lambda c, kj: (maybe_step(c, kj), None), carry, plan.key_order)
    return carry


def _finish(plan: _Plan, block: _QueryTile, carry) -> jax.Array:
    """A query block's outputs ``[B, bq, N, H]`` from its carry after every key."""
    batch, num_heads, _ = plan.shape
    state, acc, vacc, _ = carry
    acc = acc + sum(vacc) if vacc else acc
    denominator = jnp.broadcast_to(
        plan.normalizer.tile_denominator(state, block.context), (batch, num_heads, plan.block_q)
    )
    denominator = jnp.where(denominator > 0, denominator, 1.0)
    return acc / einops.rearrange(denominator, "B N T -> B T N 1")
