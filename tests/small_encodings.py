"""Settings that make every registered encoding meaningful at the tests' tiny sizes
(head dim 8, a handful of tokens), shared by the test files."""

from posenc_jax.functional import encoding_config

SETTINGS = {
    "rope-pi": dict(factor=2.0),
    "rope-ntk": dict(factor=2.0),
    "rope-dynamic-ntk": dict(factor=2.0, original_context=4),
    "rope-yarn": dict(factor=2.0, original_context=4),
    "rope-llama3": dict(factor=2.0, original_context=4),
    "rope-longrope": dict(short_factor=(1.0,) * 4, long_factor=(2.0,) * 4, original_context=4, max_context=16),
    "rope-2d": dict(grid_width=3),
    "learned": dict(max_positions=32),
    "shaw": dict(max_distance=3),
    "deberta": dict(span=4),
    "clipped-bias": dict(max_distance=3),
    "t5": dict(num_buckets=8, max_distance=16, bidirectional=False),
    "cope": dict(num_positions=6),
}


def small_config(name: str, **extra):
    """The registered config ``name`` with the tiny-size settings (and ``extra`` on top)."""
    return encoding_config(name, **{**SETTINGS.get(name, {}), **extra})
