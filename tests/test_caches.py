"""KV caches carry what they were made for, and a model or layer refuses a cache made for another.

* Each cache records its layer's encodings, heads and head size, its dtype and slots, and (made by a
  model) the model's encodings and its layer; a cache made for another encoding, head layout, model or
  layer is refused before tracing, one line naming what differs and the fix.
* ``init_cache`` refuses a dtype that is not floating (an int32 or bool cache rounded the keys and
  values and decoded wrong logits without a word).
* Decoding past the cache's end is one line naming the slots and the positions, in and out of jit.
* Caches × models: a generator of caches made for other encodings, head layouts, head sizes, layer
  counts, dtypes and lengths, fed to each model and layer kind; each is refused naming what differs,
  or (made for the same model) decodes as the full forward pass does.
"""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posenc_jax.functional import KVCache, encoding_info, encoding_names
from posenc_jax.functional.core.cache import CacheRecord
from posenc_jax.functional.core.validation import reraise_check_errors
from posenc_jax.nn import MultiHeadAttention, Transformer, decode_step, with_encoding
from small_encodings import small_config

VOCAB = 16


def _model(encoding="rope", num_layers=2, num_heads=2, head_dim=8, num_kv_heads=None, seed=0):
    return Transformer(
        vocab_size=VOCAB,
        model_dim=num_heads * head_dim,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        mlp_dim=32,
        encoding=encoding,
        causal=True,
        rngs=nnx.Rngs(seed),
    )


def _layer(encodings=("rope",), num_heads=2, head_dim=8, num_kv_heads=None, model_dim=16, seed=0):
    return MultiHeadAttention(
        num_heads,
        model_dim,
        num_heads * head_dim,
        num_kv_heads=num_kv_heads,
        encodings=encodings,
        rngs=nnx.Rngs(seed),
    )


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message and len(message) < 600, message
    return message


TOKENS = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
POSITIONS = jnp.arange(5)[None]


# ---------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.uint8, jnp.int8, "int16"])
def test_a_cache_of_integers_or_booleans_is_refused_naming_the_dtype(dtype):
    name = np.dtype(dtype).name
    message = rf"dtype must be a floating dtype for the cached keys and values, got {name}: .* pass jnp.float32"
    for make in (
        lambda: _model().init_cache(1, 8, dtype=dtype),
        lambda: _layer().new_cache(1, 8, dtype=dtype),
        lambda: KVCache.empty(1, 8, 2, 8, dtype=dtype),
    ):
        with pytest.raises(ValueError, match=message) as error:
            make()
        _one_line(error)
    with pytest.raises(TypeError, match=r"dtype must be a floating dtype .* got 'floaty'"):
        _model().init_cache(1, 8, dtype="floaty")


def test_a_cache_whose_arrays_became_integers_is_refused():
    model = _model()
    caches = model.init_cache(1, 8)
    caches[1] = caches[1]._replace(key=caches[1].key.astype(jnp.int32), value=caches[1].value.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"caches\[1\] holds keys of dtype int32 and values of dtype int32") as error:
        model.decode(TOKENS, POSITIONS, caches)
    assert "init_cache(1, max_length)" in _one_line(error)
    plain = [KVCache.empty(1, 8, 2, 8)._replace(key=jnp.zeros((1, 8, 2, 8), jnp.bool_)) for _ in range(2)]
    with pytest.raises(ValueError, match=r"caches\[0\] holds keys of dtype bool"):
        model.decode(TOKENS, POSITIONS, plain)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_half_precision_cache_decodes_close_to_the_full_forward(dtype):
    model = _model()
    full = model(TOKENS, POSITIONS)
    caches = model.init_cache(1, 8, dtype=dtype)
    assert caches[0].key.dtype == dtype and caches[0].made_for.dtype == np.dtype(dtype).name
    first, caches = model.decode(TOKENS[:, :3], POSITIONS[:, :3], caches)
    then, caches = model.decode(TOKENS[:, 3:], POSITIONS[:, 3:], caches)
    np.testing.assert_allclose(jnp.concatenate([first, then], 1), full, atol=5e-2)


# ---------------------------------------------------------------- what a cache was made for


def test_a_cache_records_what_it_was_made_for():
    model = _model(["rope", "alibi"], num_heads=4, num_kv_heads=2)
    caches = model.init_cache(1, 8, dtype=jnp.bfloat16)
    rope = repr(model.blocks[0].attention.encodings[0].config)
    assert [cache.made_for.layer for cache in caches] == [0, 1]
    record = caches[1].made_for
    assert record == CacheRecord((rope,), 4, 2, 8, "bfloat16", 8, tuple(model.describe()["encodings"]), 1)
    # Static: no leaf of the pytree, and kept through jit, appends and tree maps.
    assert len(jax.tree.leaves(caches[0])) == len(jax.tree.leaves(caches[0]._replace(made_for=None)))
    _, after = jax.jit(lambda c: model.decode(TOKENS, POSITIONS, c))(caches)
    assert [cache.made_for for cache in after] == [cache.made_for for cache in caches]
    assert jax.tree.map(lambda x: x, caches[0]).made_for == caches[0].made_for
    layer = _layer(num_heads=4, num_kv_heads=1)
    assert layer.new_cache(2, 6).made_for == CacheRecord((rope,), 4, 1, 8, "float32", 6)
    assert KVCache.empty(1, 4, 1, 2).made_for is None


def test_a_cache_made_by_a_rope_model_is_refused_by_a_nope_model():
    rope, nope = _model("rope"), _model("nope")
    _, caches = rope.decode(TOKENS[:, :3], POSITIONS[:, :3], rope.init_cache(1, 8))
    for decode in (nope.decode, decode_step(nope)):
        with pytest.raises(
            ValueError, match=r"caches\[0\] was made for another model: encodings \[RoPE\(base"
        ) as error:
            decode(TOKENS[:, 3:], POSITIONS[:, 3:], caches)
        assert "[NoPE()] here; make the caches with this model's init_cache(1, max_length)" in _one_line(error)


def test_a_layer_refuses_a_cache_made_for_another_layer_naming_what_differs():
    x = jnp.ones((1, 3, 16))
    cases = [
        (_layer(["rope"]), _layer([]), r"encodings \[RoPE\(.*\)\] there, \[\] here"),
        (_layer(["rope"]), _layer(["xpos"]), r"encodings \[RoPE\(.*\)\] there, \[XPos\(.*\)\] here"),
        # The same keys' shape, another number of query heads: the record tells them apart.
        (_layer(num_heads=4, num_kv_heads=2), _layer(num_heads=2), r"num_heads 4 there, 2 here"),
    ]
    for maker, taker, differs in cases:
        _, cache = maker(x, cache=maker.new_cache(1, 8))
        with pytest.raises(ValueError, match=rf"this cache was made for another layer: {differs}") as error:
            taker(x[:, :1], cache=cache)
        assert _one_line(error).endswith("make the cache with this layer's new_cache(batch, max_length)")


def test_a_models_cache_and_a_layers_cache_are_not_interchangeable():
    model = _model("rope")
    layer = model.blocks[0].attention
    x = jnp.ones((1, 3, 16))
    with pytest.raises(ValueError, match=r"this cache was made by a Transformer for its layer 0 .*decode with that"):
        layer(x, causal=True, cache=model.init_cache(1, 8)[0])
    own = [block.attention.new_cache(1, 8) for block in model.blocks]
    with pytest.raises(ValueError, match=r"caches\[0\] was made by a layer's new_cache, not by a model's"):
        model.decode(TOKENS, POSITIONS, own)
    # A cache made by hand (KVCache.empty) records nothing: only its shapes and dtype are checked.
    logits, _ = model.decode(TOKENS, POSITIONS, [KVCache.empty(1, 8, 2, 8) for _ in range(2)])
    np.testing.assert_allclose(logits, model(TOKENS, POSITIONS), atol=2e-4, rtol=1e-4)


def test_caches_out_of_order_or_filled_apart_are_refused_in_and_out_of_jit():
    model = _model("rope")
    step = decode_step(model, donate=False)
    _, early = step(TOKENS[:, :3], POSITIONS[:, :3], model.init_cache(1, 8))
    _, late = step(TOKENS[:, 3:4], POSITIONS[:, 3:4], early)
    for decode in (model.decode, step):
        with pytest.raises(ValueError, match=r"caches\[0\] was made for layer 1 of this model, not layer 0"):
            decode(TOKENS[:, 4:], POSITIONS[:, 4:], late[::-1])
        with pytest.raises(ValueError, match=r"the caches are filled to \[4, 3\] tokens, layer by layer") as error:
            decode(TOKENS[:, 4:], POSITIONS[:, 4:], [late[0], early[1]])
        _one_line(error)
    with pytest.raises(ValueError, match=r"the caches hold 8, 6 slots, layer by layer"):
        model.decode(TOKENS, POSITIONS, [model.init_cache(1, 8)[0], model.init_cache(1, 6)[1]])


def test_a_model_after_an_encoding_swap_refuses_the_caches_made_before():
    trained = _model("rope")
    swapped = with_encoding(trained, small_config("rope-yarn"))
    _, caches = trained.decode(TOKENS[:, :3], POSITIONS[:, :3], trained.init_cache(1, 8))
    with pytest.raises(ValueError, match=r"caches\[0\] was made for another model: encodings \[RoPE\(base"):
        swapped.decode(TOKENS[:, 3:], POSITIONS[:, 3:], caches)


# ---------------------------------------------------------------- past the end


def test_decoding_past_the_cache_names_its_slots_and_the_position_in_and_out_of_jit():
    model = _model("rope")
    step = decode_step(model, donate=False)
    for decode in (model.decode, step):
        _, caches = decode(TOKENS[:, :4], POSITIONS[:, :4], model.init_cache(1, 4))
        with pytest.raises(ValueError) as error:  # the library's own error, not JAX's runtime error
            decode(TOKENS[:, 4:], POSITIONS[:, 4:], caches)
        assert _one_line(error) == (
            "the KV cache holds 4 tokens; 4 are filled and 1 more (at position 4) do not fit: make it larger "
            "(a model's init_cache(batch, max_length), a layer's new_cache(batch, max_length) or init_cache((batch, "
            "max_length, features))) with max_length >= 5"
        )
    # One's own model of the library's layers, under one's own jit: the same line, first, inside
    # reraise_check_errors (without it JAX's runtime error carries it further down).
    layer = _layer()
    attend = nnx.jit(lambda layer, x, positions, cache: layer(x, query_positions=positions, cache=cache))
    _, cache = attend(layer, jnp.ones((1, 3, 16)), jnp.arange(3, 6), layer.new_cache(1, 4))
    with pytest.raises(ValueError) as error, reraise_check_errors():
        jax.block_until_ready(attend(layer, jnp.ones((1, 2, 16)), jnp.arange(7, 9), cache))
    assert _one_line(error).startswith(
        "the KV cache holds 4 tokens; 3 are filled and 2 more (at positions 7 to 8) do not fit"
    )


# ---------------------------------------------------------------- caches × models

FUZZ_DRAWS = 40
DECODED = 4  # draws that decode and compare with the full forward; the others taken are traced only
FLOATS = ("float32", "bfloat16", "float16")
NOT_FLOATS = ("int32", "bool", "uint8")
# What a draw may change between the cache's maker and the model or layer given the cache, and the words the
# refusal must use for it: the model's side (encodings, heads, head size, layers, model or layer) must be
# refused; the cache's own side (slots, a floating dtype) decodes.
NAMED = {
    "encoding": ("encodings",),
    "heads": ("heads",),
    "head_dim": ("head",),
    "layers": ("layer",),
    "kind": ("Transformer", "layer's new_cache"),
}


def _draw_side(rng: random.Random, kind: str) -> dict:
    """One model or layer, drawn: its encoding (from every registered one, so a new encoding is drawn
    without being listed), heads (query and key/value), head size and layers."""
    names = [
        n
        for n in encoding_names()
        if "causal" in encoding_info(n).forms
        and (kind == "model" or encoding_info(n).acts_on in ("attention", "shared_bias"))
    ]
    num_heads = rng.choice((2, 4))
    return {
        "kind": kind,
        "encoding": rng.choice(names),
        "heads": (num_heads, rng.choice([k for k in (1, 2, 4) if num_heads % k == 0])),
        "head_dim": rng.choice((8, 16)),
        "layers": rng.choice((1, 2)) if kind == "model" else 1,
    }


def _draws(rng: random.Random):
    """(maker, taker, cache's dtype, cache's slots, what differs): a cache made for ``maker`` given to ``taker``,
    equal to it or differing in one or two things."""
    for _ in range(FUZZ_DRAWS):
        maker = _draw_side(rng, rng.choice(("model", "layer")))
        taker = dict(maker)
        changes = rng.choice((0, 1, 1, 2, 2))
        for field in rng.sample(sorted(NAMED), changes):
            kind = taker["kind"] if field != "kind" else {"model": "layer", "layer": "model"}[taker["kind"]]
            other = _draw_side(rng, kind)
            taker[field] = other[field]
            if field == "kind":
                taker["layers"], taker["encoding"] = other["layers"], other["encoding"]
        dtype = rng.choice(FLOATS * 3 + NOT_FLOATS)
        differs = sorted(field for field in NAMED if taker[field] != maker[field])
        yield maker, taker, dtype, rng.choice((5, 8)), differs


def _build(side: dict):
    config = small_config(side["encoding"])
    num_heads, num_kv_heads = side["heads"]
    if side["kind"] == "model":
        return _model(config, side["layers"], num_heads, side["head_dim"], num_kv_heads)
    return _layer([config], num_heads, side["head_dim"], num_kv_heads)


def _inputs(side: dict):
    """The tokens (a model's) or the layer's input ``[1, 5, 16]``, the same for every draw."""
    if side["kind"] == "model":
        return TOKENS
    return jnp.asarray(np.random.default_rng(56).normal(size=(1, 5, 16)), jnp.float32)


def _cache(module, slots: int, dtype):
    """An empty cache of batch 1 for a model (its init_cache) or a layer (its new_cache)."""
    if isinstance(module, Transformer):
        return module.init_cache(1, slots, dtype=dtype)
    return module.new_cache(1, slots, dtype=dtype)


def _decode(module, inputs, positions, cache):
    """A model's decode, or a layer's call with a cache, on a cache (a model's list, or one)."""
    if isinstance(module, Transformer):
        caches = cache if isinstance(cache, list) else [cache] * len(module.blocks)
        return module.decode(inputs, positions, caches)
    return module(inputs, query_positions=positions, causal=True, cache=cache[0] if isinstance(cache, list) else cache)


def _full(module, inputs):
    if isinstance(module, Transformer):
        return module(inputs, POSITIONS)
    return module(inputs, query_positions=POSITIONS, causal=True)


# Compiled: a draw that decodes runs three programs, each once (an eager model call compiles every operation).
_decode_jit, _full_jit = nnx.jit(_decode), nnx.jit(_full)


def _traced(module, inputs, positions, cache):
    """Whether the module takes the cache: its decode traced only (every check of a static fact runs, nothing
    computes), so a draw that is refused costs no compilation."""
    graphdef, state = nnx.split(module)
    jax.eval_shape(lambda state, cache: _decode(nnx.merge(graphdef, state), inputs, positions, cache), state, cache)


@pytest.mark.long
def test_fuzz_caches_made_for_another_model_or_layer_are_refused_naming_it():
    rng = random.Random(56)
    seen = {"refused": 0, "taken": 0, "decoded": 0, "skipped": 0, "dtype": 0}
    for maker_side, taker_side, dtype, slots, differs in _draws(rng):
        where = f"cache of {dtype}, {slots} slots, made for {maker_side}, given to {taker_side}"
        try:
            maker, taker = _build(maker_side), _build(taker_side)
        except ValueError:  # a setting the encoding refuses at this size (LongRoPE's factors, say): no draw
            seen["skipped"] += 1
            continue
        if dtype in NOT_FLOATS:
            with pytest.raises(ValueError, match=rf"dtype must be a floating dtype .* got {dtype}") as error:
                _cache(maker, slots, dtype)
            _one_line(error)
            seen["dtype"] += 1
            continue
        prompt, rest = _inputs(maker_side), _inputs(taker_side)
        own = _cache(taker, slots, dtype)
        try:  # an encoding that never decodes with a cache (randomized positions, say) says so: no draw
            _traced(taker, rest[:, 3:], POSITIONS[:, 3:], own)
            _traced(maker, prompt[:, :3], POSITIONS[:, :3], _cache(maker, slots, dtype))
        except ValueError:
            seen["skipped"] += 1
            continue
        cache = _cache(maker, slots, dtype)
        if differs:
            with pytest.raises((ValueError, TypeError)) as error:
                _traced(taker, rest[:, 3:], POSITIONS[:, 3:], cache)
            message = _one_line(error)
            assert "init_cache" in message or "new_cache" in message, f"{where}: {message}"
            assert any(word in message for field in differs for word in NAMED[field]), f"{where}: {message}"
            seen["refused"] += 1
            continue
        # Made for this very model (the same settings, the same seed): the cache's own slots and dtype
        # aside, it is taken, and (the first few, each three compilations) decodes a prompt and the tokens
        # after it as the full forward pass does.
        _traced(taker, rest[:, 3:], POSITIONS[:, 3:], cache)
        seen["taken"] += 1
        if seen["decoded"] == DECODED:
            continue
        _, cache = _decode_jit(maker, prompt[:, :3], POSITIONS[:, :3], cache)
        out, _ = _decode_jit(taker, rest[:, 3:], POSITIONS[:, 3:], cache)
        tolerance = 2e-4 if dtype == "float32" else 5e-2
        np.testing.assert_allclose(out, _full_jit(taker, rest)[:, 3:], atol=tolerance, rtol=1e-4, err_msg=where)
        seen["decoded"] += 1
    assert seen["refused"] >= 12 and seen["decoded"] == DECODED and seen["dtype"] >= 4, seen
