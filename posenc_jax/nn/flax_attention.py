"""This library's encodings inside Flax's own attention layers, decode caches included.

``flax.nnx.MultiHeadAttention`` and ``flax.linen.MultiHeadDotProductAttention`` take an
``attention_fn(query, key, value, bias=None, mask=None, ...)``. The functions made here are
drop-in replacements for Flax's ``dot_product_attention``: they take every argument Flax
passes, with Flax's meaning, and run this library's attention (its scores, encodings and
value product; the softmax normaliser below gives Flax's weights):

* ``[batch..., length, heads, depth]`` with any number of batch dimensions (none too);
  fewer key/value heads than query heads (grouped-query attention);
* ``mask`` and ``bias`` broadcastable to ``[batch..., heads, q_length, kv_length]``, the
  bias added to the scores before the mask; a query whose keys are all masked gets the
  mean of the values, as Flax's;
* ``is_causal``: query ``i`` sees keys ``0 .. i`` (Flax's alignment, in cross-attention too);
* dropout on the weights with ``dropout_rate``, ``dropout_rng`` and ``deterministic``,
  ``broadcast_dropout=True`` drawing one ``[q_length, kv_length]`` mask for every batch
  row and head as Flax does;
* ``module``: the softmax weights are sown (NNX: ``nnx.Intermediate``; Linen:
  ``"intermediates"``) as ``attention_weights``, ``[batch..., heads, q_length, kv_length]``;
* ``dtype`` (and NNX's ``promote_dtype``): the inputs are promoted to it and the output and
  the sown weights are in it (Linen's ``force_fp32_for_softmax`` keeps the weights float32);
  scores and softmax are computed in float32;
* ``precision``: the precision of every matrix product of the call.

What it cannot honour is an error naming it, never ignored: Linen's
``qk_attn_weights_einsum``/``attn_weights_value_einsum`` and ``einsum_dot_general`` (they
would replace this library's products), complex inputs, and a ``precision`` pair whose two
operands differ.

Positions are made only where an encoding (or ``causal=True``) needs them:

* as many queries as keys, or ``is_causal``: ``0 .. T-1`` and ``0 .. S-1``;
* a decoding step of Flax's cache (``decode=True``: one query against the cache's
  ``max_length`` keys): the keys are the cache slots ``0 .. S-1`` and the query sits at
  the cache index, which Flax's decode mask carries (it lets the query see the slots
  ``0 .. index``), so the query's position is the last slot its mask lets it see;
* or positions fixed when the function is made (``query_positions``, ``key_positions``).

Without an encoding that needs them (NoPE), queries and keys of any lengths attend as in Flax.

Flax caches keys before ``attention_fn`` sees them, unrotated, so RoPE rotates every
cached key by its slot at each step, and decoding gives the full forward's outputs
(tested for RoPE, ALiBi and T5 in both Flax APIs).

:func:`make_attention_fn` takes parameter-free encodings (names or configs) and built
hooks with fixed arrays (``T5Bias(table)``); :class:`AttentionFunction` is an NNX module
that holds learned encodings' parameters (T5's table, ...), so passed as
``nnx.MultiHeadAttention(..., attention_fn=AttentionFunction(["t5"], ...))`` they are
parameters of the layer and train with it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from posenc_jax.functional.core.attention import dot_product_attention
from posenc_jax.functional.core.hooks import ATTENTION_HOOKS, EncodingConfig, builds_itself, hook_names
from posenc_jax.functional.core.registry import resolve_encodings
from posenc_jax.nn.encoding import PositionEncoding, resolve_config

__all__ = ["AttentionFunction", "call_positions", "make_attention_fn"]

# Linen passes these to an attention_fn that names them; they would replace this library's products.
_REPLACED_PRODUCTS = ("qk_attn_weights_einsum", "attn_weights_value_einsum", "einsum_dot_general")


def call_positions(
    query: jax.Array, key: jax.Array, mask, query_positions=None, key_positions=None, *, is_causal: bool = False
):
    """The ``(query_positions [B, T] or [T], key_positions [S])`` of one Flax attention call.

    ``query`` and ``key`` are ``[B, T, N, H]`` / ``[B, S, K, H]`` and ``mask`` broadcasts to
    ``[B, N, T, S]``. Explicit positions win. Otherwise ``arange`` when there are as many
    queries as keys or ``is_causal`` (Flax aligns query ``i`` with key ``i``), and for fewer
    queries than keys (Flax's decode cache) the keys are the slots ``0 .. S-1`` and the T
    queries end at the last slot the mask lets the last query see.
    """
    batch, q_len, k_len = query.shape[0], query.shape[-3], key.shape[-3]
    if query_positions is not None and key_positions is not None:
        return query_positions, key_positions
    if query_positions is not None or key_positions is not None:
        raise ValueError("pass both query_positions and key_positions, or neither (they are then taken per call)")
    if q_len == k_len:
        positions = jnp.arange(q_len)
        return positions, positions
    if is_causal:
        return jnp.arange(q_len), jnp.arange(k_len)
    if q_len > k_len or mask is None:
        raise ValueError(
            f"{q_len} queries against {k_len} keys without a mask: the positions are not implied. With Flax's "
            f"decode cache the mask says where the query is (decode=True passes it); otherwise pass "
            f"query_positions and key_positions when making the attention function"
        )
    mask = jnp.asarray(mask, jnp.bool_)
    if mask.ndim != 4:
        raise ValueError(f"expected a [B, N, T, S] mask (Flax's), got shape {mask.shape}")
    # The last slot the last query may see: the cache index in decode mode.
    seen = jnp.any(mask[..., -1, :], axis=-2)  # [B|1, S]
    last = k_len - 1 - jnp.argmax(seen[..., ::-1], axis=-1)
    query_positions = last[:, None] - (q_len - 1) + jnp.arange(q_len)[None, :]
    return jnp.broadcast_to(query_positions, (batch, q_len)).astype(jnp.int32), jnp.arange(k_len)


def _refuse(replaced: dict, query, key, value, precision):
    given = [name for name, value in replaced.items() if value is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)} would replace posenc_jax's own score and value products, which this attention_fn "
            f"cannot do; leave them unset (qk_attn_weights_einsum_cls=None, ...) or use flax's dot_product_attention"
        )
    for name, array in (("query", query), ("key", key), ("value", value)):
        if jnp.issubdtype(jnp.result_type(array), jnp.complexfloating):
            raise TypeError(
                f"{name} is {jnp.result_type(array)}: posenc_jax's attention takes real inputs only (its encodings "
                f"rotate and bias real scores); use flax's dot_product_attention for complex attention"
            )
    return _precision_name(precision)


def _precision_name(precision) -> str | None:
    """``precision`` as the name ``jax.default_matmul_precision`` takes, for every product of the call."""
    if precision is None:
        return None
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2 or precision[0] != precision[1]:
            raise ValueError(
                f"precision={precision!r} gives the two operands different precisions, which this attention_fn "
                f"cannot honour; give one precision (e.g. jax.lax.Precision.HIGHEST)"
            )
        precision = precision[0]
    if isinstance(precision, jax.lax.Precision):
        return precision.name.lower()
    if isinstance(precision, jax.lax.DotAlgorithmPreset):
        return precision.name
    if isinstance(precision, str):
        return precision
    raise ValueError(
        f"precision={precision!r} is not one this attention_fn can honour; give a jax.lax.Precision, its name "
        f"('highest') or a jax.lax.DotAlgorithmPreset"
    )


def _check_shapes(query, key, value) -> None:
    if not query.ndim == key.ndim == value.ndim or query.ndim < 3:
        raise ValueError(
            f"query, key and value need one rank, [batch..., length, heads, depth], got shapes {query.shape}, "
            f"{key.shape}, {value.shape}"
        )
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(
            f"query, key and value need the same batch dimensions [batch...], got shapes {query.shape}, "
            f"{key.shape}, {value.shape}"
        )
    if key.shape[-3] != value.shape[-3]:
        raise ValueError(f"key and value need one length, got {key.shape[-3]} and {value.shape[-3]}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key need one depth per head, got {query.shape[-1]} and {key.shape[-1]}")
    if key.shape[-2] != value.shape[-2] or query.shape[-2] % key.shape[-2]:
        raise ValueError(
            f"the query heads ({query.shape[-2]}) must be a multiple of the key/value heads (key {key.shape[-2]}, "
            f"value {value.shape[-2]}, which must be equal)"
        )


def _flat(array, batch: tuple, what: str):
    """``array`` broadcastable to ``[batch..., N, T, S]`` as ``[B|1, N|1, T|1, S|1]``."""
    if array is None:
        return None
    array = jnp.asarray(array)
    rank = len(batch) + 3
    if array.ndim > rank:
        raise ValueError(
            f"{what} of shape {array.shape} has more dimensions than [batch..., heads, q_length, kv_length]"
        )
    array = array.reshape((1,) * (rank - array.ndim) + array.shape)
    lead = array.shape[: len(batch)]
    if all(size == 1 for size in lead):
        return array.reshape((1, *array.shape[len(batch) :]))
    try:
        array = jnp.broadcast_to(array, batch + array.shape[len(batch) :])
    except ValueError:
        raise ValueError(f"{what} of shape {array.shape} does not broadcast to the batch dimensions {batch}") from None
    return array.reshape((math.prod(batch), *array.shape[len(batch) :]))


def _sow(module, weights) -> None:
    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
        return
    import flax.linen as nn

    if isinstance(module, nn.Module):
        module.sow("intermediates", "attention_weights", weights)
        return
    raise TypeError(f"module must be the flax.nnx or flax.linen Module that sows the weights, got {module!r}")


def _flax_softmax(*, bias, mask, is_causal, dtype, keep_float32, dropout, captured):
    """The normaliser with Flax's meaning: ``bias`` added, ``mask`` and ``is_causal`` applied by
    setting the scores to the lowest float (a query with every key masked then weighs all
    keys alike), the weights rounded to ``dtype`` as Flax's are, and dropout. ``captured``
    receives the weights before dropout (to sow) and the mask applied."""

    def normalize(scores, mask_of_call):
        t, s = scores.shape[-2:]
        if bias is not None:
            scores = scores + bias.astype(jnp.float32)
        keep = mask
        if is_causal:
            tril = jnp.tril(jnp.ones((t, s), jnp.bool_))[None, None]
            keep = tril if keep is None else keep & tril
        if mask_of_call is not None:
            keep = mask_of_call if keep is None else keep & mask_of_call
        if keep is not None:
            scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1)
        if not keep_float32:
            weights = weights.astype(dtype)
        captured["weights"] = weights
        captured["keep"] = keep
        weights = weights.astype(jnp.float32)
        if dropout is not None:
            rate, rng, broadcast = dropout
            shape = (1, 1, t, s) if broadcast else weights.shape
            kept = jax.random.bernoulli(rng, 1.0 - rate, shape)
            weights = weights * (kept.astype(jnp.float32) / jnp.float32(1.0 - rate))
        captured["dropped"] = weights
        return weights

    return normalize


def _attend(
    hooks,
    query,
    key,
    value,
    *,
    bias=None,
    mask=None,
    broadcast_dropout=True,
    dropout_rng=None,
    dropout_rate=0.0,
    deterministic=False,
    dtype=None,
    precision=None,
    module=None,
    is_causal=False,
    promote_dtype=None,
    force_fp32_for_softmax=False,
    causal=False,
    query_positions=None,
    key_positions=None,
    replaced=None,
):
    precision = _refuse(replaced or {}, query, key, value, precision)
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        if dtype is None:  # Flax's promotion, whatever jax_numpy_dtype_promotion says
            with jax.numpy_dtype_promotion("standard"):
                dtype = jnp.result_type(query, key, value)
        query, key, value = (jnp.asarray(x).astype(dtype) for x in (query, key, value))
    dtype = query.dtype
    _check_shapes(query, key, value)
    batch = query.shape[:-3]
    q_len, k_len = query.shape[-3], key.shape[-3]
    rows = math.prod(batch)
    q, k, v = (x.reshape((rows, *x.shape[-3:])) for x in (query, key, value))
    # Flax's masks are often float 0/1 (make_causal_mask, the decode mask): nonzero = attend.
    mask = _flat(mask, batch, "mask")
    mask = None if mask is None else mask.astype(jnp.bool_)
    bias = _flat(bias, batch, "bias")
    dropout = None
    if dropout_rate > 0.0 and not deterministic:
        if dropout_rng is None:
            raise ValueError(f"dropout_rate={dropout_rate} with deterministic=False needs a dropout_rng PRNG key")
        dropout = (float(dropout_rate), dropout_rng, bool(broadcast_dropout))
    # Positions only where an encoding (or a causal mask by position) needs them.
    needs_positions = causal or any(set(hook_names(h)) & set(ATTENTION_HOOKS) for h in hooks)
    q_pos = k_pos = None
    if needs_positions:
        q_pos, k_pos = call_positions(q, k, mask, query_positions, key_positions, is_causal=bool(is_causal))
    by_position = needs_positions and (causal or bool(is_causal))
    captured = {}
    normalize = _flax_softmax(
        bias=bias,
        mask=mask,
        is_causal=bool(is_causal),
        dtype=dtype,
        keep_float32=force_fp32_for_softmax,
        dropout=dropout,
        captured=captured,
    )

    def run():
        return dot_product_attention(
            q,
            k,
            v,
            query_positions=q_pos,
            key_positions=k_pos,
            encodings=hooks,
            causal=by_position,
            normalizer=normalize,
            implementation="materialize",
        )

    if precision is None:
        out = run()
    else:
        with jax.default_matmul_precision(precision):
            out = run()
    if by_position:
        # The causal mask by position hides its keys from the value product; a query whose keys are
        # all masked weighs every key alike in Flax, so it gets Flax's answer back.
        empty = ~jnp.any(captured["keep"], axis=-1)  # [B|1, N|1, T]
        weights = captured["dropped"]  # [B, N, T, S]
        heads, groups = v.shape[-2], q.shape[-2] // v.shape[-2]
        grouped = weights.reshape(rows, heads, groups, q_len, k_len)
        every_key = jnp.einsum("bkgts,bskh->btkgh", grouped, v.astype(jnp.float32)).reshape(out.shape)
        empty = jnp.broadcast_to(empty, (rows, q.shape[-2], q_len)).transpose(0, 2, 1)[..., None]
        out = jnp.where(empty, every_key.astype(out.dtype), out)
    if module is not None:
        weights = captured["weights"]
        _sow(module, jnp.broadcast_to(weights, (rows, *weights.shape[1:])).reshape(*batch, *weights.shape[1:]))
    return out.astype(dtype).reshape((*batch, q_len, *out.shape[-2:]))


def _fixed_hooks(encodings) -> list:
    hooks = []
    for encoding in resolve_encodings(encodings):
        if not isinstance(encoding, (str, EncodingConfig)) and set(hook_names(encoding)) & set(ATTENTION_HOOKS):
            hooks.append(encoding)  # a built hook with its arrays (e.g. T5Bias(table))
            continue
        config = resolve_config(encoding)
        if not builds_itself(config):
            raise ValueError(
                f"{config!r} has parameters; wrap the NNX MultiHeadAttention with posenc_jax.linen.to_linen, use "
                f"posenc_jax.nn.AttentionFunction in NNX, or pass a built hook with fixed arrays (e.g. T5Bias(table))"
            )
        if config.acts_on not in ("attention", "shared_bias"):
            raise ValueError(f"{type(config).__name__} acts on the {config.acts_on}, not inside attention")
        hooks.append(config.build({}))
    return hooks


def make_attention_fn(encodings=(), *, causal: bool = False, query_positions=None, key_positions=None):
    """An ``attention_fn`` for Flax's ``MultiHeadAttention`` (NNX) or ``MultiHeadDotProductAttention`` (Linen).

    A drop-in for Flax's ``dot_product_attention``: every argument Flax passes keeps Flax's
    meaning (see the module docstring), and the attention is this library's, with ``encodings``.

    Args:
      encodings: parameter-free encodings: a name (``"rope"``), names joined by ``+``
        (``"rope+alibi"``), configs, built hooks with fixed arrays (``T5Bias(table)``), or a
        list of these; none (the default) is Flax's attention.
      causal: a causal mask by position (Flax's own ``mask`` is applied too); encodings
        with two forms (ALiBi, T5) follow it, and Flax's ``is_causal``.
      query_positions, key_positions: fixed integer positions; by default they are taken
        per call where an encoding needs them (``arange``, or the cache index when
        decoding; see :func:`call_positions`).

    Returns:
      ``attention_fn(query, key, value, bias=None, mask=None, ...)`` in Flax's signature.

    Example:
      >>> layer = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=False,
      ...                                attention_fn=make_attention_fn("rope", causal=True),
      ...                                rngs=nnx.Rngs(0))
      >>> x = jnp.ones((1, 5, 16))
      >>> full = layer(x)
      >>> layer.init_cache(x.shape)
      >>> steps = jnp.concatenate([layer(x[:, i : i + 1], decode=True) for i in range(5)], axis=1)
      >>> bool(jnp.allclose(steps, full, atol=1e-5))
      True
    """
    hooks = _fixed_hooks(encodings)

    def attention_fn(
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        is_causal=False,
        promote_dtype=None,
        force_fp32_for_softmax=False,
        einsum_dot_general=None,
        qk_attn_weights_einsum=None,
        attn_weights_value_einsum=None,
    ):
        return _attend(
            hooks,
            query,
            key,
            value,
            bias=bias,
            mask=mask,
            broadcast_dropout=broadcast_dropout,
            dropout_rng=dropout_rng,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
            precision=precision,
            module=module,
            is_causal=is_causal,
            promote_dtype=promote_dtype,
            force_fp32_for_softmax=force_fp32_for_softmax,
            causal=causal,
            query_positions=query_positions,
            key_positions=key_positions,
            replaced={
                "einsum_dot_general": einsum_dot_general,
                "qk_attn_weights_einsum": qk_attn_weights_einsum,
                "attn_weights_value_einsum": attn_weights_value_einsum,
            },
        )

    return attention_fn


class AttentionFunction(nnx.Module):
    """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` that holds its encodings' parameters.

    Passed as ``attention_fn``, it becomes a submodule of the layer: learned encodings
    (T5's table, Kerple, FIRE, DeBERTa's tables, ...) are ``nnx.Param`` of the layer and
    train with it. Positions are taken per call as in :func:`make_attention_fn`.

    Args:
      encodings: names, ``"a+b"``, configs, or a list of them (``["rope", "t5"]``).
      num_heads, head_dim: the layer's N and H (the parameters are made for them).
      causal: a causal mask by position; encodings with two forms follow it.
      rngs: ``nnx.Rngs`` with a ``params`` stream.

    Example:
      >>> fn = AttentionFunction(["t5"], num_heads=2, head_dim=8, causal=True, rngs=nnx.Rngs(0))
      >>> layer = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=False,
      ...                                attention_fn=fn, rngs=nnx.Rngs(1))
      >>> layer(jnp.ones((1, 5, 16))).shape, layer.attention_fn.encodings[0].table[...].shape
      ((1, 5, 16), (32, 2))
    """

    def __init__(self, encodings, *, num_heads: int, head_dim: int, causal: bool = False, rngs: nnx.Rngs):
        self.causal = causal
        self.encodings = nnx.List(
            [
                PositionEncoding(e, num_heads=num_heads, head_dim=head_dim, model_dim=num_heads * head_dim, rngs=rngs)
                for e in resolve_encodings(encodings)
            ]
        )
        for module in self.encodings:
            if module.acts_on not in ("attention", "shared_bias"):
                raise ValueError(f"{type(module.config).__name__} acts on the {module.acts_on}, not inside attention")

    def __call__(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        is_causal=False,
        promote_dtype=None,
        force_fp32_for_softmax=False,
        einsum_dot_general=None,
        qk_attn_weights_einsum=None,
        attn_weights_value_einsum=None,
    ):
        return _attend(
            [m() for m in self.encodings],
            query,
            key,
            value,
            bias=bias,
            mask=mask,
            broadcast_dropout=broadcast_dropout,
            dropout_rng=dropout_rng,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
            precision=precision,
            module=module,
            is_causal=is_causal,
            promote_dtype=promote_dtype,
            force_fp32_for_softmax=force_fp32_for_softmax,
            causal=self.causal,
            replaced={
                "einsum_dot_general": einsum_dot_general,
                "qk_attn_weights_einsum": qk_attn_weights_einsum,
                "attn_weights_value_einsum": attn_weights_value_einsum,
            },
        )
