"""Every public entry point refuses what it cannot mean, by name, before tracing (cases in bad_inputs.py)."""

import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bad_inputs import CASES
from posenc_jax.nn import MultiHeadAttention, Transformer


@pytest.mark.parametrize("what, call, error, pattern", CASES, ids=[case[0] for case in CASES])
def test_a_bad_input_is_refused_by_name(what, call, error, pattern):
    with pytest.raises(error) as caught:
        call()
    assert re.search(pattern, str(caught.value)), f"{what}: {caught.value}"
    # Raised by the project's own check, not from inside JAX or Flax.
    origin = traceback.extract_tb(caught.value.__traceback__)[-1].filename
    assert "/posenc_jax/" in origin and "site-packages" not in origin, f"{what}: raised in {origin}"


def test_a_single_encoding_name_is_one_encoding():
    layer = MultiHeadAttention(2, 16, encodings="rope", rngs=nnx.Rngs(0))
    assert [type(module.config).__name__ for module in layer.encodings] == ["RoPE"]
    x = np.ones((1, 4, 16), np.float32)
    assert layer(x, query_positions=np.arange(4), causal=True).shape == (1, 4, 16)


def test_more_heads_than_input_features_is_a_layer_when_qkv_features_is_given():
    # The swapped-order error is for the call that would fail anyway (qkv_features not divisible), not for this one.
    layer = MultiHeadAttention(8, 4, qkv_features=16, rngs=nnx.Rngs(0))
    assert layer(np.ones((1, 3, 4), np.float32), causal=True).shape == (1, 3, 4)


def _small_model():
    return Transformer(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=16, rngs=nnx.Rngs(0))


def test_token_ids_out_of_the_vocabulary_are_an_error_under_jit_too():
    # Traced ids cannot be checked before tracing: the same check runs when the computation does, so an id
    # equal to vocab_size is an error, not NaN logits.
    model = _small_model()
    forward = nnx.jit(lambda m, t: m(t, jnp.arange(4)))
    assert np.isfinite(np.asarray(forward(model, jnp.asarray([[0, 1, 2, 7]])))).all()
    for bad, word in ((8, "8"), (-1, "-1")):
        with pytest.raises(Exception, match=rf"token id {word} is outside the vocabulary \[0, 8\)"):
            jax.block_until_ready(forward(model, jnp.asarray([[0, 1, 2, bad]])))


def test_the_in_jit_check_calls_the_host_only_for_bad_ids_and_holds_under_vmap(monkeypatch):
    from posenc_jax.functional.core import validation

    model = _small_model()
    graph, state = nnx.split(model)
    logits = lambda t: nnx.merge(graph, state)(t, jnp.arange(4))
    # The host is called (at run time) only for a batch holding a bad id: a good batch pays no callback.
    calls = []
    run_check = validation._run_check
    monkeypatch.setattr(validation, "_run_check", lambda *args: (calls.append(1), run_check(*args))[1])

    def run(fn, tokens):
        calls.clear()
        out = jax.block_until_ready(fn(tokens))
        jax.effects_barrier()
        return out

    forward = jax.jit(logits)
    assert np.isfinite(np.asarray(run(forward, jnp.zeros((1, 4), jnp.int32)))).all() and not calls
    with pytest.raises(Exception, match=r"token id 8 is outside the vocabulary \[0, 8\)"):
        run(forward, jnp.asarray([[0, 1, 8, 2]]))
    assert calls
    # Under vmap (seeds trained together), one bad example among good ones is still caught.
    batched = jax.jit(jax.vmap(logits))
    good = jnp.zeros((3, 1, 4), jnp.int32)
    assert np.isfinite(np.asarray(run(batched, good))).all() and not calls
    with pytest.raises(Exception, match=r"token id 8 is outside the vocabulary \[0, 8\)"):
        run(batched, good.at[1, 0, 2].set(8))


def test_decoding_past_the_cache_is_an_error_under_jit_too():
    model = _small_model()
    step = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))
    _, caches = step(model, jnp.zeros((1, 4), jnp.int32), jnp.arange(4)[None], model.init_cache(1, 4))
    with pytest.raises(Exception, match=r"holds 4 tokens; 4 are filled and 1 more \(at position 4\) do not fit"):
        jax.block_until_ready(step(model, jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 4), caches))


def test_decoding_at_a_position_already_held_is_an_error_under_jit_too():
    model = _small_model()
    step = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))
    _, caches = step(model, jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None], model.init_cache(1, 8))
    logits, _ = step(model, jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 5), caches)  # a gap is fine
    assert np.isfinite(np.asarray(logits)).all()
    with pytest.raises(Exception, match=r"holds positions up to 2, and a new token is at 1"):
        jax.block_until_ready(step(model, jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 1), caches))
