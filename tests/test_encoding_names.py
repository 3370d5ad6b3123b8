"""One way to name encodings everywhere (issue 55): a name, ``"a+b"``, a config, a hook, a list of
them, or ``from_hf_config``'s result; every entry point reads them through
``registry.resolve_encodings``, and a bare string is one name, never its characters."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import posenc_jax.linen
from posenc_jax import bench
from posenc_jax.functional import ALiBi, RoPE, T5Bias, dot_product_attention, encoding_config
from posenc_jax.functional.core.registry import encoding_labels, encoding_names, resolve_encodings
from posenc_jax.hf import from_hf_config
from posenc_jax.nn import AttentionFunction, MultiHeadAttention, PositionEncoding, Transformer, make_attention_fn

B, T, N, H = 2, 6, 2, 8
Q, K, V = (jax.random.normal(jax.random.key(i), (B, T, N, H)) for i in range(3))
POS = jnp.arange(T)

# Every form of "RoPE and ALiBi together", and of "RoPE alone".
BOTH = {
    "a+b": "rope+alibi",
    "a + b": "rope + alibi",
    "list": ["rope", "alibi"],
    "tuple": ("rope", "alibi"),
    "configs": [RoPE(), ALiBi()],
    "mixed": ["rope", encoding_config("alibi")],
}
ALONE = {"name": "rope", "list": ["rope"], "config": RoPE(), "configs": [RoPE()]}
FORMS = {**{f"both-{k}": ("both", v) for k, v in BOTH.items()}, **{f"rope-{k}": ("rope", v) for k, v in ALONE.items()}}
TYPES = {"both": ["RoPE", "ALiBi"], "rope": ["RoPE"]}
BAD = ["rpoe", "rope+alibbi", "rope+", "r"]


def _types(encodings) -> list[str]:
    return [type(e).__name__ for e in encodings]


@pytest.mark.parametrize("kind, encodings", FORMS.values(), ids=FORMS.keys())
def test_the_resolver_reads_every_form(kind, encodings):
    assert _types(resolve_encodings(encodings)) == TYPES[kind]


def test_a_bare_string_is_one_name_and_none_is_none():
    assert _types(resolve_encodings("rope")) == ["RoPE"]  # not r, o, p, e
    assert resolve_encodings(None) == [] and resolve_encodings(()) == [] and resolve_encodings([]) == []
    hook = T5Bias(jnp.zeros((32, N)))
    assert resolve_encodings(hook) == [hook] and resolve_encodings(["rope", hook])[1] is hook


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_name_is_one_line_listing_the_known_names(bad):
    with pytest.raises(ValueError) as error:
        resolve_encodings(bad)
    message = str(error.value)
    assert "\n" not in message and "known encodings: " in message
    assert all(name in message for name in encoding_names())


def test_a_nested_list_is_refused():
    with pytest.raises(TypeError, match="flatten"):
        resolve_encodings([["rope", "alibi"]])


# --- every entry point, every form -------------------------------------------------------------


def _functional(encodings):
    return dot_product_attention(Q, K, V, query_positions=POS, key_positions=POS, encodings=encodings, causal=True)


OBJECTS = {"both": [RoPE(), ALiBi()], "rope": [RoPE()]}
REFERENCE = {kind: _functional(objects) for kind, objects in OBJECTS.items()}


@pytest.mark.parametrize("kind, encodings", FORMS.values(), ids=FORMS.keys())
def test_functional_attention_takes_every_form(kind, encodings):
    np.testing.assert_array_equal(_functional(encodings), REFERENCE[kind])


@pytest.mark.parametrize("kind, encodings", FORMS.values(), ids=FORMS.keys())
def test_make_attention_fn_takes_every_form(kind, encodings):
    out = make_attention_fn(encodings, causal=True)(Q, K, V)
    np.testing.assert_allclose(out, REFERENCE[kind], atol=1e-6)


@pytest.mark.parametrize("kind, encodings", FORMS.values(), ids=FORMS.keys())
def test_the_linen_attention_fn_takes_every_form(kind, encodings):
    layer = nn.MultiHeadDotProductAttention(
        num_heads=N, qkv_features=N * H, attention_fn=posenc_jax.linen.make_attention_fn(encodings, causal=True)
    )
    x = jnp.ones((B, T, N * H))
    params = layer.init(jax.random.key(0), x)
    reference = nn.MultiHeadDotProductAttention(
        num_heads=N, qkv_features=N * H, attention_fn=make_attention_fn(OBJECTS[kind], causal=True)
    )
    np.testing.assert_array_equal(layer.apply(params, x), reference.apply(params, x))


@pytest.mark.parametrize("kind, encodings", FORMS.values(), ids=FORMS.keys())
def test_the_modules_take_every_form(kind, encodings):
    attention = MultiHeadAttention(N, N * H, encodings=encodings, rngs=nnx.Rngs(0))
    assert _types(m.config for m in attention.encodings) == TYPES[kind]
    model = Transformer(
        vocab_size=8, model_dim=N * H, num_layers=1, num_heads=N, mlp_dim=16, encoding=encodings, rngs=nnx.Rngs(0)
    )
    assert {type(m.config).__name__ for _, m in nnx.iter_graph(model) if isinstance(m, PositionEncoding)} == set(
        TYPES[kind]
    )
    function = AttentionFunction(encodings, num_heads=N, head_dim=H, rngs=nnx.Rngs(0))
    assert _types(m.config for m in function.encodings) == TYPES[kind]


@pytest.mark.parametrize("bad", BAD)
def test_every_entry_point_refuses_a_bad_name_in_one_line(bad):
    calls = {
        "functional": lambda: _functional(bad),
        "make_attention_fn": lambda: make_attention_fn(bad),
        "linen": lambda: posenc_jax.linen.make_attention_fn(bad),
        "AttentionFunction": lambda: AttentionFunction(bad, num_heads=N, head_dim=H, rngs=nnx.Rngs(0)),
        "MultiHeadAttention": lambda: MultiHeadAttention(N, N * H, encodings=bad, rngs=nnx.Rngs(0)),
        "Transformer": lambda: Transformer(
            vocab_size=8, model_dim=N * H, num_layers=1, num_heads=N, mlp_dim=16, encoding=bad, rngs=nnx.Rngs(0)
        ),
        "bench": lambda: bench.run("smoke", out="/nonexistent/never-written", encodings=bad),
    }
    for where, call in calls.items():
        with pytest.raises(ValueError) as error:
            call()
        assert "\n" not in str(error.value) and "known encodings: " in str(error.value), where


# --- the benchmark: a label per cell ------------------------------------------------------------


@pytest.mark.parametrize(
    "given, labels",
    [
        ("rope", ("rope",)),
        ("rope+alibi", ("rope+alibi",)),
        (" rope + alibi ", ("rope+alibi",)),
        (["rope", "alibi"], ("rope", "alibi")),
        (("rope", "rope+alibi"), ("rope", "rope+alibi")),
    ],
)
def test_the_benchmark_reads_a_label_per_cell(given, labels):
    assert encoding_labels(given) == labels


def test_the_benchmark_takes_a_bare_string_as_one_cell(monkeypatch, tmp_path):
    seen = {}

    def fake_run(preset, out, **kwargs):
        seen["encodings"] = preset.encodings

    monkeypatch.setattr("posenc_jax.bench.extrapolate.run", fake_run)
    bench.run("smoke", out=tmp_path, encodings="rope+alibi", report=False, plots=False)
    assert seen["encodings"] == ("rope+alibi",)
    bench.run("smoke", out=tmp_path, encodings="rope", report=False, plots=False)
    assert seen["encodings"] == ("rope",)


def test_the_benchmark_refuses_configs_with_the_forms_it_takes():
    with pytest.raises(TypeError, match="the benchmark names its encodings"):
        encoding_labels([RoPE()])


# --- from_hf_config's result --------------------------------------------------------------------

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
}


def test_from_hf_config_result_is_accepted_wherever_encodings_are():
    loaded = from_hf_config(LLAMA)
    configs = list(loaded.encodings)
    assert resolve_encodings(loaded) == configs
    assert resolve_encodings(loaded.encodings) == configs
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 5, 4, 16)) for i in range(3))
    pos = jnp.arange(5)
    reference = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=configs, causal=True)
    for given in (loaded, loaded.encodings):
        np.testing.assert_array_equal(
            dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=given, causal=True),
            reference,
        )
        np.testing.assert_allclose(make_attention_fn(given, causal=True)(q, k, v), reference, atol=1e-6)
        attention = MultiHeadAttention(4, 64, encodings=given, rngs=nnx.Rngs(0))
        assert _types(m.config for m in attention.encodings) == _types(configs)


def test_sequence_parallel_attention_takes_every_form():
    from jax.sharding import Mesh

    from posenc_jax.functional.core.sharded import sequence_parallel_attention

    mesh = Mesh(np.array(jax.devices()[:1]), ("devices",))

    def call(encodings):
        return sequence_parallel_attention(
            Q, K, V, mesh=mesh, query_positions=POS, key_positions=POS, encodings=encodings, causal=True
        )

    expected = call([RoPE(), ALiBi()])
    for encodings in BOTH.values():
        np.testing.assert_array_equal(call(encodings), expected)
    np.testing.assert_allclose(expected, REFERENCE["both"], atol=1e-5)
    with pytest.raises(ValueError, match="known encodings: ") as error:
        call("rope+alibbi")
    assert "\n" not in str(error.value)
