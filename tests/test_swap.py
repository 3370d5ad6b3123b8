"""with_encoding: a trained model evaluated with another compatible encoding, parameters shared."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posenc_jax.functional import RoPE, encoding_config
from posenc_jax.nn import Transformer, with_encoding

SIZES = dict(vocab_size=16, model_dim=32, num_layers=2, num_heads=4, mlp_dim=64)


def _model(encoding, seed=0, **kwargs):
    return Transformer(**SIZES, encoding=encoding, rngs=nnx.Rngs(seed), **kwargs)


def _tokens(length=24):
    return jax.random.randint(jax.random.key(1), (2, length), 0, SIZES["vocab_size"])


def test_swapped_model_equals_a_model_built_with_the_encoding_and_the_trained_weights():
    trained = _model("rope", seed=3)
    yarn = encoding_config("rope-yarn", factor=4.0, original_context=8)
    swapped = with_encoding(trained, yarn)
    # The reference: build the model with YaRN and copy every trained parameter into it.
    reference = _model(yarn, seed=99)
    nnx.update(reference, nnx.state(trained, nnx.Param))
    tokens, positions = _tokens(), jnp.arange(24)
    np.testing.assert_array_equal(swapped(tokens, positions), reference(tokens, positions))
    assert not np.allclose(swapped(tokens, positions), trained(tokens, positions))  # the encoding did change
    assert swapped.describe()["encodings"] == [repr(yarn)]
    assert trained.describe()["encodings"] == [repr(RoPE())]


def test_parameters_are_shared_not_copied_and_the_original_is_unchanged():
    trained = _model(["rope", "t5"])
    before = trained(_tokens(), jnp.arange(24))
    swapped = with_encoding(trained, encoding_config("rope-pi", factor=2.0))
    for (path, leaf), (_, other) in zip(
        jax.tree_util.tree_leaves_with_path(nnx.state(trained, nnx.Param)),
        jax.tree_util.tree_leaves_with_path(nnx.state(swapped, nnx.Param)),
        strict=True,
    ):
        assert leaf is other, path
    np.testing.assert_array_equal(trained(_tokens(), jnp.arange(24)), before)
    assert type(trained.blocks[0].attention.encodings[0].config) is RoPE
    assert trained.blocks[0].attention.encodings[0].config.scaling is None


def test_learned_tables_of_the_same_shape_swap():
    trained = _model("t5", causal=False)
    longer = with_encoding(trained, encoding_config("t5", max_distance=256))
    assert longer.shared[0].config.max_distance == 256
    assert longer.shared[0].table[...] is trained.shared[0].table[...]


def test_encodings_whose_parameters_do_not_fit_are_refused():
    trained = _model("t5")
    with pytest.raises(ValueError, match=r"\{'table': \(\(32, 4\), 'float32'\)\} do not fit .*\(\(64, 4\)"):
        with_encoding(trained, encoding_config("t5", num_buckets=64))
    with pytest.raises(ValueError, match="acts on the attention but T5Config.* acts on the shared_bias"):
        with_encoding(trained, "rope", replace="t5")
    with pytest.raises(ValueError, match="0 encodings acting on the attention"):
        with_encoding(trained, "rope")


def test_a_model_with_several_encodings_in_one_place_names_the_one_to_replace():
    trained = _model(["rope", "shaw"])
    with pytest.raises(ValueError, match="2 encodings acting on the attention"):
        with_encoding(trained, encoding_config("rope-ntk", factor=2.0))
    swapped = with_encoding(trained, encoding_config("rope-ntk", factor=2.0), replace=RoPE)
    assert swapped.blocks[1].attention.encodings[0].config.scaling.factor == 2.0
    assert swapped.blocks[1].attention.encodings[1].config == trained.blocks[1].attention.encodings[1].config


def test_a_length_dependent_swap_updates_the_cache_rule():
    trained = _model("rope")
    dynamic = with_encoding(trained, encoding_config("rope-dynamic-ntk", factor=2.0, original_context=8))
    caches = dynamic.init_cache(batch=2, max_length=8)
    with pytest.raises(ValueError, match="follows the sequence length"):
        dynamic.decode(_tokens(4), jnp.arange(4)[None].repeat(2, 0), caches)
