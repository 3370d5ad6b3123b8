"""Linen adapters, training step, data parallelism and checkpoints."""

import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posenc_jax.checkpoint import Checkpointer
from posenc_jax.functional import ALiBi, RoPE, dot_product_attention
from posenc_jax.linen import load_linen_params, make_attention_fn, to_linen
from posenc_jax.nn import Transformer
from posenc_jax.training import (
    make_optimizer,
    train_step,
    warmup_cosine_adamw,
)


@pytest.fixture(autouse=True)
def _standard_promotion():
    # optax's schedules mix Python floats with int32 step counts, which strict promotion
    # (set for the library's own code in conftest.py) refuses.
    with jax.numpy_dtype_promotion("standard"):
        yield


KW = dict(vocab_size=16, model_dim=32, num_layers=2, num_heads=4, mlp_dim=64, causal=True)


def _batch(seed=0, batch=8, length=12):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 16, (batch, length + 1))
    return {
        "inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
        "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
        "positions": jnp.arange(length),
        "weights": jnp.ones((batch, length)),
    }


@pytest.mark.parametrize("encodings", [["rope"], ["alibi"], ["rope", "alibi"], ["nope"]])
def test_linen_attention_fn_matches_the_functional_attention(encodings):
    layer = nn.MultiHeadDotProductAttention(
        num_heads=4, qkv_features=32, attention_fn=make_attention_fn(encodings, causal=True)
    )
    x = jax.random.normal(jax.random.key(0), (2, 7, 32))
    variables = layer.init(jax.random.key(1), x)
    out = layer.apply(variables, x)
    p = variables["params"]
    proj = lambda name: jnp.einsum("BTD,DNH->BTNH", x, p[name]["kernel"]) + p[name]["bias"][None, None]
    hooks = {"rope": RoPE(), "alibi": ALiBi()}
    pos = jnp.arange(7)
    attended = dot_product_attention(
        proj("query"),
        proj("key"),
        proj("value"),
        query_positions=pos,
        key_positions=pos,
        encodings=[hooks[e] for e in encodings if e in hooks],
        causal=True,
    )
    want = jnp.einsum("BTNH,NHD->BTD", attended, p["out"]["kernel"]) + p["out"]["bias"][None, None]
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_linen_attention_fn_refuses_learned_encodings():
    with pytest.raises(
        ValueError, match="has parameters; wrap the NNX MultiHeadAttention with posenc_jax.linen.to_linen"
    ):
        make_attention_fn(["t5"])


@pytest.mark.parametrize("encoding", [["rope", "t5"], ["learned"], ["shaw"], ["kerple-log"]])
def test_linen_bridge_equals_nnx_for_the_same_parameters(encoding):
    linen_model = to_linen(Transformer, encoding=encoding, **KW)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (2, 9)), jnp.int32)
    variables = linen_model.init(jax.random.key(0), tokens, jnp.arange(9))

    class Wrapper(nn.Module):  # the bridged module inside a Linen model
        @nn.compact
        def __call__(self, tokens):
            return to_linen(Transformer, encoding=encoding, **KW)(tokens, jnp.arange(tokens.shape[1])) * 2.0

    wrapped = Wrapper()
    wrapped_vars = wrapped.init(jax.random.key(0), tokens)
    nnx_model = load_linen_params(Transformer(encoding=encoding, rngs=nnx.Rngs(5), **KW), variables)
    np.testing.assert_allclose(
        linen_model.apply(variables, tokens, jnp.arange(9)), nnx_model(tokens, jnp.arange(9)), atol=1e-6
    )
    inner = load_linen_params(
        Transformer(encoding=encoding, rngs=nnx.Rngs(5), **KW), {"params": wrapped_vars["params"]["ToLinen_0"]}
    )
    np.testing.assert_allclose(wrapped.apply(wrapped_vars, tokens), 2.0 * inner(tokens, jnp.arange(9)), atol=1e-6)


def test_training_reduces_the_loss():
    model = Transformer(encoding="rope", rngs=nnx.Rngs(0), **KW)
    optimizer = make_optimizer(model, warmup_cosine_adamw(learning_rate=3e-3, total_steps=60, warmup_steps=5))
    batch = _batch()
    first = float(train_step(model, optimizer, batch))
    for _ in range(59):
        last = float(train_step(model, optimizer, batch))
    assert last < 0.5 * first


def test_the_first_warmup_step_learns():
    model = Transformer(encoding="rope", rngs=nnx.Rngs(0), **KW)
    before = [np.array(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    tx = warmup_cosine_adamw(learning_rate=1e-2, total_steps=100, warmup_steps=10, weight_decay=0.0)
    train_step(model, make_optimizer(model, tx), _batch())
    after = [np.array(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    change = max(np.abs(a - b).max() for a, b in zip(after, before, strict=True))
    # Adam's first update moves each parameter with a gradient by the learning rate, here 1e-2 / 10.
    np.testing.assert_allclose(change, 1e-3, rtol=1e-3)


def test_schedule_warms_up_then_decays():
    with pytest.raises(ValueError, match="0 <= warmup_steps < total_steps"):
        warmup_cosine_adamw(learning_rate=1e-3, total_steps=10, warmup_steps=10)


@pytest.mark.long
def test_checkpoint_round_trip_and_exact_resume(tmp_path):
    def fresh():
        model = Transformer(encoding=["rope", "t5"], dropout_rate=0.1, rngs=nnx.Rngs(0), **KW)
        return model, make_optimizer(model, warmup_cosine_adamw(learning_rate=1e-3, total_steps=20, warmup_steps=2))

    batches = [_batch(seed) for seed in range(6)]
    model, optimizer = fresh()
    ckpt = Checkpointer(tmp_path / "ckpt", max_to_keep=2)
    losses = []
    for i, batch in enumerate(batches):
        losses.append(float(train_step(model, optimizer, batch)))
        if i in (0, 1, 2):
            ckpt.save(i + 1, model, optimizer)
    assert ckpt.all_steps() == [2, 3]  # keeps the last two
    restored, restored_opt = fresh()
    assert ckpt.restore(restored, restored_opt) == 3
    # Training goes on exactly as it did (dropout RNG streams and optimizer moments included).
    resumed = [float(train_step(restored, restored_opt, batch)) for batch in batches[3:]]
    np.testing.assert_allclose(resumed, losses[3:], rtol=1e-6)
    forward = nnx.jit(lambda model, batch: model(batch["inputs"], batch["positions"]))
    np.testing.assert_array_equal(forward(restored, batches[0]), forward(model, batches[0]))
    with pytest.raises(ValueError, match="no checkpoint in"):
        Checkpointer(tmp_path / "empty").restore(*fresh())


def test_sharded_training_equals_single_device_on_8_simulated_devices():
    script = textwrap.dedent(
        """
        import os
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        os.environ["JAX_PLATFORMS"] = "cpu"  # simulated CPU devices, also on a GPU machine
        import jax, numpy as np, jax.numpy as jnp
        from flax import nnx
        from posenc_jax.nn import Transformer
        from posenc_jax.training import (data_parallel_mesh, make_optimizer, replicate, shard_batch,
                                         train_step, warmup_cosine_adamw)
        assert len(jax.devices()) == 8, jax.devices()
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 16, (8, 13))
        batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
                 "positions": jnp.arange(12), "weights": jnp.ones((8, 12))}
        losses = {}
        for n in (1, 8):
            model = Transformer(vocab_size=16, model_dim=32, num_layers=2, num_heads=4, mlp_dim=64,
                                encoding=["rope", "t5"], causal=True, rngs=nnx.Rngs(0))
            optimizer = make_optimizer(model, warmup_cosine_adamw(learning_rate=1e-3, total_steps=10, warmup_steps=1))
            mesh = data_parallel_mesh(jax.devices()[:n])
            replicate(model, mesh); replicate(optimizer, mesh)
            sharded = shard_batch(batch, mesh)
            assert len(sharded["inputs"].sharding.device_set) == n
            losses[n] = [float(train_step(model, optimizer, sharded)) for _ in range(3)]
        print(losses[1]); print(losses[8])
        np.testing.assert_allclose(losses[8], losses[1], rtol=1e-5)
        try:
            shard_batch({"inputs": jnp.zeros((6, 4), jnp.int32)}, data_parallel_mesh())
        except ValueError as error:
            print("error:", error)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "batch size 6 is not divisible by the 8 devices" in result.stdout
