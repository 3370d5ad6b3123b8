"""Greedy and temperature sampling on top of the Transformer's KV cache.

:func:`generate` runs the prompt through :meth:`Transformer.decode` once (prefill), then
one token per step against the cache; each step is one jitted call compiled once for all
steps. With ``temperature=0`` it picks the most likely token (greedy), otherwise it
samples from ``softmax(logits / temperature)`` with one key per new token, so the tokens
equal those of running the full forward pass over the growing sequence at every step
(tested).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from posenc_jax.functional.core.validation import check_key, reraise_check_errors

__all__ = ["generate", "next_token"]


@nnx.jit
def _decode(model, tokens, positions, caches):
    return model.decode(tokens, positions, caches)


def next_token(logits: jax.Array, *, temperature: float = 0.0, key: jax.Array | None = None) -> jax.Array:
    """The next token ``[B]`` from last-position logits ``[B, vocab]``: argmax at temperature 0, else a sample.

    Example:
      >>> next_token(jnp.array([[0.0, 2.0, 1.0]])).tolist()
      [1]
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    check_key("key", key)
    return jax.random.categorical(key, logits.astype(jnp.float32) / temperature, axis=-1).astype(jnp.int32)


def _check(prompt, max_new_tokens, temperature, rng):
    if jnp.ndim(prompt) != 2 or not jnp.issubdtype(jnp.asarray(prompt).dtype, jnp.integer):
        raise ValueError(f"prompt must be integer tokens [B, P], got shape {jnp.shape(prompt)}")
    if jnp.shape(prompt)[1] < 1:
        raise ValueError("prompt must hold at least one token per row")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if temperature > 0 and rng is None:
        raise ValueError(f"sampling at temperature {temperature} needs rng= (a jax.random key); use 0 for greedy")
    if temperature > 0:
        check_key("rng", rng)


@reraise_check_errors()  # a check failing inside a step raises its own error, not JAX's
def generate(model, prompt, *, max_new_tokens: int, temperature: float = 0.0, rng: jax.Array | None = None):
    """Continues ``prompt`` ``[B, P]`` by ``max_new_tokens`` tokens with a causal :class:`~posenc_jax.nn.Transformer`.

    Positions are ``0 .. P + max_new_tokens - 1`` for every row (prompts of one length; pad
    shorter ones on the left with :meth:`Transformer.decode`'s ``key_mask`` if needed).

    Args:
      model: a causal ``Transformer`` (it holds the encodings; those that refuse a cache,
        such as randomized positions, say so).
      prompt: integer tokens ``[B, P]``.
      max_new_tokens: how many tokens to add.
      temperature: 0 for greedy decoding, else the sampling temperature.
      rng: a ``jax.random`` key, needed when ``temperature > 0``; new token i uses
        ``jax.random.split(rng, max_new_tokens)[i]``.

    Returns:
      int32 ``[B, P + max_new_tokens]``: the prompt followed by the new tokens.

    Example:
      >>> from posenc_jax.nn import Transformer
      >>> model = Transformer(vocab_size=16, model_dim=32, num_layers=2, num_heads=4, mlp_dim=64,
      ...                     encoding="rope", rngs=nnx.Rngs(0))
      >>> generate(model, jnp.zeros((2, 3), jnp.int32), max_new_tokens=4).shape
      (2, 7)
    """
    _check(prompt, max_new_tokens, temperature, rng)
    prompt = jnp.asarray(prompt, jnp.int32)
    batch, length = prompt.shape
    keys = jax.random.split(rng, max_new_tokens) if temperature > 0 else [None] * max_new_tokens
    caches = model.init_cache(batch, length + max_new_tokens)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    logits, caches = _decode(model, prompt, positions, caches)
    tokens = [next_token(logits[:, -1], temperature=temperature, key=keys[0])]
    for i in range(1, max_new_tokens):
        position = jnp.full((batch, 1), length + i - 1, jnp.int32)
        logits, caches = _decode(model, tokens[-1][:, None], position, caches)
        tokens.append(next_token(logits[:, -1], temperature=temperature, key=keys[i]))
    return jnp.concatenate([prompt, jnp.stack(tokens, axis=1)], axis=1)
