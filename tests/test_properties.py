"""Property-based checks of the attention against float64 references, and a finiteness grid.

Hypothesis draws shapes (batch, query and key lengths, grouped heads, head dim), explicit
positions with offsets and gaps, key padding, causal or not, an encoding, a normaliser, and
the implementation (materialising, or blockwise with block sizes that may not divide the
lengths); masked keys and values are filled with NaN, which must never reach the output.

Hugging Face configs × fields: every numeric and true/false field of every shipped config is
given a bool, a string, 0, a negative number and NaN in turn; each must be refused naming the
field, or leave the loaded result unchanged (a field the loader does not read).
"""

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hf import DYNAMIC, SHIPPED

from posenc_jax.functional import (
    ALiBi,
    ClippedRelativeBias,
    Kerple,
    ReLU2,
    RoPE,
    Sandwich,
    T5Bias,
    dot_product_attention,
    encoding_info,
    encoding_names,
    l2_normalized_weights,
    relu2_weights,
    softmax_weights,
)
from posenc_jax.hf import from_hf_config
from posenc_jax.reference import relative as ref_relative
from posenc_jax.reference import sandwich as ref_sandwich
from posenc_jax.reference import su_rope
from posenc_jax.reference.beyond_seeds import alibi_get_slopes
from small_encodings import small_config

ENCODINGS = ("none", "rope", "alibi", "t5", "clipped", "kerple", "sandwich")
NORMALIZERS = {"softmax": softmax_weights, "l2": l2_normalized_weights, "relu2": relu2_weights, "gau": ReLU2()}


def _reference_bias(name, params, num_heads, head_dim, q_pos, k_pos, causal):
    """float64 ``[N, T, S]`` bias of one batch row, from the references."""
    rel = (k_pos[None, :] - q_pos[:, None]).astype(np.float64)
    if name == "alibi":
        slopes = np.asarray(alibi_get_slopes(num_heads))[:, None, None]
        return slopes * (rel if causal else -np.abs(rel))
    if name == "t5":
        return ref_relative.t5_bias(params, q_pos, k_pos, bidirectional=not causal, max_distance=16)
    if name == "clipped":
        return ref_relative.clipped_relative_bias(params, q_pos, k_pos, 3)
    if name == "kerple":
        r1, r2 = (np.asarray(p, np.float64)[:, None, None] for p in params)
        return -r1 * np.log1p(r2 * np.abs(rel))
    if name == "sandwich":
        return ref_sandwich.sandwich_bias(num_heads, q_pos, k_pos, dim=head_dim)
    return np.zeros((num_heads, len(q_pos), len(k_pos)))


def _hook(name, params):
    return {
        "rope": lambda: RoPE(),
        "alibi": lambda: ALiBi(),
        "t5": lambda: T5Bias(jnp.asarray(params, jnp.float32), max_distance=16),
        "clipped": lambda: ClippedRelativeBias(jnp.asarray(params, jnp.float32), max_distance=3),
        "kerple": lambda: Kerple(*(jnp.asarray(p, jnp.float32) for p in params)),
        "sandwich": lambda: Sandwich(),
    }[name]()


def _reference_weights(normalizer, scores, mask, sequence_length):
    scores = np.where(mask, scores, -np.inf)
    if normalizer in ("relu2", "gau"):
        # relu2: n = the row's unmasked keys; gau (Hua et al. 2022): n = the sequence's real keys.
        count = np.maximum(mask.sum(-1, keepdims=True), 1) if normalizer == "relu2" else max(sequence_length, 1)
        return np.where(mask, np.maximum(scores, 0.0) ** 2, 0.0) / count
    row_max = np.max(scores, axis=-1, keepdims=True)
    e = np.where(mask, np.exp(scores - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
    norm = np.sqrt((e * e).sum(-1, keepdims=True)) if normalizer == "l2" else e.sum(-1, keepdims=True)
    return e / np.where(norm > 0, norm, 1.0)


@st.composite
def _cases(draw):
    batch, q_len, k_len = draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 8))
    num_kv, groups, head_dim = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([2, 4, 8]))
    offset = draw(st.sampled_from([0, 7, 100_000]))
    gaps = st.lists(st.integers(1, 5), min_size=k_len, max_size=k_len)
    k_pos = offset + np.cumsum(draw(gaps)) - 1
    # Queries are the last q_len keys' positions, or their own increasing positions (cross-attention).
    own = offset + np.cumsum(draw(st.lists(st.integers(1, 5), min_size=q_len, max_size=q_len))) - 1
    q_pos = k_pos[-q_len:] if q_len <= k_len and draw(st.booleans()) else own
    key_mask = np.asarray(draw(st.lists(st.booleans(), min_size=batch * k_len, max_size=batch * k_len)))
    return dict(
        batch=batch,
        num_kv=num_kv,
        groups=groups,
        head_dim=head_dim,
        q_pos=np.asarray(q_pos),
        k_pos=k_pos,
        key_mask=key_mask.reshape(batch, k_len),
        causal=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        encoding=draw(st.sampled_from(ENCODINGS)),
        normalizer=draw(st.sampled_from(sorted(NORMALIZERS))),
        blocks=draw(st.sampled_from([None, (1, 1), (2, 3), (4, 4), (5, 2)])),  # None: materialising
    )


@pytest.mark.slow  # 40 drawn cases; test_attention's fixed cases stay in the main suite
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_attention_matches_float64_references_and_masked_keys_never_leak(case):
    rng = np.random.default_rng(case["seed"])
    batch, num_kv, groups, head_dim = case["batch"], case["num_kv"], case["groups"], case["head_dim"]
    num_heads, q_pos, k_pos, key_mask = num_kv * groups, case["q_pos"], case["k_pos"], case["key_mask"]
    if case["encoding"] == "rope" and head_dim < 2:
        return
    q = rng.normal(size=(batch, len(q_pos), num_heads, head_dim))
    k = rng.normal(size=(batch, len(k_pos), num_kv, head_dim))
    v = rng.normal(size=(batch, len(k_pos), num_kv, head_dim))
    # What the mask hides holds NaN: it must not reach any output.
    k = np.where(key_mask[:, :, None, None], k, np.nan)
    v = np.where(key_mask[:, :, None, None], v, np.nan)
    params = {
        "t5": rng.normal(size=(8, num_heads)),
        "clipped": rng.normal(size=(7, num_heads)),
        "kerple": (rng.uniform(0.1, 1.0, num_heads), rng.uniform(0.1, 1.0, num_heads)),
    }.get(case["encoding"])
    encodings = [] if case["encoding"] == "none" else [_hook(case["encoding"], params)]
    # Under jit, as a model runs it: one program per drawn case, where eager dispatch compiles each of its
    # operations at the case's shapes (twice the time); tests/test_attention.py runs the eager path.
    attend = jax.jit(
        lambda q, k, v, query_positions, key_positions, key_mask: dot_product_attention(
            q,
            k,
            v,
            query_positions=query_positions,
            key_positions=key_positions,
            encodings=encodings,
            normalizer=NORMALIZERS[case["normalizer"]],
            causal=case["causal"],
            key_mask=key_mask,
            implementation="materialize" if case["blocks"] is None else "blockwise",
            **({} if case["blocks"] is None else dict(block_q=case["blocks"][0], block_k=case["blocks"][1])),
        )
    )
    out = attend(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), *map(jnp.asarray, (q_pos, k_pos, key_mask)))
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()

    # float64 reference, one batch row and head at a time.
    if case["encoding"] == "rope":
        q = su_rope(q, q_pos[None])
        k = su_rope(np.nan_to_num(k), k_pos[None])
    bias = _reference_bias(case["encoding"], params, num_heads, head_dim, q_pos, k_pos, case["causal"])
    mask = key_mask[:, None, None, :] & ((k_pos[None, :] <= q_pos[:, None]) if case["causal"] else True)
    want = np.zeros_like(out)
    for b in range(batch):
        for n in range(num_heads):
            kv = n // groups
            scores = q[b, :, n] @ np.nan_to_num(k[b, :, kv]).T / np.sqrt(head_dim) + bias[n]
            visible = np.broadcast_to(mask[b, 0], scores.shape)
            weights = _reference_weights(case["normalizer"], scores, visible, key_mask[b].sum())
            want[b, :, n] = weights @ np.nan_to_num(v[b, :, kv])
    np.testing.assert_allclose(out, want, atol=2e-4, rtol=2e-4)


# -- every registered encoding stays finite with fully masked rows, in every float dtype ----------------

_ATTENTION_NAMES = [n for n in encoding_names() if encoding_info(n).acts_on in ("attention", "shared_bias")]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("name", _ATTENTION_NAMES)
def test_fully_masked_rows_stay_finite_with_every_encoding(rng, name, dtype):
    config = small_config(name)
    params = config.init(jax.random.key(0), num_heads=4, head_dim=8, model_dim=32)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 6, 4, 8)), dtype) for _ in range(3))
    pos = jnp.arange(6)
    key_mask = jnp.array([[True] * 6, [False] * 6])  # the second row sees nothing

    def loss(params, q):
        out = dot_product_attention(
            q,
            k,
            v,
            query_positions=pos,
            key_positions=pos,
            causal=True,
            encodings=[config.build(params)],
            key_mask=key_mask,
        )
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, q)
    assert out.dtype == dtype
    assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)
    for leaf in jax.tree.leaves(grads):
        assert bool(jnp.isfinite(leaf.astype(jnp.float32)).all())


# -- Hugging Face configs × fields: a bad value is refused by name or changes nothing ------------------

HF_CONFIGS = {name: case[:2] for name, case in SHIPPED.items()} | {"dynamic": (DYNAMIC, None)}
# (field, bad value) pairs transformers gives a meaning: DeBERTa's span and buckets <= 0 mean "the
# default" and "none", a zero mscale means none, Qwen's max_window_layers 0 means every layer.
MEANINGFUL = {
    ("position_buckets", 0),
    ("position_buckets", -3),
    ("max_relative_positions", 0),
    ("max_relative_positions", -3),
    ("mscale", 0),
    ("mscale_all_dim", 0),
    ("max_window_layers", 0),
}


def _leaves(config, path=()):
    """``(path, value)`` of each number, bool and list of numbers in ``config`` and its nested dicts."""
    for key, value in config.items():
        here = (*path, key)
        if isinstance(value, dict):
            yield from _leaves(value, here)
        elif isinstance(value, (bool, int, float)):
            yield here, value
        elif isinstance(value, list) and value and all(isinstance(x, (int, float)) for x in value):
            yield (*here, 0), value[0]  # a list's first entry stands for every entry


def _bad_values(value):
    """A bool, a string, 0, a negative and NaN for a number; a string and ints for a bool."""
    if isinstance(value, bool):
        return ("false" if value else "true", int(not value), int(value))
    return (True, False, str(value), 0, -3, math.nan)


def _replaced(config, path, value):
    config = copy.deepcopy(config)
    inner = config
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return config


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_every_hf_field_given_a_bad_value_is_refused_by_name_or_changes_nothing(name):
    config, layer_type = HF_CONFIGS[name]
    clean = from_hf_config(config, layer_type=layer_type)
    for path, value in _leaves(config):
        field = next(key for key in reversed(path) if isinstance(key, str))
        for bad in _bad_values(value):
            if bad is value or (field, bad) in MEANINGFUL or (type(bad) is type(value) and bad == value):
                continue
            where = f"{name}: {'.'.join(map(str, path))}={bad!r}"
            try:
                loaded = from_hf_config(_replaced(config, path, bad), layer_type=layer_type)
            except ValueError as error:
                message = str(error)
                assert field in message and "\n" not in message, f"{where}: {message}"
                continue
            assert loaded == clean, f"{where} loaded as another answer, without an error"
