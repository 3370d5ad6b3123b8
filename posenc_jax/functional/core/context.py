"""The per-call context every hook receives, and the pytree dataclasses hooks and configs are made of.

:class:`AttentionContext` is what one attention call tells every hook: the query and key
positions, the boolean mask, the score scale, the head dim and head count, whether the
attention is causal, the key length; :func:`attention_context` makes one from checked
positions, :func:`rotation_context` from what a user rotating q and k directly passes.
:func:`pytree_dataclass` and :func:`parameter` make a frozen dataclass a pytree whose
parameters are its leaves. All of them are importable from
:mod:`posenc_jax.functional.core.hooks`, the contract.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from posenc_jax.functional.core.positions import check_positions

__all__ = ["AttentionContext", "attention_context", "parameter", "pytree_dataclass", "rotation_context"]


def parameter(**kwargs) -> Any:
    """A dataclass field holding a parameter: a pytree leaf (or subtree) of the hook."""
    return dataclasses.field(metadata={"parameter": True}, **kwargs)


def pytree_dataclass(cls):
    """Makes ``cls`` a frozen dataclass registered as a pytree.

    Fields declared with :func:`parameter` are the children; the others are static
    auxiliary data (hashable settings). Unflattening bypasses ``__init__``, so the
    checks in ``__post_init__`` run when a user builds the object, not when JAX rebuilds
    it around tracers or placeholder leaves.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if f.metadata.get("parameter"))
    meta = tuple(f.name for f in fields if not f.metadata.get("parameter"))

    def flatten_with_keys(obj):
        children = [(jax.tree_util.GetAttrKey(name), getattr(obj, name)) for name in data]
        return children, tuple(getattr(obj, name) for name in meta)

    def flatten(obj):
        return [getattr(obj, name) for name in data], tuple(getattr(obj, name) for name in meta)

    def unflatten(aux, children):
        obj = object.__new__(cls)
        for name, value in zip(meta, aux, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(data, children, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


@pytree_dataclass
class AttentionContext:
    """What one attention call tells every hook.

    Attributes:
      query_positions: int32 ``[T]`` or ``[B, T]``.
      key_positions: int32 ``[S]`` or ``[B, S]`` (the same object as ``query_positions``
        in self-attention, so tables computed from positions are computed once).
      scale: the content-score scale of this call (explicit, prescribed by an
        encoding, or ``1/√H``); terms bilinear in q read it.
      head_dim: H.
      num_heads: N, the number of query heads.
      causal: whether keys after the query (by position) are masked.
      key_length: S, the number of keys of this call.
      mask: the call's boolean mask ``[B|1, N|1, T, S]`` (True = attend), or None: the
        causal mask, key padding (and a KV cache's empty slots), segments and any extra
        mask, combined. A hook that sums over keys (CoPE's gates, a value term) must
        leave masked keys out by selecting (``jnp.where``), not by multiplying by zero,
        so that whatever a masked key holds (NaN, inf) never reaches the output.
      sequence_lengths: float32 ``[B|1, T]``, for each query the number of keys of its
        sequence (real keys of its packed segment; the causal mask does not enter), or
        None when every one of the ``key_length`` keys counts (relu²/n reads it).

    In blockwise attention a hook sees one tile at a time (:meth:`tile`): the positions,
    ``mask`` and ``sequence_lengths`` are the tile's (``key_length`` stays the whole call's S),
    so a hook that computes its term from the context's positions works unchanged in tiles.

    Positions are checked once, where they enter (:meth:`from_positions`, :func:`rotation_context`,
    ``dot_product_attention``, the modules), and every context is then made by
    :func:`attention_context`: a hook given a context reads its positions as they are, int32.
    Building the dataclass directly skips that check (its positions must already be int32 arrays).
    """

    query_positions: jax.Array = parameter()
    key_positions: jax.Array = parameter()
    scale: float = 1.0
    head_dim: int = 0
    num_heads: int = 0
    causal: bool = False
    key_length: int = 0
    mask: jax.Array | None = parameter(default=None)
    sequence_lengths: jax.Array | None = parameter(default=None)

    @classmethod
    def from_positions(
        cls,
        query_positions,
        key_positions,
        *,
        causal: bool,
        scale: float,
        head_dim: int = 0,
        num_heads: int = 0,
        mask: jax.Array | None = None,
        sequence_lengths: jax.Array | None = None,
    ) -> AttentionContext:
        """The context of one attention call over these positions, for calling hooks directly.

        ``causal`` and ``scale`` have no default: an encoding with a causal and a
        bidirectional form (T5, ALiBi) follows ``causal``, and a term bilinear in q
        (DeBERTa, Shaw, Transformer-XL) multiplies by ``scale``, so a guessed value would
        silently change the result. ``key_length`` is the number of keys, ``S``.

        Args:
          query_positions: integer ``[T]`` or ``[B, T]``.
          key_positions: integer ``[S]`` or ``[B, S]``; pass the very same object as
            ``query_positions`` in self-attention (tables are then computed once).
          causal: whether keys after the query (by position) are masked.
          scale: the content-score scale, e.g. ``1/√H`` (or ``HFEncoding.scale``).
          head_dim, num_heads: H and N, for hooks that read them (ALiBi's slopes read N).
          mask, sequence_lengths: as in the attributes above.

        Example:
          >>> from posenc_jax.functional import RoPE
          >>> pos = jnp.arange(4); q = k = jnp.ones((1, 4, 2, 8))
          >>> context = AttentionContext.from_positions(pos, pos, causal=True, scale=8**-0.5)
          >>> [x.shape for x in RoPE().rotate(q, k, context)]
          [(1, 4, 2, 8), (1, 4, 2, 8)]
        """
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be True or False, got {causal!r}")
        try:
            value = float(scale)
        except (TypeError, ValueError):
            value = float("nan")
        if isinstance(scale, bool) or not 0 < value < float("inf"):
            raise ValueError(f"scale must be a finite number > 0 (e.g. 1/sqrt(head_dim)), got {scale!r}")
        query_positions, key_positions = _checked_pair(query_positions, key_positions)
        return attention_context(
            query_positions,
            key_positions,
            scale=value,
            causal=causal,
            head_dim=head_dim,
            num_heads=num_heads,
            mask=mask,
            sequence_lengths=sequence_lengths,
        )

    def tile(
        self,
        query_positions: jax.Array,
        key_positions: jax.Array,
        *,
        mask: jax.Array | None = None,
        sequence_lengths: jax.Array | None = None,
    ) -> AttentionContext:
        """This call's context for one tile of queries × keys (blockwise attention).

        The positions, ``mask`` and ``sequence_lengths`` are the tile's; the scale, sizes,
        direction and ``key_length`` (the whole call's S) stay the call's. The tile's
        positions are cut from the call's, so they are not checked again.
        """
        return dataclasses.replace(
            self,
            query_positions=query_positions,
            key_positions=key_positions,
            mask=mask,
            sequence_lengths=sequence_lengths,
        )

    def bidirectional(self, setting: bool | None) -> bool:
        """An encoding's direction: its explicit ``setting``, else the attention's (not causal)."""
        return (not self.causal) if setting is None else bool(setting)

    def check_heads(self, heads: int, what: str) -> None:
        """Refuses a per-head parameter (``what``, for ``heads`` heads) that does not match N (when known)."""
        if self.num_heads and heads != self.num_heads:
            raise ValueError(
                f"{what} has {heads} heads but the attention has N={self.num_heads} query heads; "
                f"make it for {self.num_heads} heads (init(..., num_heads={self.num_heads}))"
            )


def attention_context(
    query_positions: jax.Array | None,
    key_positions: jax.Array | None,
    *,
    scale: float,
    causal: bool,
    head_dim: int = 0,
    num_heads: int = 0,
    key_length: int | None = None,
    mask: jax.Array | None = None,
    sequence_lengths: jax.Array | None = None,
) -> AttentionContext:
    """The context of one attention call, from positions already checked: every context is made here.

    The entry points check positions once (:func:`~posenc_jax.functional.core.positions.check_positions`)
    and then make the context here: :meth:`AttentionContext.from_positions` and
    :func:`rotation_context` for hooks called directly, ``dot_product_attention`` and the
    modules for a call, a model for its per-forward terms. Nothing below re-checks them.

    Args:
      query_positions, key_positions: int32 ``[T]`` / ``[S]`` or ``[B, T]`` / ``[B, S]`` as
        ``check_positions`` returns them (the same object twice in self-attention, so tables
        computed from positions are computed once), or both None when nothing reads them.
      scale, causal, head_dim, num_heads, mask, sequence_lengths: as in :class:`AttentionContext`.
      key_length: S; by default the key positions' length (required without positions).

    Example:
      >>> pos = jnp.arange(4)
      >>> context = attention_context(pos, pos, scale=0.5, causal=True)
      >>> context.key_length, context.query_positions is context.key_positions
      (4, True)
    """
    if key_length is None:
        key_length = key_positions.shape[-1]
    return AttentionContext(
        query_positions=query_positions,
        key_positions=key_positions,
        scale=scale,
        head_dim=int(head_dim),
        num_heads=int(num_heads),
        causal=causal,
        key_length=int(key_length),
        mask=mask,
        sequence_lengths=sequence_lengths,
    )


def _checked_pair(query_positions, key_positions) -> tuple[jax.Array, jax.Array]:
    """Both positions checked; self-attention (one array given twice) keeps one array."""
    same = key_positions is query_positions
    query_positions = check_positions(query_positions, "query_positions")
    return query_positions, query_positions if same else check_positions(key_positions, "key_positions")


def rotation_context(context, caller: str) -> AttentionContext:
    """The :class:`AttentionContext` a ``rotate`` hook called directly works from.

    The attention hands every hook an :class:`AttentionContext`. A user rotating q and k
    themselves (to pair RoPE with ``jax.nn.dot_product_attention`` or a fused kernel) passes
    positions instead: one integer array ``[T]`` or ``[B, T]`` for queries and keys alike, or
    a pair ``(query_positions, key_positions)``, checked here. A context is returned as it is:
    its positions were checked where it was made. ``caller`` names the hook in the error.

    Example:
      >>> rotation_context(jnp.arange(4), "RoPE.rotate").key_length
      4
      >>> context = rotation_context((jnp.arange(1) + 3, jnp.arange(4)), "RoPE.rotate")
      >>> context.query_positions.tolist(), context.key_positions.tolist()
      ([3], [0, 1, 2, 3])
    """
    if isinstance(context, AttentionContext):
        return context
    arrays = (jax.Array, np.ndarray)
    if isinstance(context, arrays):
        query_positions = key_positions = check_positions(context, "positions")
    elif isinstance(context, (tuple, list)) and len(context) == 2 and all(isinstance(p, arrays) for p in context):
        query_positions, key_positions = _checked_pair(*context)
    else:

        def kind(x) -> str:
            return f"array of shape {x.shape}" if isinstance(x, arrays) else type(x).__name__

        if isinstance(context, (tuple, list)):
            got = f"a {type(context).__name__} of {len(context)} ({', '.join(kind(p) for p in context)})"
        else:
            got = f"{type(context).__name__} {context!r}"[:80]
        raise TypeError(
            f"{caller}(q, k, context): context must be an AttentionContext, a positions array [T] or [B, T] (for "
            f"q and k alike), or a pair (query_positions, key_positions) of arrays; got {got}"
        )
    return attention_context(query_positions, key_positions, scale=1.0, causal=False)
