"""The encoding contract: metadata for every name, hooks as pytrees, defaults that follow the model,
and a new encoding added in one place."""

import functools
import importlib.util
import pathlib
import re
import uuid
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posenc_jax.functional import (
    ALiBi,
    AttentionContext,
    BiasHook,
    T5Config,
    dot_product_attention,
    encoding_config,
    encoding_info,
    encoding_names,
    hook_names,
    normalizer_config,
    pytree_dataclass,
    register_encoding,
)
from posenc_jax.functional.core import operations, registry
from posenc_jax.functional.core.forms import Forms, declare_forms, forms_of
from posenc_jax.functional.core.hooks import (
    PLACEMENTS,
    CarriedLogitsFromContent,
    DistanceBias,
    ParameterFree,
    PerCallRotation,
    Placement,
    TiledLogits,
    TiledScores,
    TiledValues,
    rotates_each_token,
)
from posenc_jax.functional.core.normalizers import softmax_weights
from posenc_jax.functional.core.relative import relative_positions
from posenc_jax.functional.core.stages import attention_output, attention_scores
from posenc_jax.functional.encodings.rope import RoPE, apply_rope
from posenc_jax.functional.encodings.rope_scaling import DynamicNTKScaling, LongRoPEScaling
from posenc_jax.hf import RoPEOnLastFeatures
from posenc_jax.nn import Transformer
from posenc_jax.nn.attention import _stores_rotated_keys
from small_encodings import small_config

B, T, N, H = 2, 6, 2, 8
_PLACED_HOOKS = {
    "embeddings": {"embed"},
    "positions": {"sample"},
    "attention": {"rotate", "logits", "values"},
    "shared_bias": {"logits"},
    "normalizer": {"normalize"},
}


def _normal(rng, shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


@pytest.mark.parametrize("name", encoding_names())
def test_every_encoding_has_metadata(name):
    info = encoding_info(name)
    assert info.name == name and len(info.description) > 20 and "\n" not in info.description
    assert info.acts_on in PLACEMENTS
    assert set(info.hooks) <= _PLACED_HOOKS[info.acts_on]
    assert info.hooks or name == "nope"  # only NoPE fills nothing
    assert info.forms and set(info.forms) <= {"causal", "bidirectional"}
    source = info.source
    assert source.title and source.authors and 2015 <= source.year <= 2026
    assert re.fullmatch(r"\d{4}\.\d{5}", source.arxiv)
    assert source.bibtex.startswith("@article{") and source.bibtex.count("{") == source.bibtex.count("}")
    assert source.arxiv in source.bibtex and str(source.year) in source.bibtex
    # The settings it lists are the ones its config takes, and nothing else is taken.
    config = encoding_config(name, **info.small_settings)
    assert config.acts_on == info.acts_on
    with pytest.raises(ValueError, match=re.escape(f"its settings are {list(info.settings)}")):
        encoding_config(name, not_a_setting=1)


def test_bad_settings_name_the_real_settings():
    with pytest.raises(
        ValueError, match=r"bad settings \['kw'\] for encoding 'kerple-log'; its settings are \['eps'\]"
    ):
        encoding_config("kerple-log", kw=1.0)
    with pytest.raises(ValueError, match="known encodings: alibi"):
        encoding_info("no-such-encoding")


def _built(name, rng_seed=0):
    config = small_config(name)
    return config.build(config.init(jax.random.key(rng_seed), num_heads=N, head_dim=H, model_dim=N * H))


def _run_hook(hook, acts_on, x, q, k, v, positions):
    """What the hook computes, as a float array, for an argument of a transformed function."""
    if acts_on == "embeddings":
        return hook.embed(x, positions)
    if acts_on == "normalizer":
        return dot_product_attention(q, k, v, query_positions=positions, key_positions=positions, normalizer=hook)
    if acts_on == "positions":  # the positions it samples, which RoPE then reads
        sampled = hook.sample(jax.random.key(1), positions, train=True)
        return dot_product_attention(
            q, k, v, query_positions=sampled, key_positions=sampled, encodings=[RoPE()], causal=True
        )
    return dot_product_attention(
        q, k, v, query_positions=positions, key_positions=positions, encodings=[hook], causal=True
    )


_HOOK_NAMES = [n for n in encoding_names() if encoding_info(n).acts_on != "positions"] + ["urpe"]


def _hook_and_placement(name):
    if name == "urpe":
        config = normalizer_config("urpe")
        return config.build(config.init(jax.random.key(0), num_heads=N, head_dim=H, model_dim=N * H)), "normalizer"
    return _built(name), encoding_info(name).acts_on


# Every registered name and URPE, each run in its placement.
_TRANSFORMED = _HOOK_NAMES + [n for n in encoding_names() if encoding_info(n).acts_on == "positions"]


@pytest.mark.parametrize("name", _TRANSFORMED)
def test_built_hooks_pass_through_jit_vmap_both_autodiff_modes_and_bfloat16(rng, name):
    hook, acts_on = _hook_and_placement(name)
    x = _normal(rng, (B, T, N * H))
    q, k, v = _normal(rng, (B, T, N, H)), _normal(rng, (B, T, N, H)), _normal(rng, (B, T, N, H))
    positions = jnp.arange(T)

    def f(hook, x, q, k=k, v=v):
        return _run_hook(hook, acts_on, x, q, k, v, positions)

    eager = f(hook, x, q)
    primals = (hook, x, q, k)
    tangents = jax.tree.map(lambda a: _normal(rng, a.shape), primals)
    u = _normal(rng, eager.shape)

    # Under jit, in one program (each eager transformation would compile every operation on its own): the
    # function; vmap over two copies of the hook whose parameters differ (the second scaled by 0.5), q mapped
    # too (some hooks have no leaves); the second copy alone; vmap over the batch, positions shared; jax.jvp
    # (no context manager: every fast form has its forward mode) and jax.vjp (the fast transposes) with
    # respect to the hook's parameters, x, q and k; the function on bfloat16 inputs.
    @jax.jit
    def transformed(primals, tangents, u):
        hook, x, q, k = primals
        stacked = jax.tree.map(lambda a: jnp.stack([a, a * 0.5]), hook)
        halved = jax.tree.map(lambda a: a * 0.5, hook)
        both = jax.vmap(f, in_axes=(0, None, 0))(stacked, x, jnp.stack([q, q]))
        rows = jax.vmap(lambda *a: f(hook, *(b[None] for b in a))[0])(x, q, k, v)
        _, forward = jax.jvp(f, primals, tangents)
        reverse_out, pullback = jax.vjp(f, *primals)
        half = f(hook, *(a.astype(jnp.bfloat16) for a in (x, q, k, v)))
        return f(hook, x, q), both, f(halved, x, q), rows, forward, reverse_out, pullback(u), half

    jitted, both, halved, rows, forward, reverse_out, cotangents, half = transformed(primals, tangents, u)
    np.testing.assert_allclose(jitted, eager, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(both[0], eager, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(both[1], halved, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(rows, eager, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(reverse_out, eager, atol=1e-5, rtol=1e-5)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(half, np.float32), eager, atol=0.1)

    # Forward mode is the transpose of reverse mode: u · (J t) = (Jᵀ u) · t for the random t and u.
    lhs = float(jnp.vdot(u, forward))
    rhs = sum(
        float(jnp.vdot(a, b)) for a, b in zip(jax.tree.leaves(cotangents), jax.tree.leaves(tangents), strict=True)
    )
    assert abs(lhs) > 1e-3  # the function depends on what is varied
    np.testing.assert_allclose(lhs, rhs, rtol=1e-4, atol=1e-4)
    # The cotangents: finite, the hook's a hook-shaped tree, not all zero when learned.
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(cotangents))
    assert jax.tree.structure(cotangents[0]) == jax.tree.structure(hook)
    if jax.tree.leaves(hook):
        assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(cotangents[0]))


def _declares_tile_form(hook) -> bool:
    tile_forms = (DistanceBias, TiledLogits, TiledScores, TiledValues, CarriedLogitsFromContent)
    return isinstance(hook, tile_forms) or (isinstance(hook, PerCallRotation) and not rotates_each_token(hook))


# Read off each hook's type, traced abstractly (no parameters computed at collection).
_WITH_TILE_FORMS = [
    n for n in _HOOK_NAMES if n != "urpe" and _declares_tile_form(jax.eval_shape(lambda n=n: _built(n)))
]


@pytest.mark.parametrize("keys_at", [0, 97, 160], ids=["far-before", "across", "far-after"])
@pytest.mark.parametrize("name", _WITH_TILE_FORMS)
def test_declared_tile_forms_equal_their_reference(rng, name, keys_at):
    """Every fast form a hook declares for blockwise tiles gives what its reference hook gives, on a tile
    of keys far before its queries, across them, and (bidirectional) far after: ``distance_bias`` at the
    tile's distances is ``bias``, ``tile_logits`` is ``logits``, ``tile_scores`` is the content plus
    ``logits``, ``tile_values`` is ``values``,
    ``carried_logits_from_content`` is ``carried_logits``, and a tile's form after ``for_query_block`` is the
    same without it."""
    hook = _built(name)
    hook = jax.tree.map(lambda p: p + 0.3 * _normal(rng, p.shape), hook)  # parameters away from their init
    forms = encoding_info(name).forms
    causal = "bidirectional" not in forms
    if causal and keys_at > 100:
        pytest.skip(f"{name} is causal only: no keys after the queries")
    qpos, kpos = jnp.arange(100, 104), jnp.arange(keys_at, keys_at + 6)
    mask = (kpos[None, :] <= qpos[:, None])[None, None] if causal else None
    context = AttentionContext.from_positions(qpos, kpos, causal=causal, scale=H**-0.5, num_heads=N, mask=mask)
    q, k = _normal(rng, (B, 4, N, H)), _normal(rng, (B, 6, N, H))
    checked = 0
    if forms_of(hook).has("tiled", "per_call"):  # what its tiles share, computed for this call (one tile here)
        hook = hook.for_tiles(context, 4, 6)
    if isinstance(hook, DistanceBias):
        distance = (kpos[None, :] - qpos[:, None]).astype(jnp.float32).reshape(1, -1)
        got = hook.distance_bias(distance, context).reshape(1, N, 4, 6)
        np.testing.assert_allclose(got, jnp.broadcast_to(hook.bias(context), got.shape), rtol=1e-5, atol=1e-5)
        checked += 1
    if isinstance(hook, TiledLogits):
        want = hook.logits(q, k, context)
        np.testing.assert_allclose(hook.tile_logits(q, k, context), want, rtol=1e-5, atol=1e-5)
        checked += 1
    if isinstance(hook, TiledScores):
        content = lambda q, k: jnp.einsum("BTNH,BSNH->BNTS", q, k) * context.scale
        want = content(q, k) + hook.logits(q, k, context)
        np.testing.assert_allclose(hook.tile_scores(q, k, context, content), want, rtol=1e-5, atol=1e-5)
        checked += 1
    if isinstance(hook, TiledValues):
        weights = jax.nn.softmax(_normal(rng, (B, N, 4, 6)), axis=-1)
        np.testing.assert_allclose(hook.tile_values(weights, context), hook.values(weights, context), atol=1e-5)
        checked += 1
    if isinstance(hook, PerCallRotation) and not rotates_each_token(hook):
        per_token = hook.per_token_for(context)  # fixed by the whole call: xPos's centre, dynamic NTK's length
        assert rotates_each_token(per_token)
        want_q, want_k = hook.rotate(q, k, context)
        for cut in (slice(0, 2), slice(2, 4)):  # two query tiles, then two key tiles, rotated apart
            got = per_token.rotate(q[:, cut], q[:, cut], context.tile(qpos[cut], qpos[cut]))[0]
            np.testing.assert_allclose(got, want_q[:, cut], rtol=1e-5, atol=1e-5)
        for cut in (slice(0, 3), slice(3, 6)):
            got = per_token.rotate(k[:, cut], k[:, cut], context.tile(kpos[cut], kpos[cut]))[1]
            np.testing.assert_allclose(got, want_k[:, cut], rtol=1e-5, atol=1e-5)
        checked += 1
    if isinstance(hook, CarriedLogitsFromContent):
        carry = hook.init_carry(q, context)
        content = jnp.einsum("BTNH,BSNH->BNTS", q, k) * context.scale
        got = hook.carried_logits_from_content(content, q, k, context, carry)
        want = hook.carried_logits(q, k, context, carry)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        checked += 1
    if forms_of(hook).has("tiled", "per_query_block"):  # what a query block's tiles share, computed for it
        if forms_of(hook).has("tiled", "carried"):  # after later key tiles counted 1.5 gates per row
            tile = lambda h: h.carried_logits(q, k, context, h.init_carry(q, context) + 1.5)
        else:
            tile = lambda h: h.tile_logits(q, k, context)
        got, want = tile(hook.for_query_block(q, context)), tile(hook)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("name", ["transformer-xl", "cope", "shaw", "deberta"])
def test_plain_forms_of_the_other_backends_equal_the_cpu_forms(rng, name, monkeypatch):
    """The kernels shaped on XLA:CPU run on the CPU only (``core.operations.current_backend``); the plain forms
    the other backends run give the same values and gradients: Transformer-XL's ladder scores and its
    table-or-identity choice in decoding steps, CoPE's counts and pair reads, Shaw's and DeBERTa's
    gathers by distance in the gradient."""
    hook = jax.tree.map(lambda p: p + 0.3 * _normal(rng, p.shape), _built(name))
    q, k, v = _normal(rng, (B, T, N, H)), _normal(rng, (B, T, N, H)), _normal(rng, (B, T, N, H))

    def value_and_grads():  # a new function each time: jit would reuse the trace of the same one
        out = lambda *args: jnp.sum(jnp.sin(_run_hook(args[0], "attention", None, *args[1:], jnp.arange(T))))
        return jax.jit(jax.value_and_grad(out, argnums=(0, 1, 2, 3)))

    def decoded(model):
        tokens = jnp.asarray(rng.integers(0, 16, (2, 7)), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
        logits, caches = model.decode(tokens[:, :5], positions[:, :5], model.init_cache(2, 8))
        steps = [logits]
        for t in (5, 6):
            logits, caches = model.decode(tokens[:, t : t + 1], positions[:, t : t + 1], caches)
            steps.append(logits)
        return jnp.concatenate(steps, axis=1)

    rng_state = rng.bit_generator.state
    cpu = value_and_grads()(hook, q, k, v)
    cpu_decoded = decoded(_model(name, causal=True)) if name == "transformer-xl" else None
    monkeypatch.setattr(operations, "current_backend", lambda: "gpu")
    rng.bit_generator.state = rng_state  # the same tokens
    plain = value_and_grads()(hook, q, k, v)  # traced with the plain forms
    for a, b in zip(jax.tree.leaves(cpu), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    if cpu_decoded is not None:  # steps against the cache's table of W_R R_d
        np.testing.assert_allclose(decoded(_model(name, causal=True)), cpu_decoded, rtol=1e-5, atol=1e-5)


def test_position_sampler_passes_through_jit_and_vmap():
    hook = _built("randomized")
    positions = jnp.arange(T)
    sample = jax.jit(lambda h, key: h.sample(key, positions, train=True))
    keys = jax.random.split(jax.random.key(0), 3)
    batch = jax.vmap(lambda key: sample(hook, key))(keys)
    assert batch.shape == (3, 1, T)
    np.testing.assert_array_equal(batch[1], sample(hook, keys[1]))
    assert bool((jnp.diff(batch, axis=-1) > 0).all()) and int(batch.max()) < hook.max_length


# -- defaults that follow the model ---------------------------------------------------------------


def _model(encoding, causal):
    return Transformer(
        vocab_size=16,
        model_dim=N * H,
        num_layers=1,
        num_heads=N,
        mlp_dim=32,
        encoding=encoding,
        causal=causal,
        rngs=nnx.Rngs(0),
    )


@pytest.mark.parametrize(
    "default, forms",
    [
        ("alibi", (ALiBi(bidirectional=True), ALiBi(bidirectional=False))),
        ("t5", (T5Config(bidirectional=True), T5Config(bidirectional=False))),
    ],
)
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_two_form_encodings_follow_the_model(rng, default, forms, causal):
    length = 40  # past T5's exact buckets, where its two forms part
    tokens = jnp.asarray(rng.integers(0, 16, (B, length)), jnp.int32)
    positions = jnp.arange(length)
    out = _model(default, causal)(tokens, positions)
    bidirectional, unidirectional = (_model(form, causal)(tokens, positions) for form in forms)
    follows, other = (bidirectional, unidirectional) if not causal else (unidirectional, bidirectional)
    np.testing.assert_allclose(out, follows, atol=1e-6)
    if not (default == "alibi" and causal):  # on past keys ALiBi's two forms are the same bias
        assert np.abs(np.asarray(out - other)).max() > 1e-4


def test_an_explicit_direction_wins(rng):
    q, k, v = (_normal(rng, (B, T, N, H)) for _ in range(3))
    pos = jnp.arange(T)

    def attend(enc, causal):
        return dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=[enc], causal=causal)

    np.testing.assert_allclose(attend(ALiBi(), False), attend(ALiBi(bidirectional=True), False), atol=1e-6)
    np.testing.assert_allclose(attend(ALiBi(), True), attend(ALiBi(bidirectional=False), True), atol=1e-6)
    # A bidirectional attention given the causal form explicitly keeps it.
    assert np.abs(np.asarray(attend(ALiBi(bidirectional=False), False) - attend(ALiBi(), False))).max() > 1e-4


@pytest.mark.parametrize(
    "scaling",
    [
        DynamicNTKScaling(factor=4.0, original_context=2048),
        LongRoPEScaling(short_factor=(1.0,) * 8, long_factor=(4.0,) * 8, original_context=2048, max_context=8192),
    ],
    ids=["dynamic-ntk", "longrope"],
)
def test_length_dependent_scalings_take_the_length_from_positions(rng, scaling):
    rope = RoPE(scaling=scaling)
    q = _normal(rng, (1, 100, 2, 16))

    def rotated(positions):
        context = AttentionContext(query_positions=positions, key_positions=positions)
        return jax.jit(rope.rotate)(q, q, context)[0]

    # A window of 100 positions at 2500-2599 is a sequence of 2600 tokens: scaled frequencies.
    window = jnp.arange(2500, 2600)
    factor = scaling.attention_factor(None)  # LongRoPE's depends on its fixed context ratio alone
    want = apply_rope(
        q, window, inverse_frequency=scaling.inverse_frequencies(16, 10000.0, 2600), attention_factor=factor
    )
    np.testing.assert_allclose(rotated(window), want, atol=2e-3)
    assert np.abs(np.asarray(rotated(window) - apply_rope(q, window, attention_factor=factor))).max() > 0.1
    # Packed sequences of 50 tokens each (positions restart at 0) stay unscaled, however many keys.
    packed = jnp.concatenate([jnp.arange(50), jnp.arange(50)])
    np.testing.assert_allclose(rotated(packed), apply_rope(q, packed, attention_factor=factor), atol=1e-5)


# -- a new encoding in one place ------------------------------------------------------------------


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made in the test go to a copy of the registry, dropped afterwards."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    yield
    encoding_info.cache_clear()


def test_a_new_encoding_is_one_registered_class(rng, scratch_registry):
    @register_encoding(
        "test-window",
        description="A parameter-free bias that forbids nothing but prefers keys within a window.",
        source=registry.Source.paper("test", title="A test encoding", authors="Nobody", year=2024, arxiv="2401.00001"),
        small_settings=dict(window=2),
        hooks=("logits",),
        tiled=(),
        cached=(),
        prepared="bias",
    )
    @pytree_dataclass
    class WindowBias(BiasHook, ParameterFree):
        window: int = 4
        acts_on: ClassVar[Placement] = "shared_bias"

        def bias(self, context):
            distance = jnp.abs(context.key_positions[None, :] - context.query_positions[:, None])
            return jnp.where(distance <= self.window, 0.0, -1.0)[None, None].astype(jnp.float32)

    info = encoding_info("test-window")
    assert (info.acts_on, info.hooks, info.settings) == ("shared_bias", ("logits",), ("window",))
    assert "test-window" in encoding_names()
    model = _model("test-window", causal=True)
    tokens = jnp.asarray(rng.integers(0, 16, (B, T)), jnp.int32)
    out = nnx.jit(lambda m, t: m(t, jnp.arange(T)))(model, tokens)
    assert out.shape == (B, T, 16) and bool(jnp.isfinite(out).all())
    # The model computed it once and shared it: the same as the attention given the hook directly.
    mha = model.blocks[0].attention
    x = model.blocks[0].attention_norm(model.embed(tokens))
    direct = dot_product_attention(
        *(getattr(mha, name)(x) for name in ("query", "key", "value")),
        query_positions=jnp.arange(T),
        key_positions=jnp.arange(T),
        encodings=[WindowBias()],
        causal=True,
    )
    via_model = mha(x, causal=True, shared=[WindowBias()])
    np.testing.assert_allclose(mha.out(direct), via_model, atol=1e-5)


def _load_p_rope():
    """tests/p_rope.py loaded afresh (it registers "p-rope" on import; the registry is the test's copy)."""
    path = pathlib.Path(__file__).with_name("p_rope.py")
    spec = importlib.util.spec_from_file_location(f"p_rope_{uuid.uuid4().hex}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Positions with large gaps: a length-dependent scaling (max position + 1) treats 2 alone and 2 among
# them differently.
_SPREAD = jnp.asarray([0, 2, 7, 300, 5000, 5001], jnp.int32)


def _rotates_each_token_alone(hook, rng) -> bool:
    """Whether rotating each token on its own gives the rows of rotating them all together."""
    q, k = _normal(rng, (B, _SPREAD.size, N, H)), _normal(rng, (B, _SPREAD.size, N, H))

    @jax.jit  # compiled twice: all tokens, and one
    def rotate(q, k, positions):
        context = AttentionContext(positions, positions, H**-0.5, H, N, True, positions.size)
        return hook.rotate(q, k, context)

    together = rotate(q, k, _SPREAD)
    for i in range(_SPREAD.size):
        alone = rotate(q[:, i : i + 1], k[:, i : i + 1], _SPREAD[i : i + 1])
        for a, b in zip(alone, together, strict=True):
            if not np.allclose(a[:, 0], b[:, i], atol=1e-5, rtol=1e-5):
                return False
    return True


def _declares_per_token(hook) -> bool:
    return rotates_each_token(hook) or forms_of(hook).has("cached", "rotation_about")


_ROTATIONS = [n for n in encoding_names() if "rotate" in encoding_info(n).hooks]


@pytest.mark.parametrize("name", _ROTATIONS)
def test_a_rotation_that_rotates_per_token_declares_it(rng, name):
    """A KV cache stores keys rotated only for a rotation that says it rotates each token by its own
    position (the form cached.rotation); one that does without saying so makes every decoding step re-rotate
    the whole cache, with equal outputs, so only this test notices."""
    hook = _built(name)
    if forms_of(hook).has("cached", "rotation_about"):  # xPos: per token given its fixed centre, which the cache keeps
        return
    assert _rotates_each_token_alone(hook, rng) == _declares_per_token(hook), (
        f"{name}: rotates each token alone: {_rotates_each_token_alone(hook, rng)}; declares it: "
        f'{_declares_per_token(hook)} (declare cached=("rotation",) and define rotates_per_token)'
    )


_SOURCE = registry.Source.paper("test", title="A test encoding", authors="Nobody", year=2024, arxiv="2401.00001")


def test_a_declared_form_the_hook_does_not_define_fails_at_registration(scratch_registry):
    @pytree_dataclass
    class Bias(BiasHook, ParameterFree):
        def bias(self, context):
            return jnp.zeros((1, 1, 1, 1), jnp.float32)

    declare = dict(description="d", source=_SOURCE, hooks=("logits",), tiled=("distance",), cached=(), prepared="bias")
    with pytest.raises(
        ValueError, match=r"declares the form tiled\.distance, but its hook Bias does not define distance_bias"
    ):
        register_encoding("test-undefined-form", **declare)(Bias)
    assert "test-undefined-form" not in encoding_names()


def test_a_form_the_hook_defines_but_does_not_declare_fails_at_registration(scratch_registry):
    @pytree_dataclass
    class Rotation(ParameterFree):
        rotates_per_token: ClassVar[bool] = True

        def rotate(self, q, k, context):
            return q, k

    declare = dict(description="d", source=_SOURCE, hooks=("rotate",), tiled=(), prepared=None)
    with pytest.raises(ValueError, match=r"defines rotates_per_token but does not declare the form cached\.rotation"):
        register_encoding("test-undeclared", cached=(), **declare)(Rotation)
    with pytest.raises(ValueError, match=r"declares some of its hooks and forms but not hooks, cached, prepared"):
        register_encoding("test-partly-declared", description="d", source=_SOURCE, tiled=())
    with pytest.raises(ValueError, match=r"unknown cached form 'rotated'; the cached forms are"):
        register_encoding("test-unknown", cached=("rotated",), **declare)


def test_an_encoding_registered_without_its_forms_fails_naming_them(scratch_registry):
    with pytest.raises(
        ValueError,
        match=r"declares none of its hooks and forms: hooks, tiled, cached, prepared: declare hooks=, tiled=",
    ):
        register_encoding("test-no-forms", description="d", source=_SOURCE)
    assert "test-no-forms" not in encoding_names()


def test_a_hook_the_class_defines_but_does_not_declare_fails_at_registration(scratch_registry):
    """The hooks a class fills are part of its declaration: one it defines and leaves out would never be
    called, so registration refuses it by name (and a hook declared but not defined, the reverse)."""

    @pytree_dataclass
    class Both(ParameterFree):
        def rotate(self, q, k, context):
            return q, k

        def logits(self, q, k, context):
            return jnp.zeros((1, 1, 1, 1), jnp.float32)

    declare = dict(description="d", source=_SOURCE, tiled=(), cached=(), prepared=None)
    with pytest.raises(ValueError, match=r"Both defines logits\(\) but does not declare the hook: declare it \(hooks="):
        register_encoding("test-logits-undeclared", hooks=("rotate",), **declare)(Both)
    with pytest.raises(ValueError, match=r"Both defines rotate\(\) but does not declare the hook"):
        register_encoding("test-rotate-undeclared", hooks=("logits",), **declare)(Both)
    with pytest.raises(
        ValueError, match=r"declares the hook values, but its hook class Both does not define values\(\)"
    ):
        register_encoding("test-values-undefined", hooks=("rotate", "logits", "values"), **declare)(Both)
    with pytest.raises(ValueError, match=r"unknown hook 'bias'; the hooks are"):
        register_encoding("test-unknown-hook", hooks=("bias",), **declare)(Both)
    with pytest.raises(TypeError, match=r"hooks must be a tuple of hook names"):
        register_encoding("test-hooks-string", hooks="logits", **declare)(Both)
    assert not {n for n in encoding_names() if n.startswith("test-")}
    # Declared as it is, the class registers and the attention calls both hooks.
    register_encoding("test-both", hooks=("logits", "rotate"), **declare)(Both)
    assert encoding_info("test-both").hooks == ("rotate", "logits")  # in the order of the design's table


def test_declare_forms_checks_the_hooks_too():
    class Rotation:
        def rotate(self, q, k, context):
            return q, k

        def logits(self, q, k, context):
            return None

    with pytest.raises(ValueError, match=r"Rotation defines logits\(\) but does not declare the hook.*declare_forms\("):
        declare_forms(Rotation, Forms(hooks=("rotate",)))
    with pytest.raises(ValueError, match=r"declares the hook values, but its hook class Rotation does not define"):
        declare_forms(Rotation, Forms(hooks=("rotate", "logits", "values")))
    assert "_declared_forms" not in Rotation.__dict__  # a refused declaration records nothing
    declare_forms(Rotation, Forms(hooks=("rotate", "logits")))
    assert hook_names(Rotation()) == ("rotate", "logits")
    with pytest.raises(ValueError, match=r"already declares"):
        declare_forms(Rotation, Forms(hooks=("rotate", "logits"), tiled=()))


def test_a_term_whose_tile_form_is_not_declared_is_not_computed_per_tile(rng, monkeypatch):
    """A class filling ``logits`` or ``values`` without saying ``tiled`` is taken as ``tiled=None``: its
    term may need every key (CoPE's gates sum over them), so blockwise attention refuses it by name and
    ``auto`` materialises it, even past the size where it would go blockwise; ``tiled=()`` opts in. A
    rotation acts before the scores: per tile without saying so."""
    assert Forms(hooks=("logits",)).tiled is None and Forms(hooks=("values",)).tiled is None
    assert Forms(hooks=("rotate",)).tiled == () and Forms(hooks=()).tiled == ()
    assert Forms(hooks=("logits",), tiled=()).tiled == ()

    @pytree_dataclass
    class RowMean:  # a term of every key: the mean of each query's content scores over all keys
        def logits(self, q, k, context):
            return jnp.einsum("bthd,bshd->bht", q, k)[..., None] / k.shape[1]

    declare_forms(RowMean, Forms(hooks=("logits",)))
    B, T, N, H = 1, 64, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32) for _ in range(3))
    pos = jnp.arange(T)
    attend = functools.partial(
        dot_product_attention, q, k, v, query_positions=pos, key_positions=pos, encodings=[RowMean()], causal=True
    )
    with pytest.raises(ValueError, match=r"RowMean cannot be computed per tile.*implementation='materialize'"):
        attend(implementation="blockwise", block_q=16, block_k=16)
    whole = attend(implementation="materialize")
    import posenc_jax.functional.core.attention as attention
    import posenc_jax.functional.core.dispatch as dispatch

    monkeypatch.setitem(attention.MATERIALIZE_LIMIT_BYTES_BY_BACKEND, jax.default_backend(), 16)
    monkeypatch.setattr(dispatch, "AUTO_TILED_FROM_LENGTH", 0)  # "auto" goes blockwise where it can
    np.testing.assert_array_equal(np.asarray(attend(implementation="auto")), np.asarray(whole))

    # Declared per tile (wrongly, for this term), the tiles compute it from their own keys: a different answer
    # (from "auto" too, now), which is why the declaration is the class's to make, not a default.
    @pytree_dataclass
    class RowMeanTiled(RowMean):
        pass

    declare_forms(RowMeanTiled, Forms(hooks=("logits",), tiled=()))
    tiled = attend(encodings=[RowMeanTiled()], implementation="blockwise", block_q=16, block_k=16)
    assert float(jnp.max(jnp.abs(tiled - whole))) > 1e-3
    auto = attend(encodings=[RowMeanTiled()], implementation="auto", block_q=16, block_k=16)
    assert float(jnp.max(jnp.abs(auto - whole))) > 1e-3


def test_an_object_whose_class_declares_no_hooks_is_refused_where_it_enters(rng):
    """A hook object of a class that declared nothing (one's own hook, a test double) is refused by every
    entry, naming declare_forms, rather than probed for methods; declared, it works."""

    @pytree_dataclass
    class Offset:
        def logits(self, q, k, context):
            return jnp.ones((1, 1, 1, 1), jnp.float32)

    q, k, v = (_normal(rng, (B, T, N, H)) for _ in range(3))
    pos = jnp.arange(T)
    context = AttentionContext(pos, pos, H**-0.5, H, N, True, T)
    message = r"Offset declares no hooks, so the attention cannot tell what it fills: .*declare_forms\(Offset, Forms\("
    for implementation in ("materialize", "blockwise"):
        with pytest.raises(TypeError, match=message):
            dot_product_attention(
                q, k, v, query_positions=pos, key_positions=pos, encodings=[Offset()], implementation=implementation
            )
    with pytest.raises(TypeError, match=message):
        attention_scores(q, k, [Offset()], context)
    with pytest.raises(TypeError, match=message):
        attention_output(jnp.zeros((B, N, T, T)), v, [Offset()], context)
    with pytest.raises(TypeError, match=message):
        hook_names(Offset())
    with pytest.raises(TypeError, match=r"declare_forms\(Offset, Forms\(hooks=\('normalize',\)\)\)"):
        dot_product_attention(q, k, v, normalizer=Offset())
    declare_forms(Offset, Forms(hooks=("logits",)))
    plain = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos)
    offset = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=[Offset()])
    np.testing.assert_allclose(offset, plain, atol=1e-6)  # a constant added to every score changes no weight
    with pytest.raises(TypeError, match=r"Offset declares the hooks \['logits'\], not normalize"):
        dot_product_attention(q, k, v, normalizer=Offset())


def test_the_attention_calls_the_declared_hooks_not_the_methods_an_object_has(rng):
    """hook_names reads the class's declaration: an attribute named like a hook, set on one object, is no hook
    (a probe for the method would have called it)."""

    class Bias:
        def logits(self, q, k, context):
            return relative_positions(context.query_positions, context.key_positions, dtype=jnp.float32)[:, None]

    declare_forms(Bias, Forms(hooks=("logits",), tiled=()))  # a term of the tile's own positions
    tampered = Bias()
    tampered.rotate = lambda q, k, context: (q * 0, k * 0)
    tampered.values = lambda weights, context: jnp.full((B, T, N, H), jnp.nan)
    assert hook_names(tampered) == ("logits",)
    q, k, v = (_normal(rng, (B, T, N, H)) for _ in range(3))
    pos = jnp.arange(T)
    for implementation in ("materialize", "blockwise"):
        attend = lambda hook, implementation=implementation: dot_product_attention(
            q, k, v, query_positions=pos, key_positions=pos, encodings=[hook], causal=True,
            implementation=implementation, block_q=4, block_k=4,
        )  # fmt: skip
        np.testing.assert_allclose(attend(tampered), attend(Bias()), atol=1e-6)


def test_a_hook_class_of_ones_own_declares_the_forms_it_defines(rng):
    """An unregistered hook class passed to the attention declares its hooks and forms: one defining a
    form's methods without declaring the form is refused by name (never a silent slow path); declared, the
    attention uses the form."""

    @pytree_dataclass
    class Window:
        def logits(self, q, k, context):
            return self.distance_bias(relative_positions(context.query_positions, context.key_positions), context)

        def distance_bias(self, distance, context):
            return jnp.where(jnp.abs(distance) <= 2, 0.0, -1.0).astype(jnp.float32)[:, None]

    q, k, v = (_normal(rng, (B, T, N, H)) for _ in range(3))
    attend = lambda: dot_product_attention(
        q, k, v, query_positions=jnp.arange(T), key_positions=jnp.arange(T), encodings=[Window()], causal=True
    )
    with pytest.raises(TypeError, match=r"Window declares no hooks.*declare_forms\(Window, Forms\(hooks="):
        attend()
    with pytest.raises(ValueError, match=r"Window defines distance_bias but does not declare the form tiled\.distance"):
        declare_forms(Window, Forms(hooks=("logits",)))
    declare_forms(Window, Forms(hooks=("logits",), tiled=("distance",)))
    assert forms_of(Window()).has("tiled", "distance")
    tiled = dot_product_attention(
        q,
        k,
        v,
        query_positions=jnp.arange(T),
        key_positions=jnp.arange(T),
        encodings=[Window()],
        causal=True,
        implementation="blockwise",
        block_q=3,
        block_k=2,
    )
    np.testing.assert_allclose(tiled, attend(), atol=1e-5)


def test_a_normalizer_of_ones_own_tiles_when_its_class_declares_tiled_weights(rng):
    @pytree_dataclass
    class Softmax2:  # the softmax with its online form, under another class
        def normalize(self, scores, mask, context):
            return softmax_weights.normalize(scores, mask, context)

        def tile_init(self, rows):
            return softmax_weights.tile_init(rows)

        def tile_weights(self, scores, visible, state, context):
            return softmax_weights.tile_weights(scores, visible, state, context)

        def tile_denominator(self, state, context):
            return softmax_weights.tile_denominator(state, context)

    q, k, v = (_normal(rng, (B, T, N, H)) for _ in range(3))
    pos = jnp.arange(T)

    def attend(implementation):
        return dot_product_attention(
            q, k, v, query_positions=pos, key_positions=pos, normalizer=Softmax2(), causal=True,
            implementation=implementation, block_q=4, block_k=4,
        )  # fmt: skip

    with pytest.raises(TypeError, match=r"declare_forms\(Softmax2, Forms\(hooks=\('normalize',\)\)\)"):
        attend("materialize")
    message = r"Softmax2 defines tile_init, tile_weights, tile_denominator but does not declare the form tiled\.weights"
    with pytest.raises(ValueError, match=message):
        declare_forms(Softmax2, Forms(hooks=("normalize",)))
    declare_forms(Softmax2, Forms(hooks=("normalize",), tiled=("weights",)))
    np.testing.assert_allclose(attend("blockwise"), attend("materialize"), atol=1e-5)


def test_every_registered_encoding_declares_its_forms_on_its_hook_class():
    """Registration recorded the checked declaration on the built hook's class, and the attention reads it
    there (a class of its own, not a reading of the hook's methods)."""
    for name in encoding_names():
        hook = _built(name)
        owner = next(c for c in type(hook).__mro__ if "_declared_forms" in c.__dict__)
        assert forms_of(hook) is owner.__dict__["_declared_forms"], name
        assert encoding_info(name).blockwise == (forms_of(hook).tiled is not None), name


def test_a_rope_variant_is_one_file(rng, scratch_registry):
    p_rope = _load_p_rope()
    assert "p-rope" in encoding_names()
    assert encoding_info("p-rope").hooks == ("rotate",)
    # Its mathematics: p = 1 is RoPE (half layout), p = 0 rotates nothing.
    q, k = _normal(rng, (B, T, N, H)), _normal(rng, (B, T, N, H))
    positions = jnp.arange(T) + 3
    context = AttentionContext(positions, positions, H**-0.5, H, N, True, T)
    full = RoPE(layout="half").rotate(q, k, context)
    for got, want in zip(p_rope.PRoPE(proportion=1.0).rotate(q, k, context), full, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    for got, want in zip(p_rope.PRoPE(proportion=0.0).rotate(q, k, context), (q, k), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # The contract test above holds it, and catches the same rotation when it does not declare it.
    declared, undeclared = p_rope.PRoPE(proportion=0.5), p_rope.UndeclaredPRoPE(proportion=0.5)
    assert _rotates_each_token_alone(declared, rng) and _declares_per_token(declared)
    assert _rotates_each_token_alone(undeclared, rng) and not _declares_per_token(undeclared)
    # In a model: a decoder whose cached decoding equals its full forward, with keys stored rotated.
    model = Transformer(
        vocab_size=16,
        model_dim=N * H,
        num_layers=1,
        num_heads=N,
        mlp_dim=32,
        encoding="p-rope",
        causal=True,
        rngs=nnx.Rngs(0),
    )
    tokens = jnp.asarray(rng.integers(0, 16, (B, T)), jnp.int32)
    full_logits = model(tokens, jnp.arange(T))
    caches = model.init_cache(B, T)
    steps = []
    for t in range(T):
        logits, caches = model.decode(tokens[:, t : t + 1], jnp.full((B, 1), t, jnp.int32), caches)
        steps.append(logits[:, 0])
    np.testing.assert_allclose(jnp.stack(steps, axis=1), full_logits, atol=1e-4, rtol=1e-4)
    assert _stores_rotated_keys([declared]) and not _stores_rotated_keys([undeclared])


def test_the_hugging_face_partial_rotation_declares_its_per_token_rotation(rng):
    hook = RoPEOnLastFeatures(RoPE(layout="interleaved"), num_features=4)
    assert _rotates_each_token_alone(hook, rng) and _declares_per_token(hook)
