"""The Pallas flash-attention kernels (``implementation="pallas"``) against the materialising path.

On the CPU the kernels run in Pallas' interpret mode: these tests check their values and
gradients (q, k, v and the bias parameters: T5's and the clipped bias's tables, Kerple's r1 and
r2, FIRE's MLP, c and L) per encoding, causal and bidirectional,
with grouped-query heads and gapped per-row positions, in float32 (tight) and bfloat16 (stated
tolerance). The lowering tests export the kernels (forward and gradient) for ``cuda`` (Triton)
and ``tpu`` (Mosaic) on this CPU: lowering is not compiling, Triton and Mosaic compile on the
device only, so a kernel passing here has not been run on an accelerator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jax.experimental.pallas")
if jax.__version_info__ < (0, 10):
    pytest.skip(
        f"the Pallas kernels are written against jax 0.10's Pallas API; jax {jax.__version__} is older",
        allow_module_level=True,
    )

from posenc_jax.functional import (
    ALiBi,
    ClippedRelativeBias,
    Fire,
    Kerple,
    NoPE,
    RoPE,
    Sandwich,
    T5Bias,
    dot_product_attention,
)
from posenc_jax.functional.core.head_bias import head_bias_at
from posenc_jax.functional.core.hooks import attention_context

B, T, N, K, H = 2, 32, 4, 2, 16
BLOCK = 16


def _inputs(dtype=jnp.float32, length=T):
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, length, N, H), dtype)
    k = jax.random.normal(keys[1], (B, length, K, H), dtype)
    v = jax.random.normal(keys[2], (B, length, K, H), dtype)
    cotangent = jax.random.normal(keys[3], (B, length, N, H), jnp.float32)
    table = jax.random.normal(keys[4], (8, N), jnp.float32)
    # Gapped, per-row positions: row 0 steps by 3 (distances past T5's max_distance), row 1 is offset.
    positions = jnp.stack([3 * jnp.arange(length), jnp.arange(length) + 7]).astype(jnp.int32)
    return q, k, v, cotangent, table, positions


def _fire_params(table):
    """FIRE's parameters (4 hidden units) from ``table``'s first rows: the MLP as :func:`fire_init` shapes it,
    ``c`` in (0.1, 1.1) and the threshold L in (10, 20), below the gapped positions' largest."""
    return {
        "w1": 0.5 + jax.nn.sigmoid(table[4, :4]),
        "b1": -0.5 * jax.nn.sigmoid(table[5, :4]),
        "w2": -0.5 * table[:4],
        "b2": table[6],
        "c": 0.1 + jax.nn.sigmoid(table[7, 0]),
        "threshold": 10.0 + 10.0 * jax.nn.sigmoid(table[7, 1]),
    }


def _encodings(name, table):
    """The encodings of a case (``+`` joins several); ``table`` ``[8, N]`` holds every learned parameter (T5's
    table; the clipped bias's first 7 rows, k = 3; Kerple's r1 and r2 from its first rows, kept in
    (0.1, 1.1); FIRE's, :func:`_fire_params`), so its gradient covers them all."""
    if "+" in name:
        return [hook for part in name.split("+") for hook in _encodings(part, table)]
    if name.startswith("kerple"):
        r1, r2 = 0.1 + jax.nn.sigmoid(table[0]), 0.1 + jax.nn.sigmoid(table[1])
        return [Kerple(r1, r2, variant=name.split("-")[1])]
    makers = {
        "nope": NoPE,
        "alibi": ALiBi,
        "t5": lambda: T5Bias(table, max_distance=16),
        "sandwich": Sandwich,
        "clipped": lambda: ClippedRelativeBias(table[:7], max_distance=3),
        "fire": lambda: Fire(_fire_params(table)),
    }
    return [makers[name]()]


def _value_and_grads(implementation, name, causal, dtype=jnp.float32, **masks):
    q, k, v, cotangent, table, positions = _inputs(dtype, masks.pop("length", T))

    def loss(q, k, v, table):
        out = dot_product_attention(
            q,
            k,
            v,
            query_positions=positions,
            key_positions=positions,
            encodings=_encodings(name, table),
            causal=causal,
            implementation=implementation,
            block_q=BLOCK if implementation == "pallas" else None,
            block_k=BLOCK if implementation == "pallas" else None,
            **masks,
        )
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, table)
    return out, grads


def _close(a, b, tolerance):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, atol=tolerance * scale, rtol=0)


@pytest.mark.parametrize(
    ("name", "causal"),
    [
        ("nope", True),
        ("alibi", False),
        ("alibi", True),
        ("t5", False),
        ("t5", True),
        ("alibi+t5", False),
        ("kerple-log", True),
        ("kerple-power", False),
        ("clipped+sandwich+fire", True),
        pytest.param("sandwich", False, marks=pytest.mark.slow),
        pytest.param("clipped", False, marks=pytest.mark.slow),
        pytest.param("fire", True, marks=pytest.mark.slow),
    ],
)
def test_kernel_matches_materialized_float32(name, causal):
    """Values and gradients (q, k, v, T5's and the clipped bias's tables, Kerple's r1 and r2, FIRE's
    parameters) of the kernels equal the materialising path's, GQA and gapped positions, to float32
    rounding."""
    out, grads = _value_and_grads("pallas", name, causal)
    expected_out, expected_grads = _value_and_grads("materialize", name, causal)
    _close(out, expected_out, 1e-5)
    for grad, expected in zip(grads, expected_grads, strict=True):
        _close(grad, expected, 1e-5)
    if name not in ("nope", "alibi", "sandwich"):  # the others have learned parameters
        assert float(jnp.abs(expected_grads[3]).max()) > 0  # the parameters' gradient is compared, not zeros


@pytest.mark.parametrize("name", ["alibi+t5", pytest.param("clipped+sandwich+fire", marks=pytest.mark.slow)])
def test_kernel_matches_materialized_bfloat16(name):
    """bfloat16 inputs: the kernels multiply bfloat16 tiles with float32 accumulation and round the weights
    to bfloat16 before the value product; within 2e-2 of the largest magnitude of the materialising path
    (which also takes bfloat16 inputs), forward and gradients."""
    out, grads = _value_and_grads("pallas", name, True, jnp.bfloat16)
    expected_out, expected_grads = _value_and_grads("materialize", name, True, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    _close(out, expected_out, 2e-2)
    for grad, expected in zip(grads, expected_grads, strict=True):
        _close(grad, expected, 2e-2)


def test_segments_key_mask_and_padding():
    """Segment ids, a key mask (with NaN in the padded keys) and lengths that are not a multiple of the
    tile (24 in tiles of 16): as the materialising path."""
    length = 24
    segments = jnp.stack([jnp.arange(length) // 10, jnp.zeros(length, jnp.int32)]).astype(jnp.int32)
    key_mask = jnp.arange(length)[None, :] < jnp.array([[20], [length]])
    masks = dict(length=length, query_segment_ids=segments, key_segment_ids=segments, key_mask=key_mask)
    out, grads = _value_and_grads("pallas", "t5", False, **masks)
    expected_out, expected_grads = _value_and_grads("materialize", "t5", False, **masks)
    _close(out, expected_out, 1e-5)
    for grad, expected in zip(grads, expected_grads, strict=True):
        _close(grad, expected, 1e-5)


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_per_head_form_agrees_with_its_bias(variant):
    """Kerple's per-head form (the kernel's) equals its bias and its per-distance form (the blockwise path's)."""
    *_, table, positions = _inputs()
    (hook,) = _encodings(f"kerple-{variant}", table)
    context = attention_context(positions, positions, scale=0.25, causal=False, head_dim=H, num_heads=N)
    per_head = head_bias_at(hook.head_bias(context), positions, positions)
    np.testing.assert_array_equal(per_head, hook.bias(context))
    distances = (positions[:, None, :] - positions[:, :, None]).reshape(B, T * T).astype(jnp.float32)
    np.testing.assert_array_equal(per_head, hook.distance_bias(distances, context).reshape(B, N, T, T))


@pytest.mark.parametrize("causal", [False, True])
def test_t5_per_head_form_agrees_with_its_table_form(causal):
    """T5's per-head form (the kernel's: the bucket of each distance, then the table) equals the bias of the
    materialising path and the blockwise path's per-distance form (the table at clipped distances,
    gathered), exactly, at gapped positions past max_distance."""
    *_, table, positions = _inputs()
    hook = T5Bias(table, max_distance=16)
    context = attention_context(positions, positions, scale=0.25, causal=causal, head_dim=H, num_heads=N)
    per_head = head_bias_at(hook.head_bias(context), positions, positions)
    np.testing.assert_array_equal(per_head, hook.bias(context))
    # The blockwise path's tile: the per-distance form at the tile's distances.
    distances = (positions[:, None, :] - positions[:, :, None]).reshape(B, T * T).astype(jnp.float32)
    tiled = hook.distance_bias(distances, context).reshape(B, N, T, T)
    np.testing.assert_array_equal(per_head, tiled)


def test_clipped_per_head_form_agrees_with_its_table_form():
    """The clipped bias's per-head form (the kernel's: the table's entry by selections) equals its bias (the
    table gathered) and its per-distance form, exactly, at gapped positions past k."""
    *_, table, positions = _inputs()
    (hook,) = _encodings("clipped", table)
    context = attention_context(positions, positions, scale=0.25, causal=False, head_dim=H, num_heads=N)
    per_head = head_bias_at(hook.head_bias(context), positions, positions)
    np.testing.assert_array_equal(per_head, hook.bias(context))
    distances = (positions[:, None, :] - positions[:, :, None]).reshape(B, T * T).astype(jnp.float32)
    np.testing.assert_array_equal(per_head, hook.distance_bias(distances, context).reshape(B, N, T, T))


def test_fire_per_head_form_agrees_with_its_bias():
    """FIRE's per-head form (the kernel's: the MLP unit by unit on each head's rows) equals its bias (the
    MLP as a contraction over the hidden units) to float32 rounding, values and every parameter's
    gradient, at positions on both sides of the threshold."""
    *_, table, positions = _inputs()
    context = attention_context(positions, positions, scale=0.25, causal=True, head_dim=H, num_heads=N)
    weights = jax.random.normal(jax.random.key(2), (B, N, T, T))

    per_head = lambda hook: head_bias_at(hook.head_bias(context), positions, positions)
    plain = lambda hook: hook.bias(context)

    @jax.jit
    def value_and_grad(table):
        pulled = lambda form: lambda table: jnp.sum(weights * form(_encodings("fire", table)[0]))
        values = [form(_encodings("fire", table)[0]) for form in (per_head, plain)]
        return values, [jax.grad(pulled(form))(table) for form in (per_head, plain)]

    (value, expected_value), (grad, expected_grad) = value_and_grad(table)
    _close(value, expected_value, 1e-6)
    assert float(jnp.abs(expected_grad).max()) > 0
    _close(grad, expected_grad, 1e-5)


def test_sandwich_per_head_form_at_a_tile_keeps_exact_phases():
    """Sandwich's per-head function on one tile as the kernel calls it (positions ``[bq, 1]`` and ``[1, bk]``,
    a head's row ``[1, 1]``) equals the materialising path's bias, near the int32 limit and at negative
    positions, where a float32 product of position and frequency would be off by whole radians."""
    hook = Sandwich()
    queries = jnp.array([2**31 - 1, 2**31 - 40, -(2**31), -7, 0, 12345678, 5, 2**30], jnp.int32)
    keys = jnp.array([2**31 - 3, 2**31 - 41, -(2**31) + 2, -9, 3, 12345000, 5, 2**30 + 17], jnp.int32)
    context = attention_context(queries, keys, scale=0.25, causal=False, head_dim=64, num_heads=N)
    head = hook.head_bias(context)
    expected = jax.jit(hook.bias)(context)[0]  # [N, T, S]
    tile = jax.jit(lambda rows: head.function(rows, queries[:, None], keys[None, :]))
    for n in range(N):
        _close(tile(tuple(p[n : n + 1] for p in head.parameters)), expected[n], 1e-6)
    assert float(jnp.abs(expected).max()) > 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(encodings=[RoPE()]), "RoPE has no per-head form"),
        (dict(normalizer="l2"), "is not softmax"),
        (dict(mask=jnp.ones((1, 1, T, T), bool)), "an extra mask"),
        (dict(dropout_rate=0.1, dropout_rng=jax.random.key(1)), "dropout_rate=0.1"),
        (dict(return_weights=True), "pallas attention never holds"),
    ],
)
def test_unsupported_settings_are_refused_by_name(kwargs, message):
    q, k, v, *_, positions = _inputs()
    with pytest.raises(ValueError, match=message):
        dot_product_attention(
            q, k, v, query_positions=positions, key_positions=positions, implementation="pallas", **kwargs
        )


CUSTOM_CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


@pytest.mark.parametrize(
    ("name", "dtype", "precision"),
    [
        ("t5", jnp.bfloat16, None),
        ("kerple-power", jnp.bfloat16, None),
        ("alibi+kerple-log", jnp.bfloat16, None),
        ("t5", jnp.float32, jax.lax.Precision.HIGHEST),
        pytest.param("clipped+sandwich+fire", jnp.bfloat16, None, marks=pytest.mark.slow),  # 3 biases: ~15 s each
    ],
)
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_lower_for_gpu_and_tpu(platform, name, dtype, precision):
    """Forward and gradient of the kernels (T5, Kerple, ALiBi with Kerple, or the clipped bias, Sandwich and
    FIRE together, with segment ids, causal, GQA, tiles of 128; bfloat16, or float32 at full precision) lower
    to Triton's and Mosaic's custom calls. Lowering only: Triton and Mosaic compile on the device."""
    from posenc_jax.functional.kernels.pallas import flash_attention, joined_head_bias

    length, head_dim = 256, 64
    q = jnp.zeros((1, length, N, head_dim), dtype)
    kv = jnp.zeros((1, length, K, head_dim), dtype)
    positions = jnp.arange(length, dtype=jnp.int32)
    segments = jnp.zeros((1, length), jnp.int32)

    def attention(q, k, v, table):
        context = attention_context(positions, positions, scale=0.125, causal=True, head_dim=head_dim, num_heads=N)
        return flash_attention(
            q,
            k,
            v,
            query_positions=positions,
            key_positions=positions,
            head_bias=joined_head_bias(
                [hook.head_bias(context) for hook in ([T5Bias(table)] if name == "t5" else _encodings(name, table))]
            ),
            causal=True,
            query_segment_ids=segments,
            key_segment_ids=segments,
            interpret=False,
            precision=precision,
        )

    def loss(q, k, v, table):
        return jnp.sum(attention(q, k, v, table).astype(jnp.float32))

    checks = [jax.export.DisabledSafetyCheck.custom_call(CUSTOM_CALLS[platform])]
    for fn in (attention, jax.grad(loss, argnums=(0, 1, 2, 3))):
        exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(
            q, kv, kv, jnp.zeros((32, N), jnp.float32)
        )
        assert CUSTOM_CALLS[platform] in exported.mlir_module()


def _largest_outside_kernels(jaxpr) -> int:
    """The most elements of any array the program computes outside its Pallas kernels (whose own jaxprs
    hold only tiles)."""
    from jax.extend import core as jax_core

    largest = 0
    for eqn in jaxpr.eqns:
        largest = max([largest, *(int(np.prod(getattr(v.aval, "shape", ()))) for v in eqn.outvars)])
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if isinstance(sub, (jax_core.ClosedJaxpr, jax_core.Jaxpr)):
                    largest = max(largest, _largest_outside_kernels(getattr(sub, "jaxpr", sub)))
    return largest


def test_no_array_of_every_query_and_key_pair():
    """The forward and backward program (the kernels for a device, traced, not lowered) builds no array as
    large as T · S outside the kernels: its largest is the queries' [B, N, T, H] (here 1 · 4 · 512 · 16)."""
    from posenc_jax.functional.kernels.pallas import flash_attention

    length, head_dim = 512, 16
    positions = jnp.arange(length, dtype=jnp.int32)

    def loss(q, k, v, table):
        context = attention_context(positions, positions, scale=0.25, causal=True, head_dim=head_dim, num_heads=N)
        head = T5Bias(table).head_bias(context)
        kwargs = dict(query_positions=positions, key_positions=positions, head_bias=head, causal=True)
        return jnp.sum(flash_attention(q, k, v, interpret=False, **kwargs))

    q = jnp.zeros((1, length, N, head_dim))
    kv = jnp.zeros((1, length, K, head_dim))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, kv, kv, jnp.zeros((32, N)))
    assert "pallas_call" in str(jaxpr)
    assert _largest_outside_kernels(jaxpr.jaxpr) == length * N * head_dim < length * length
