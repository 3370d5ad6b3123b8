"""generate (greedy and temperature sampling over the KV cache) and the fit loop."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posenc_jax.checkpoint import Checkpointer
from posenc_jax.generation import generate, next_token
from posenc_jax.nn import Transformer
from posenc_jax.training import fit, make_optimizer

SIZES = dict(vocab_size=11, model_dim=16, num_layers=2, num_heads=2, mlp_dim=32)
PROMPT = jax.random.randint(jax.random.key(5), (3, 4), 0, 11)


def _model(encoding="rope", seed=0):
    return Transformer(**SIZES, encoding=encoding, causal=True, rngs=nnx.Rngs(seed))


def _by_full_forwards(model, prompt, new, temperature=0.0, rng=None):
    """The reference: the full forward pass (no cache) over the sequence so far, at every step.

    The model is causal, so the logits at position t of a fixed-length buffer whose later
    slots are still zeros are those of the sequence cut at t: one compiled forward serves
    every step.
    """
    keys = jax.random.split(rng, new) if temperature > 0 else [None] * new
    length = prompt.shape[1]
    tokens = jnp.zeros((prompt.shape[0], length + new), jnp.int32).at[:, :length].set(prompt)
    forward = nnx.jit(lambda m, t: m(t, jnp.arange(t.shape[1])))
    for i in range(new):
        logits = forward(model, tokens)[:, length + i - 1]
        tokens = tokens.at[:, length + i].set(next_token(logits, temperature=temperature, key=keys[i]))
    return tokens


@pytest.mark.parametrize("encoding", ["rope", "alibi", "t5"])
def test_greedy_generation_equals_repeated_full_forwards(encoding):
    model = _model(encoding)
    out = generate(model, PROMPT, max_new_tokens=8)
    np.testing.assert_array_equal(out, _by_full_forwards(model, PROMPT, 8))
    assert out.shape == (3, 12) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out[:, :4], PROMPT)


def test_sampling_equals_repeated_full_forwards_with_the_same_keys():
    model = _model()
    rng = jax.random.key(9)
    out = generate(model, PROMPT, max_new_tokens=8, temperature=1.5, rng=rng)
    np.testing.assert_array_equal(out, _by_full_forwards(model, PROMPT, 8, temperature=1.5, rng=rng))
    # Sampling differs from greedy and follows the key (the test above would hold trivially otherwise).
    assert not np.array_equal(out, generate(model, PROMPT, max_new_tokens=8))
    assert not np.array_equal(out, generate(model, PROMPT, max_new_tokens=8, temperature=1.5, rng=jax.random.key(1)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(max_new_tokens=2, temperature=-1.0), "temperature must be a finite number >= 0"),
        (dict(max_new_tokens=2, temperature=0.7), "needs rng="),
    ],
)
def test_bad_generation_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(_model(), PROMPT, **kwargs)


def _batches(count, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        tokens = jnp.asarray(rng.integers(0, 11, (4, 9)), jnp.int32)
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": jnp.arange(8)}


def test_fit_trains_logs_and_checkpoints(tmp_path):
    model = _model()
    optimizer = make_optimizer(model, optax.adam(3e-3))
    lines = []
    checkpointer = Checkpointer(tmp_path, max_to_keep=5)
    losses = fit(
        model,
        optimizer,
        _batches(6),
        steps=6,
        log_every=2,
        checkpointer=checkpointer,
        checkpoint_every=4,
        log=lines.append,
    )
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert [line.split("  ")[0] for line in lines] == ["step 2/6", "step 4/6", "step 6/6"]
    assert checkpointer.all_steps() == [4, 6]
    # Resuming from step 4 with the same batches gives the same last two losses.
    fresh = _model(seed=1)
    fresh_optimizer = make_optimizer(fresh, optax.adam(3e-3))
    assert checkpointer.restore(fresh, fresh_optimizer, step=4) == 4
    resumed = fit(fresh, fresh_optimizer, list(_batches(6))[4:], steps=6, start_step=4, log=None)
    np.testing.assert_allclose(resumed, losses[4:], rtol=1e-5)


def test_fit_trains_to_a_criterion_and_saves_where_it_stops():
    model = _model()
    optimizer = make_optimizer(model, optax.adam(3e-3))
    checked, saved = [], []
    losses = fit(
        model,
        optimizer,
        _batches(20),
        steps=20,
        log=None,
        check_every=3,
        check=lambda step: checked.append(step) or step >= 6,  # the criterion holds from step 6
        save=saved.append,
        checkpoint_every=5,
    )
    assert len(losses) == 6 and checked == [3, 6] and saved == [5, 6]
    # A step function of its own (the benchmark's seeds stepped together) may return an array of losses.
    losses = fit(model, optimizer, _batches(2), steps=2, log=None, step_fn=lambda m, o, b: np.array([1.0, 2.0]))
    assert [list(x) for x in losses] == [[1.0, 2.0], [1.0, 2.0]]
    with pytest.raises(ValueError, match="check and check_every go together"):
        fit(model, optimizer, _batches(2), steps=2, log=None, check=lambda step: False)


def test_fit_says_when_the_batches_run_out():
    model = _model()
    optimizer = make_optimizer(model, optax.adam(1e-3))
    with pytest.raises(ValueError, match="batches ran out after 2 batches; .* needs 5"):
        fit(model, optimizer, _batches(2), steps=5, log=None)
