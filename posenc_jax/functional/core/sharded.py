"""Sequence-parallel attention: one long sequence's queries split over the devices of a mesh.

:func:`sequence_parallel_attention` computes what
``dot_product_attention(..., implementation="blockwise")`` computes, with the query axis T
cut into one contiguous slice per device of a mesh axis. Each device runs the blockwise
attention of its slice of queries against every key (keys and values are gathered whole on
every device), so the work and the query-side memory (queries, outputs, the running
statistics) divide by the number of devices; the keys, the values and the
``[B, N, block_q, block_k]`` tile workspace do not. With ``ring=True`` the keys and values
are split too, and each device's shard is passed round the devices, one pass per device
(:class:`~posenc_jax.functional.core.blockwise.KeyRing`): a device then holds one shard of
them at a time.

Every encoding sees its true positions. A device's queries keep their positions (the slice
of ``query_positions``), so causal masking, segment ids, biases from positions (T5, ALiBi,
Kerple, FIRE, ...), terms from positions and q or k (Shaw, DeBERTa, Transformer-XL, CoPE)
are computed for each tile exactly as on one device. Rotations go to the devices, which apply
them per tile as one device does: those by each token's own position (RoPE, its fixed
scalings, axial RoPE) as they are, and those that read one value of the whole call (dynamic
NTK and LongRoPE the length ``max(query_positions) + 1``, xPos the queries' midpoint, which
one device's slice would change) with that value fixed from the whole call before the split
(:class:`~posenc_jax.functional.core.hooks.PerCallRotation`). Any other rotation is applied
once to the whole q and k before the split.

Each query row goes through the same arithmetic as on one device (its tiles of keys, in the
same order). On XLA:CPU the outputs equal one device's bit for bit, for every encoding, with T
padded and with blocks that divide neither length (``tests/test_sharded.py``); gradients with
respect to what is replicated (keys, values, the encodings' parameters) are sums over the
devices, taken in another order, and agree to float32 rounding.

Axis letters as in :mod:`posenc_jax.functional.core.attention`: B batch, T queries, S keys,
N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from posenc_jax.functional.core.attention import _attention_hooks, _blockwise_call, dot_product_attention
from posenc_jax.functional.core.blockwise import KeyRing
from posenc_jax.functional.core.checks import _call, _checked_positions, _score_scale
from posenc_jax.functional.core.forms import forms_of
from posenc_jax.functional.core.hooks import (
    AttentionContext,
    Normalize,
    hook_names,
    rotates_each_token,
    with_per_call_rotations_fixed,
)
from posenc_jax.functional.core.normalizers import as_normalizer, softmax_weights
from posenc_jax.functional.core.registry import resolve_encodings
from posenc_jax.functional.core.tiles import _pad_to

__all__ = ["sequence_parallel_attention"]

_shard_map = functools.partial(jax.shard_map, check_vma=False)


def _mesh_axis(mesh, axis_name: str | None) -> str:
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; e.g. "
            f"Mesh(np.asarray(jax.devices()), ('sequence',))"
        )
    if axis_name is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"the mesh has the axes {mesh.axis_names}; pass axis_name= to say which one splits the queries"
            )
        return mesh.axis_names[0]
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh, whose axes are {mesh.axis_names}")
    return axis_name


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _split_arrays(tree):
    """``tree``'s array leaves (they cross ``shard_map`` as arguments) and a function rebuilding it."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [leaf for leaf in leaves if _is_array(leaf)]

    def rebuild(new_arrays):
        it = iter(new_arrays)
        return treedef.unflatten([next(it) if _is_array(leaf) else leaf for leaf in leaves])

    return arrays, rebuild


def _pad_rows(x, length: int, axis: int):
    """``x`` padded along ``axis`` to ``length`` by repeating its last entry (positions, ids stay valid);
    None and a broadcast axis of 1 as they are."""
    if x is None or x.shape[axis] == 1:
        return x
    return _pad_to(x, length, axis, edge=True)


def _gathered(x: jax.Array, axis: str) -> jax.Array:
    """Keys or values ``[B, S/P, K, H]`` gathered from every device into ``[B, S, K, H]``.

    Gathered along the leading axis: XLA:CPU lays an all-gather out with the gathered axis
    major, and gathering ``[B, S/P, ...]`` along axis 1 would add a copy of the whole result.
    """
    whole = jax.lax.all_gather(jnp.moveaxis(x, 1, 0), axis, axis=0, tiled=True)
    return jnp.moveaxis(whole, 0, 1)


def _rotations(hooks: list) -> list:
    rotations = [hook for hook in hooks if "rotate" in hook_names(hook)]
    for hook in rotations:
        forms = forms_of(hook)
        adds_terms = {"logits", "values"} & set(hook_names(hook))
        if adds_terms or forms.has("tiled", "carried") or forms.has("cached", "key_features"):
            raise ValueError(
                f"{type(hook).__name__} both rotates q and k and adds a term; sequence_parallel_attention applies "
                f"rotations before splitting the queries and cannot split such a hook: use "
                f"dot_product_attention(..., implementation='blockwise') on one device"
            )
    return rotations


def sequence_parallel_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mesh: Mesh,
    axis_name: str | None = None,
    query_positions=None,
    key_positions=None,
    encodings: Sequence = (),
    normalizer: Normalize | str | Callable = softmax_weights,
    causal: bool = False,
    key_mask: jax.Array | None = None,
    query_segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
    mask: jax.Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    broadcast_dropout: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    ring: bool = False,
) -> jax.Array:
    """Blockwise attention with the queries split over the devices of ``mesh``'s ``axis_name``.

    The same attention as ``dot_product_attention(..., implementation="blockwise")``
    (the same arguments, less ``return_weights`` and ``implementation``): device ``d`` of the
    ``P`` devices along ``axis_name`` computes the outputs of queries
    ``d·⌈T/P⌉ .. (d+1)·⌈T/P⌉ - 1`` against all S keys, in tiles of ``block_q × block_k``.
    Queries, their positions, segment ids, the rows of ``mask`` and the output are split
    along T; keys, values, their positions, ``key_mask`` and the encodings' parameters are
    replicated. A T that the devices do not divide is padded (the last query repeated)
    and the padding dropped. Rotations go to the devices, which apply them per tile (see the
    module docstring).

    The arguments after ``axis_name`` (``query_positions`` … ``block_k``) mean what they
    mean in :func:`~posenc_jax.functional.core.attention.dot_product_attention`.

    Call it under ``jax.jit`` or not; the inputs may be placed anywhere (they are moved to
    the split above). Dropout draws each device's masks from ``fold_in(dropout_rng, d)``.

    Args:
      query: ``[B, T, N, H]`` (or ``[T, N, H]``).
      key, value: ``[B, S, K, H]`` (or ``[S, K, H]``).
      mesh: a :class:`jax.sharding.Mesh`; e.g. ``Mesh(np.asarray(jax.devices()), ("sequence",))``.
      axis_name: the mesh axis that splits the queries (default: the mesh's only axis).
        Along the mesh's other axes, if any, the computation is repeated.
      ring: split the keys and values too, and pass each device's shard round the devices
        (:class:`~posenc_jax.functional.core.blockwise.KeyRing`) instead of gathering them
        whole on every device: a device then holds ``1/P`` of the keys and values, and the
        attention takes ``P`` passes, each visiting one shard. Causal attention with a
        carried hook (CoPE) only. The outputs equal the gathered form's to float32 rounding
        (each row's keys are visited in another order).

    Returns:
      ``[B, T, N, H]`` in ``query``'s dtype, split along T over ``axis_name``.

    Example:
      >>> mesh = Mesh(np.asarray(jax.devices()), ("sequence",))
      >>> q = k = v = jnp.ones((1, 16, 2, 8)); pos = jnp.arange(16)
      >>> sequence_parallel_attention(q, k, v, mesh=mesh, query_positions=pos, key_positions=pos,
      ...                             encodings=["rope", "alibi"], causal=True, block_q=4).shape
      (1, 16, 2, 8)
    """
    axis = _mesh_axis(mesh, axis_name)
    settings = dict(normalizer=normalizer, causal=causal, scale=scale, block_q=block_q, block_k=block_k)
    settings.update(dropout_rate=dropout_rate, broadcast_dropout=bool(broadcast_dropout))
    masks = (key_mask, query_segment_ids, key_segment_ids, mask)
    _check_as_one_device(query, key, value, query_positions, key_positions, encodings, masks, dropout_rng, settings)
    unbatched = query.ndim == 3
    key_mask, query_segment_ids, key_segment_ids = (
        None if a is None else jnp.asarray(a)[None] if unbatched else jnp.asarray(a)
        for a in (key_mask, query_segment_ids, key_segment_ids)
    )
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    head_dim = query.shape[3]
    hooks = resolve_encodings(encodings)
    rotations = _rotations(hooks)
    # Resolved here, from every hook (a rotation may prescribe it): the devices are given the result.
    settings["scale"] = _score_scale(hooks, head_dim, scale)
    settings["normalizer"] = as_normalizer(normalizer)
    hooks, query, key = _rotate_whole_call(hooks, rotations, query, key, query_positions, key_positions, settings)
    devices = mesh.shape[axis]
    q_len = query.shape[1]
    queries, mask_spec = _split_queries(axis, devices, query, query_positions, key_positions, query_segment_ids, mask)
    query, query_positions, key_positions, query_segment_ids, mask = queries
    keys = (key, value, key_positions, key_mask, key_segment_ids, mask)
    if ring and key.shape[1] % devices:
        keys, hooks = _pad_keys_for_ring(devices, keys, hooks)
    key, value, key_positions, key_mask, key_segment_ids, mask = keys
    arrays = (query, key, value, query_positions, key_positions, key_mask, query_segment_ids, key_segment_ids, mask)
    out = _on_devices(mesh, axis, ring, settings, hooks, arrays, mask_spec, dropout_rng)[:, :q_len]
    return out[0] if unbatched else out


def _on_devices(mesh, axis, ring, settings, hooks, arrays, mask_spec, dropout_rng):
    """The attention of the split call's ``arrays`` (``query, key, value, query_positions, key_positions,
    key_mask, query_segment_ids, key_segment_ids, mask``), each device's queries by :func:`_local`."""
    key = arrays[1]
    devices = mesh.shape[axis]
    split_keys = key.shape[1] % devices == 0
    parameters, rebuild = _split_arrays((hooks, settings["normalizer"]))
    local = functools.partial(
        _local,
        rebuild=rebuild,
        axis=axis,
        whole_key=jax.ShapeDtypeStruct(key.shape, key.dtype),
        gather=split_keys and not ring,
        ring=KeyRing(axis, devices) if ring else None,
        settings=settings,
    )
    rows, whole = PartitionSpec(None, axis), PartitionSpec()
    keys = rows if split_keys else whole
    in_specs = (rows, keys, keys, rows, whole, whole, rows, whole, mask_spec, whole, whole)
    return _shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=rows)(*arrays, dropout_rng, parameters)


def _check_as_one_device(query, key, value, query_positions, key_positions, encodings, masks, dropout_rng, settings):
    """Every check of the one-device call, with its messages, on the whole call's shapes (nothing is computed)."""
    key_mask, query_segment_ids, key_segment_ids, mask = masks
    jax.eval_shape(
        lambda q, k, v, rng: dot_product_attention(
            q,
            k,
            v,
            query_positions=query_positions,
            key_positions=key_positions,
            encodings=encodings,
            key_mask=key_mask,
            query_segment_ids=query_segment_ids,
            key_segment_ids=key_segment_ids,
            mask=mask,
            dropout_rng=rng,
            implementation="blockwise",
            **settings,
        ),
        query,
        key,
        value,
        dropout_rng,
    )


def _rotate_whole_call(hooks, rotations, query, key, query_positions, key_positions, settings):
    """``(hooks, query, key)`` with the rotations that cannot go to the devices applied to the whole call.

    A rotation by each token's own position goes to the devices, whose blockwise attention applies it per
    tile (no rotated copy of q or k, nor of the gathered keys); so does one that reads one value of the whole
    call (xPos's centre, a scaling's length), fixed here first; any other rotation runs here, on the whole call.
    """
    if all(rotates_each_token(h) for h in rotations):
        return hooks, query, key
    context = AttentionContext.from_positions(
        query_positions,
        key_positions,
        causal=bool(settings["causal"]),
        scale=settings["scale"],
        head_dim=query.shape[3],
        num_heads=query.shape[2],
    )
    hooks = with_per_call_rotations_fixed(hooks, context)
    whole_call = [h for h in hooks if "rotate" in hook_names(h) and not rotates_each_token(h)]
    for hook in whole_call:
        query, key = hook.rotate(query, key, context)
    hooks = [hook for hook in hooks if not any(hook is rotation for rotation in whole_call)]
    return hooks, query, key


def _split_queries(axis, devices, query, query_positions, key_positions, query_segment_ids, mask):
    """Whole-call arrays in the shapes the devices receive: per-query ones ``[B|1, T, ...]`` padded to
    ``P·⌈T/P⌉``; and the mask's partition (split along T when it has rows)."""
    padded = devices * math.ceil(query.shape[1] / devices)
    query = _pad_rows(query, padded, 1)
    if query_positions is not None:
        query_positions = _pad_rows(jnp.atleast_2d(jnp.asarray(query_positions)), padded, 1)
        key_positions = jnp.atleast_2d(jnp.asarray(key_positions))
    if query_segment_ids is not None:
        query_segment_ids = _pad_rows(jnp.asarray(query_segment_ids), padded, 1)
    mask_spec = PartitionSpec()
    if mask is not None:
        mask = jnp.asarray(mask)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        if mask.shape[2] != 1:
            mask = _pad_rows(mask, padded, 2)
            mask_spec = PartitionSpec(None, None, axis, None)
    return (query, query_positions, key_positions, query_segment_ids, mask), mask_spec


def _pad_keys_for_ring(devices, keys, hooks):
    """The per-key arrays ``keys`` (``key, value, key_positions, key_mask, key_segment_ids, mask``) and the
    hooks' per-key arrays padded to a multiple of the devices, the padded keys invalid."""
    key, value, key_positions, key_mask, key_segment_ids, mask = keys
    k_len = key.shape[1]
    k_padded = devices * math.ceil(k_len / devices)
    real = jnp.arange(k_padded) < k_len
    key_mask = real[None] if key_mask is None else _pad_to(jnp.asarray(key_mask), k_padded, 1) & real[None]
    key, value = _pad_to(key, k_padded, 1), _pad_to(value, k_padded, 1)
    if key_positions is not None:
        key_positions = _pad_rows(key_positions, k_padded, 1)
    if key_segment_ids is not None:
        key_segment_ids = _pad_rows(jnp.asarray(key_segment_ids), k_padded, 1)
    if mask is not None and mask.shape[3] != 1:
        mask = _pad_to(mask, k_padded, 3)
    hooks = [
        hook.map_key_features(lambda x: _pad_to(x, k_padded, 1))
        if forms_of(hook).has("cached", "key_features")
        else hook
        for hook in hooks
    ]
    return (key, value, key_positions, key_mask, key_segment_ids, mask), hooks


def _local(
    q, k, v, qpos, kpos, kmask, qseg, kseg, extra, rng, parameters, *, rebuild, axis, whole_key, gather, ring, settings
):
    """One device's part, inside ``shard_map``: its queries against every key (gathered, or passed round
    the ring), by the one-device blockwise path with the context of its queries against all the keys."""
    local_hooks, local_normalizer = rebuild(parameters)
    if gather:
        k, v = _gathered(k, axis), _gathered(v, axis)
    if rng is not None:
        rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
    causal, k_len = settings["causal"], whole_key.shape[1]
    local_hooks = _attention_hooks(local_hooks, causal=bool(causal))
    qpos, kpos = _checked_positions(
        qpos, kpos, needed=bool(causal) or bool(local_hooks), q_len=q.shape[1], k_len=k_len, batch=q.shape[0]
    )
    call = _call(
        q,
        whole_key,
        whole_key,
        local_hooks,
        query_positions=qpos,
        key_positions=kpos,
        causal=causal,
        key_mask=kmask,
        query_segment_ids=qseg,
        key_segment_ids=kseg,
        mask=extra,
        scale=settings["scale"],
        build_mask=False,
    )
    masks = (kmask, qseg, kseg, extra)
    blocks = (settings["block_q"], settings["block_k"])
    out = _blockwise_call(
        call,
        k,
        v,
        local_normalizer,
        masks,
        *blocks,
        settings["dropout_rate"],
        rng,
        settings["broadcast_dropout"],
        ring=ring,
    )
    return out.astype(q.dtype)
