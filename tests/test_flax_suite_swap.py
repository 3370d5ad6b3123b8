"""tools/flax_suite/posenc_swap.py, the plugin that runs Flax's own attention tests against this
library's attention_fn: it makes ours the default everywhere Flax keeps one, and Flax's own raises.
(Run in a subprocess: the swap changes flax for the rest of the process.)"""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = """
import jax, jax.numpy as jnp, flax.linen as nn
import flax.linen.attention as linen_attention
import flax.nnx.nn.attention as nnx_attention
from flax import nnx
import posenc_swap

posenc_swap.pytest_configure(None)
x = jnp.ones((2, 5, 8))
layer = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=nnx.Rngs(0))
assert layer.attention_fn.__wrapped__.__module__ == "posenc_jax.nn.flax_attention", layer.attention_fn
layer(x)
linen_layer = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
linen_layer.init_with_output(jax.random.key(0), x)
nnx.dot_product_attention(jnp.ones((1, 3, 2, 4)), jnp.ones((1, 3, 2, 4)), jnp.ones((1, 3, 2, 4)))
for function in (nnx.dot_product_attention, nn.dot_product_attention, linen_attention.dot_product_attention):
    assert function is layer.attention_fn, function
print("calls", posenc_swap.CALLS["posenc"])
"""


def test_the_plugin_makes_ours_flax_default_and_counts_its_calls():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={"PYTHONPATH": str(ROOT / "tools" / "flax_suite"), "PATH": "", "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["calls", "3"]


def test_the_plugin_turns_flax_own_function_into_an_error():
    script = (
        "import jax.numpy as jnp, flax.nnx.nn.attention as a, posenc_swap\n"
        "old = a.dot_product_attention\n"
        "posenc_swap.pytest_configure(None)\n"
        "q = jnp.ones((1, 3, 2, 4))\n"
        "old(q, q, q)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": str(ROOT / "tools" / "flax_suite"), "PATH": "", "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "flax's own dot_product_attention was called while posenc_jax's is the default" in result.stderr
