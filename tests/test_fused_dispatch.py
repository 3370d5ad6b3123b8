"""``implementation="auto"`` hands plain attention of rotated q and k to the backend's fused kernel (cuDNN on
a GPU) only on facts known at trace time; every other call keeps the library's own path.

The dispatch is tested on the CPU: the backend is reported as ``"gpu"`` and ``jax.nn.dot_product_attention``
is replaced by a recorder that runs XLA's form of the same call (cuDNN needs a GPU). What runs on a real
GPU is cuDNN itself, which these tests cannot run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.functional import ALiBi, RoPE, XPos, dot_product_attention
from posenc_jax.functional.core import operations
from posenc_jax.functional.kernels import cudnn
from posenc_jax.nn import MultiHeadAttention

B, T, N, K, H = 2, 16, 4, 2, 16


@pytest.fixture
def handed(monkeypatch):
    """The calls handed to cuDNN, as ``(is_causal, scale, dtype, key heads)``, with the backend reported as a GPU."""
    calls, original = [], jax.nn.dot_product_attention

    def recorder(query, key, value, *, scale, is_causal, implementation):
        assert implementation == "cudnn"
        calls.append((is_causal, scale, query.dtype, key.shape[2]))
        return original(query, key, value, scale=scale, is_causal=is_causal, implementation="xla")

    monkeypatch.setattr(operations, "current_backend", lambda: "gpu")
    monkeypatch.setattr(jax.nn, "dot_product_attention", recorder)
    return calls


def _inputs(dtype=jnp.bfloat16, kv_heads=N, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(B, T, N, H), (B, T, kv_heads, H), (B, T, kv_heads, H)]
    return [jnp.asarray(rng.normal(size=shape), dtype) for shape in shapes]


def _attend(q, k, v, positions, implementation="auto", **kwargs):
    return dot_product_attention(
        q, k, v, query_positions=positions, key_positions=positions, implementation=implementation, **kwargs
    )


_SLOW = pytest.mark.slow  # one rotation per head layout stays in the main suite: RoPE with N heads, NoPE with K


@pytest.mark.parametrize(
    "encodings, kv_heads",
    [
        pytest.param([RoPE()], N, id="rope-mha"),
        pytest.param([RoPE()], K, id="rope-gqa", marks=_SLOW),
        pytest.param([XPos()], N, id="xpos-mha", marks=_SLOW),
        pytest.param([XPos()], K, id="xpos-gqa", marks=_SLOW),
        pytest.param([], N, id="nope-mha", marks=_SLOW),
        pytest.param([], K, id="nope-gqa"),
    ],
)
def test_a_rotation_only_call_is_handed_to_cudnn_with_the_plain_paths_values(handed, encodings, kv_heads):
    q, k, v = _inputs(kv_heads=kv_heads)
    positions = jnp.arange(T)
    fused = _attend(q, k, v, positions, encodings=encodings, causal=True)
    assert handed == [(True, H**-0.5, jnp.bfloat16, kv_heads)]
    plain = _attend(q, k, v, positions, "materialize", encodings=encodings, causal=True)
    assert fused.dtype == plain.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(plain, np.float32), atol=3e-2)


def test_what_is_not_plain_attention_keeps_the_librarys_path(handed):
    q, k, v = _inputs()
    positions = jnp.arange(T)
    _attend(q, k, v, positions, encodings=[ALiBi()], causal=True)  # a term in the scores
    _attend(q, k, v, positions, encodings=[RoPE()], causal=True, key_mask=(jnp.arange(T) < 12)[None])
    _attend(q, k, v, positions, encodings=[RoPE()], causal=True, mask=jnp.tril(jnp.ones((T, T), bool)))
    segments = jnp.zeros((B, T), jnp.int32)
    _attend(q, k, v, positions, causal=True, query_segment_ids=segments, key_segment_ids=segments)
    _attend(q, k, v, positions, encodings=[RoPE()], causal=True, normalizer="relu2")
    _attend(q, k, v, positions, encodings=[RoPE()], causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    _attend(q, k, v, positions, "materialize", encodings=[RoPE()], causal=True)  # asked for explicitly
    _attend(q, k, v, positions, "blockwise", encodings=[RoPE()], causal=True)
    # A causal mask over positions that are not the indices is not the kernel's index mask.
    _attend(q, k, v, jnp.arange(T) * 2 + 5, encodings=[RoPE()], causal=True)
    # ... nor over positions it cannot see while tracing.
    jax.jit(lambda p: _attend(q, k, v, p, encodings=[RoPE()], causal=True))(jnp.arange(T))
    assert handed == []
    # float32 inputs: cuDNN's flash attention takes half precision only; it is not asked.
    _attend(*_inputs(jnp.float32), positions, encodings=[RoPE()], causal=True)
    assert handed == []


def test_bidirectional_attention_is_handed_over_whatever_the_positions(handed):
    # No mask at all: the positions only rotated q and k, which is done before the hand-off.
    q, k, v = _inputs()
    positions = jnp.arange(T) * 3 + 7
    fused = jax.jit(lambda p: _attend(q, k, v, p, encodings=[RoPE()]))(positions)
    assert handed == [(False, H**-0.5, jnp.bfloat16, N)]
    plain = _attend(q, k, v, positions, "materialize", encodings=[RoPE()])
    np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(plain, np.float32), atol=3e-2)


def test_the_layer_hands_over_when_it_made_the_positions_itself(handed):
    layer = MultiHeadAttention(4, 32, encodings="rope", dtype=jnp.bfloat16, rngs=__import__("flax").nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, 32)), jnp.float32)
    fused = layer(x, causal=True)
    assert len(handed) == 1 and handed[0][0] is True
    plain = layer(x, causal=True, implementation="materialize")
    np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(plain, np.float32), atol=3e-2)
    layer(x, causal=True, query_positions=jnp.arange(T))  # given positions: traced arrays, not known as indices
    assert len(handed) == 1


def test_where_cudnn_refuses_the_call_the_librarys_path_runs(monkeypatch):
    # On this CPU, reported as a GPU, cuDNN itself refuses (not detected) while tracing: the form returns None.
    monkeypatch.setattr(operations, "current_backend", lambda: "gpu")
    q, k, v = _inputs()
    assert cudnn.cudnn_attention(q, k, v, causal=True, scale=0.25) is None
    positions = jnp.arange(T)
    got = _attend(q, k, v, positions, encodings=[RoPE()], causal=True)
    want = _attend(q, k, v, positions, "materialize", encodings=[RoPE()], causal=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_on_the_cpu_nothing_is_handed_over(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **kw: calls.append(1))
    q, k, v = _inputs()
    _attend(q, k, v, jnp.arange(T), encodings=[RoPE()], causal=True)
    assert calls == [] and operations.current_backend() == "cpu"
