"""The DeBERTa-v2/v3 family's configs and checkpoint tables.

:func:`_deberta` reads a config into a :class:`~posenc_jax.functional.encodings.deberta.DeBERTaConfig`
(its c2p/p2c terms over log buckets) and, with ``position_biased_input``, a learned absolute table;
:func:`deberta_position_tables` and :func:`_deberta_weights` project a checkpoint's relative
embeddings into the position tables the terms read.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import EncodingConfig
from posenc_jax.functional.encodings.deberta import DeBERTaConfig
from posenc_jax.functional.encodings.learned_absolute import LearnedAbsoluteConfig
from posenc_jax.hf.encoding import HFEncoding
from posenc_jax.hf.fields import _check_reads, _find, _head_dim, _num_heads, _required

__all__ = ["deberta_position_tables"]

_DEBERTA_READS = frozenset(
    {
        "max_position_embeddings",
        "relative_attention",
        "position_buckets",
        "max_relative_positions",
        "pos_att_type",
        "share_att_key",
        "position_biased_input",
        "norm_rel_ebd",
        "attention_head_size",
    }
)


def _deberta_terms(pos_att_type) -> tuple[str, ...]:
    if pos_att_type is None:
        return ()
    if isinstance(pos_att_type, str):
        pos_att_type = pos_att_type.lower().split("|")
    terms = tuple(dict.fromkeys(t.strip() for t in pos_att_type if t.strip()))
    unknown = sorted(set(terms) - {"c2p", "p2c"})
    if unknown:
        raise ValueError(f"pos_att_type {pos_att_type!r} has {unknown}; DeBERTa-v2's terms are 'c2p' and 'p2c'")
    return terms


def _deberta(fields: dict, notes: list) -> HFEncoding:
    _check_reads(fields, _DEBERTA_READS, "deberta-v2")
    num_heads = _num_heads(fields)
    head_dim = _head_dim(fields, num_heads)
    encodings: list[EncodingConfig] = []
    if fields.get("position_biased_input", True):
        size = int(_required(fields, "max_position_embeddings", "DeBERTa's absolute table"))
        encodings.append(LearnedAbsoluteConfig(max_positions=size))
        notes.append(f"position_biased_input: a learned absolute table of {size} positions on the embeddings")
    terms = _deberta_terms(fields.get("pos_att_type"))
    if fields.get("relative_attention", False) and terms:
        max_relative = int(fields.get("max_relative_positions", -1) or -1)
        if max_relative < 1:
            max_relative = int(_required(fields, "max_position_embeddings", "DeBERTa's relative span"))
        buckets = int(fields.get("position_buckets", -1) or -1)
        buckets = max(buckets, 0)
        span = buckets if buckets > 0 else max_relative
        encodings.append(
            DeBERTaConfig(span=span, position_buckets=buckets, max_relative_positions=max_relative, terms=terms)
        )
        if fields.get("share_att_key", False):
            notes.append("share_att_key: the position tables come from the layer's own query/key projections")
    else:
        notes.append("no relative attention terms (relative_attention false or pos_att_type empty)")
    # DisentangledSelfAttention divides by sqrt(H * (1 + number of pos_att_type terms)) whatever relative_attention.
    scale = (head_dim * (1 + len(terms))) ** -0.5
    return HFEncoding(
        family="deberta-v2",
        encodings=tuple(encodings),
        scale=scale,
        head_dim=head_dim,
        num_heads=num_heads,
        notes=tuple(notes),
        model_type=fields.get("model_type"),
        num_kv_heads=num_heads,
        causal=False,
    )


def deberta_position_tables(
    rel_embeddings,
    *,
    num_heads: int,
    terms: tuple[str, ...] = ("c2p", "p2c"),
    key_kernel=None,
    key_bias=None,
    query_kernel=None,
    query_bias=None,
) -> dict:
    """DeBERTa-v2's projected relative tables ``K_r``, ``Q_r`` ``[2·span, N, H]`` from a checkpoint.

    ``K_r = rel_embeddings · W_k + b_k`` (read by c2p), ``Q_r = rel_embeddings · W_q + b_q``
    (read by p2c), split into N heads. With ``share_att_key`` the kernels are the layer's
    own key and query projections, otherwise its ``pos_key_proj`` and ``pos_query_proj``;
    ``rel_embeddings`` is the encoder's table after its LayerNorm when ``norm_rel_ebd``
    says ``layer_norm``, cut to its first ``2·span`` rows. :func:`load_hf_position_weights`
    does all of this from a state dict.

    Args:
      rel_embeddings: ``[2·span, D]``.
      num_heads: N.
      terms: the terms whose tables to make.
      key_kernel, key_bias: ``[D, N·H]`` and ``[N·H]`` (a torch ``Linear`` weight transposed).
      query_kernel, query_bias: the same for the query side.

    Returns:
      ``{"pos_key": ..., "pos_query": ...}`` (those the terms need), the ``params`` of
      ``DeBERTaConfig.build``.

    Example:
      >>> tables = deberta_position_tables(jnp.ones((8, 16)), num_heads=2, terms=("c2p",),
      ...                                  key_kernel=jnp.ones((16, 16)), key_bias=jnp.zeros(16))
      >>> tables["pos_key"].shape
      (8, 2, 8)
    """
    rel = jnp.asarray(rel_embeddings, jnp.float32)
    if rel.ndim != 2:
        raise ValueError(f"rel_embeddings must have shape [2*span, D], got {rel.shape}")
    sides = {"c2p": ("pos_key", key_kernel, key_bias), "p2c": ("pos_query", query_kernel, query_bias)}
    tables = {}
    for term in terms:
        name, kernel, bias = sides[term]
        if kernel is None:
            raise ValueError(f"the {term} term needs the {name.split('_')[1]} kernel [D, N*H]; pass it")
        projected = rel @ jnp.asarray(kernel, jnp.float32)
        if bias is not None:
            projected = projected + jnp.asarray(bias, jnp.float32)[None, :]
        if projected.shape[-1] % num_heads:
            raise ValueError(
                f"the {term} kernel's output width {projected.shape[-1]} is not a multiple of N={num_heads}"
            )
        tables[name] = projected.reshape(rel.shape[0], num_heads, projected.shape[-1] // num_heads)
    return tables


def _absolute_weights(encoding: LearnedAbsoluteConfig, state_dict: Mapping) -> dict:
    """``{"table": embeddings.position_embeddings.weight}``, the absolute table of ``position_biased_input``."""
    table = _find(state_dict, "embeddings.position_embeddings.weight")
    if table.shape[0] != encoding.max_positions:
        raise ValueError(
            f"position_embeddings has {table.shape[0]} rows, expected max_position_embeddings={encoding.max_positions}"
        )
    return {"table": jnp.asarray(table)}


def _deberta_weights(fields: dict, encoding: DeBERTaConfig, num_heads: int, state_dict: Mapping, layer) -> dict:
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(
            f"DeBERTa's position tables differ by layer (each projects the shared table with its own weights): "
            f"pass layer= the layer index (an integer >= 0), got {layer!r}"
        )
    rel = _find(state_dict, "encoder.rel_embeddings.weight")
    if rel.shape[0] < 2 * encoding.span:
        raise ValueError(
            f"rel_embeddings has {rel.shape[0]} rows; DeBERTa with span {encoding.span} needs {2 * encoding.span}"
        )
    norms = [x.strip() for x in str(fields.get("norm_rel_ebd") or "none").lower().split("|")]
    if "layer_norm" in norms:
        weight = _find(state_dict, "encoder.LayerNorm.weight")
        bias = _find(state_dict, "encoder.LayerNorm.bias")
        eps = float(fields.get("layer_norm_eps", 1e-7))
        mean = rel.mean(-1, keepdims=True)
        var = ((rel - mean) ** 2).mean(-1, keepdims=True)
        rel = (rel - mean) / np.sqrt(var + eps) * weight + bias
    shared = bool(fields.get("share_att_key", False))
    prefix = f"encoder.layer.{layer}.attention.self."
    sides = {"c2p": "key_proj" if shared else "pos_key_proj", "p2c": "query_proj" if shared else "pos_query_proj"}
    weights = {}
    for term in encoding.terms:
        # torch's Linear holds [out, in]; the tables need x @ W with W [in, out].
        weights[term] = (
            _find(state_dict, prefix + sides[term] + ".weight").T,
            _find(state_dict, prefix + sides[term] + ".bias"),
        )
    return deberta_position_tables(
        rel[: 2 * encoding.span],
        num_heads=num_heads,
        terms=encoding.terms,
        key_kernel=weights.get("c2p", (None, None))[0],
        key_bias=weights.get("c2p", (None, None))[1],
        query_kernel=weights.get("p2c", (None, None))[0],
        query_bias=weights.get("p2c", (None, None))[1],
    )
