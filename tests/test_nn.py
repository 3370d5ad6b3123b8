"""NNX modules: shapes, decoding with a KV cache, packing, causality, every encoding in a model."""

import collections
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled
from flax import nnx

from posenc_jax.functional import RoPE, T5Config, dot_product_attention, encoding_info, encoding_names
from posenc_jax.functional.core.positions import check_positions
from posenc_jax.nn import KVCache, MultiHeadAttention, PositionEncoding, Transformer, decode_step
from small_encodings import one_per_path, small_config

VOCAB, D, LAYERS, HEADS = 32, 32, 2, 4


def _config(name):
    return small_config(name)


def _model(encoding, causal=True, seed=0, num_layers=LAYERS, **kwargs):
    return Transformer(
        vocab_size=VOCAB,
        model_dim=D,
        num_layers=num_layers,
        num_heads=HEADS,
        mlp_dim=64,
        encoding=encoding,
        causal=causal,
        rngs=nnx.Rngs(seed),
        **kwargs,
    )


def _tokens(rng, batch, length):
    return jnp.asarray(rng.integers(0, VOCAB, (batch, length)), jnp.int32)


# The reference forwards and the decoding calls a test compares, compiled: at each new length an eager model call
# compiles every operation of the model afresh (about 3 s for a 2-layer RoPE model here), a jitted one the
# whole program once (about 0.6 s). Tests of the eager path itself call the model directly.
_forward = nnx.jit(lambda model, tokens, positions: model(tokens, positions))
_decode = nnx.jit(
    lambda model, tokens, positions, caches, key_mask=None: model.decode(tokens, positions, caches, key_mask=key_mask)
)


def test_attention_and_model_shapes_with_and_without_jit():
    mha = MultiHeadAttention(HEADS, D, num_kv_heads=2, encodings=["rope", "alibi"], rngs=nnx.Rngs(0))
    x = jnp.ones((2, 9, D))
    for fn in (
        lambda m, x: m(x, query_positions=jnp.arange(9), causal=True),
        nnx.jit(lambda m, x: m(x, query_positions=jnp.arange(9), causal=True)),
    ):
        chex.assert_shape(fn(mha, x), (2, 9, D))
    model = _model(["sinusoidal", "t5"])
    tokens = jnp.zeros((3, 11), jnp.int32)
    for fn in (lambda m, t: m(t, jnp.arange(11)), nnx.jit(lambda m, t: m(t, jnp.arange(11)))):
        out = fn(model, tokens)
        chex.assert_shape(out, (3, 11, VOCAB))
        chex.assert_tree_all_finite(out)


def test_position_encoding_module_holds_parameters():
    enc = PositionEncoding(T5Config(num_buckets=16), num_heads=HEADS, head_dim=8, model_dim=D, rngs=nnx.Rngs(0))
    params = nnx.state(enc, nnx.Param)
    chex.assert_shape(params["table"][...], (16, HEADS))
    assert PositionEncoding("rope", num_heads=HEADS, head_dim=8, model_dim=D, rngs=nnx.Rngs(0)).param_names == ()
    with pytest.raises(ValueError, match="unknown encoding 'ropee'"):
        PositionEncoding("ropee", num_heads=HEADS, head_dim=8, model_dim=D, rngs=nnx.Rngs(0))


# Dynamic NTK and LongRoPE pick frequencies from the current length, max(position) + 1.
LENGTH_DEPENDENT = [n for n in encoding_names() if encoding_info(n).length_dependent]
DECODABLE = one_per_path(n for n in encoding_names() if encoding_info(n).kv_cache and n not in LENGTH_DEPENDENT)


@pytest.mark.parametrize("name", DECODABLE)
def test_prefill_then_decode_equals_full_forward(rng, name):
    """A prefill and four cached steps give each row's own forward, at offset positions. Row 0 is left-padded
    by two masked tokens (its real ones at positions 3..9), row 1 is full (3..11): the batch decodes as each
    row alone (stored rotated keys, biases of the distance, absolute embeddings, cached per-key terms)."""
    model = _model(_config(name))
    tokens = _tokens(rng, 2, 9)
    positions = jnp.asarray([[3, 3, *range(3, 10)], list(range(3, 12))])
    key_mask = jnp.asarray([[False, False] + [True] * 7, [True] * 9])
    # The references in one causal forward: row 0's real tokens first (its last two logits are not compared).
    alone = _forward(model, tokens.at[0].set(jnp.roll(tokens[0], -2)), jnp.broadcast_to(positions[1], (2, 9)))

    @nnx.jit
    def step(model, tokens, positions, caches):
        return model.decode(tokens, positions, caches)

    caches = model.init_cache(2, 12)
    prefill = nnx.jit(
        lambda model, tokens, positions, caches, key_mask: model.decode(tokens, positions, caches, key_mask=key_mask)
    )
    logits, caches = prefill(model, tokens[:, :5], positions[:, :5], caches, key_mask[:, :5])
    outputs = [logits]
    for t in range(5, 9):
        logits, caches = step(model, tokens[:, t : t + 1], positions[:, t : t + 1], caches)
        outputs.append(logits)
    decoded = jnp.concatenate(outputs, axis=1)
    np.testing.assert_allclose(decoded[0, 2:], alone[0, :7], atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(decoded[1], alone[1], atol=2e-4, rtol=1e-4)


@pytest.mark.long
@pytest.mark.parametrize("name", LENGTH_DEPENDENT)
def test_length_dependent_scalings_decode_one_layer_as_the_forward_of_each_prefix(rng, name):
    # The small settings have original_context=4: the steps cross from plain to scaled frequencies.
    assert LENGTH_DEPENDENT == ["rope-dynamic-ntk", "rope-longrope"]
    model = _model(_config(name), num_layers=1)
    tokens = _tokens(rng, 2, 9)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))

    @nnx.jit
    def step(model, tokens, positions, caches):
        return model.decode(tokens, positions, caches)

    caches = model.init_cache(2, 12)
    logits, caches = model.decode(tokens[:, :3], positions[:, :3], caches)
    np.testing.assert_allclose(logits, _forward(model, tokens[:, :3], positions[:, :3]), atol=2e-4, rtol=1e-4)
    for t in range(3, 9):
        logits, caches = step(model, tokens[:, t : t + 1], positions[:, t : t + 1], caches)
        prefix = _forward(model, tokens[:, : t + 1], positions[:, : t + 1])
        np.testing.assert_allclose(logits[:, 0], prefix[:, -1], atol=2e-4, rtol=1e-4)
    # The last step's frequencies are scaled: the same model without the scaling differs there.
    plain = _model("rope", num_layers=1)
    nnx.update(plain, nnx.state(model, nnx.Param))
    assert np.abs(np.asarray(_forward(plain, tokens, positions)[:, -1] - prefix[:, -1])).max() > 1e-3


@pytest.mark.parametrize("name", LENGTH_DEPENDENT)
def test_length_dependent_scalings_refuse_a_cache_in_deeper_models(rng, name):
    model = _model(_config(name))
    with pytest.raises(ValueError, match="hidden state after the first layer changes as the sequence grows"):
        model.decode(_tokens(rng, 1, 3), jnp.arange(3)[None], model.init_cache(1, 8))


def test_randomized_positions_refuse_a_cache(rng):
    model = _model(["rope", "randomized"])
    with pytest.raises(ValueError, match="randomized positions are sampled afresh"):
        model.decode(_tokens(rng, 1, 3), jnp.arange(3)[None], model.init_cache(1, 8))


def test_decode_step_compiles_once(rng):
    model = _model("rope")

    @nnx.jit
    @chex.assert_max_traces(n=1)
    def step(model, tokens, positions, caches):
        return model.decode(tokens, positions, caches)

    caches = model.init_cache(1, 16)
    for t in range(6):
        _, caches = step(model, _tokens(rng, 1, 1), jnp.full((1, 1), t), caches)
    assert int(caches[0].length) == 6


def test_encoder_cannot_decode():
    model = _model("alibi", causal=False)
    with pytest.raises(ValueError, match="bidirectional encoder; only a causal decoder can decode"):
        model.init_cache(1, 8)


@pytest.mark.parametrize("name", ["rope", "t5", "alibi", "learned", "shaw", "transformer-xl", "cope"])
def test_packed_rows_equal_separate_sequences(rng, name):
    model = _model(_config(name))
    lengths = (4, 7, 3)
    seqs = [_tokens(rng, 1, n) for n in lengths]

    @nnx.jit
    def packed_and_separate(model, seqs):  # one program for the four forwards
        packed = model(
            jnp.concatenate(seqs, axis=1),
            jnp.asarray(np.concatenate([np.arange(n) for n in lengths]))[None],
            segment_ids=jnp.asarray(np.repeat(np.arange(1, 4), lengths))[None],
        )
        return packed, [model(seq, jnp.arange(n)) for seq, n in zip(seqs, lengths, strict=True)]

    packed, separate = packed_and_separate(model, seqs)
    start = 0
    for alone, n in zip(separate, lengths, strict=True):
        np.testing.assert_allclose(packed[:, start : start + n], alone, atol=2e-5)
        start += n


@pytest.mark.parametrize("name", ["rope", "t5", "alibi", "sinusoidal", "cope", "fire", "transformer-xl"])
def test_causality_through_gradients(name):
    model = _model(_config(name))
    T = 10
    tokens = jnp.arange(T, dtype=jnp.int32)[None]  # distinct tokens: one embedding row per position
    # One compiled gradient for the three rows (the row is an argument, not a constant).
    row_gradient = nnx.jit(nnx.grad(lambda m, t: m(tokens, jnp.arange(T))[0, t].sum()))
    for t in (0, 4, 9):
        grads = row_gradient(model, jnp.int32(t))
        row_norms = np.abs(np.asarray(grads.embed.embedding[...])).sum(-1)[:T]
        assert np.all(row_norms[t + 1 :] == 0.0), (t, row_norms)
        assert row_norms[t] > 0


@pytest.mark.parametrize("name", one_per_path(encoding_names()))
def test_every_encoding_trains_a_step_with_finite_gradients(rng, name):
    model = _model(_config(name), dropout_rate=0.1)
    tokens = _tokens(rng, 2, 6)

    def loss(model):
        logits = model(tokens, jnp.arange(6), deterministic=False)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    value, grads = nnx.jit(nnx.value_and_grad(loss))(model)  # one program, not one per operation
    assert np.isfinite(float(value))
    for leaf in jax.tree_util.tree_leaves(nnx.state(grads, nnx.Param)):
        assert np.isfinite(np.asarray(leaf)).all()


def test_shared_bias_is_one_table_for_all_layers():
    model = _model("t5")
    params = nnx.state(model, nnx.Param)
    tables = [path for path, _ in jax.tree_util.tree_leaves_with_path(params) if "table" in jax.tree_util.keystr(path)]
    assert len(tables) == 1
    shaw = _model(_config("shaw"))
    key_tables = [
        p
        for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(shaw, nnx.Param))
        if "key_table" in jax.tree_util.keystr(p)
    ]
    assert len(key_tables) == LAYERS


def test_cache_overflow_is_an_error(rng):
    model = _model("rope")
    caches = model.init_cache(1, 4)
    _, caches = model.decode(_tokens(rng, 1, 3), jnp.arange(3)[None], caches)
    with pytest.raises(ValueError, match=r"holds 4 tokens; 3 are filled and 2 more \(at positions 3 to 4\) do not fit"):
        model.decode(_tokens(rng, 1, 2), jnp.arange(3, 5)[None], caches)
    step = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))
    _, caches = step(model, _tokens(rng, 1, 1), jnp.full((1, 1), 3), caches)
    with pytest.raises(Exception, match=r"holds 4 tokens; 4 are filled and 1 more \(at position 4\) do not fit"):
        jax.block_until_ready(step(model, _tokens(rng, 1, 1), jnp.full((1, 1), 4), caches))


@pytest.mark.parametrize("normalizer", ["softmax", "l2", "relu2", "urpe"])
def test_normalisers_by_name_in_the_model(rng, normalizer):
    model = _model("alibi", causal=False, normalizer=normalizer)
    tokens = _tokens(rng, 2, 6)
    grads = nnx.grad(lambda m: (m(tokens, jnp.arange(6)) ** 2).mean())(model)
    for leaf in jax.tree_util.tree_leaves(nnx.state(grads, nnx.Param)):
        assert np.isfinite(np.asarray(leaf)).all()
    tables = [
        p
        for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
        if "normalizer_params" in jax.tree_util.keystr(p)
    ]
    assert len(tables) == (LAYERS if normalizer == "urpe" else 0)  # URPE's C is learned in every layer
    if normalizer == "urpe":
        c_grad = grads.blocks[0].attention.normalizer_params.table[...]
        assert np.abs(np.asarray(c_grad)).sum() > 0
    with pytest.raises(ValueError, match="unknown normalizer 'softmaxx'; known normalizers: softmax, l2, relu2, urpe"):
        _model("alibi", normalizer="softmaxx")


def test_randomized_positions_are_resampled_in_training_and_evaluation(rng):
    tokens = _tokens(rng, 2, 7)
    model = _model(["rope", "randomized"])
    train = [model(tokens, jnp.arange(7), deterministic=False) for _ in range(2)]
    assert np.abs(np.asarray(train[0] - train[1])).max() > 1e-4  # a new sample each call
    evaluated = [model(tokens, jnp.arange(7)) for _ in range(2)]
    assert np.abs(np.asarray(evaluated[0] - evaluated[1])).max() > 1e-4  # the authors sample at test time too
    # With plain positions at evaluation it is the RoPE model itself.
    fixed = _model(["rope", small_config("randomized", evaluation="arange")])
    plain = _model("rope")
    nnx.update(plain, nnx.state(fixed, nnx.Param))
    np.testing.assert_allclose(fixed(tokens, jnp.arange(7)), plain(tokens, jnp.arange(7)), atol=1e-6)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 7\), got 3..9"):
        model(tokens, jnp.arange(7) + 3)


@pytest.mark.parametrize("name", ["rope", "xpos", "deberta", "transformer-xl", "t5"])
def test_split_state_decode_step_equals_the_forward_and_compiles_once_per_shape(rng, name):
    model = _model(_config(name))
    tokens = _tokens(rng, 2, 10)
    positions = jnp.broadcast_to(jnp.arange(10) + 2, (2, 10))
    full = _forward(model, tokens, positions)
    traces = []
    step = decode_step(model, on_trace=lambda: traces.append(1))
    caches = model.init_cache(2, 12)
    logits, caches = step(tokens[:, :4], positions[:, :4], caches)  # prefill
    outputs = [logits]
    for t in range(4, 10):
        logits, caches = step(tokens[:, t : t + 1], positions[:, t : t + 1], caches)
        outputs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outputs, axis=1), full, atol=2e-4, rtol=1e-4)
    assert len(traces) == 2  # the prefill's shape and the step's


def _transcendentals(fn, *args) -> float:
    """How many transcendental functions (sin, cos, exp, ...) the compiled ``fn`` evaluates (XLA's cost analysis)."""
    return compiled(jax.jit(fn).lower(*args)).cost_analysis()["transcendentals"]


def test_decoding_step_rotates_only_the_new_tokens():
    # RoPE's and xPos's caches hold keys rotated: a step evaluates sin and cos for its own token, not for the 64
    # cached keys. Counted against NoPE's step (the softmax's exponentials), per rotary frequency of the batch's
    # two new tokens. Dynamic NTK follows the current length, so its cache holds keys unrotated and a step
    # rotates every cached key again (the check can fail).
    def added(name):
        model = _model(_config(name), num_layers=1)
        graphdef, state = nnx.split(model)
        step = lambda state, t, p, c: nnx.merge(graphdef, state).decode(t, p, c)
        tokens = jnp.zeros((2, 1), jnp.int32)
        return _transcendentals(step, state, tokens, tokens, model.init_cache(2, 64))

    frequencies = D // HEADS // 2
    plain = added("nope")
    for name in ("rope", "xpos"):  # sin, cos (and xPos's scale) per frequency of a new token
        assert 0 < added(name) - plain <= 2 * frequencies * 8, name
    assert added("rope-dynamic-ntk") - plain >= 2 * 64 * frequencies * 2  # sin and cos for every cached key


@pytest.mark.parametrize(
    "name, shapes, tables",
    [
        ("deberta", [(2, 16, HEADS, 4)], []),
        # Transformer-XL: u·k per key, and W_R R_d for every distance the 16 slots can hold (no sinusoid per key).
        ("transformer-xl", [(2, 16, HEADS)], [(16, HEADS, D // HEADS)]),
        ("functional-relative", [(2, 16, D // HEADS)], []),
    ],
)
def test_caches_hold_per_key_terms_and_work_without_them(rng, name, shapes, tables):
    model = _model(_config(name))
    caches = model.init_cache(2, 16)
    assert sorted(leaf.shape for leaf in jax.tree.leaves(caches[0].features)) == sorted(shapes)
    assert [leaf.shape for leaf in jax.tree.leaves(caches[0].tables)] == tables
    tokens = _tokens(rng, 2, 7)
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    full = _forward(model, tokens, positions)
    # A cache made without the per-key terms (KVCache.empty) decodes the same, recomputing them.
    plain = [KVCache.empty(2, 16, HEADS, D // HEADS) for _ in range(LAYERS)]
    for empty in (caches, plain):
        logits, caches = _decode(model, tokens[:, :5], positions[:, :5], empty)
        outputs = [logits]
        for t in (5, 6):
            logits, caches = _decode(model, tokens[:, t : t + 1], positions[:, t : t + 1], caches)
            outputs.append(logits)
        np.testing.assert_allclose(jnp.concatenate(outputs, 1), full, atol=2e-4, rtol=1e-4)
        if tables and empty is not plain:  # the prefill's table, kept by every step after: W_R R_d, d = 0 .. 15
            hook = model.blocks[0].attention._hooks()[0]
            np.testing.assert_allclose(caches[0].tables[0], hook.cache_table(16), rtol=1e-6)


def test_a_cache_first_written_without_its_tables_decodes_exactly(rng):
    # Transformer-XL's table: a prefill appended by hand (no tables) leaves it unmade; the layer's next
    # call makes it, and the steps give the full forward's logits (not a zero position term).
    model = _model(_config("transformer-xl"))
    layer = model.blocks[0].attention
    x = jnp.asarray(rng.normal(size=(2, 6, D)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    # Each call compiled whole (eagerly, the layer's every operation would compile on its own).
    call = nnx.jit(lambda layer, x, positions, cache: layer(x, query_positions=positions, causal=True, cache=cache))
    full = call(layer, x, positions, None)
    hook = layer._hooks()[0]
    k = layer.key(x[:, :4]).reshape(2, 4, layer.num_kv_heads, layer.head_dim)
    v = layer.value(x[:, :4]).reshape(2, 4, layer.num_kv_heads, layer.head_dim)
    cache = layer.new_cache(2, 8).append(k, v, positions[:, :4], features=(hook.key_features(k, positions[:, :4]),))
    assert not bool(cache.tables_ready)
    out, cache = call(layer, x[:, 4:], positions[:, 4:], cache)
    assert bool(cache.tables_ready)
    np.testing.assert_allclose(out, full[:, 4:], atol=2e-5, rtol=1e-5)


def test_a_cache_computes_its_tables_at_its_first_write_only():
    spec = jax.ShapeDtypeStruct
    empty = KVCache.empty(1, 4, 1, 2, features=(None, None), tables=(spec((3,), jnp.float32), None))
    write = jax.jit(
        lambda cache, value, at: cache.append(
            k, k, jnp.full((1, 1), at, jnp.int32), features=(None, None), tables=(lambda: jnp.full(3, value), None)
        )
    )
    k = jnp.ones((1, 1, 1, 2))
    first = write(empty, 1.0, 0)
    np.testing.assert_array_equal(first.tables[0], [1.0, 1.0, 1.0])
    assert first.tables[1] is None and bool(first.tables_ready)
    np.testing.assert_array_equal(write(first, 2.0, 1).tables[0], [1.0, 1.0, 1.0])  # kept, not made again
    # A first write that supplies no tables leaves them unmade (zeros, not ready): the next write that
    # supplies them makes them, whatever the cache's length.
    bare = empty.append(k, k, jnp.zeros((1, 1), jnp.int32), features=(None, None))
    assert not bool(bare.tables_ready)
    later = write(bare, 3.0, 1)
    assert int(later.length) == 2 and bool(later.tables_ready)
    np.testing.assert_array_equal(later.tables[0], [3.0, 3.0, 3.0])
    with pytest.raises(ValueError, match="tables needs one entry per entry of features"):
        KVCache.empty(1, 4, 1, 2, features=(None,), tables=(None, None))


@pytest.mark.parametrize("name", ["transformer-xl", "deberta", "functional-relative"])
def test_blockwise_attention_over_a_cache_reads_each_key_tiles_stored_terms(rng, name):
    # The per-key terms a cache stores ([B, S, ...]) are cut into the key tiles blockwise attention
    # visits (3 tiles of 4 here, the last padded); prefill and a step give the full forward's output.
    layer = MultiHeadAttention(HEADS, D, encodings=[_config(name)], block_q=2, block_k=4, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.normal(size=(2, 7, D)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    full = layer(x, query_positions=positions, causal=True, implementation="materialize")
    cache = layer.new_cache(2, 10)
    first, cache = layer(
        x[:, :6], query_positions=positions[:, :6], causal=True, cache=cache, implementation="blockwise"
    )
    step, cache = layer(
        x[:, 6:], query_positions=positions[:, 6:], causal=True, cache=cache, implementation="blockwise"
    )
    np.testing.assert_allclose(jnp.concatenate([first, step], 1), full, atol=2e-5, rtol=1e-5)


def _position_checks(run) -> collections.Counter:
    """Who checked positions while ``run()`` ran: for each call of ``check_positions``, the file (under
    ``posenc_jax/``) of the first caller outside the shared helpers (positions, masks, relative)."""
    code = check_positions.__code__
    helpers = ("core/positions.py", "core/masks.py", "core/relative.py")
    where = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            caller = frame.f_back
            while caller.f_code.co_filename.endswith(helpers):  # batched_positions, relative_positions, ...
                caller = caller.f_back
            where[caller.f_code.co_filename.split("posenc_jax/")[-1]] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
    return where


@pytest.mark.parametrize("implementation", ["materialize", "blockwise"])
@pytest.mark.parametrize("name", ["nope", "rope", "rope-yarn", "alibi"])
def test_a_forward_and_a_decoding_step_check_positions_once(name, implementation):
    # The model checks positions where they enter; its layers, their attention and masks, the shared
    # terms, RoPE's table and the caches take them as they are (they were checked 15 to 29 times).
    model = _model(_config(name), implementation=implementation)
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((2, 8), jnp.int32)
    forward = lambda state, t, p: nnx.merge(graphdef, state)(t, p)
    step = lambda state, t, p, c: nnx.merge(graphdef, state).decode(t, p, c)
    caches = model.init_cache(2, 12)
    for run in (
        lambda: jax.make_jaxpr(forward)(state, tokens, jnp.arange(8)),
        lambda: jax.make_jaxpr(step)(state, tokens[:, :1], jnp.full((2, 1), 3), caches),
    ):
        checks = _position_checks(run)
        # ALiBi's bias function checks its own arguments, as a public function must: once per forward
        # when the layers share its bias, in every tile when they go blockwise.
        bias_function = checks.pop("functional/encodings/alibi.py", 0)
        assert checks == {"nn/transformer.py": 1}
        if name != "alibi":
            assert bias_function == 0
        elif implementation == "materialize":
            assert bias_function == 2


@pytest.mark.parametrize("name", encoding_names())
def test_the_model_and_its_attention_check_positions_once_whatever_the_encoding(name):
    # An encoding's own functions (t5_bias, apply_xpos_qk, ...) check their arguments as public functions
    # must; between them, the model, its layers, the attention, its masks and caches check them once.
    encoding = ["rope", _config(name)] if name == "randomized" else _config(name)
    model = _model(encoding)
    graphdef, state = nnx.split(model)
    forward = lambda state, t, p: nnx.merge(graphdef, state)(t, p)
    checks = _position_checks(lambda: jax.make_jaxpr(forward)(state, jnp.zeros((2, 8), jnp.int32), jnp.arange(8)))
    layers = {where: count for where, count in checks.items() if not where.startswith("functional/encodings/")}
    assert layers == {"nn/transformer.py": 1}, checks


def test_the_attention_entry_points_check_positions_once():
    q = k = v = jnp.ones((1, 6, 2, 8))
    positions = jnp.arange(6)
    mha = MultiHeadAttention(2, 16, encodings=["rope"], rngs=nnx.Rngs(0))
    # Self-attention: one array for queries and keys, checked once.
    attend = lambda: dot_product_attention(
        q, k, v, query_positions=positions, key_positions=positions, encodings=[RoPE()], causal=True
    )
    assert _position_checks(attend) == {"functional/core/checks.py": 1}
    assert _position_checks(lambda: mha(jnp.ones((1, 6, 16)), query_positions=positions, causal=True)) == {
        "nn/attention_inputs.py": 1
    }
    assert _position_checks(lambda: RoPE().rotate(q, k, positions)) == {"functional/core/context.py": 1}
    other = jnp.arange(6) + 2  # two arrays, each checked once
    attend = lambda: dot_product_attention(q, k, v, query_positions=positions, key_positions=other, causal=True)
    assert _position_checks(attend) == {"functional/core/checks.py": 2}


def test_a_sequence_mesh_is_refused_where_it_cannot_split_the_queries():
    # mesh= splits a forward pass's queries over devices (tests/test_sharded.py checks the results on 8);
    # a cache, the materialising implementation, or a mesh that is not one are refused by name.
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("sequence",))
    layer = MultiHeadAttention(HEADS, D, encodings=["rope"], rngs=nnx.Rngs(0))
    x, positions = jnp.ones((1, 6, D)), jnp.arange(6)
    np.testing.assert_allclose(
        layer(x, query_positions=positions, causal=True, mesh=mesh),
        layer(x, query_positions=positions, causal=True, implementation="blockwise"),
        atol=1e-6,
    )
    with pytest.raises(ValueError, match="decoding with a cache takes no mesh"):
        layer(x, query_positions=positions, causal=True, cache=layer.new_cache(1, 8), mesh=mesh)
    for implementation in ("materialize", "pallas"):  # neither runs silently as blockwise
        with pytest.raises(ValueError, match=f"implementation='{implementation}' is not split over a mesh"):
            layer(x, query_positions=positions, causal=True, implementation=implementation, mesh=mesh)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh .*got str"):
        _model("alibi")(jnp.zeros((1, 6), jnp.int32), positions, mesh="sequence")
    # ring= passes the keys round a mesh's devices: one device's ring is the call itself; no mesh, no ring.
    np.testing.assert_allclose(
        layer(x, query_positions=positions, causal=True, mesh=mesh, ring=True),
        layer(x, query_positions=positions, causal=True, implementation="blockwise"),
        atol=1e-6,
    )
    with pytest.raises(ValueError, match="ring=True passes the keys round the devices of a mesh: pass mesh= too"):
        _model("alibi")(jnp.zeros((1, 6), jnp.int32), positions, ring=True)
    with pytest.raises(TypeError, match="ring must be True or False, got 'yes'"):
        layer(x, query_positions=positions, causal=True, mesh=mesh, ring="yes")
    from posenc_jax.bench.cell import predict  # the benchmark's evaluation passes ring on as given

    tokens = jnp.zeros((1, 6), jnp.int32)
    with pytest.raises(TypeError, match="ring must be True or False, got 'no'"):
        predict(_model("alibi"), dict(inputs=tokens, targets=tokens, positions=positions), mesh=mesh, ring="no")


def test_a_built_normalizer_with_arrays_is_module_data():
    """A normaliser hook built with its own arrays (URPE with a fixed table) is data of the module: its table
    is in the layer's state, and the layer runs under nnx.jit with the same output as the functional call."""
    from posenc_jax.functional import URPE

    table = jnp.linspace(0.5, 1.5, 14).reshape(2, 7)
    layer = MultiHeadAttention(2, 16, normalizer=URPE(table, max_distance=3), rngs=nnx.Rngs(0))
    paths = [path for path, _ in nnx.to_flat_state(nnx.state(layer))]
    assert ("normalizer", "table") in paths
    x = jax.random.normal(jax.random.key(1), (1, 5, 16))
    out = nnx.jit(lambda layer, x: layer(x, causal=True))(layer, x)
    q, k, v = layer.query(x), layer.key(x), layer.value(x)
    positions = jnp.arange(5)
    expected = dot_product_attention(
        q, k, v, query_positions=positions, key_positions=positions, normalizer=URPE(table, max_distance=3), causal=True
    )
    np.testing.assert_allclose(out, layer.out(expected), rtol=1e-5, atol=1e-5)
