"""Evaluate a trained model with another, compatible encoding.

:func:`with_encoding` returns a copy of a model whose encoding modules use a new config
and whose arrays are the trained model's own (shared, not copied): the recipe behind
"YaRN at evaluation", where a model trained with plain RoPE is evaluated with a RoPE
scaling whose factor is the evaluation length over the training length.
"""

from __future__ import annotations

import jax
from flax import nnx

from posenc_jax.functional.core.hooks import check_together
from posenc_jax.nn.encoding import PositionEncoding, resolve_config
from posenc_jax.nn.transformer import Transformer

__all__ = ["with_encoding"]


def _encoding_modules(model: nnx.Module) -> list[PositionEncoding]:
    return [module for _, module in nnx.iter_graph(model) if isinstance(module, PositionEncoding)]


def _parameter_layout(config, sizes: dict) -> dict:
    """``{name: (shape, dtype)}`` of the parameters ``config`` makes for these sizes (shapes only, no arrays)."""
    shapes = jax.eval_shape(lambda key: config.init(key, **sizes), jax.random.key(0))
    return {name: (tuple(leaf.shape), str(leaf.dtype)) for name, leaf in shapes.items()}


def _held_layout(module: PositionEncoding) -> dict:
    return {
        name: (tuple(getattr(module, name)[...].shape), str(getattr(module, name)[...].dtype))
        for name in module.param_names
    }


def _pick_old(configs: list, replace, new):
    distinct = list(dict.fromkeys(configs))
    if replace is None:
        # The encoding acting where the new one acts (a normaliser or an absolute table is left alone).
        same_place = [c for c in distinct if c.acts_on == new.acts_on]
        if len(same_place) != 1:
            raise ValueError(
                f"the model has {len(same_place)} encodings acting on the {new.acts_on} "
                f"({[repr(c) for c in same_place]}) for {new!r} to replace; "
                + (
                    "say which one with replace= (a registered name, a config, or a config class)"
                    if same_place
                    else "it fits only in place of an encoding acting there"
                )
            )
        return same_place[0]
    if isinstance(replace, type):
        matches = [c for c in distinct if isinstance(c, replace)]
    else:
        wanted = resolve_config(replace)
        matches = [c for c in distinct if c == wanted]
    if len(matches) != 1:
        raise ValueError(
            f"replace={replace!r} matches {len(matches)} of the model's encodings {[repr(c) for c in distinct]}; "
            f"it must match exactly one"
        )
    return matches[0]


def with_encoding(model: nnx.Module, encoding, *, replace=None) -> nnx.Module:
    """A copy of ``model`` that uses ``encoding`` in place of one of its encodings, sharing its arrays.

    Every other setting and every trained parameter stays: the copy's arrays are the
    model's own (nothing is copied), and the encoding modules that held the old config
    hold the new one with the same parameters. The two encodings must fit: the same place
    (``acts_on``) and the same parameters (names, shapes, dtypes), e.g. RoPE and any RoPE
    scaling, or T5 tables of the same size with another ``max_distance``.

    Args:
      model: a module of :mod:`posenc_jax.nn` (``Transformer``, ``MultiHeadAttention``, ...).
      encoding: a registered name or config (``encoding_config("rope-yarn", factor=4.0,
        original_context=512)``).
      replace: which of the model's encodings to replace when it has several: a registered
        name or config equal to one of them, or a config class (``RoPE``).

    Returns:
      The new module; ``model`` itself is unchanged.

    Raises:
      ValueError: naming both encodings, when they act in different places or their
        parameters differ.

    Example:
      >>> from posenc_jax.functional import encoding_config
      >>> from posenc_jax.nn import Transformer
      >>> model = Transformer(vocab_size=16, model_dim=32, num_layers=2, num_heads=4, mlp_dim=64,
      ...                     encoding="rope", rngs=nnx.Rngs(0))
      >>> longer = with_encoding(model, encoding_config("rope-yarn", factor=4.0, original_context=16))
      >>> type(longer.blocks[0].attention.encodings[0].config.scaling).__name__
      'YaRNScaling'
      >>> longer.embed.embedding[...] is model.embed.embedding[...]
      True
    """
    new = resolve_config(encoding)
    modules = _encoding_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} holds no encoding modules (PositionEncoding) to replace")
    old = _pick_old([m.config for m in modules], replace, new)
    if isinstance(model, Transformer):
        check_together([new], causal=model.causal)
    if new.acts_on != old.acts_on:
        raise ValueError(
            f"{new!r} acts on the {new.acts_on} but {old!r} acts on the {old.acts_on}; they do not fit in the same "
            f"place: build a new model instead"
        )
    copy = nnx.merge(*nnx.split(model))  # new module objects around the same arrays
    for module in _encoding_modules(copy):
        if module.config != old:
            continue
        held, wanted = _held_layout(module), _parameter_layout(new, dict(module.sizes))
        if held != wanted:
            raise ValueError(
                f"the parameters of {old!r} {held} do not fit {new!r}, which needs {wanted}: swap only encodings "
                f"with the same parameters (or none)"
            )
        module.config = new
    _refresh(copy, old, new)
    return copy


def _refresh(model: nnx.Module, old, new) -> None:
    """Settings a model derived from its encodings' configs (a Transformer's description and cache rule)."""
    if not isinstance(model, Transformer):
        return
    model._settings = tuple(
        (name, tuple(repr(new) if r == repr(old) else r for r in value) if name == "encodings" else value)
        for name, value in model._settings
    )
    model.length_dependent = any(
        m.config.length_dependent for m in _encoding_modules(model) if m.acts_on not in ("shared_bias",)
    )
