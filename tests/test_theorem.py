"""The blind spot of relative encodings (Luo et al. 2022), exactly, on random models (no training).

On n identical tokens every position starts with the same vector. Feed-forward layers
and layer norm act per position, so positions can only become different inside
attention. Values are then equal at every key, so a query's output is (row sum of its
weights) x v, plus whatever the position terms add to the output itself. Hence:

* softmax (rows sum to 1) with positional information only in the logits (or in q and
  k): every position gets exactly v, the same everywhere, however the logits differ;
* anything that makes row sums or the output depend on the position breaks the tie.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posenc_jax.functional import (
    URPE,
    ALiBi,
    ReLU2,
    dot_product_attention,
    encoding_info,
    l2_normalized_weights,
    relu2_weights,
)
from posenc_jax.functional.encodings.shaw import ShawConfig
from posenc_jax.nn import Transformer
from small_encodings import small_config

N_TOKENS = 7
LOGIT_ONLY = [
    "nope",
    "rope",
    "rope-pi",
    "rope-ntk",
    "rope-dynamic-ntk",
    "rope-yarn",
    "rope-llama3",
    "rope-longrope",
    "rope-2d",
    "xpos",
    "alibi",
    "kerple-log",
    "kerple-power",
    "fire",
    "t5",
    "clipped-bias",
    "functional-relative",
    "transformer-xl",
    "deberta",
    "cope",
]


def _outputs(encoding, *, causal, normalizer=None, boundary=False, seed=0):
    kwargs = {} if normalizer is None else {"normalizer": normalizer}
    model = Transformer(
        vocab_size=16,
        model_dim=32,
        num_layers=2,
        num_heads=4,
        mlp_dim=64,
        encoding=encoding,
        causal=causal,
        rngs=nnx.Rngs(seed),
        **kwargs,
    )
    tokens = jnp.full((1, N_TOKENS), 3, jnp.int32)
    if boundary:
        tokens = tokens.at[0, 0].set(10).at[0, -1].set(11)  # [CLS] x ... x [SEP]
    logits = np.asarray(model(tokens, jnp.arange(N_TOKENS)), np.float64)[0]
    inner = logits[1:-1] if boundary else logits
    return inner, np.abs(inner - inner[0]).max() / np.abs(inner).max()


def _config(name, **extra):
    return small_config(name, **extra)


@pytest.mark.parametrize(
    "name, causal",
    # CoPE, xPos and FIRE have no bidirectional form (attention refuses causal=False).
    [
        (name, causal)
        for name in LOGIT_ONLY
        for causal in (False, True)
        if causal or "bidirectional" in encoding_info(name).forms
    ],
    ids=lambda x: x if isinstance(x, str) else ("causal" if x else "bidirectional"),
)
def test_logit_only_encodings_cannot_tell_positions_apart(name, causal):
    # Rows sum to 1 and all values are equal: every position gets the same output.
    _, spread = _outputs(_config(name), causal=causal)
    assert spread < 1e-5, f"{name}: outputs differ by {spread:.2e} across identical tokens"


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_shaw_key_term_alone_is_logit_only(causal):
    _, spread = _outputs(ShawConfig(max_distance=3, value_term=False), causal=causal)
    assert spread < 1e-5


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("name", ["sinusoidal", "learned"])
def test_absolute_encodings_break_the_tie(name, causal):
    # The embeddings themselves differ by position before any attention.
    _, spread = _outputs(_config(name), causal=causal)
    assert spread > 1e-3


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_shaw_value_term_breaks_the_tie_near_the_edges(causal):
    # The output adds Σ_j w_ij R_V[clip(j - i)]: which distances exist depends on where
    # the query is (within k of an edge), so those positions differ.
    _, spread = _outputs(ShawConfig(max_distance=3, value_term=True, init_std=0.5), causal=causal)
    assert spread > 1e-3


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_urpe_with_non_constant_c_breaks_the_tie(causal):
    # Row sums Σ_j w_ij c[j - i] depend on which distances the row has.
    table = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, (4, 7)), jnp.float32)
    _, spread = _outputs(_config("nope"), causal=causal, normalizer=URPE(table, 3))
    assert spread > 1e-3
    # With C at its initial value (all ones) URPE is softmax: still blind.
    _, spread = _outputs(_config("nope"), causal=causal, normalizer=URPE(jnp.ones((4, 7)), 3))
    assert spread < 1e-5


def test_l2_normalisation():
    # Causal: row i weighs i + 1 equal keys 1/sqrt(i+1) each, row sum sqrt(i+1): differs.
    _, spread = _outputs(_config("nope"), causal=True, normalizer=l2_normalized_weights)
    assert spread > 1e-3
    # Bidirectional NoPE: every row sees the same n equal scores, so the same weights.
    _, spread = _outputs(_config("nope"), causal=False, normalizer=l2_normalized_weights)
    assert spread < 1e-5
    # With a relative bias the rows' score sets differ, and so do their L2 row sums.
    _, spread = _outputs(ALiBi(bidirectional=True), causal=False, normalizer=l2_normalized_weights)
    assert spread > 1e-3


def test_relu2_over_the_sequence_length_breaks_the_tie_when_causal():
    # GAU's relu(s)^2 / n with n the sequence length (Hua et al. 2022): on equal scores a
    # causal row t sums (t + 1) relu(s)^2 / n, which grows with t, so even NoPE sees where
    # it is. Bidirectional, every row sums n relu(s)^2 / n alike: NoPE stays blind.
    _, spread = _outputs(_config("nope"), causal=True, normalizer=ReLU2())
    assert spread > 1e-3
    _, spread = _outputs(_config("nope"), causal=False, normalizer=ReLU2())
    assert spread < 1e-5
    # An explicit n (e.g. the training length) keeps the growth, and also decodes with a cache.
    _, spread = _outputs(_config("nope"), causal=True, normalizer=ReLU2(length=64))
    assert spread > 1e-3


def test_relu2_over_the_row_count():
    # The per-row variant, n = the number of unmasked keys of the row: with equal scores every
    # row sums to relu(s)^2 whatever n is, so NoPE stays blind, causal or not.
    for causal in (False, True):
        _, spread = _outputs(_config("nope"), causal=causal, normalizer=relu2_weights)
        assert spread < 1e-5
    # With a relative bias the scores, hence the row sums, depend on the query's place.
    for causal in (False, True):
        _, spread = _outputs(ALiBi(bidirectional=not causal), causal=causal, normalizer=relu2_weights)
        assert spread > 1e-3


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("name", ["alibi", "t5", "rope"])
def test_boundary_tokens_break_the_tie_for_relative_encodings(name, causal):
    # [CLS] and [SEP] are different values at fixed places; a relative encoding weighs
    # them differently from each query, so the mixtures differ. (ALiBi's causal form
    # m·(j - i) would not do in an encoder: a bias linear in j shifts every logit of a
    # row equally and cancels in the softmax, so the encoder uses the symmetric form.)
    config = ALiBi(bidirectional=not causal) if name == "alibi" else _config(name)
    _, spread = _outputs(config, causal=causal, boundary=True)
    assert spread > 1e-3


def test_normalisers_respect_masks_and_fully_masked_rows():
    scores = jnp.asarray(np.random.default_rng(0).normal(size=(1, 2, 3, 4)), jnp.float32)
    mask = jnp.asarray([[[[True, False, True, False], [False] * 4, [True] * 4]]])
    for normalizer in (l2_normalized_weights, relu2_weights):
        w = np.asarray(normalizer(scores, mask))
        assert np.all(w[..., 0, [1, 3]] == 0) and np.all(w[..., 1, :] == 0) and np.isfinite(w).all()
    l2 = np.asarray(l2_normalized_weights(scores, mask))
    np.testing.assert_allclose(np.sqrt((l2[..., 2, :] ** 2).sum(-1)), 1.0, rtol=1e-6)
    relu = np.asarray(relu2_weights(scores, mask))
    np.testing.assert_allclose(relu[..., 2, :], np.maximum(np.asarray(scores)[..., 2, :], 0) ** 2 / 4, rtol=1e-6)
    x = jnp.ones((1, 3, 2, 4))
    with pytest.raises(ValueError, match="query_positions and key_positions are required .*URPE"):
        dot_product_attention(x, x, x, normalizer=URPE(jnp.ones((2, 7)), 3))
    with pytest.raises(ValueError, match="URPE table must have shape \\[N, 2\\*max_distance\\+1\\] = \\[N, 7\\]"):
        URPE(jnp.ones((2, 5)), 3)


@pytest.mark.parametrize("normalizer", ["l2", "relu2"])
def test_biases_of_the_distance_alone_cannot_tell_a_position_from_its_mirror(normalizer):
    # Bidirectional, on n identical tokens, a bias of |i - j| alone maps the input onto its mirror
    # image, so position i and position n-1-i get the same output under any normaliser: the
    # probe's ceiling for these is ceil(n/2)/n (posenc_jax.bench.probe.MIRROR_SYMMETRIC). The
    # others tell them apart.
    from posenc_jax.bench.probe import MIRROR_SYMMETRIC
    from posenc_jax.functional.core.normalizers import normalizer_config

    chosen = normalizer_config(normalizer)
    for name in ["nope", *MIRROR_SYMMETRIC, "t5", "clipped-bias", "rope", "functional-relative", "shaw"]:
        outputs, spread = _outputs(_config(name), causal=False, normalizer=chosen)
        mirror = np.abs(outputs - outputs[::-1]).max() / np.abs(outputs).max()
        if name == "nope":
            assert spread < 1e-5  # blind outright
        elif name in MIRROR_SYMMETRIC:
            assert spread > 1e-4 and mirror < 1e-5, f"{name}: mirror images differ by {mirror:.2e}"
        else:
            assert mirror > 1e-5, f"{name}: positions and their mirrors agree to {mirror:.2e}"
