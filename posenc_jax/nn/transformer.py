"""A small pre-LN Transformer with any positional encoding (encoder or causal decoder).

The model the benchmarks and Colabs train. Encodings are given by name or config
and placed where their config's ``acts_on`` says:

* ``"positions"`` (randomized positions) replace the positions every other encoding sees;
* ``"embeddings"`` (sinusoidal, learned, NoPE) add to the token embeddings;
* ``"shared_bias"`` (T5, ALiBi, Kerple, FIRE, Sandwich, the clipped bias) have one set
  of parameters for the whole model and are computed once per forward, then added by
  every layer;
* ``"attention"`` (RoPE family, xPos, Shaw, Transformer-XL, DeBERTa, CoPE, ...) live in
  each layer's attention with their own parameters.

Encodings with a causal and a bidirectional form (T5, ALiBi) take the model's
``causal`` unless their config sets a direction.

RoPE (and its fixed scalings) has no parameters, so its cos/sin table is computed once
per forward pass (:meth:`~posenc_jax.functional.RoPE.prepare`) and every layer rotates by
it, like the shared biases.

Positions are explicit: ``model(tokens, positions)``. Decoding: ``init_cache`` then
``decode(tokens, positions, cache)`` for the prompt and for each new token; in a loop,
:func:`decode_step` runs it as Flax recommends for hot loops (``jax.jit`` over the
model's split state, the caches donated).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from posenc_jax.functional.core.cache import KVCache, show_encodings
from posenc_jax.functional.core.hooks import check_together
from posenc_jax.functional.core.normalizers import NORMALIZERS, softmax_weights
from posenc_jax.functional.core.positions import check_positions
from posenc_jax.functional.core.registry import resolve_encodings
from posenc_jax.functional.core.validation import check_values, reraise_check_errors
from posenc_jax.nn.attention import MultiHeadAttention
from posenc_jax.nn.encoding import PositionEncoding, check_dropout_rate, check_rngs, check_size, resolve_config

__all__ = ["Block", "Transformer", "decode_step"]


def _name_of(normalizer) -> str:
    """A registered normaliser by its name, a function by its import path, a config (URPE) by its repr:
    the same text in every process."""
    named = [name for name, registered in NORMALIZERS.items() if registered is normalizer]
    if named:
        return named[0]
    if inspect.isfunction(normalizer) or inspect.isclass(normalizer):
        return f"{normalizer.__module__}.{normalizer.__qualname__}"
    return repr(normalizer)


def _dropout(rate: float, rngs: nnx.Rngs) -> nnx.Dropout:
    # Without dropout no "dropout" RNG stream is needed (e.g. under the Linen bridge).
    return nnx.Dropout(rate, rngs=rngs) if rate > 0 else nnx.Dropout(0.0)


class Block(nnx.Module):
    """Pre-LN block: ``x + attn(LN(x))``, then ``x + MLP(LN(x))``.

    A layer of :class:`Transformer`, called with the model's positions (checked once, by the
    model) and the terms it computed for the forward (``shared``, ``prepared``: see
    :meth:`MultiHeadAttention.forward_terms`).
    """

    def __init__(
        self,
        model_dim: int,
        num_heads: int,
        mlp_dim: int,
        *,
        num_kv_heads: int | None,
        encodings: Sequence,
        normalizer: Callable,
        dropout_rate: float,
        implementation: str = "auto",
        block_q: int | None = None,
        block_k: int | None = None,
        rngs: nnx.Rngs,
    ):
        self.attention_norm = nnx.LayerNorm(model_dim, rngs=rngs)
        self.attention = MultiHeadAttention(
            num_heads,
            model_dim,
            num_kv_heads=num_kv_heads,
            use_bias=False,
            broadcast_dropout=False,
            encodings=encodings,
            normalizer=normalizer,
            dropout_rate=dropout_rate,
            implementation=implementation,
            block_q=block_q,
            block_k=block_k,
            rngs=rngs,
        )
        self.mlp_norm = nnx.LayerNorm(model_dim, rngs=rngs)
        self.mlp_in = nnx.Linear(model_dim, mlp_dim, rngs=rngs)
        self.mlp_out = nnx.Linear(mlp_dim, model_dim, rngs=rngs)
        self.dropout = _dropout(dropout_rate, rngs)

    def __call__(
        self,
        x,
        positions,
        *,
        causal,
        shared,
        key_mask,
        segment_ids,
        cache,
        deterministic,
        implementation=None,
        prepared=None,
        mesh=None,
        ring=False,
    ):
        attended = self.attention.attend(
            self.attention_norm(x),
            positions,
            causal=causal,
            shared=shared,
            key_mask=key_mask,
            segment_ids=segment_ids,
            cache=cache,
            deterministic=deterministic,
            implementation=implementation,
            prepared=prepared,
            mesh=mesh,
            ring=ring,
        )
        if cache is not None:
            attended, cache = attended
        x = x + self.dropout(attended, deterministic=deterministic)
        h = self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))
        x = x + self.dropout(h, deterministic=deterministic)
        return x, cache


class Transformer(nnx.Module):
    """Token embedding, N pre-LN blocks, final LayerNorm and an output projection.

    Args:
      vocab_size: tokens.
      model_dim, num_layers, num_heads, mlp_dim: sizes.
      encoding: a registered name, a config, or a list of them (hybrids such as
        ``["rope", "alibi"]``).
      causal: a causal decoder (True) or a bidirectional encoder (False).
      num_kv_heads: grouped-query attention (default: num_heads).
      normalizer: the attention ``normalize`` hook.
      dropout_rate: dropout on embeddings, residual branches and attention weights.
      implementation: the attention's ``"auto"`` (default), ``"materialize"`` or
        ``"blockwise"`` (tiles of ``block_q`` × ``block_k``: memory linear in the length,
        for evaluating far beyond the training length); a call may override it. In
        blockwise attention the shared biases are computed per tile by every layer instead
        of once as ``[B, N, T, S]``.
      block_q, block_k: blockwise tile sizes (default 512).
      rngs: ``nnx.Rngs``.

    Example:
      >>> model = Transformer(vocab_size=16, model_dim=32, num_layers=2, num_heads=4, mlp_dim=64,
      ...                     encoding="rope", causal=True, rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 7), jnp.int32), jnp.arange(7)).shape
      (2, 7, 16)
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        model_dim: int,
        num_layers: int,
        num_heads: int,
        mlp_dim: int,
        encoding="rope",
        causal: bool = True,
        num_kv_heads: int | None = None,
        normalizer: Callable = softmax_weights,
        dropout_rate: float = 0.0,
        implementation: str = "auto",
        block_q: int | None = None,
        block_k: int | None = None,
        rngs: nnx.Rngs,
    ):
        for name, size in (
            ("vocab_size", vocab_size),
            ("model_dim", model_dim),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("mlp_dim", mlp_dim),
        ):
            check_size(name, size)
        check_rngs(rngs)
        check_dropout_rate(dropout_rate)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be True or False, got {causal!r}")
        configs = [resolve_config(e) for e in resolve_encodings(encoding)]
        check_together(configs, causal=causal)
        if model_dim % num_heads:
            raise ValueError(f"model_dim={model_dim} is not divisible by num_heads={num_heads}")
        head_dim = model_dim // num_heads
        sizes = dict(num_heads=num_heads, head_dim=head_dim, model_dim=model_dim)
        # Static and hashable (it is part of the graph definition); describe() returns it as a dict.
        self._settings = (
            ("vocab_size", vocab_size),
            ("model_dim", model_dim),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("mlp_dim", mlp_dim),
            ("encodings", tuple(repr(c) for c in configs)),
            ("causal", causal),
            ("num_kv_heads", num_kv_heads),
            ("normalizer", _name_of(normalizer)),
            ("dropout_rate", dropout_rate),
        )
        self.causal = causal
        self.num_heads = num_heads
        self.implementation = implementation
        self.embed = nnx.Embed(vocab_size, model_dim, rngs=rngs)
        placed = {
            place: [c for c in configs if c.acts_on == place] for place in ("positions", "embeddings", "shared_bias")
        }
        per_layer = [c for c in configs if c.acts_on not in placed]
        self.position_samplers = nnx.List([PositionEncoding(c, **sizes, rngs=rngs) for c in placed["positions"]])
        # Sampled positions draw from their own stream, so they never shift the parameters' or dropout's keys.
        self.position_rngs = nnx.Rngs(rngs.params()) if placed["positions"] else None
        self.absolute = nnx.List([PositionEncoding(c, **sizes, rngs=rngs) for c in placed["embeddings"]])
        self.shared = nnx.List([PositionEncoding(c, **sizes, rngs=rngs) for c in placed["shared_bias"]])
        self.length_dependent = any(c.length_dependent for c in per_layer)
        self.blocks = nnx.List(
            [
                Block(
                    model_dim,
                    num_heads,
                    mlp_dim,
                    num_kv_heads=num_kv_heads,
                    encodings=per_layer,
                    normalizer=normalizer,
                    dropout_rate=dropout_rate,
                    implementation=implementation,
                    block_q=block_q,
                    block_k=block_k,
                    rngs=rngs,
                )
                for _ in range(num_layers)
            ]
        )
        self.final_norm = nnx.LayerNorm(model_dim, rngs=rngs)
        self.head = nnx.Linear(model_dim, vocab_size, rngs=rngs)
        self.dropout = _dropout(dropout_rate, rngs)

    def describe(self) -> dict:
        """The model's constructor settings as a JSON-able dict; encodings as their configs' reprs.

        Checkpoints record it, so a checkpoint restores only into a model built the same way.

        Example:
          >>> model = Transformer(vocab_size=16, model_dim=32, num_layers=2, num_heads=4, mlp_dim=64,
          ...                     encoding="alibi", rngs=nnx.Rngs(0))
          >>> model.describe()["encodings"], model.describe()["num_layers"]
          (['ALiBi(bidirectional=None)'], 2)
        """
        return {name: list(value) if isinstance(value, tuple) else value for name, value in self._settings}

    def _check_tokens(self, tokens, positions) -> None:
        """Tokens: integer ``[B, T]`` (static facts, refused before tracing) with ids in ``[0, vocab_size)``
        (a fact of the data: checked at once when the tokens are concrete, else when the jitted
        computation runs; see :func:`~posenc_jax.functional.core.validation.check_values`)."""
        shape, dtype = getattr(tokens, "shape", None), getattr(tokens, "dtype", None)
        if shape is None or len(shape) != 2:
            raise ValueError(
                f"tokens must be integer ids [B, T], got shape {shape}; add a batch axis for one sequence "
                f"(tokens[None])"
            )
        if not jnp.issubdtype(dtype, jnp.integer):
            raise TypeError(f"tokens must be integer ids [B, T], got dtype {dtype}")
        if (
            positions.shape[-1] != shape[1]
            or positions.ndim > 2
            or (positions.ndim == 2 and positions.shape[0] not in (1, shape[0]))
        ):
            raise ValueError(f"positions must be [T] or [B, T] for tokens {shape}, got shape {positions.shape}")
        vocab = self.embed.num_embeddings

        def check(ids):
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
                raise ValueError(
                    f"token id {bad} is outside the vocabulary [0, {vocab}) of this model (vocab_size={vocab}); "
                    f"map tokens to ids below vocab_size, or build the model with a larger vocab_size"
                )

        check_values(check, tokens, within=(0, vocab))

    def _run(
        self,
        tokens,
        positions,
        *,
        key_mask,
        segment_ids,
        caches,
        deterministic,
        key_positions,
        implementation=None,
        mesh=None,
        ring=False,
    ):
        """The forward pass at positions :meth:`__call__` or :meth:`decode` checked: nothing below checks them again."""
        for module in self.position_samplers:
            positions = module().sample(self.position_rngs.default(), positions, train=not deterministic)
            key_positions = positions
        x = self.embed(tokens)
        for module in self.absolute:
            x = module().embed(x, positions)
        x = self.dropout(x, deterministic=deterministic)
        # What every layer shares for this forward, as the attention makes it: the position-only biases
        # (computed once, or per tile when the layers go blockwise) and parameter-free rotations' tables.
        shared, prepared = self.blocks[0].attention.forward_terms(
            positions,
            key_positions,
            biases=[module() for module in self.shared],
            causal=self.causal,
            batch=tokens.shape[0],
            implementation="blockwise" if mesh is not None else implementation,
        )
        new_caches = []
        for i, block in enumerate(self.blocks):
            x, cache = block(
                x,
                positions,
                causal=self.causal,
                shared=shared,
                key_mask=key_mask,
                segment_ids=segment_ids,
                cache=None if caches is None else caches[i],
                deterministic=deterministic,
                implementation=implementation,
                prepared=prepared,
                mesh=mesh,
                ring=ring,
            )
            new_caches.append(cache)
        logits = self.head(self.final_norm(x))
        return logits, new_caches

    def __call__(
        self,
        tokens,
        positions,
        *,
        key_mask=None,
        segment_ids=None,
        deterministic: bool = True,
        implementation: str | None = None,
        mesh: jax.sharding.Mesh | None = None,
        ring: bool = False,
    ):
        """Logits ``[B, T, vocab]`` for ``tokens`` ``[B, T]`` at ``positions`` ``[T]`` or ``[B, T]``.

        Token ids must lie in ``[0, vocab_size)``: an id outside is a ``ValueError`` naming it,
        raised at once for concrete tokens and, under ``jit``, when the computation runs
        (never NaN logits; see the README's Reliability section).

        ``implementation`` overrides the model's attention implementation for this call
        (e.g. ``"blockwise"`` to evaluate at 64k tokens a model trained on 256). ``mesh`` (a
        :class:`jax.sharding.Mesh`) splits every layer's queries over the mesh's devices, so
        one long sequence uses all of them (see :meth:`MultiHeadAttention.__call__`); with
        ``ring=True`` the keys and values are split too and passed round the devices.
        """
        positions = check_positions(positions)
        self._check_tokens(tokens, positions)
        logits, _ = self._run(
            tokens,
            positions,
            key_mask=key_mask,
            segment_ids=segment_ids,
            caches=None,
            deterministic=deterministic,
            key_positions=positions,
            implementation=implementation,
            mesh=mesh,
            ring=ring,
        )
        return logits

    def init_cache(self, batch: int, max_length: int, dtype=jnp.float32) -> list[KVCache]:
        """Empty per-layer caches of ``max_length`` slots, for :meth:`decode`.

        ``dtype``: the cached keys' and values' dtype, a floating one (``jnp.bfloat16`` halves the
        caches); an integer or boolean dtype is refused. Each cache records what it is made for (this
        model's encodings, its layer, the layer's heads and head size), and :meth:`decode` refuses a
        cache made for another model or layer, naming what differs.
        """
        if not self.causal:
            raise ValueError(
                "this Transformer is a bidirectional encoder; only a causal decoder can decode step by step"
            )
        encodings = self._encodings()
        caches = []
        for i, block in enumerate(self.blocks):
            cache = block.attention.new_cache(batch, max_length, dtype)
            made_for = dataclasses.replace(cache.made_for, model=encodings, layer=i)
            caches.append(cache._replace(made_for=made_for))
        return caches

    def _encodings(self) -> tuple[str, ...]:
        """This model's encodings, all of them, as their configs' reprs (as :meth:`describe` lists them)."""
        return dict(self._settings)["encodings"]

    def _check_caches(self, caches, batch: int, length: int) -> None:
        """One cache per layer, each of this model's batch size, made by :meth:`init_cache` for this model
        and layer (static facts: before tracing)."""
        if not isinstance(caches, (list, tuple)) or not all(isinstance(c, KVCache) for c in caches):
            raise TypeError(f"caches must be the list of KVCache that init_cache returns, got {type(caches).__name__}")
        if len(caches) != len(self.blocks):
            raise ValueError(
                f"caches has {len(caches)} entries but the model has {len(self.blocks)} layers; pass one cache per "
                f"layer, as model.init_cache(batch, max_length) makes them"
            )
        fix = f"make the caches with this model's init_cache({batch}, max_length)"
        encodings = self._encodings()
        slots = {cache.key.shape[1] for cache in caches}
        if len(slots) > 1:
            raise ValueError(
                f"the caches hold {', '.join(str(c.key.shape[1]) for c in caches)} slots, layer by layer: one "
                f"model's caches are of one size; {fix}"
            )
        for i, (cache, block) in enumerate(zip(caches, self.blocks, strict=True)):
            layer = block.attention
            want = (batch, layer.num_kv_heads, layer.head_dim)
            got = (cache.key.shape[0], cache.key.shape[2], cache.key.shape[3])
            if got != want:
                raise ValueError(
                    f"caches[{i}] holds batch {got[0]} with {got[1]} key/value heads of {got[2]}, but this call has "
                    f"batch {batch} and layer {i} has {want[1]} heads of {want[2]}; make the caches with this "
                    f"model's init_cache({batch}, max_length)"
                )
            if length > cache.key.shape[1]:
                raise ValueError(
                    f"{length} tokens are given at once but the caches hold {cache.key.shape[1]}; make them larger "
                    f"with init_cache({batch}, max_length) with max_length >= {length} (prompt and new tokens)"
                )
            made = cache.made_for
            if made is not None and made.model is None:
                raise ValueError(
                    f"caches[{i}] was made by a layer's new_cache, not by a model's: a model's layers attend with "
                    f"its shared encodings too; {fix}"
                )
            if made is not None and made.model != encodings:
                raise ValueError(
                    f"caches[{i}] was made for another model: encodings {show_encodings(made.model)} there, "
                    f"{show_encodings(encodings)} here; {fix}"
                )
            layer.check_cache(cache, f"caches[{i}]", fix)
            if made is not None and made.layer is not None and made.layer != i:
                raise ValueError(
                    f"caches[{i}] was made for layer {made.layer} of this model, not layer {i}: pass the caches in "
                    f"the order init_cache returns them, one per layer"
                )
        if len(caches) > 1:
            # The layers share one set of key positions (the first cache's): caches filled to different
            # lengths (one kept from an earlier step) would give some layers another sequence's positions.
            lengths = jnp.stack([cache.length for cache in caches])

            def check(lengths):
                if (lengths != lengths[0]).any():
                    raise ValueError(
                        f"the caches are filled to {lengths.tolist()} tokens, layer by layer: one model's caches are "
                        f"filled together; pass the caches the last decode returned"
                    )

            check_values(check, lengths, within=(lengths[0], lengths[0] + 1))

    def decode(self, tokens, positions, caches: list[KVCache], *, key_mask=None):
        """Runs ``tokens`` ``[B, t]`` at ``positions`` ``[B, t]`` against the caches and appends to them.

        Use it for the prompt (t = prompt length) and then one token at a time; each
        call returns ``(logits [B, t, vocab], new_caches)``. The logits equal those of
        the full forward pass over the whole sequence. ``key_mask`` ``[B, t]`` marks
        real tokens; padding (e.g. left padding of shorter prompts) is cached as invalid
        slots, which no later query attends to.
        """
        if not self.causal:
            raise ValueError(
                "this Transformer is a bidirectional encoder; only a causal decoder can decode step by step"
            )
        if len(self.position_samplers):
            raise ValueError(
                "randomized positions are sampled afresh at every call, so cached keys and new queries would "
                "not share one sample; evaluate with the full forward pass instead of a KV cache"
            )
        if self.length_dependent and len(self.blocks) > 1:
            raise ValueError(
                "this model's RoPE scaling follows the sequence length (max position + 1), so every earlier "
                "token's hidden state after the first layer changes as the sequence grows, and a cache of them "
                "goes stale: run the full sequence instead of a KV cache (a single attention layer, or a "
                "one-layer model, does decode exactly), or use a fixed scaling such as rope-yarn"
            )
        positions = check_positions(positions)
        self._check_tokens(tokens, positions)
        self._check_caches(caches, *tokens.shape)
        positions = jnp.broadcast_to(positions, tokens.shape)
        # Keys' positions after this call's append (as every layer stores them), for the shared biases;
        # empty and padding slots are masked by the caches' validity, whatever their positions.
        key_positions = jax.lax.dynamic_update_slice_in_dim(caches[0].positions, positions, caches[0].length, axis=1)
        return self._run(
            tokens,
            positions,
            key_mask=key_mask,
            segment_ids=None,
            caches=caches,
            deterministic=True,
            key_positions=key_positions,
        )


def decode_step(model: Transformer, *, donate: bool = True, on_trace: Callable[[], None] | None = None):
    """``model.decode`` as a ``jax.jit`` over the model's split state, for decoding loops.

    ``nnx.jit`` re-walks the module graph on every call, which costs about as much as a
    small model's decoding step itself; Flax recommends, for hot loops, splitting the
    model once (``nnx.split``) and jitting a function of the state that merges it back.
    The state is captured when ``decode_step`` is called: make a new step after changing
    the model's parameters.

    Args:
      model: a causal :class:`Transformer`.
      donate: donate the caches to the step, so their buffers are updated in place; the
        caches passed in must then not be used again (use the returned ones).
      on_trace: called each time the step is traced (to count compilations).

    Returns:
      ``step(tokens, positions, caches, *, key_mask=None) -> (logits, new_caches)`` with the
      arguments and results of :meth:`Transformer.decode`.

    Example:
      >>> model = Transformer(vocab_size=16, model_dim=32, num_layers=2, num_heads=4, mlp_dim=64,
      ...                     rngs=nnx.Rngs(0))
      >>> step, caches = decode_step(model), model.init_cache(1, 8)
      >>> logits, caches = step(jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None], caches)  # prompt
      >>> logits, caches = step(jnp.zeros((1, 1), jnp.int32), jnp.array([[3]]), caches)  # one token
      >>> logits.shape, int(caches[0].length)
      ((1, 1, 16), 4)
    """
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(3,) if donate else ())
    def step(state, tokens, positions, caches, key_mask):
        if on_trace is not None:
            on_trace()
        return nnx.merge(graphdef, state).decode(tokens, positions, caches, key_mask=key_mask)

    @reraise_check_errors()  # a check failing inside the step raises its own error, not JAX's
    def run(tokens, positions, caches, *, key_mask=None):
        return step(state, tokens, positions, caches, key_mask)

    return run
