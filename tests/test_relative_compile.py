"""Compile budgets of the learned relative biases (T5, the clipped bias) outside the Pallas kernel.

Their materialising and blockwise paths read the table directly (a gather): the compiled forward
and backward stays within a few times plain attention's in optimised-program lines, whatever the
table's length. The per-head form's selection tree (one selection per table entry, for the kernel's
tiles where no gather lowers) compiled into those paths grows with the table: 45 times NoPE's
program for the clipped bias at k = 128, with the compile time to match. The table's gradient, the
cotangent summed by clipped distance, keeps the backward's temporaries near plain attention's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled

from posenc_jax.functional import ClippedRelativeBias, T5Bias, dot_product_attention

B, T, N, H = 1, 64, 2, 16
LINES_BUDGET = 4.0  # times NoPE's optimised forward-and-backward program (the selection trees: 8x to 51x)


def _program(hooks, implementation: str, length: int = T):
    """The compiled causal forward and backward (q, k, v and the hooks' parameters)."""
    positions = jnp.arange(length)

    def loss(q, k, v, hooks):
        out = dot_product_attention(
            q, k, v, query_positions=positions, key_positions=positions, encodings=hooks, causal=True,
            implementation=implementation,
        )  # fmt: skip
        return jnp.sum(out)

    shape = jax.ShapeDtypeStruct((B, length, N, H), jnp.float32)
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    return compiled(jax.jit(grad).lower(shape, shape, shape, hooks))


def _program_lines(hooks, implementation: str) -> int:
    """Lines of the optimised program of the causal forward and backward."""
    return _program(hooks, implementation).as_text().count("\n")


def _hooks(name: str) -> list:
    table = lambda rows: jax.random.normal(jax.random.key(0), (rows, N)) * 0.1
    if name == "clipped":
        return [ClippedRelativeBias(table(2 * 128 + 1), max_distance=128)]
    return [T5Bias(table(32), max_distance=128)]


@pytest.mark.parametrize("implementation", ["materialize", "blockwise"])
@pytest.mark.parametrize("name", ["clipped", "t5"])
def test_learned_relative_bias_compiles_within_a_few_times_plain_attention(name, implementation):
    """The forward and backward program of a learned relative bias (a table of 257 or 32 entries) stays within
    4x NoPE's lines, on either path."""
    plain = _program_lines([], implementation)
    lines = _program_lines(_hooks(name), implementation)
    assert lines <= LINES_BUDGET * plain, f"{name} {implementation}: {lines} lines against NoPE's {plain}"


@pytest.mark.parametrize("name", ["clipped", "t5"])
def test_learned_relative_bias_backward_memory_is_within_a_quarter_again_plain_attention(name):
    """The materialised forward and backward's temporaries at T = 512 stay within 1.25x NoPE's (the budget is
    1.5x; a padded copy of the score-sized cotangent, summed along its diagonals, made them 1.39x here and 1.62x
    at T = 1,024 with 8 heads of 64): the table's gradient sums the cotangent by clipped distance instead."""
    temp = lambda hooks: _program(hooks, "materialize", 512).memory_analysis().temp_size_in_bytes
    plain, ours = temp([]), temp(_hooks(name))
    assert ours <= 1.25 * plain, f"{name}: {ours / 2**20:.2f} MiB of temporaries against NoPE's {plain / 2**20:.2f} MiB"


def test_t5_per_distance_table_equals_its_per_head_form_with_gradients():
    """T5's per-distance values (the table read at constant buckets) and their gradient equal the per-head form's
    (a selection per bucket) at every distance -M .. M, both directions."""
    from posenc_jax.functional.core.head_bias import head_bias_at
    from posenc_jax.functional.encodings import t5

    table = jax.random.normal(jax.random.key(1), (32, N))
    cotangent = jax.random.normal(jax.random.key(2), (N, 2 * 40 + 1))
    distances = np.arange(-40, 41, dtype=np.int32)
    for bidirectional in (True, False):
        settings = dict(bidirectional=bidirectional, max_distance=40)
        direct = functools.partial(t5._per_distance, **settings)
        per_head = lambda table, s=settings: head_bias_at(t5._t5_head(table, **s), np.zeros(1, np.int32), distances)[
            0, :, 0
        ]
        np.testing.assert_array_equal(direct(table), per_head(table))
        pulled = [jax.grad(lambda t, f=f: jnp.sum(cotangent * f(t)))(table) for f in (direct, per_head)]
        assert float(jnp.abs(pulled[0]).max()) > 0
        np.testing.assert_allclose(pulled[0], pulled[1], rtol=1e-6, atol=1e-6)
