"""Every public entry point refuses what it cannot mean, by name, before tracing (cases in bad_inputs.py)."""

import re
import traceback

import numpy as np
import pytest
from flax import nnx

from bad_inputs import CASES
from posenc_jax.nn import MultiHeadAttention


@pytest.mark.parametrize("what, call, error, pattern", CASES, ids=[case[0] for case in CASES])
def test_a_bad_input_is_refused_by_name(what, call, error, pattern):
    with pytest.raises(error) as caught:
        call()
    assert re.search(pattern, str(caught.value)), f"{what}: {caught.value}"
    # Raised by the project's own check, not from inside JAX or Flax.
    origin = traceback.extract_tb(caught.value.__traceback__)[-1].filename
    assert "/posenc_jax/" in origin and "site-packages" not in origin, f"{what}: raised in {origin}"


def test_a_single_encoding_name_is_one_encoding():
    layer = MultiHeadAttention(16, 2, encodings="rope", rngs=nnx.Rngs(0))
    assert [type(module.config).__name__ for module in layer.encodings] == ["RoPE"]
    x = np.ones((1, 4, 16), np.float32)
    assert layer(x, np.arange(4), causal=True).shape == (1, 4, 16)
